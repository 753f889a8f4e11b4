"""Tinker's built-in losses (``forward_backward(data, loss_fn=...)``), as its documentation
states them (https://tinker-docs.thinkingmachines.ai/losses), over one padded batch of datums.

Every Tinker loss is a **sum** over the datum's positions (no mean, no normaliser: a datum's
``weights`` or ``advantages`` carry any scaling), and everything it needs is in the datum:

- ``cross_entropy``: ``loss = -(weights * logp).sum()``;
- ``importance_sampling``: ``r = exp(logp - sampling_logp)``, ``loss = -(r * A).sum()``;
- ``ppo``: ``loss = -min(r * A, clip(r, lo, hi) * A).sum()``;
- ``cispo``: ``loss = -(sg(clip(r, lo, hi)) * logp * A).sum()`` (``sg``: stop-gradient);

with ``logp`` the trainer's log-prob of ``target_tokens``, ``sampling_logp`` the datum's
``logprobs`` (the sampler's), ``A`` its ``advantages``; ``lo``/``hi`` are ``clip_low_threshold``
/ ``clip_high_threshold`` from ``loss_fn_config`` (default 0.8 / 1.2, Tinker's), or per-token
tensors of those names in the datum. ``tinker_loss`` returns the summed loss and the per-token
objective terms; the metric Tinker reports is ``loss:sum``.

It deliberately does not compute log-probs (the Tinker server, ``peergrade.tinker_server``), does
not aggregate across requests (gradients of successive ``forward_backward`` calls add up until
``optim_step``, which is Tinker's contract) and knows nothing about HTTP or the ``tinker`` SDK.
"""

from __future__ import annotations

import torch

__all__ = ["TINKER_LOSSES", "REQUIRED_INPUTS", "tinker_loss"]

#: the loss names served, each with the ``loss_fn_inputs`` it reads besides ``target_tokens``
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
TINKER_LOSSES = tuple(REQUIRED_INPUTS)

#: Tinker's documented default clip thresholds (epsilon = 0.2 on each side)
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
_CONFIG_KEYS = {"clip_low_threshold", "clip_high_threshold"}


def _threshold(name: str, inputs: dict, config: dict, default: float, like: torch.Tensor):
    if name in inputs:
        return inputs[name].to(like.dtype)  # [B, T] per-token thresholds
    return torch.full_like(like, float(config.get(name, default)))  # [B, T]


def _check(loss_fn: str, inputs: dict, config: dict, logp: torch.Tensor) -> None:
    if loss_fn not in REQUIRED_INPUTS:
        raise ValueError(
            f"loss_fn={loss_fn!r}: expected one of {', '.join(TINKER_LOSSES)} "
            "(or forward_backward_custom for any other loss)"
        )
    missing = [k for k in REQUIRED_INPUTS[loss_fn] if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn={loss_fn!r} needs loss_fn_inputs {missing} in every datum")
    for k in REQUIRED_INPUTS[loss_fn]:
        if inputs[k].shape != logp.shape:
            raise ValueError(
                f"loss_fn_inputs[{k!r}] has shape {tuple(inputs[k].shape)}; expected "
                f"{tuple(logp.shape)} (one value per target token)"
            )
    unknown = set(config) - (_CONFIG_KEYS if loss_fn in ("ppo", "cispo") else set())
    if unknown:
        raise ValueError(
            f"loss_fn_config keys {sorted(unknown)} are not understood by {loss_fn!r}"
            + (
                "; it takes clip_low_threshold, clip_high_threshold"
                if loss_fn in ("ppo", "cispo")
                else ""
            )
        )


def tinker_loss(
    loss_fn: str,
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    config: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per_token)`` of Tinker loss ``loss_fn`` (see the module docstring).

    logp: ``[B, T]`` the trainer's log-probs of the target tokens (differentiable);
    inputs: the datums' ``loss_fn_inputs`` as ``[B, T]`` tensors (padding arbitrary);
    mask: ``[B, T]``, 1 where a datum has a position (padding 0; a position's own weight
    or advantage still decides whether it counts). Returns the scalar loss (the sum over every
    datum and position, what ``backward`` runs on) and ``per_token`` ``[B, T]``, each position's
    term of that sum (0 on padding).
    """
    config = dict(config or {})
    _check(loss_fn, inputs, config, logp)
    m = mask.to(logp.dtype)  # [B, T]
    lp = logp * m  # [B, T] padding never reaches exp()
    if loss_fn == "cross_entropy":
        per_token = -(inputs["weights"].to(lp.dtype) * lp)  # [B, T]
    else:
        adv = inputs["advantages"].to(lp.dtype) * m  # [B, T]
        ratio = torch.exp(lp - inputs["logprobs"].to(lp.dtype) * m)  # [B, T]
        if loss_fn == "importance_sampling":
            per_token = -(ratio * adv)
        else:
            lo = _threshold("clip_low_threshold", inputs, config, DEFAULT_CLIP_LOW, lp)
            hi = _threshold("clip_high_threshold", inputs, config, DEFAULT_CLIP_HIGH, lp)
            clipped = torch.minimum(torch.maximum(ratio, lo), hi)  # [B, T]
            if loss_fn == "ppo":
                per_token = -torch.minimum(ratio * adv, clipped * adv)
            else:  # cispo
                per_token = -(clipped.detach() * lp * adv)
    per_token = per_token * m
    return per_token.sum(), per_token
