"""Policy-gradient losses (GRPO family, GSPO, CISPO), KL estimators and the PPO value loss.

What this module does
---------------------
``kl_divergence(logp, ref_logp, estimator)``: per-token estimators of KL(pi || pi_ref) from
samples of pi, from J. Schulman, "Approximating KL Divergence" (2020), with
d = ref_logp - logp = log(pi_ref / pi):

    k1 = logp - ref_logp = -d                 unbiased, high variance, can be negative
    k2 = 0.5 * (logp - ref_logp)^2            biased, low variance, >= 0
    k3 = exp(d) - d - 1                        unbiased, low variance, >= 0 (DeepSeekMath GRPO)

``policy_loss(logp, old_logp, advantages, mask, ...)``: the clipped surrogate of PPO
(Schulman et al. 2017) as used by GRPO (DeepSeekMath, Shao et al. 2024), per token t of
sequence i, with A_i the sequence's advantage (one scalar per completion, ``[B]``; PPO passes
one advantage per token, ``[B, T]``, and A_i becomes A_it below):

    rho_it = exp(logp_it - old_logp_it)                                  (ratio_level="token")
    l_it   = -min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps_high) A_i) + beta * KL_it

``eps_high`` (``clip_eps_high``) defaults to ``eps``; a larger value is DAPO's "clip-higher"
(Yu et al. 2025). The KL term (estimator ``kl_estimator``, default k3) is added only when
``beta > 0`` *and* ``ref_logp`` is given; with ``beta > 0`` and no ``ref_logp`` the loss has no
KL term (callers that skip the reference model pass ``beta=0``).

``ratio_level="sequence"`` is GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"):
one ratio per sequence, the length-normalised sequence likelihood ratio

    log s_i = sum_t m_it (logp_it - old_logp_it) / sum_t m_it,

applied to every token in the "GSPO-token" form rho_it = exp(sg(log s_i) + logp_it - sg(logp_it))
(sg = stop-gradient): its value is s_i for every token, and d rho_it / d logp_it = s_i, so the
gradient flows through each token's own log-probability. Clipping then acts on whole sequences.

``loss_type="cispo"`` is CISPO (MiniMax-M1, MiniMax 2025): the importance weight is truncated
from above and detached, and every token keeps a gradient (no token is dropped by clipping):

    l_it = -sg(min(rho_it, 1 + eps_high)) A_i logp_it (+ beta * KL_it)

``weights`` (optional, ``[B, T]``): per-token off-policy correction weights w_it
(``offpolicy.off_policy_weights``: truncated or masked importance sampling toward the sampler's
log-probs) multiply the surrogate part, l_it = -w_it min(...) + beta * KL_it (for CISPO
-w_it sg(min(rho_it, 1 + eps_high)) A_i logp_it + beta * KL_it); they are detached, change no
normaliser (a token of weight 0 still counts in every denominator, as in TRL and verl) and
not the clip or ratio metrics. ``weights=None`` multiplies by nothing; weights all exactly 1
give the same loss bit for bit.

Aggregation of the masked per-token losses l (m = mask, B = number of sequences):

    grpo     mean_i( sum_t m_it l_it / sum_t m_it )       DeepSeekMath GRPO (sequence mean)
    bnpo     sum m l / sum m                              token mean over this (micro)batch
    dr_grpo  sum m l / (B * max_completion_length)        Dr. GRPO (Liu et al. 2025), constant
    dapo     sum m l / num_tokens                         DAPO token-level loss
    cispo    sum m l / num_tokens                         as DAPO

``num_tokens`` is the active-token count of the whole global batch (across gradient
accumulation steps and processes) so that micro-batch losses add up to the global token mean;
it defaults to sum m (local). It is used by ``dapo`` and ``cispo`` only. A sequence with no
active token contributes 0 to ``grpo`` but still counts in the mean over B (as in TRL).

``num_sequences`` is the minibatch rule for gradient accumulation: when the B sequences here
are one micro-batch of a minibatch of ``num_sequences`` sequences, the returned loss of the
per-batch normalised types (``grpo``, ``bnpo``, ``dr_grpo``) is scaled by B / num_sequences,
its share of the minibatch, so that the micro-batch gradients add up to the minibatch's
(size-weighted for ``bnpo``, exact for the others). ``dapo`` and ``cispo`` are already
normalised by the minibatch's ``num_tokens`` and are not scaled. The metrics stay this
micro-batch's own normalised values.

``stands_for`` and ``batch_tokens`` are the exact-elision rule: a sequence whose every token
has loss 0 (advantage 0 and no KL term) has zero gradient, so a caller may leave it out of the
forward/backward. The B rows given then *stand for* ``stands_for`` sequences (>= B; the others
have loss 0) holding ``batch_tokens`` counted tokens, and these replace B and ``sum m`` in
every normaliser: grpo's mean over sequences, bnpo's token count, dr_grpo's B, and the share
B / num_sequences. The loss and its gradient are then those of the full batch (up to float
summation order). ``stands_for`` may be fractional when several micro-batches share the left-out
rows of a minibatch: grpo and dr_grpo divide by it and the share multiplies by it, so it cancels
in the loss; it only sets the metrics' normalisation.

Metrics (python floats, computed without gradient over tokens with ``mask == 1``; a fraction
over zero tokens is 0):

- ``clip/low_frac``: tokens where the clipped branch is active on the low side, A < 0 and
  rho < 1 - eps (their gradient is zero); ``clip/high_frac``: A > 0 and rho > 1 + eps_high;
  ``clip/frac``: their sum. These are the tokens whose gradient the clip removes (the way TRL
  and verl count them). For ``cispo``, ``clip/high_frac`` counts tokens whose weight was
  truncated at 1 + eps_high (any sign of A) and ``clip/low_frac`` is 0 (CISPO has no low clip).
- ``ratio/mean``, ``ratio/min``, ``ratio/max``: of rho over active tokens (for GSPO every
  token carries its sequence's ratio, so the mean is token-weighted); all 0 with no tokens.
- ``kl/mean``: token mean of the chosen KL estimator whenever ``ref_logp`` is given (also with
  ``beta == 0``, for monitoring), 0.0 when it is not.
- ``advantage/mean``: mean of ``advantages`` over the B sequences (not token-weighted), or
  over ``stands_for`` sequences whose left-out ones have advantage 0; for ``[B, T]``
  advantages, their mean over active tokens.
- With ``stands_for`` (elision), ``loss/policy``, ``loss/kl`` and ``advantage/mean`` are those
  of the full batch; the clip, ratio and KL statistics are over the tokens of the B rows given
  (the only ones computed).
- ``loss/policy``: the aggregated surrogate part of the loss; ``loss/kl``: the aggregated
  ``beta * KL`` part (0.0 without a KL term). ``loss == loss/policy + loss/kl``.

``value_loss(values, old_values, returns, mask, clip_eps)``: the clipped value loss of PPO
(Schulman et al. 2017; the form used by OpenAI baselines and LLM PPO trainers),

    L = masked_mean( 0.5 * max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2) )

returning ``(loss, metrics)`` with ``value/clip_frac`` (tokens where the clipped term is the
larger one, i.e. the clip removed the gradient) and ``value/mean``.

Robustness: positions with ``mask == 0`` are replaced by 0 before any arithmetic, so padding
that holds -inf or NaN log-probabilities cannot leak NaN into the loss or its gradient. Only
``logp`` (and ``values``) carry gradient: old/ref log-probs, advantages and returns are detached.

What it deliberately does not do
--------------------------------
No log-prob computation (see peergrade.model.logprobs), no advantage computation (advantages.py), no
cross-process reduction (the caller passes ``num_tokens`` and reduces metrics), no dual-clip,
no entropy bonus, no config objects, no I/O. It imports torch only.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["kl_divergence", "policy_loss", "value_loss"]

_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
_RATIO_LEVELS = ("token", "sequence")
_KL_ESTIMATORS = ("k1", "k2", "k3")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_tensor_2d(name: str, t: object, what: str = "[B, T]") -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor of shape {what}, got {type(t)}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected shape {what}, got {tuple(t.shape)}")


def _check_same_shape(name: str, t: object, ref_name: str, ref: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(
            f"{name}: expected a torch.Tensor of shape {tuple(ref.shape)} (as {ref_name}), "
            f"got {type(t)}"
        )
    if t.shape != ref.shape:
        raise ValueError(
            f"{name}: expected shape {tuple(ref.shape)} (the shape of {ref_name}), "
            f"got {tuple(t.shape)}"
        )


def _check_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask == 1`` as bool after checking that every entry is 0 or 1."""
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask: expected only 0/1 values (mask == 1 marks tokens that count)")
    return mask == 1


def kl_divergence(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of sampled tokens (Schulman's k1/k2/k3).

    Args:
        logp: log pi(token), any shape.
        ref_logp: log pi_ref(token), same shape as ``logp``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring).

    Returns:
        A tensor of the shape of ``logp``; gradients flow through both arguments.
    """
    if not isinstance(logp, torch.Tensor):
        raise ValueError(f"logp: expected a torch.Tensor, got {type(logp)}")
    _check_same_shape("ref_logp", ref_logp, "logp", logp)
    if estimator == "k1":
        return logp - ref_logp
    elif estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    elif estimator == "k3":
        d = ref_logp - logp  # log(pi_ref / pi)
        return torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"estimator: expected one of {_KL_ESTIMATORS}, got {estimator!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    ratio_level: str = "token",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    max_completion_length: int | None = None,
    num_tokens: float | int | torch.Tensor | None = None,
    num_sequences: int | None = None,
    stands_for: float | None = None,
    batch_tokens: float | int | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss over a batch of completions (see the module docstring).

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that sampled them (detached here).
        advantages: ``[B]`` one advantage per sequence (GRPO), or ``[B, T]`` one per token (PPO).
        mask: ``[B, T]``, ``mask == 1`` marks completion tokens that count.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"`` or ``"cispo"``.
        ratio_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO).
        clip_eps: lower clip range, rho >= 1 - clip_eps (> 0).
        clip_eps_high: upper clip range, rho <= 1 + clip_eps_high (> 0); defaults to clip_eps.
        ref_logp: ``[B, T]`` reference log-probs, needed for the KL term and ``kl/mean``.
        beta: KL coefficient (>= 0).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        max_completion_length: the constant normaliser of ``dr_grpo`` (required there).
        num_tokens: global active-token count for ``dapo``/``cispo`` (default: ``mask.sum()``).
        num_sequences: sequences in the minibatch these B belong to (gradient accumulation):
            the loss of ``grpo``/``bnpo``/``dr_grpo`` is scaled by B / num_sequences.
        stands_for: sequences these B rows stand for (>= B) when rows whose loss is exactly 0
            were left out (exact elision); replaces B in grpo/dr_grpo and the share.
        batch_tokens: counted tokens of the batch these rows stand for; bnpo's normaliser
            (default ``mask.sum()``).
        weights: ``[B, T]`` off-policy correction weights multiplying the per-token surrogate
            (detached here; e.g. from ``off_policy_weights``); None = no correction.

    Returns:
        ``(loss, metrics)``: a scalar tensor with gradient w.r.t. ``logp`` and a dict of floats.
    """
    # ---- validation: shapes, options, numbers -------------------------------------------
    _check_tensor_2d("logp", logp)
    if not logp.is_floating_point():
        raise ValueError(f"logp: expected a floating-point tensor, got dtype {logp.dtype}")
    B, T = logp.shape
    if B == 0 or T == 0:
        raise ValueError(f"logp: expected a non-empty [B, T] tensor, got {tuple(logp.shape)}")
    _check_same_shape("old_logp", old_logp, "logp", logp)
    _check_same_shape("mask", mask, "logp", logp)
    if ref_logp is not None:
        _check_same_shape("ref_logp", ref_logp, "logp", logp)
    if weights is not None:
        _check_same_shape("weights", weights, "logp", logp)
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in ((B,), (B, T)):
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(
            f"advantages: expected shape ({B},) (one per sequence of logp) or ({B}, {T}) "
            f"(one per token), got {got}"
        )
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {_LOSS_TYPES}, got {loss_type!r}")
    if ratio_level not in _RATIO_LEVELS:
        raise ValueError(f"ratio_level: expected one of {_RATIO_LEVELS}, got {ratio_level!r}")
    if kl_estimator not in _KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: expected one of {_KL_ESTIMATORS}, got {kl_estimator!r}")
    if not (_is_number(clip_eps) and clip_eps > 0):
        raise ValueError(f"clip_eps: expected a positive number, got {clip_eps!r}")
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if not (_is_number(clip_eps_high) and clip_eps_high > 0):
        raise ValueError(
            f"clip_eps_high: expected a positive number or None, got {clip_eps_high!r}"
        )
    if not (_is_number(beta) and beta >= 0):
        raise ValueError(f"beta: expected a number >= 0, got {beta!r}")
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError(
                "max_completion_length: required for loss_type='dr_grpo' (its constant "
                "normaliser is B * max_completion_length)"
            )
        if not (
            isinstance(max_completion_length, numbers.Integral)
            and not isinstance(max_completion_length, bool)
            and max_completion_length > 0
        ):
            raise ValueError(
                f"max_completion_length: expected a positive int, got {max_completion_length!r}"
            )
    if num_tokens is not None:
        if isinstance(num_tokens, torch.Tensor):
            if num_tokens.numel() != 1:
                raise ValueError(
                    f"num_tokens: expected a scalar, got a tensor of shape {tuple(num_tokens.shape)}"
                )
            ok = bool(num_tokens.detach().reshape(()) > 0)
        else:
            ok = _is_number(num_tokens) and num_tokens > 0
        if not ok:
            raise ValueError(f"num_tokens: expected a positive count, got {num_tokens!r}")
    if num_sequences is not None and not (
        isinstance(num_sequences, numbers.Integral)
        and not isinstance(num_sequences, bool)
        and num_sequences >= B
    ):
        raise ValueError(
            f"num_sequences: expected an int >= B = {B} (the minibatch these rows belong to), "
            f"got {num_sequences!r}"
        )

    if stands_for is not None and not (_is_number(stands_for) and stands_for >= B):
        raise ValueError(
            f"stands_for: expected a number >= B = {B} (the sequences these rows stand for), "
            f"got {stands_for!r}"
        )
    if batch_tokens is not None:
        bt = batch_tokens
        if isinstance(bt, torch.Tensor):
            bt = bt.detach().reshape(()).to(mask.device)
        if not (isinstance(bt, torch.Tensor) or _is_number(bt)) or bool(bt < (mask == 1).sum()):
            raise ValueError(
                f"batch_tokens: expected a count >= the counted tokens of mask, got {batch_tokens!r}"
            )
    B_all = B if stands_for is None else stands_for  # the sequences the normalisers count

    # ---- per-token quantities ----------------------------------------------------------
    valid = _check_mask(mask)  # [B, T] bool
    m = valid.to(logp.dtype)  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Padding may hold -inf/NaN: replace it before any arithmetic so it cannot poison grads.
    lp = torch.where(valid, logp, zero)  # [B, T]
    old = torch.where(valid, old_logp.detach().to(logp.dtype), zero)  # [B, T]
    if advantages.dim() == 1:
        adv = advantages.detach().to(logp.dtype)[:, None]  # [B, 1]
    else:
        adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)  # [B, T]

    log_ratio = lp - old  # [B, T], 0 on padding
    if ratio_level == "token":
        log_rho = log_ratio  # [B, T]
    elif ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
        log_rho = seq_log_ratio.detach()[:, None] + lp - lp.detach()  # [B, T], GSPO-token
    else:  # pragma: no cover - validated above
        raise ValueError(f"ratio_level: expected one of {_RATIO_LEVELS}, got {ratio_level!r}")
    rho = torch.exp(log_rho)  # [B, T]

    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps_high
    if loss_type == "cispo":
        weight = rho.clamp(max=hi).detach()  # [B, T], sg(min(rho, 1 + eps_high))
        pg = -weight * adv * lp  # [B, T]
        clipped_low = torch.zeros_like(valid)
        clipped_high = rho.detach() > hi
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        unclipped = rho * adv  # [B, T]
        clipped = rho.clamp(min=lo, max=hi) * adv  # [B, T]
        pg = -torch.minimum(unclipped, clipped)  # [B, T]
        rd = rho.detach()
        clipped_low = (adv < 0) & (rd < lo)  # [B, T]
        clipped_high = (adv > 0) & (rd > hi)  # [B, T]
    else:  # pragma: no cover - validated above
        raise ValueError(f"loss_type: expected one of {_LOSS_TYPES}, got {loss_type!r}")
    if weights is not None:  # off-policy correction of the surrogate; padding gets 0
        pg = pg * torch.where(valid, weights.detach().to(logp.dtype), zero)  # [B, T]

    kl = None
    if ref_logp is not None:
        ref = torch.where(valid, ref_logp.detach().to(logp.dtype), zero)  # [B, T]
        kl = kl_divergence(lp, ref, kl_estimator)  # [B, T], 0 on padding
    use_kl = kl is not None and beta > 0

    # ---- aggregation -------------------------------------------------------------------
    n_active = m.sum()  # []
    if loss_type == "grpo":

        def aggregate(x: torch.Tensor) -> torch.Tensor:
            per_seq = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
            return per_seq.mean() if stands_for is None else per_seq.sum() / B_all

    elif loss_type == "bnpo":
        if batch_tokens is None:
            bnpo_norm = n_active.clamp(min=1)
        elif isinstance(batch_tokens, torch.Tensor):
            bnpo_norm = batch_tokens.detach().reshape(()).to(logp.device, logp.dtype).clamp(min=1)
        else:
            bnpo_norm = max(float(batch_tokens), 1.0)

        def aggregate(x: torch.Tensor) -> torch.Tensor:
            return (x * m).sum() / bnpo_norm

    elif loss_type == "dr_grpo":

        def aggregate(x: torch.Tensor) -> torch.Tensor:
            return (x * m).sum() / (B_all * max_completion_length)

    elif loss_type in ("dapo", "cispo"):
        if num_tokens is None:
            norm = n_active.clamp(min=1)
        elif isinstance(num_tokens, torch.Tensor):
            norm = num_tokens.detach().reshape(()).to(device=logp.device, dtype=logp.dtype)
        else:
            norm = float(num_tokens)

        def aggregate(x: torch.Tensor) -> torch.Tensor:
            return (x * m).sum() / norm

    else:  # pragma: no cover - validated above
        raise ValueError(f"loss_type: expected one of {_LOSS_TYPES}, got {loss_type!r}")

    loss_pg = aggregate(pg)
    loss = loss_pg + beta * aggregate(kl) if use_kl else loss_pg
    share = 1.0
    if num_sequences is not None and loss_type in ("grpo", "bnpo", "dr_grpo"):
        share = B_all / num_sequences  # this micro-batch's share of the minibatch

    # ---- metrics (no grad, one host sync) ------------------------------------------------
    with torch.no_grad():
        denom = n_active.clamp(min=1)
        rd = rho.detach()
        has_tokens = n_active > 0
        big = torch.finfo(rd.dtype).max
        r_min = torch.where(valid, rd, torch.full_like(rd, big)).amin()
        r_max = torch.where(valid, rd, torch.full_like(rd, -big)).amax()
        low = (clipped_low & valid).to(logp.dtype).sum() / denom
        high = (clipped_high & valid).to(logp.dtype).sum() / denom
        values = torch.stack(
            [
                low,
                high,
                low + high,
                (rd * m).sum() / denom,
                torch.where(has_tokens, r_min, zero),
                torch.where(has_tokens, r_max, zero),
                (kl.detach() * m).sum() / denom if kl is not None else zero,
                (adv.mean() if stands_for is None else adv.sum() / B_all)
                if advantages.dim() == 1
                else (adv * m).sum() / denom,
                loss_pg.detach(),
                (loss - loss_pg).detach() if use_kl else zero,
            ]
        ).tolist()
    names = (
        "clip/low_frac",
        "clip/high_frac",
        "clip/frac",
        "ratio/mean",
        "ratio/min",
        "ratio/max",
        "kl/mean",
        "advantage/mean",
        "loss/policy",
        "loss/kl",
    )
    return (loss * share if share != 1.0 else loss), dict(zip(names, values))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss, masked token mean (see the module docstring).

    Args:
        values: ``[B, T]`` current critic values (with grad).
        old_values: ``[B, T]`` critic values at rollout time (detached here).
        returns: ``[B, T]`` regression targets, e.g. from ``gae`` (detached here).
        mask: ``[B, T]``, ``mask == 1`` marks tokens that count.
        clip_eps: positive clip range around ``old_values``.

    Returns:
        ``(loss, metrics)`` with metrics ``value/clip_frac`` and ``value/mean`` (floats).
    """
    _check_tensor_2d("values", values)
    if not values.is_floating_point():
        raise ValueError(f"values: expected a floating-point tensor, got dtype {values.dtype}")
    _check_same_shape("old_values", old_values, "values", values)
    _check_same_shape("returns", returns, "values", values)
    _check_same_shape("mask", mask, "values", values)
    if not (_is_number(clip_eps) and clip_eps > 0):
        raise ValueError(f"clip_eps: expected a positive number, got {clip_eps!r}")

    valid = _check_mask(mask)  # [B, T]
    m = valid.to(values.dtype)  # [B, T]
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(valid, values, zero)  # [B, T]
    v_old = torch.where(valid, old_values.detach().to(values.dtype), zero)  # [B, T]
    ret = torch.where(valid, returns.detach().to(values.dtype), zero)  # [B, T]

    v_clipped = v_old + (v - v_old).clamp(min=-clip_eps, max=clip_eps)  # [B, T]
    err = (v - ret) ** 2  # [B, T]
    err_clipped = (v_clipped - ret) ** 2  # [B, T]
    per_token = 0.5 * torch.maximum(err, err_clipped)  # [B, T]
    denom = m.sum().clamp(min=1)
    loss = (per_token * m).sum() / denom

    with torch.no_grad():
        clip_frac = ((err_clipped > err) & valid).to(values.dtype).sum() / denom
        v_mean = (v.detach() * m).sum() / denom
        clip_frac_f, v_mean_f = torch.stack([clip_frac, v_mean]).tolist()
    return loss, {"value/clip_frac": clip_frac_f, "value/mean": v_mean_f}
