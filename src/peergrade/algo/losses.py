"""Policy-gradient losses (GRPO family, GSPO, CISPO, SAPO, LUSPO, VESPO), KL estimators, the
entropy helpers and the PPO value loss.

The formulas and their sources, the aggregation of every loss type, the normalisers (gradient
accumulation, exact elision), the off-policy weights and keep mask, and every metric are stated
in docs/algorithms.md ("The policy loss" to "PPO"); each function's docstring gives its
arguments. ``policy_loss`` takes its options as one ``LossOptions`` record (``loss_options``:
one record per loss family) and runs the loss registered under ``options.loss_type``
(``loss_registry``): the eight built-in types are ``builtin_policy_loss``, registered here.

What it deliberately does not do: no log-prob or entropy computation (peergrade.model.logprobs),
no advantage computation (advantages.py), no cross-process reduction (the caller passes
``num_tokens`` and reduces metrics), no dual-clip, no config objects, no I/O. The entropy bonus
and the high-entropy token selection are separate functions (``entropy_bonus``,
``high_entropy_mask``, ``adaptive_entropy_coef``) that the caller adds to the loss. It imports
torch only.
"""

from __future__ import annotations

import math
import numbers

import torch

from peergrade.algo.loss_options import (
    KL_ESTIMATORS,
    TOKEN_MEAN_TYPES,
    CispoLoss,
    ClippedLoss,
    DrGrpoLoss,
    LossBatch,
    LossCounts,
    LossOptions,
    SapoLoss,
    VespoLoss,
    loss_options,
)
from peergrade.algo.loss_registry import LOSS_TYPES, is_builtin, loss_function, register_loss

__all__ = [
    "LOSS_TYPES",
    "adaptive_entropy_coef",
    "builtin_policy_loss",
    "entropy_bonus",
    "high_entropy_mask",
    "kl_divergence",
    "policy_loss",
    "value_loss",
    "vespo_weights",
]

_LOSS_TYPES = LOSS_TYPES
_TOKEN_MEAN = TOKEN_MEAN_TYPES  # normalised by the global token count num_tokens
_VESPO_LOG_MIN = math.log(1e-8)  # VESPO's lower clamp of log w
_RATIO_LEVELS = ("token", "sequence")
_KL_ESTIMATORS = KL_ESTIMATORS
_COUNT_NAMES = ("num_tokens", "num_sequences", "stands_for", "batch_tokens")


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
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (docs/algorithms.md).

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
    options: LossOptions | None = None,
    *,
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    counts: LossCounts | None = None,
    **knobs: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss ``options.loss_type`` over a batch of completions: the
    built-in types (docs/algorithms.md) or a loss added with ``register_loss``.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that sampled them (detached here).
        advantages: ``[B]`` one advantage per sequence (GRPO), or ``[B, T]`` one per token (PPO).
        mask: ``[B, T]``, ``mask == 1`` marks completion tokens that count.
        options: the loss type with its family's knobs and the shared clip/KL options
            (``LossOptions``; ``loss_options(**flat)`` builds one from ``algo.*`` names).
        ref_logp: ``[B, T]`` reference log-probs, for the KL term (``options.beta > 0``) and
            ``kl/mean``; None: no KL term.
        weights: ``[B, T]`` off-policy correction weights (``off_policy_weights``) or None.
        keep: ``[B, T]`` 0/1 (or bool) tokens whose surrogate counts; None = all.
        counts: the counts that replace the local ones in the normalisers (``LossCounts``:
            ``num_tokens``, ``num_sequences``, ``stands_for``, ``batch_tokens``); None: local.
        **knobs: the keyword form, for one-off calls and tests, instead of ``options`` and
            ``counts``: their fields by flat name, e.g. ``loss_type="dr_grpo",
            max_completion_length=8, beta=0.1, num_tokens=40`` (``loss_options``' names
            plus the four counts). Not together with ``options``.

    Returns:
        ``(loss, metrics)``: a scalar tensor with gradient w.r.t. ``logp`` and a dict of floats
        (a registered loss without ``loss/policy`` gets its returned loss there).
    """
    B = _check_tensors(logp, old_logp, advantages, mask, ref_logp, weights, keep)
    options, counts = _resolve_options(options, counts, knobs)
    _check_normalisers(B, mask, counts)
    batch = LossBatch(logp, old_logp, advantages, mask, ref_logp, weights, keep, counts)
    loss, metrics = loss_function(options.loss_type)(batch, options)
    if not is_builtin(options.loss_type) and "loss/policy" not in metrics:
        metrics = {**metrics, "loss/policy": float(loss.detach())}
    return loss, metrics


def _resolve_options(
    options: LossOptions | None, counts: LossCounts | None, knobs: dict
) -> tuple[LossOptions, LossCounts]:
    """``policy_loss``'s options and counts: as given, or from the keyword form ``knobs``."""
    if options is not None:
        if knobs:
            raise TypeError(
                f"policy_loss: options is given, so the keyword options {sorted(knobs)} would "
                "be ignored: set them in the LossOptions (or LossCounts) instead"
            )
        if not isinstance(options, LossOptions):
            raise ValueError(
                f"options: expected a LossOptions (peergrade.algo.loss_options), got "
                f"{type(options).__name__}"
            )
        return options, LossCounts() if counts is None else counts
    flat_counts = {k: knobs.pop(k) for k in _COUNT_NAMES if k in knobs}
    if flat_counts and counts is not None:
        raise TypeError(f"policy_loss: counts is given, so {sorted(flat_counts)} would be ignored")
    opts = loss_options(**knobs)
    return opts, LossCounts(**flat_counts) if counts is None else counts


def builtin_policy_loss(
    batch: LossBatch, options: LossOptions
) -> tuple[torch.Tensor, dict[str, float]]:
    """The built-in loss types (``LOSS_TYPES``), a registered ``LossFn``: the family's
    per-token objective, times the off-policy weights and the keep mask, plus the KL term,
    aggregated by the loss type, times the micro-batch's share; and the metrics."""
    fam, c = options.family, batch.counts
    loss_type = fam.loss_type
    if not is_builtin(loss_type):
        raise ValueError(f"loss_type: expected one of {_LOSS_TYPES}, got {loss_type!r}")
    B = batch.logp.shape[0]
    B_all = B if c.stands_for is None else c.stands_for  # the sequences the normalisers count
    cap = fam.cap if isinstance(fam, CispoLoss) else None
    delta = fam.delta if isinstance(fam, (ClippedLoss, DrGrpoLoss)) else None
    max_len = fam.max_completion_length if isinstance(fam, DrGrpoLoss) else None
    hi = 1.0 + options.eps_high if cap is None else float(cap)  # CISPO's cap as given
    clip = (1.0 - options.clip_eps, hi, delta)
    x = _LossInputs(batch, options.ratio_level, clip, fam)
    s = _OBJECTIVES[loss_type](x)
    # VESPO folds the off-policy weights into phi; the other families multiply the surrogate
    weights = None if loss_type == "vespo" else batch.weights
    pg = _corrected(x, s.pg, weights, batch.keep)  # [B, T]
    kl = _kl_term(x, batch.ref_logp, options.kl_estimator)  # [B, T] or None
    if kl is not None and options.kl_bias_correction:
        kl = kl * _kl_ratio(x, options.ratio_level)  # [B, T] (DeepSeek-V3.2's correction)
    beta = options.beta
    use_kl = kl is not None and beta > 0

    aggregate = _aggregator(
        x, loss_type, B_all, c.stands_for, max_len, c.num_tokens, c.batch_tokens
    )
    loss_pg = aggregate(pg)
    loss = loss_pg + beta * aggregate(kl) if use_kl else loss_pg
    metrics = _metrics(x, s, kl, loss_pg, loss, use_kl, c.stands_for, B_all)
    share = 1.0
    if c.num_sequences is not None and loss_type not in _TOKEN_MEAN:
        share = B_all / c.num_sequences  # this micro-batch's share of the minibatch
    return (loss * share if share != 1.0 else loss), metrics


for _name in LOSS_TYPES:  # the built-in (and TRL) names, through the public registry
    register_loss(_name, builtin_policy_loss)
del _name


# ---- policy_loss's argument checks, in the order they are made ------------------------------


def _check_tensors(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    weights: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> int:
    """Check the tensors of ``policy_loss`` (shapes, dtypes, 0/1 keep); return B."""
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
    if keep is not None:
        _check_same_shape("keep", keep, "logp", logp)
        if keep.dtype != torch.bool and not bool(((keep == 0) | (keep == 1)).all()):
            raise ValueError("keep: expected only 0/1 values (keep == 1 marks tokens that count)")
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in ((B,), (B, T)):
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(
            f"advantages: expected shape ({B},) (one per sequence of logp) or ({B}, {T}) "
            f"(one per token), got {got}"
        )
    return B


def _check_normalisers(B: int, mask: torch.Tensor, counts: LossCounts) -> None:
    """Check the counts that replace the local ones in the normalisers (gradient accumulation,
    exact elision)."""
    num_tokens, num_sequences = counts.num_tokens, counts.num_sequences
    stands_for, batch_tokens = counts.stands_for, counts.batch_tokens
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


# ---- policy_loss's pieces: the inputs, one objective per loss family, aggregation, metrics ---


class _LossInputs:
    """One ``policy_loss`` call as its pieces read it, after the argument checks.

    The padding of ``logp``, ``old_logp`` and ``[B, T]`` advantages may hold -inf/NaN: it is
    replaced by 0 before any arithmetic, so it cannot poison the loss or its gradient. Only
    ``lp`` (and ``rho``, computed from it) carries gradient.
    """

    def __init__(
        self,
        batch: LossBatch,
        ratio_level: str,
        clip: tuple[float, float, float | None],
        family: object,
    ) -> None:
        logp, old_logp, advantages = batch.logp, batch.old_logp, batch.advantages
        mask = batch.mask
        self.valid = _check_mask(mask)  # [B, T] bool
        self.m = self.valid.to(logp.dtype)  # [B, T]
        self.n_active = self.m.sum()  # [], the counted tokens
        self.zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        self.lp = torch.where(self.valid, logp, self.zero)  # [B, T]
        self.old = torch.where(self.valid, old_logp.detach().to(logp.dtype), self.zero)  # [B, T]
        self.advantages = advantages  # as given: [B] (one per sequence) or [B, T]
        if advantages.dim() == 1:
            self.adv = advantages.detach().to(logp.dtype)[:, None]  # [B, 1]
        else:
            self.adv = torch.where(self.valid, advantages.detach().to(logp.dtype), self.zero)
        self.rho = _ratio(self.lp, self.old, self.m, ratio_level)  # [B, T]
        self.lo, self.hi, self.delta = clip  # 1 - eps, 1 + eps_high, INTELLECT-2's cap or None
        self.family = family  # the loss family's record: SAPO's and VESPO's knobs
        self.weights = batch.weights  # [B, T] off-policy weights or None (VESPO: into phi)


def _ratio(lp: torch.Tensor, old: torch.Tensor, m: torch.Tensor, ratio_level: str) -> torch.Tensor:
    """rho ``[B, T]``: the token ratio, or GSPO's length-normalised sequence ratio s_i in its
    "GSPO-token" form exp(sg(log s_i) + logp_it - sg(logp_it)) (value s_i, gradient through
    each token's own log-prob)."""
    log_ratio = lp - old  # [B, T], 0 on padding
    if ratio_level == "token":
        log_rho = log_ratio  # [B, T]
    elif ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
        log_rho = seq_log_ratio.detach()[:, None] + lp - lp.detach()  # [B, T], GSPO-token
    else:  # pragma: no cover - validated above
        raise ValueError(f"ratio_level: expected one of {_RATIO_LEVELS}, got {ratio_level!r}")
    return torch.exp(log_rho)  # [B, T]


def _kl_ratio(x: _LossInputs, ratio_level: str) -> torch.Tensor:
    """The importance ratio that ``kl_bias_correction`` multiplies the KL term by, with its full
    gradient, as TRL forms it: the token ratio ``[B, T]``, or the sequence ratio s_i ``[B, 1]``
    (d s_i / d logp_it = s_i / |o_i| for every token, unlike the surrogate's GSPO-token form)."""
    log_ratio = x.lp - x.old  # [B, T], 0 on padding
    if ratio_level == "token":
        return torch.exp(log_ratio)  # [B, T]
    return torch.exp(log_ratio.sum(dim=1, keepdim=True) / x.m.sum(dim=1, keepdim=True).clamp(min=1))


class _Surrogate:
    """A loss family's per-token surrogate ``pg`` ``[B, T]`` (before the off-policy weights and
    the keep mask) and what its metrics count: the ``[B, T]`` bool masks of the tokens whose
    gradient the clip removed on the low and the high side, with ``delta`` those the delta cap
    removed, and VESPO's ``[B]`` weights phi."""

    def __init__(
        self,
        pg: torch.Tensor,
        clipped_low: torch.Tensor,
        clipped_high: torch.Tensor,
        clipped_delta: torch.Tensor | None = None,
        phi: torch.Tensor | None = None,
    ) -> None:
        self.pg = pg
        self.clipped_low = clipped_low
        self.clipped_high = clipped_high
        self.clipped_delta = clipped_delta
        self.phi = phi


def _clipped_objective(x: _LossInputs) -> _Surrogate:
    """The clipped surrogate of PPO/GRPO (also bnpo, Dr. GRPO, DAPO, LUSPO; GSPO through the
    ratio): l = -min(min(rho, delta) A, clip(rho, 1 - eps, 1 + eps_high) A), the delta cap
    (INTELLECT-2) only when delta is given."""
    # INTELLECT-2's delta caps the unclipped branch (only A < 0 can reach it: for A > 0
    # the clipped branch, <= 1 + eps_high < delta, is the minimum first)
    capped = x.rho if x.delta is None else x.rho.clamp(max=x.delta)  # [B, T]
    unclipped = capped * x.adv  # [B, T]
    clipped = x.rho.clamp(min=x.lo, max=x.hi) * x.adv  # [B, T]
    pg = -torch.minimum(unclipped, clipped)  # [B, T]
    rd = x.rho.detach()
    clipped_low = (x.adv < 0) & (rd < x.lo)  # [B, T]
    clipped_high = (x.adv > 0) & (rd > x.hi)  # [B, T]
    clipped_delta = None if x.delta is None else (x.adv < 0) & (rd > x.delta)  # [B, T]
    return _Surrogate(pg, clipped_low, clipped_high, clipped_delta)


def _cispo_objective(x: _LossInputs) -> _Surrogate:
    """CISPO: l = -sg(min(rho, cap)) A logp (cap = 1 + eps_high, or ``cispo_cap``); the weight
    is truncated from above and detached, every token keeps a gradient (no low clip)."""
    weight = x.rho.clamp(max=x.hi).detach()  # [B, T], sg(min(rho, cap))
    pg = -weight * x.adv * x.lp  # [B, T]
    return _Surrogate(pg, torch.zeros_like(x.valid), x.rho.detach() > x.hi)


def _sapo_objective(x: _LossInputs) -> _Surrogate:
    """SAPO: l = -f(rho) A with the smooth gate f(rho) = (4 / tau) sigmoid(tau (rho - 1)),
    tau = tau_pos for A > 0 and tau_neg for A <= 0; no hard clip."""
    fam: SapoLoss = x.family
    tau_pos, tau_neg = fam.temperature_pos, fam.temperature_neg
    tau = torch.where(
        x.adv > 0,
        torch.full_like(x.adv, float(tau_pos)),
        torch.full_like(x.adv, float(tau_neg)),
    )  # [B, 1] or [B, T]
    gate = torch.sigmoid(tau * (x.rho - 1.0)) * (4.0 / tau)  # [B, T], f(rho)
    pg = -gate * x.adv  # [B, T]
    no_clip = torch.zeros_like(x.valid)
    return _Surrogate(pg, no_clip, no_clip)


def _vespo_objective(x: _LossInputs) -> _Surrogate:
    """VESPO: l = -sg(phi(w_i)) A_i logp with phi the Gamma-shaped weight of the sequence ratio
    (``vespo_weights``, which also takes the off-policy weights); no hard clip."""
    if x.advantages.dim() != 1:
        raise ValueError(
            f"advantages: loss_type='vespo' needs one advantage per sequence, "
            f"shape ({x.lp.shape[0]},)"
        )
    fam: VespoLoss = x.family
    k_pos, lambda_pos, k_neg, lambda_neg = fam.k_pos, fam.lambda_pos, fam.k_neg, fam.lambda_neg
    phi = vespo_weights(
        x.lp.detach(),
        x.old,
        x.advantages.detach().to(x.lp.dtype),
        x.valid,
        weights=x.weights,
        k_pos=k_pos,
        lambda_pos=lambda_pos,
        k_neg=k_neg,
        lambda_neg=lambda_neg,
    )  # [B]
    pg = -phi[:, None] * x.adv * x.lp  # [B, T]
    no_clip = torch.zeros_like(x.valid)
    return _Surrogate(pg, no_clip, no_clip, phi=phi)


# loss_type -> the per-token objective of its family
_OBJECTIVES = {
    "grpo": _clipped_objective,
    "bnpo": _clipped_objective,
    "dr_grpo": _clipped_objective,
    "dapo": _clipped_objective,
    "luspo": _clipped_objective,
    "cispo": _cispo_objective,
    "sapo": _sapo_objective,
    "vespo": _vespo_objective,
}


def _corrected(
    x: _LossInputs, pg: torch.Tensor, weights: torch.Tensor | None, keep: torch.Tensor | None
) -> torch.Tensor:
    """The surrogate times the off-policy weights and the keep mask (both detached, 0 on
    padding); neither changes a normaliser."""
    if weights is not None:  # off-policy correction; padding gets 0
        pg = pg * torch.where(x.valid, weights.detach().to(x.lp.dtype), x.zero)  # [B, T]
    if keep is not None:  # OPSM / high-entropy selection: surrogate only, normalisers unchanged
        pg = pg * (keep.detach().to(torch.bool) & x.valid).to(x.lp.dtype)  # [B, T]
    return pg


def _kl_term(
    x: _LossInputs, ref_logp: torch.Tensor | None, kl_estimator: str
) -> torch.Tensor | None:
    """``[B, T]`` KL estimate toward the reference (0 on padding), or None without ``ref_logp``."""
    if ref_logp is None:
        return None
    ref = torch.where(x.valid, ref_logp.detach().to(x.lp.dtype), x.zero)  # [B, T]
    return kl_divergence(x.lp, ref, kl_estimator)  # [B, T], 0 on padding


def _aggregator(
    x: _LossInputs,
    loss_type: str,
    B_all: float,
    stands_for: float | None,
    max_completion_length: int | None,
    num_tokens: float | int | torch.Tensor | None,
    batch_tokens: float | int | torch.Tensor | None,
):
    """The aggregation of ``loss_type`` (docs/algorithms.md's table): a function from masked
    per-token losses ``[B, T]`` to the scalar loss."""
    m = x.m
    if loss_type in ("grpo", "sapo"):

        def aggregate(t: torch.Tensor) -> torch.Tensor:
            per_seq = (t * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
            return per_seq.mean() if stands_for is None else per_seq.sum() / B_all

    elif loss_type == "bnpo":
        if batch_tokens is None:
            bnpo_norm = x.n_active.clamp(min=1)
        elif isinstance(batch_tokens, torch.Tensor):
            bnpo_norm = batch_tokens.detach().reshape(()).to(x.lp.device, x.lp.dtype).clamp(min=1)
        else:
            bnpo_norm = max(float(batch_tokens), 1.0)

        def aggregate(t: torch.Tensor) -> torch.Tensor:
            return (t * m).sum() / bnpo_norm

    elif loss_type == "dr_grpo":

        def aggregate(t: torch.Tensor) -> torch.Tensor:
            return (t * m).sum() / (B_all * max_completion_length)

    elif loss_type == "luspo":

        def aggregate(t: torch.Tensor) -> torch.Tensor:
            per_seq = (t * m).sum(dim=1)  # [B], the sequence loss times its length
            return per_seq.mean() if stands_for is None else per_seq.sum() / B_all

    elif loss_type in _TOKEN_MEAN:
        if num_tokens is None:
            norm = x.n_active.clamp(min=1)
        elif isinstance(num_tokens, torch.Tensor):
            norm = num_tokens.detach().reshape(()).to(device=x.lp.device, dtype=x.lp.dtype)
        else:
            norm = float(num_tokens)

        def aggregate(t: torch.Tensor) -> torch.Tensor:
            return (t * m).sum() / norm

    else:  # pragma: no cover - validated above
        raise ValueError(f"loss_type: expected one of {_LOSS_TYPES}, got {loss_type!r}")
    return aggregate


_METRIC_NAMES = (
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


def _metrics(
    x: _LossInputs,
    s: _Surrogate,
    kl: torch.Tensor | None,
    loss_pg: torch.Tensor,
    loss: torch.Tensor,
    use_kl: bool,
    stands_for: float | None,
    B_all: float,
) -> dict[str, float]:
    """``policy_loss``'s metrics (docs/algorithms.md), no grad, one host sync for the common
    ones."""
    with torch.no_grad():
        denom = x.n_active.clamp(min=1)
        rd = x.rho.detach()
        has_tokens = x.n_active > 0
        big = torch.finfo(rd.dtype).max
        r_min = torch.where(x.valid, rd, torch.full_like(rd, big)).amin()
        r_max = torch.where(x.valid, rd, torch.full_like(rd, -big)).amax()
        low = (s.clipped_low & x.valid).to(x.lp.dtype).sum() / denom
        high = (s.clipped_high & x.valid).to(x.lp.dtype).sum() / denom
        if x.advantages.dim() == 1:  # per sequence, over the sequences these rows stand for
            adv_mean = x.adv.mean() if stands_for is None else x.adv.sum() / B_all
        else:  # per token, over the counted tokens
            adv_mean = (x.adv * x.m).sum() / denom
        values = torch.stack(
            [
                low,
                high,
                low + high,
                (rd * x.m).sum() / denom,
                torch.where(has_tokens, r_min, x.zero),
                torch.where(has_tokens, r_max, x.zero),
                (kl.detach() * x.m).sum() / denom if kl is not None else x.zero,
                adv_mean,
                loss_pg.detach(),
                (loss - loss_pg).detach() if use_kl else x.zero,
            ]
        ).tolist()
    metrics = dict(zip(_METRIC_NAMES, values))
    if s.clipped_delta is not None:
        metrics["clip/delta_frac"] = float((s.clipped_delta & x.valid).sum()) / max(
            float(x.n_active), 1.0
        )
    if s.phi is not None:
        metrics["vespo/phi_mean"] = float(s.phi.mean())
    return metrics


@torch.no_grad()
def vespo_weights(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's detached sequence weight phi(w_i) (docs/algorithms.md), ``[B]``.

    Args:
        logp, old_logp: ``[B, T]`` current and old log-probs (padding may hold anything).
        advantages: ``[B]`` one advantage per sequence (its sign picks k and lambda).
        mask: ``[B, T]`` 0/1 or bool, 1 = counts.
        weights: ``[B, T]`` token-level off-policy weights whose logs join log w, or None.
        k_pos, lambda_pos, k_neg, lambda_neg: the Gamma shape and decay for A >= 0 / A < 0.

    Returns:
        ``[B]`` phi(w_i) = exp(lam + k log w_i - lam w_i), 0 where not finite.
    """
    valid = _check_mask(mask)  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, (logp - old_logp.to(logp.dtype)).clamp(-20.0, 20.0), zero)
    log_w = log_ratio.sum(dim=1)  # [B], the product of the token ratios, in log space
    if weights is not None:
        lw = torch.log(weights.to(logp.dtype)).clamp(_VESPO_LOG_MIN, 20.0)  # [B, T]
        log_w = log_w + torch.where(valid, lw, zero).sum(dim=1)  # [B]
    log_w = log_w.clamp(_VESPO_LOG_MIN, 20.0)  # [B]
    nonneg = advantages >= 0  # [B]
    k = torch.where(nonneg, float(k_pos), float(k_neg)).to(logp.dtype)  # [B]
    lam = torch.where(nonneg, float(lambda_pos), float(lambda_neg)).to(logp.dtype)
    lam = lam.clamp(min=1e-4)  # [B]
    log_phi = lam + k * log_w - lam * torch.exp(log_w)  # [B]
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [B]


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """``[B, T]`` bool: the counted tokens whose entropy is in the top ``quantile`` fraction.

    "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
    Reasoning" (Wang et al. 2025, arXiv 2506.01939), as TRL's ``top_entropy_quantile`` (rho):
    with tau = the (1 - rho)-quantile of the entropies of the counted tokens (linear
    interpolation, ``torch.quantile``), keep the counted tokens with H_it >= tau. rho = 1 keeps
    every counted token (tau is their minimum); rho = 0 keeps only the highest-entropy ones (ties
    included). No counted token: all False.

    Args:
        entropy: ``[B, T]`` per-token entropy of the policy's distribution (any grad, detached).
        mask: ``[B, T]`` 0/1 or bool, 1 = counts.
        quantile: rho in [0, 1].
    """
    _check_tensor_2d("entropy", entropy)
    _check_same_shape("mask", mask, "entropy", entropy)
    if not (_is_number(quantile) and 0 <= quantile <= 1):
        raise ValueError(f"quantile: expected a number in [0, 1], got {quantile!r}")
    valid = _check_mask(mask)  # [B, T]
    counted = entropy.detach()[valid].float()  # [M]
    if counted.numel() == 0:
        return torch.zeros_like(valid)
    tau = torch.quantile(counted, 1.0 - float(quantile))  # []
    return (entropy.detach().float() >= tau) & valid  # [B, T]


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked token mean of ``entropy`` (with gradient): the H of L = L_policy - coef * H.

    As TRL's ``entropy_coef``: the mean per-token entropy over the tokens that count (the
    high-entropy subset when tokens are selected), the same for every loss type (not rescaled
    to the policy term's normaliser); 0 when no token counts.

    Args:
        entropy: ``[B, T]`` per-token entropy (with gradient).
        mask: ``[B, T]`` 0/1 or bool, 1 = counts.
    """
    _check_tensor_2d("entropy", entropy)
    _check_same_shape("mask", mask, "entropy", entropy)
    valid = _check_mask(mask)  # [B, T]
    zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    ent = torch.where(valid, entropy, zero)  # [B, T], padding cannot leak NaN
    return ent.sum() / valid.sum().clamp(min=1).to(entropy.dtype)


def adaptive_entropy_coef(
    coef: float,
    entropy: float,
    *,
    target: float,
    step: float,
    coef_min: float,
    coef_max: float,
) -> float:
    """Skywork-OR1's adaptive entropy control (He et al. 2025, arXiv 2505.22312), TRL's rule.

    After each optimizer step, with H the step's mean entropy over the tokens the bonus acts on:
    coef <- min(coef + step, coef_max) if H <= target, else max(coef - step, coef_min). The
    coefficient applied in the next step is coef when that H <= target, else 0 (the caller
    keeps the last H and gates the bonus with it).
    """
    for name, v in (("coef", coef), ("entropy", entropy), ("target", target), ("step", step)):
        if not _is_number(v):
            raise ValueError(f"{name}: expected a number, got {v!r}")
    if not (_is_number(coef_min) and _is_number(coef_max) and coef_min <= coef_max):
        raise ValueError(
            f"coef_min, coef_max: expected numbers with coef_min <= coef_max, got "
            f"{coef_min!r}, {coef_max!r}"
        )
    if entropy <= target:
        return min(coef + step, coef_max)
    return max(coef - step, coef_min)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss, masked token mean (docs/algorithms.md).

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
