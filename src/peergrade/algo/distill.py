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

What it deliberately does not do: no model forward (the caller gives both log-prob tensors),
no loss (``policy_loss`` takes ``[B, T]`` advantages), no normalisation across the batch.
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
