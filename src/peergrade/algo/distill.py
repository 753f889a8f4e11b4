"""On-policy distillation: a teacher's log-probs on the student's own sampled tokens as a
per-token reward, turned into per-token advantages for ``policy_loss``.

The student samples as in GRPO; the teacher scores every sampled token; the reward of token t
is the negative reverse KL on the sampled token (the single-sample estimate of
-KL(pi_student || pi_teacher) at that position):

    r_t = log pi_teacher(y_t | x, y_<t) - log pi_student(y_t | x, y_<t)

and the advantage of token t is ``coef * R_t`` with ``R_t = (r_t - b) + discount * R_next``
(discount 0, tinker-cookbook's ``kl_discount_factor`` default: each token credited with its own
log-ratio; ``b`` a baseline: 0 in tinker-cookbook's distillation recipe, the batch's token mean
of r in its RL KL penalty), plus ``verifier_weight`` times the completion's group-relative
verifier advantage (0 = pure distillation).

The dense alternative (``algo.teacher_divergence: top_k``): at every sampled position, the
generalized JSD (TRL's ``beta``: forward KL, reverse KL or between) between the student's and
the teacher's next-token distributions over the teacher's k most likely tokens plus a tail
bucket (``topk_divergence``), a loss term rather than an advantage.

What it deliberately does not do: no model forward (the caller gives the log-prob tensors),
no reduction over positions or the batch (the update normalises).
"""

from __future__ import annotations

import torch


def reverse_kl_reward(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` float32: log p_teacher - log p_student on each sampled token where
    ``mask == 1`` (counted), exactly 0 elsewhere (padding may hold anything, even -inf)."""
    if student_logp.shape != teacher_logp.shape or student_logp.shape != mask.shape:
        raise ValueError(
            f"reverse_kl_reward: student_logp {tuple(student_logp.shape)}, teacher_logp "
            f"{tuple(teacher_logp.shape)} and mask {tuple(mask.shape)} must have one shape [B, T]"
        )
    on = mask == 1  # [B, T]
    diff = teacher_logp.float() - student_logp.float()  # [B, T]
    return torch.where(on, diff, torch.zeros_like(diff))


def token_mean_reward(reward: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(sum of ``reward`` over counted tokens, their count): the pieces of the batch's token
    mean, which a caller reduces across processes before dividing."""
    on = mask == 1
    return float(reward[on].sum()), int(on.sum())


def discounted_returns(reward: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[B, T]``: each counted token's discounted sum of its own and the later counted tokens'
    rewards, ``R_t = r_t + gamma * R_next`` (tinker-cookbook's ``kl_discount_factor``); tokens
    with ``mask == 0`` (padding, an environment's tokens in an episode) get 0 and pass the sum
    through unchanged, so the discount counts sampled tokens only. ``gamma = 0``: ``reward``."""
    on = mask == 1  # [B, T]
    r = torch.where(on, reward.float(), torch.zeros_like(reward, dtype=torch.float32))
    if gamma == 0.0:
        return r
    out = torch.zeros_like(r)  # [B, T]
    running = torch.zeros_like(r[:, 0])  # [B]
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(on[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(on[:, t], running, torch.zeros_like(running))
    return out


def distill_advantages(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    baseline: float = 0.0,
    discount: float = 0.0,
    verifier_advantages: torch.Tensor | None = None,
    verifier_weight: float = 0.0,
) -> torch.Tensor:
    """``[B, T]`` per-token advantages: ``coef * (log p_teacher - log p_student - baseline)``
    on counted tokens, plus ``verifier_weight * verifier_advantages[b]`` (``[B]``, one per
    completion, e.g. GRPO's group-relative advantage) on each counted token of completion b;
    0 on padding. ``discount``: each token's advantage is the discounted sum of its own and the
    later tokens' (centred) rewards (``discounted_returns``; 0 = its own only). ``baseline``: a
    constant subtracted from every token's reward, e.g. the
    batch's token mean of the reward (``token_mean_reward``), as tinker-cookbook centres its RL
    KL penalty."""
    r = reverse_kl_reward(student_logp, teacher_logp, mask)  # [B, T]
    r = torch.where(mask == 1, r - baseline, torch.zeros_like(r))
    adv = coef * discounted_returns(r, mask, discount)  # [B, T]; discount 0: r itself
    if verifier_weight != 0.0:
        if verifier_advantages is None or verifier_advantages.shape != mask.shape[:1]:
            got = None if verifier_advantages is None else tuple(verifier_advantages.shape)
            raise ValueError(
                f"distill_advantages: verifier_weight={verifier_weight} needs verifier_advantages "
                f"of shape ({mask.shape[0]},), got {got}"
            )
        v = verifier_advantages.float()[:, None].expand_as(adv)  # [B, T]
        adv = adv + torch.where(mask == 1, verifier_weight * v, torch.zeros_like(adv))
    return adv


# ------------------------------------------------- the divergence over the teacher's top-k tokens


def add_tail_bucket(logp: torch.Tensor) -> torch.Tensor:
    """``[..., k] -> [..., k + 1]``: the log-probs of k tokens and, last, of every other token
    together, ``log(1 - sum_j exp(logp_j))`` (TRL's ``_add_tail_bucket``: the sum's log is
    clamped to at most -1e-7, so a support holding all the mass leaves a tail of about 1e-7
    instead of log 0). Tokens at -inf count 0."""
    log_sum = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)  # [..., 1]
    tail = torch.log(-torch.expm1(log_sum))  # log(1 - exp(log_sum))
    return torch.cat([logp, tail], dim=-1)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """``[..., K] x2 -> [...]``: the generalized Jensen-Shannon divergence between two
    distributions given as log-probs over the same K outcomes (each summing to 1), TRL's
    ``generalized_jsd_loss`` per position (Agarwal et al. 2024, eq. 1):

        beta = 0: KL(teacher || student) = sum_v p_t (log p_t - log p_s)     (forward KL)
        beta = 1: KL(student || teacher) = sum_v p_s (log p_s - log p_t)     (reverse KL)
        else:     beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta p_t + (1 - beta) p_s

    Log-probs below -1e4 count as -1e4 (probability exactly 0): -inf is safe."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")

    def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:  # KL(p || q), last dim
        return (p_log.exp() * (p_log - q_log)).sum(-1)

    # clamped: exp(-1e4) is exactly 0, so a -inf log-prob adds 0 (not 0 * inf) and no NaN
    # reaches the gradient
    student, teacher = student.clamp(min=-1e4), teacher.clamp(min=-1e4)
    if beta == 0.0:
        return kl(teacher, student)
    if beta == 1.0:
        return kl(student, teacher)
    b = torch.tensor(beta, dtype=student.dtype, device=student.device)
    mix = torch.logaddexp(student + torch.log1p(-b), teacher + torch.log(b))  # [..., K]
    return beta * kl(teacher, mix) + (1.0 - beta) * kl(student, mix)


def topk_divergence(
    student_at_ids: torch.Tensor, teacher_topk: torch.Tensor, *, beta: float, add_tail: bool = True
) -> torch.Tensor:
    """``[M, k] x2 -> [M]``: the generalized JSD (``generalized_jsd``, TRL's ``beta``) of one
    position's distributions restricted to the teacher's k most likely tokens there, given the
    student's and the teacher's log-probs of those k tokens (full-vocabulary log-softmax
    values). ``add_tail`` (TRL's ``loss_add_tail``): the rest of the vocabulary as a (k+1)-th
    outcome (``add_tail_bucket``), so both are distributions over k+1 outcomes and with
    k = V the value is the full-vocabulary divergence; without, both are renormalised over
    the k tokens. Coarse-graining never increases a divergence, so with the tail the value is at
    most the full-vocabulary one."""
    if student_at_ids.shape != teacher_topk.shape or student_at_ids.dim() != 2:
        raise ValueError(
            f"topk_divergence: student {tuple(student_at_ids.shape)} and teacher "
            f"{tuple(teacher_topk.shape)} log-probs must have one shape [M, k]"
        )
    s, t = student_at_ids.float(), teacher_topk.float()
    if add_tail:
        s, t = add_tail_bucket(s), add_tail_bucket(t)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    return generalized_jsd(s, t, beta)
