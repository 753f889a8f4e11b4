"""Tinker's built-in losses (``forward_backward(data, loss_fn=...)``), as its documentation
states them (https://tinker-docs.thinkingmachines.ai/losses), over one padded batch of datums.

Every Tinker loss is a **sum** over the datum's positions (no mean, no normaliser: a datum's
``weights`` or ``advantages`` carry any scaling), and everything it needs is in the datum:

- ``cross_entropy``: ``loss = -(weights * logp).sum()``;
- ``importance_sampling``: ``r = exp(logp - sampling_logp)``, ``loss = -(r * A).sum()``;
- ``ppo``: ``loss = -min(r * A, clip(r, lo, hi) * A).sum()``;
- ``cispo``: ``loss = -(sg(clip(r, lo, hi)) * logp * A).sum()`` (``sg``: stop-gradient);
- ``dro``: ``loss = -(logp * A - 0.5 * beta * (logp - sampling_logp) ** 2).sum()``, ``beta``
  from ``loss_fn_config`` (required here: Tinker's page does not state its default);
- ``gspo`` (GSPO-token): per datum ``s = exp(mean over M of (sg(logp) - sampling_logp))`` with
  ``M`` the positions where ``sequence_ratio_mask != 0``, each token's ratio
  ``r_t = s * exp(logp - sg(logp))`` (s's value, its own token's gradient), then ppo's
  ``loss = -min(r_t * A, clip(r_t, lo, hi) * A).sum()``;

with ``logp`` the trainer's log-prob of ``target_tokens``, ``sampling_logp`` the datum's
``logprobs`` (the sampler's), ``A`` its ``advantages``; ``lo``/``hi`` are ``clip_low_threshold``
/ ``clip_high_threshold`` from ``loss_fn_config`` (default 0.8 / 1.2, Tinker's for ppo; gspo
takes the same keys and defaults), or per-token tensors of those names in the datum.
``tinker_loss`` returns the summed loss and the per-token objective terms; the metric Tinker
reports is ``loss:sum``.

The SDK's other names are refused with a reason: ``stable_reinforce`` (its objective reads
sampling-time information Tinker does not publish) and ``custom`` (a loss uploaded to the
server; this server tells the SDK to run ``forward_backward_custom`` client-side).

peergrade's own policy losses (``peergrade.algo.loss_registry``: grpo, dapo, dr_grpo, cispo,
sapo, luspo, vespo, bnpo and any name given to ``peergrade.register_loss``) are reached as
``loss_fn="peergrade:<name>"`` or ``loss_fn="importance_sampling"`` with
``loss_fn_config={"peergrade_loss": "<name>", ...}``; ``peergrade_loss`` maps the datums onto a
``LossBatch`` (see its docstring) and returns that loss, a normalised mean, not a sum.

It deliberately does not compute log-probs (the Tinker server, ``peergrade.tinker_server``), does
not aggregate across requests (gradients of successive ``forward_backward`` calls add up until
``optim_step``, which is Tinker's contract) and knows nothing about HTTP or the ``tinker`` SDK.
"""

from __future__ import annotations

import numbers

import torch

from peergrade.algo.loss_options import LossCounts, loss_options
from peergrade.algo.losses import policy_loss

__all__ = [
    "PEERGRADE_PREFIX",
    "REFUSED_LOSSES",
    "REQUIRED_INPUTS",
    "TINKER_LOSSES",
    "peergrade_loss_name",
    "peergrade_mask",
    "request_counts",
    "tinker_loss",
]

#: the loss names served, each with the ``loss_fn_inputs`` it reads besides ``target_tokens``
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}
TINKER_LOSSES = tuple(REQUIRED_INPUTS)

#: names the tinker SDK (0.38) accepts that this server refuses, with the reason
REFUSED_LOSSES: dict[str, str] = {
    "stable_reinforce": (
        "its objective reads sampling-time information (record_stability_info) whose use "
        "Tinker does not publish; use importance_sampling, cispo or gspo"
    ),
    "custom": (
        "a loss uploaded to the service; this server runs forward_backward_custom client-side "
        "(the SDK does that by itself here)"
    ),
}

#: ``loss_fn="peergrade:<name>"`` selects peergrade's policy loss ``<name>``
PEERGRADE_PREFIX = "peergrade:"
_PEERGRADE_KEY = "peergrade_loss"  # or loss_fn="importance_sampling" with this config key

#: Tinker's documented default clip thresholds (epsilon = 0.2 on each side)
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
_CLIP_KEYS = {"clip_low_threshold", "clip_high_threshold"}
_CONFIG_KEYS: dict[str, set[str]] = {"ppo": _CLIP_KEYS, "cispo": _CLIP_KEYS, "gspo": _CLIP_KEYS}
_CONFIG_KEYS["dro"] = {"beta"}
# a Tinker datum carries no reference log-probs, so peergrade's KL term has nothing to read
_NO_KL_KEYS = {"beta", "kl_estimator", "kl_bias_correction"}


def _threshold(name: str, inputs: dict, config: dict, default: float, like: torch.Tensor):
    if name in inputs:
        return inputs[name].to(like.dtype)  # [B, T] per-token thresholds
    return torch.full_like(like, float(config.get(name, default)))  # [B, T]


def _check_inputs(loss_fn: str, needed, inputs: dict, logp: torch.Tensor) -> None:
    missing = [k for k in needed if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn={loss_fn!r} needs loss_fn_inputs {missing} in every datum")
    for k in needed:
        if inputs[k].shape != logp.shape:
            raise ValueError(
                f"loss_fn_inputs[{k!r}] has shape {tuple(inputs[k].shape)}; expected "
                f"{tuple(logp.shape)} (one value per target token)"
            )


def _check(loss_fn: str, inputs: dict, config: dict, logp: torch.Tensor) -> None:
    if loss_fn in REFUSED_LOSSES:
        raise ValueError(f"loss_fn={loss_fn!r} is not served locally: {REFUSED_LOSSES[loss_fn]}")
    if loss_fn not in REQUIRED_INPUTS:
        raise ValueError(
            f"loss_fn={loss_fn!r}: expected one of {', '.join(TINKER_LOSSES)}, or "
            f"'{PEERGRADE_PREFIX}<name>' for peergrade's losses (or forward_backward_custom "
            "for any other loss)"
        )
    _check_inputs(loss_fn, REQUIRED_INPUTS[loss_fn], inputs, logp)
    allowed = _CONFIG_KEYS.get(loss_fn, set())
    unknown = set(config) - allowed
    if unknown:
        raise ValueError(
            f"loss_fn_config keys {sorted(unknown)} are not understood by {loss_fn!r}"
            + (f"; it takes {', '.join(sorted(allowed))}" if allowed else "")
        )
    if loss_fn == "dro" and "beta" not in config:
        raise ValueError(
            "loss_fn='dro' needs loss_fn_config={'beta': ...} (the weight of the quadratic "
            "penalty; Tinker's documentation states no default, so none is assumed here)"
        )


def _gspo_ratio(lp: torch.Tensor, sampling: torch.Tensor, inputs: dict, m: torch.Tensor):
    """``[B, T]`` GSPO-token ratios: each datum's sequence ratio (the geometric mean of the
    token ratios over ``sequence_ratio_mask``) as the value, each token's own gradient."""
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(lp.dtype) * m  # [B, T]
    n = in_ratio.sum(dim=1)  # [B]
    if bool((n == 0).any()):
        k = int((n == 0).nonzero()[0, 0])
        raise ValueError(
            f"loss_fn='gspo': datum {k} of its batch has no position with "
            "sequence_ratio_mask != 0 (the tokens the sequence ratio averages over)"
        )
    log_s = ((lp.detach() - sampling) * in_ratio).sum(dim=1) / n  # [B]
    return torch.exp(log_s[:, None] + lp - lp.detach())  # [B, T]


def tinker_loss(
    loss_fn: str,
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    config: dict[str, float | str] | None = None,
    *,
    counts: LossCounts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(loss, per_token)`` of Tinker loss ``loss_fn`` (see the module docstring).

    logp: ``[B, T]`` the trainer's log-probs of the target tokens (differentiable);
    inputs: the datums' ``loss_fn_inputs`` as ``[B, T]`` tensors (padding arbitrary);
    mask: ``[B, T]``, 1 where a datum has a position (padding 0; a position's own weight
    or advantage still decides whether it counts). Returns the scalar loss (the sum over every
    datum and position, what ``backward`` runs on) and ``per_token`` ``[B, T]``, each position's
    term of that sum (0 on padding). A peergrade loss (``peergrade:<name>``) returns its
    normalised loss and ``per_token`` None; ``counts`` are its normalisers over the whole
    request (``request_counts``), None: this batch's own.
    """
    config = dict(config or {})
    name = peergrade_loss_name(loss_fn, config)
    if name is not None:
        return _peergrade_loss(name, logp, inputs, mask, config, counts), None
    _check(loss_fn, inputs, config, logp)
    m = mask.to(logp.dtype)  # [B, T]
    lp = logp * m  # [B, T] padding never reaches exp()
    if loss_fn == "cross_entropy":
        per_token = -(inputs["weights"].to(lp.dtype) * lp)  # [B, T]
    else:
        adv = inputs["advantages"].to(lp.dtype) * m  # [B, T]
        sampling = inputs["logprobs"].to(lp.dtype) * m  # [B, T]
        if loss_fn == "dro":
            beta = float(config["beta"])
            per_token = -(lp * adv - 0.5 * beta * (lp - sampling) ** 2)
        elif loss_fn == "gspo":
            ratio = _gspo_ratio(lp, sampling, inputs, m)  # [B, T]
            per_token = _clipped(ratio, adv, inputs, config, lp, ppo=True)
        else:
            ratio = torch.exp(lp - sampling)  # [B, T]
            if loss_fn == "importance_sampling":
                per_token = -(ratio * adv)
            else:
                per_token = _clipped(ratio, adv, inputs, config, lp, ppo=loss_fn == "ppo")
    per_token = per_token * m
    return per_token.sum(), per_token


def _clipped(ratio, adv, inputs, config, lp, *, ppo: bool) -> torch.Tensor:
    """ppo's ``-min(r * A, clip(r) * A)`` or cispo's ``-(sg(clip(r)) * logp * A)``, ``[B, T]``."""
    lo = _threshold("clip_low_threshold", inputs, config, DEFAULT_CLIP_LOW, lp)
    hi = _threshold("clip_high_threshold", inputs, config, DEFAULT_CLIP_HIGH, lp)
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)  # [B, T]
    if ppo:
        return -torch.minimum(ratio * adv, clipped * adv)
    return -(clipped.detach() * lp * adv)


# ---- peergrade's policy losses through the Tinker route ------------------------------------


def peergrade_loss_name(loss_fn: str, config: dict) -> str | None:
    """The peergrade loss a request asks for (``loss_fn="peergrade:<name>"``, or
    ``loss_fn="importance_sampling"`` with ``loss_fn_config["peergrade_loss"]``), else None."""
    if loss_fn.startswith(PEERGRADE_PREFIX):
        if _PEERGRADE_KEY in config:
            raise ValueError(
                f"loss_fn={loss_fn!r} names the loss already; drop loss_fn_config"
                f"[{_PEERGRADE_KEY!r}]"
            )
        return loss_fn[len(PEERGRADE_PREFIX) :]
    if _PEERGRADE_KEY in config:
        if loss_fn != "importance_sampling":
            raise ValueError(
                f"loss_fn_config[{_PEERGRADE_KEY!r}] goes with loss_fn='importance_sampling' "
                f"(the Tinker loss with the same inputs), not {loss_fn!r}"
            )
        return str(config[_PEERGRADE_KEY])
    return None


def peergrade_mask(inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` 0/1: the positions a peergrade loss counts: ``weights != 0`` where the datums
    carry ``weights``, else ``advantages != 0`` (the cookbook's RL datums put advantage 0 on the
    prompt); padding never."""
    key = "weights" if "weights" in inputs else "advantages"
    if key not in inputs:
        raise ValueError("a peergrade loss needs loss_fn_inputs 'advantages' in every datum")
    return ((inputs[key] != 0) & mask.bool()).to(torch.float32)


def request_counts(
    loss_fn: str, config: dict | None, inputs: list[dict[str, torch.Tensor]]
) -> LossCounts | None:
    """The normalisers of a whole request (its datums' ``loss_fn_inputs``, each ``[N]``) for a
    peergrade loss: the counted positions and the datums, so that the server's micro-batches
    add up to the loss of the request as one batch. None for a Tinker loss (a plain sum)."""
    if peergrade_loss_name(loss_fn, dict(config or {})) is None:
        return None
    n = 0.0
    for ins in inputs:
        row = {k: v[None] for k, v in ins.items()}  # [1, N]
        ref = next(iter(row.values()))
        n += float(peergrade_mask(row, torch.ones(ref.shape)).sum())
    return LossCounts(num_tokens=max(n, 1.0), num_sequences=len(inputs))


def _peergrade_options(name: str, config: dict):
    knobs = {k: v for k, v in config.items() if k != _PEERGRADE_KEY}
    kl = sorted(_NO_KL_KEYS & set(knobs))
    if kl:
        raise ValueError(
            f"loss_fn_config {kl}: peergrade's KL term needs reference log-probs, which a Tinker "
            "datum does not carry; fold a KL penalty into the advantages instead"
        )
    mcl = knobs.get("max_completion_length")
    if isinstance(mcl, numbers.Real) and float(mcl).is_integer():
        knobs["max_completion_length"] = int(mcl)  # the wire sends numbers as floats
    try:
        return loss_options(name, **knobs)
    except TypeError as e:  # an unknown knob
        raise ValueError(f"loss_fn_config: {e}") from None
    except ValueError as e:
        raise ValueError(f"loss_fn='{PEERGRADE_PREFIX}{name}': {e}") from None


def _peergrade_loss(name, logp, inputs, mask, config, counts) -> torch.Tensor:
    """peergrade's policy loss ``name`` over the batch: ``old_logp`` = the datum's ``logprobs``
    (the sampler's), per-token ``advantages``, the mask ``peergrade_mask``."""
    options = _peergrade_options(name, config)
    _check_inputs(f"{PEERGRADE_PREFIX}{name}", ("logprobs", "advantages"), inputs, logp)
    m = peergrade_mask(inputs, mask).to(logp.dtype)  # [B, T]
    old = inputs["logprobs"].to(logp.dtype) * m  # [B, T]
    adv = inputs["advantages"].to(logp.dtype) * m  # [B, T]
    loss, _ = policy_loss(logp * m, old, _per_sequence(adv, m), m, options, counts=counts)
    return loss


def _per_sequence(adv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages where every datum has one value over its counted positions (GRPO's
    case, which the sequence-level losses such as vespo require), else ``adv`` ``[B, T]``."""
    at = m.argmax(dim=1, keepdim=True)  # [B, 1] each datum's first counted position
    first = adv.gather(1, at)[:, 0] * (m.sum(dim=1) > 0)  # [B] (0 for a datum with none)
    same = bool((((adv - first[:, None]) * m) == 0).all())
    return first if same else adv
