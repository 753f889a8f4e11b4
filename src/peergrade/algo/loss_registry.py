"""The policy losses by name: what ``algo.loss_type`` (and ``policy_loss``'s ``loss_type``)
may say, and ``register_loss`` to add one without forking (as verl's ``register_policy_loss``).

Every entry is a function of one documented signature (``loss_options.LossFn``)::

    fn(batch: LossBatch, options: LossOptions) -> tuple[torch.Tensor, dict[str, float]]

``batch`` holds one micro-batch's tensors and counts (``peergrade.algo.loss_options.LossBatch``:
``logp`` with gradient, ``old_logp``, ``advantages`` ``[B]`` or ``[B, T]``, ``mask``, and the
optional ``ref_logp``, ``weights``, ``keep`` and ``counts``), already checked for shape;
``options`` the run's options (``LossOptions``: the shared ratio/clip/KL options and
``options.family``, for a registered loss ``CustomLoss(loss_type=name)``). It returns the
scalar loss to backpropagate and a dict of float metrics. The update accumulates gradients
over micro-batches, so the loss must be this micro-batch's *share* of its minibatch's loss:
normalise by the minibatch's counts (``batch.counts.num_tokens``, the minibatch's counted
tokens; ``batch.counts.num_sequences``, its sequences), not by the micro-batch's own. Its
``loss/policy`` metric (``policy_loss`` adds the returned loss when the function reports none)
is read as that share too. The GRPO update never leaves a row or a minibatch out of a
registered loss's forward/backward (the built-ins' exact elision assumes a loss of exactly 0
at advantage 0, which a new loss need not have).

The eight built-in names (``LOSS_TYPES``, TRL 1.16's ``loss_type`` names with the same
meaning) are registered through ``register_loss`` when ``peergrade.algo`` is imported; they
cannot be registered again or replaced.

What it deliberately does not do: no loss math (``losses.py``), no config (a registered name
becomes valid for ``algo.loss_type`` where the trainer builds its options), no I/O. It imports
nothing of ours (``loss_options`` imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "LOSS_TYPES",
    "is_builtin",
    "loss_function",
    "loss_names",
    "register_loss",
    "unknown_loss_message",
]

#: the built-in loss types, in the order error messages list them
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

# name -> LossFn (``loss_options.LossFn``: the signature above), in registration order
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_loss(
    name: str, fn: Callable[..., Any], *, replace: bool = False
) -> Callable[..., Any]:
    """Make ``fn`` the policy loss named ``name`` (``algo.loss_type: name``); returns ``fn``.

    ``fn`` has the module docstring's signature ``fn(batch, options) -> (loss, metrics)``.
    A name already registered is refused (a built-in always; another with ``replace=False``,
    so a typo cannot silently swap a loss).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_loss: name must be a non-empty identifier string, got {name!r}")
    if not callable(fn):
        raise ValueError(
            f"register_loss({name!r}, ...): fn must be callable as fn(batch, options), "
            f"got {type(fn).__name__}"
        )
    if name in _REGISTRY:
        if name in LOSS_TYPES:
            raise ValueError(
                f"register_loss: {name!r} is a built-in loss type ({', '.join(LOSS_TYPES)}) "
                "and cannot be registered again; choose another name"
            )
        if not replace:
            raise ValueError(
                f"register_loss: a loss named {name!r} is already registered; pass "
                "replace=True to replace it"
            )
    _REGISTRY[name] = fn
    return fn


def loss_names() -> tuple[str, ...]:
    """Every registered loss name: the built-ins first, then the registered ones in order."""
    return tuple(_REGISTRY)


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of the built-in loss types (``LOSS_TYPES``)."""
    return name in LOSS_TYPES


def loss_function(name: str) -> Callable[..., Any]:
    """The function registered as ``name``; a ValueError naming every registered loss if none."""
    fn = _REGISTRY.get(name)
    if fn is None:
        raise ValueError(unknown_loss_message(name))
    return fn


def unknown_loss_message(name: object) -> str:
    """``loss_type: expected one of (...), got ...``: the registered names listed."""
    return (
        f"loss_type: expected one of {loss_names()} (the built-in losses and those added with "
        f"peergrade.register_loss), got {name!r}"
    )
