"""Off-policy corrections: per-token weights for tokens sampled by a policy other than pi_old.

What this module does
---------------------
The clipped surrogate of ``losses.policy_loss`` assumes the completions were sampled by
pi_old, the policy whose log-probs it divides by. In practice they were sampled by a
*behaviour* policy mu: the sampler's own log-probs, which differ from the trainer's
recomputation of pi_old by numerics alone (bf16 or batched logits while sampling, another
kernel, another summation order) or, with pipelined rollouts, by whole policy versions.
``off_policy_weights(old_logp, behaviour_logp, mask, correction=...)`` returns one weight per
token that multiplies the per-token surrogate, correcting for mu != pi_old by importance
sampling (as TRL's ``vllm_importance_sampling_correction``, verl's rollout IS and the "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" note by Yao et al. 2025).

With m the loss mask and d_it = old_logp_it - behaviour_logp_it = log(pi_old / mu) on counted
tokens (0 on padding), the ratio r is

    token level:       r_it = exp(d_it)
    sequence level:    r_it = r_i for every token of sequence i, with
        geometric mean (default):  log r_i = sum_t m_it d_it / sum_t m_it
        product:                   log r_i = sum_t m_it d_it

and the weight w (0 on padding in every mode) is

    none:            w_it = 1
    token_tis:       w_it = min(r_it, C)                         truncated IS (C = ``cap``)
    sequence_tis:    w_it = min(r_i, C)
    token_mis:       w_it = r_it if low <= r_it <= high else 0    masked IS
    sequence_mis:    w_it = r_i  if low <= r_i  <= high else 0    (the whole sequence)

IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", arXiv 2510.18855; TRL's ``vllm_importance_sampling_mode=
"token_mask"`` with both ``_clip_min`` and ``_clip_max``, trl#4732) is ``token_mis``: the
bidirectional token mask, weight r_it inside [low, high] and 0 outside (the paper's
[alpha, beta] = [0.5, 5]: ``low=0.5, high=5``).

TIS keeps every token and bounds its weight from above (the variance of IS comes from large
ratios); MIS drops tokens or whole sequences whose behaviour probability is too far from
pi_old to be corrected for, and keeps the others with their full ratio.

Why the geometric mean is the default at sequence level: the product is the exact sequence
likelihood ratio, but it multiplies T per-token ratios, so its log is a sum of T small
numerical differences that grows with the length. On a 500-token completion a mismatch of
only 0.002 nats per token (bf16 logits) gives a product of exp(+-1) = 2.7 or 0.37: TIS with
C = 2 then truncates nearly every long sequence and MIS with [0.5, 2] masks nearly every
long sequence, even though each of their tokens is almost on-policy. The geometric mean
exp(mean d) is the per-token ratio of a typical token and does not grow with the length
(GSPO's length-normalised ratio, Zheng et al. 2025). Use the product only for short
completions, or when the bias against long sequences is intended.

Metrics (python floats, over counted tokens; 0 with no counted token):
``correction/weight_mean``, ``correction/weight_min``, ``correction/weight_max`` of w;
``correction/masked_frac``: tokens given weight 0 by MIS; ``correction/truncated_frac``:
tokens whose weight TIS truncated at C.

Identity: when ``behaviour_logp`` equals ``old_logp`` bitwise, d = 0 exactly, so every ratio is
exp(0) = 1 exactly, every weight is exactly 1 on counted tokens (``cap >= 1`` and
``low <= 1 <= high`` are required for this reason) and nothing is masked: multiplying the
surrogate by it changes no bit of the loss.

``off_policy_sequence_mask(logp, behaviour_logp, advantages, mask, threshold)`` is
DeepSeek-V3.2's off-policy sequence mask (OPSM, DeepSeek-AI 2025, arXiv 2512.02556, Eq. 9;
TRL's ``off_policy_mask_threshold``): a sequence is dropped from the surrogate when its
advantage is negative *and* its mean per-token KL estimate from the behaviour policy is above
delta:

    D_i    = sum_t m_it (behaviour_logp_it - logp_it) / sum_t m_it     (NaN terms count 0)
    keep_i = A_i >= 0  or  D_i <= delta

(logp detached). Negative-advantage samples that the current policy already finds unlikely
carry the most harmful, least reliable gradient; positive ones are always kept.

Weights are detached (they correct the sampling distribution; no gradient flows through
them) and are returned in float32 or the inputs' wider float dtype.

What it deliberately does not do
--------------------------------
No log-prob computation, no loss (``losses.policy_loss`` takes the weights as ``weights``), no
change of any normaliser (a masked token still counts in the loss's denominators, as in TRL
and verl), no staleness bookkeeping, no cross-process reduction of the metrics, no config.
It imports torch only.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["CORRECTIONS", "SEQUENCE_RATIOS", "off_policy_sequence_mask", "off_policy_weights"]

CORRECTIONS = ("none", "token_tis", "sequence_tis", "token_mis", "sequence_mis")
SEQUENCE_RATIOS = ("geometric", "product")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_btt(name: str, logp, behaviour_logp, mask) -> None:
    """``logp`` (called ``name``), ``behaviour_logp`` and ``mask`` are ``[B, T]`` tensors of one
    shape."""
    for n, x in ((name, logp), ("behaviour_logp", behaviour_logp), ("mask", mask)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)
            raise ValueError(f"{n}: expected a [B, T] torch.Tensor, got {got}")
    if behaviour_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"behaviour_logp {tuple(behaviour_logp.shape)} and mask {tuple(mask.shape)}: "
            f"expected the shape of {name} {tuple(logp.shape)}"
        )


def _valid(mask: torch.Tensor) -> torch.Tensor:
    """``mask == 1`` as a bool tensor; a mask of other values than 0/1 is an error."""
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask == 0) | (mask == 1)).all()):
        return mask == 1
    raise ValueError("mask: expected only 0/1 values (mask == 1 marks tokens that count)")


@torch.no_grad()
def off_policy_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: str = "none",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    sequence_ratio: str = "geometric",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights correcting for sampling by mu instead of pi_old.

    Args:
        old_logp: ``[B, T]`` log pi_old of the sampled tokens (the trainer's recomputation).
        behaviour_logp: ``[B, T]`` log mu of the same tokens (the sampler's).
        mask: ``[B, T]`` 0/1 (or bool), 1 marks tokens that count; padding may hold any value
            (-inf, NaN) in the log-probs.
        correction: ``"none"``, ``"token_tis"``, ``"sequence_tis"``, ``"token_mis"`` or
            ``"sequence_mis"`` (see the module docstring).
        cap: C of TIS, >= 1.
        low, high: the kept interval of MIS, 0 <= low <= 1 <= high.
        sequence_ratio: ``"geometric"`` (mean log-ratio) or ``"product"`` (summed log-ratio),
            for the sequence-level modes.

    Returns:
        ``(weights, metrics)``: ``[B, T]`` detached weights, 0 where ``mask == 0``, and a dict
        of floats (module docstring).
    """
    _check_btt("old_logp", old_logp, behaviour_logp, mask)
    _check_correction_options(correction, sequence_ratio, cap, low, high)
    valid = _valid(mask)

    dtype = torch.promote_types(
        torch.promote_types(old_logp.dtype, behaviour_logp.dtype), torch.float32
    )
    m = valid.to(dtype)  # [B, T]
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    # Padding may hold -inf/NaN: replace it before any arithmetic.
    d = torch.where(valid, old_logp.detach().to(dtype) - behaviour_logp.detach().to(dtype), zero)
    ratio = _correction_ratio(d, m, correction, sequence_ratio)  # [B, T]
    weights, masked, truncated = _correction_weights(ratio, valid, zero, correction, cap, low, high)
    return weights, _weight_metrics(weights, valid, m, masked, truncated)


def _check_correction_options(
    correction: str, sequence_ratio: str, cap: float, low: float, high: float
) -> None:
    """Check the options of ``off_policy_weights``."""
    if correction not in CORRECTIONS:
        raise ValueError(f"correction: expected one of {CORRECTIONS}, got {correction!r}")
    if sequence_ratio not in SEQUENCE_RATIOS:
        raise ValueError(
            f"sequence_ratio: expected one of {SEQUENCE_RATIOS}, got {sequence_ratio!r}"
        )
    # cap >= 1 and low <= 1 <= high keep an on-policy token's weight exactly 1
    if not (_is_number(cap) and cap >= 1):
        raise ValueError(f"cap: expected a number >= 1, got {cap!r}")
    if not (_is_number(low) and 0 <= low <= 1):
        raise ValueError(f"low: expected a number in [0, 1], got {low!r}")
    if not (_is_number(high) and high >= 1):
        raise ValueError(f"high: expected a number >= 1, got {high!r}")


def _correction_ratio(
    d: torch.Tensor, m: torch.Tensor, correction: str, sequence_ratio: str
) -> torch.Tensor:
    """The ratio r ``[B, T]`` of ``correction`` from d = log(pi_old / mu) (0 on padding): 1, the
    token ratio exp(d_it), or the sequence's ratio (geometric mean or product) on every token."""
    if correction == "none":
        ratio = torch.ones_like(d)  # [B, T]
    elif correction in ("token_tis", "token_mis"):
        ratio = torch.exp(d)  # [B, T]
    elif correction in ("sequence_tis", "sequence_mis"):
        if sequence_ratio == "geometric":
            log_seq = d.sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
        elif sequence_ratio == "product":
            log_seq = d.sum(dim=1)  # [B]
        else:  # pragma: no cover - validated above
            raise ValueError(f"sequence_ratio: expected one of {SEQUENCE_RATIOS}")
        ratio = torch.exp(log_seq)[:, None].expand_as(d)  # [B, T]
    else:  # pragma: no cover - validated above
        raise ValueError(f"correction: expected one of {CORRECTIONS}, got {correction!r}")
    return ratio


def _correction_weights(
    ratio: torch.Tensor,
    valid: torch.Tensor,
    zero: torch.Tensor,
    correction: str,
    cap: float,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, masked, truncated)``: w ``[B, T]`` (exactly 0 on padding) from the ratio, TIS's
    min(r, C) or MIS's r inside [low, high] and 0 outside, and the ``[B, T]`` bool masks of the
    counted tokens MIS gave weight 0 and TIS truncated."""
    truncated = torch.zeros_like(valid)  # [B, T] bool
    masked = torch.zeros_like(valid)  # [B, T] bool
    if correction in ("token_tis", "sequence_tis"):
        truncated = valid & (ratio > cap)
        w = torch.where(truncated, torch.full_like(ratio, cap), ratio)  # min(r, C)
    elif correction in ("token_mis", "sequence_mis"):
        masked = valid & ((ratio < low) | (ratio > high))
        w = torch.where(masked, zero, ratio)
    else:
        w = ratio
    weights = torch.where(valid, w, zero)  # [B, T], exactly 0 on padding
    return weights, masked, truncated


_WEIGHT_METRICS = (
    "correction/weight_mean",
    "correction/weight_min",
    "correction/weight_max",
    "correction/masked_frac",
    "correction/truncated_frac",
)


def _weight_metrics(
    weights: torch.Tensor,
    valid: torch.Tensor,
    m: torch.Tensor,
    masked: torch.Tensor,
    truncated: torch.Tensor,
) -> dict[str, float]:
    """The metrics of the module docstring over the counted tokens (0 with none), one host sync."""
    dtype = weights.dtype
    zero = torch.zeros((), dtype=dtype, device=weights.device)
    one = torch.ones((), dtype=dtype, device=weights.device)
    n = m.sum()
    denom = n.clamp(min=1)
    big = torch.finfo(dtype).max
    has = n > 0
    stats = torch.stack(
        [
            weights.sum() / denom,
            torch.where(has, torch.where(valid, weights, big * one).amin(), zero),
            torch.where(has, torch.where(valid, weights, -big * one).amax(), zero),
            masked.to(dtype).sum() / denom,
            truncated.to(dtype).sum() / denom,
        ]
    ).tolist()
    return dict(zip(_WEIGHT_METRICS, stats))


@torch.no_grad()
def off_policy_sequence_mask(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """``[B]`` bool, True = keep: DeepSeek-V3.2's OPSM (see the module docstring).

    Args:
        logp: ``[B, T]`` log-probs of the current policy (detached here).
        behaviour_logp: ``[B, T]`` log-probs of the policy that sampled (the sampler's, else
            pi_old); NaN on a counted token means "not scored" and counts 0.
        advantages: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` 0/1 or bool, 1 = counts.
        threshold: delta, > 0.
    """
    _check_btt("logp", logp, behaviour_logp, mask)
    B = logp.shape[0]
    if not isinstance(advantages, torch.Tensor) or advantages.shape != (B,):
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(f"advantages: expected shape ({B},) (one per sequence), got {got}")
    if not (_is_number(threshold) and threshold > 0):
        raise ValueError(f"threshold: expected a positive number, got {threshold!r}")
    valid = _valid(mask)
    dtype = torch.promote_types(
        torch.promote_types(logp.dtype, behaviour_logp.dtype), torch.float32
    )
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    d = behaviour_logp.detach().to(dtype) - logp.detach().to(dtype)  # [B, T]
    d = torch.where(valid & ~torch.isnan(d), d, zero)  # [B, T]
    kl = d.sum(dim=1) / valid.sum(dim=1).clamp(min=1).to(dtype)  # [B]
    return (advantages.detach() >= 0) | (kl <= threshold)  # [B]
