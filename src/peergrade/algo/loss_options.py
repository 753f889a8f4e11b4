"""The typed inputs of ``policy_loss``: its options, one record per loss family, and one call's
tensors and counts.

``LossOptions`` holds what every loss type reads (the ratio level, the clip range, the KL
term) and ``family``, a discriminated union on ``loss_type`` (in the spirit of prime-rl's loss
config): one small frozen record per loss family holding only that family's knobs.

============================  ===============================  ==================================
record                        ``loss_type``                    its knobs (``algo.*`` key)
============================  ===============================  ==================================
``ClippedLoss``               grpo, bnpo, dapo, luspo          ``delta``
``DrGrpoLoss``                dr_grpo                          ``max_completion_length``,
                                                               ``delta``
``CispoLoss``                 cispo                            ``cap`` (``cispo_cap``)
``SapoLoss``                  sapo                             ``temperature_pos`` / ``_neg``
                                                               (``sapo_temperature_*``)
``VespoLoss``                 vespo                            ``k_pos``, ``lambda_pos``,
                                                               ``k_neg``, ``lambda_neg``
                                                               (``vespo_*``)
``CustomLoss``                a name given to                  none (the loss reads the shared
                              ``register_loss``                options)
============================  ===============================  ==================================

Each record checks its values when it is made, with the ``algo.*`` key's name in the message.
``loss_options(**knobs)`` builds the record from the flat keyword names (``loss_type``,
``clip_eps``, ``sapo_temperature_pos``, ... : the ``algo.*`` keys, plus
``max_completion_length``): the form of ``policy_loss``'s keyword call and of the trainer's
config. It checks every knob it is given as before the records existed (those of another family
too, which it then leaves out; ``delta`` and ``cispo_cap`` outside their families are refused).

``LossCounts`` are the counts that replace the local ones in the normalisers (gradient
accumulation, exact elision); ``LossBatch`` is one call's tensors and counts, what a registered
loss function receives. The formulas are in docs/algorithms.md.

What it deliberately does not do: no loss math, no config import (the trainer maps
``AlgoConfig`` onto ``loss_options``), no tensor checks (``policy_loss`` makes them). It imports
torch only for annotations.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peergrade.algo.loss_registry import is_builtin, loss_names, unknown_loss_message

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

__all__ = [
    "CispoLoss",
    "ClippedLoss",
    "CustomLoss",
    "DrGrpoLoss",
    "LossBatch",
    "LossCounts",
    "LossFamily",
    "LossFn",
    "LossOptions",
    "SapoLoss",
    "VespoLoss",
    "loss_options",
]

CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the hard clip (and delta)
TOKEN_MEAN_TYPES = ("dapo", "cispo", "vespo")  # normalised by the global token count
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_delta(delta: float | None) -> None:
    if delta is not None and not (_is_number(delta) and delta > 1):
        raise ValueError(f"delta: expected a number > 1 or None, got {delta!r}")


def _check_positive(name: str, v: object) -> None:
    if not (_is_number(v) and v > 0):
        raise ValueError(f"{name}: expected a positive number, got {v!r}")


def _check_non_negative(name: str, v: object) -> None:
    if not (_is_number(v) and v >= 0):
        raise ValueError(f"{name}: expected a number >= 0, got {v!r}")


def _check_max_completion_length(n: object) -> None:
    if n is None:
        raise ValueError(
            "max_completion_length: required for loss_type='dr_grpo' (its constant "
            "normaliser is B * max_completion_length)"
        )
    if not (isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0):
        raise ValueError(f"max_completion_length: expected a positive int, got {n!r}")


# ---- the loss families ----------------------------------------------------------------------


@dataclass(frozen=True)
class ClippedLoss:
    """The hard-clipped surrogate of PPO/GRPO, aggregated as ``loss_type`` (grpo, bnpo, dapo
    or luspo); ``delta``: INTELLECT-2's cap of the unclipped ratio (> 1), or None."""

    loss_type: str = "grpo"
    delta: float | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in ("grpo", "bnpo", "dapo", "luspo"):
            raise ValueError(
                f"ClippedLoss.loss_type: expected grpo, bnpo, dapo or luspo (dr_grpo is "
                f"DrGrpoLoss), got {self.loss_type!r}"
            )
        _check_delta(self.delta)


@dataclass(frozen=True)
class DrGrpoLoss:
    """Dr. GRPO: the clipped surrogate over the constant ``B * max_completion_length``."""

    max_completion_length: int
    delta: float | None = None
    loss_type: str = field(default="dr_grpo", init=False)

    def __post_init__(self) -> None:
        _check_max_completion_length(self.max_completion_length)
        _check_delta(self.delta)


@dataclass(frozen=True)
class CispoLoss:
    """CISPO: ``cap`` is the cap of the detached weight itself (> 0, TRL's ``epsilon_high``),
    or None for the paper's ``1 + clip_eps_high``."""

    cap: float | None = None
    loss_type: str = field(default="cispo", init=False)

    def __post_init__(self) -> None:
        if self.cap is not None and not (_is_number(self.cap) and self.cap > 0):
            raise ValueError(f"cispo_cap: expected a positive number or None, got {self.cap!r}")


@dataclass(frozen=True)
class SapoLoss:
    """SAPO: the gate's temperatures for A > 0 and A <= 0 (> 0)."""

    temperature_pos: float = 1.0
    temperature_neg: float = 1.05
    loss_type: str = field(default="sapo", init=False)

    def __post_init__(self) -> None:
        _check_positive("sapo_temperature_pos", self.temperature_pos)
        _check_positive("sapo_temperature_neg", self.temperature_neg)


@dataclass(frozen=True)
class VespoLoss:
    """VESPO: the Gamma kernel's shape k and decay lambda for A >= 0 and A < 0 (>= 0)."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    loss_type: str = field(default="vespo", init=False)

    def __post_init__(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            _check_non_negative(f"vespo_{name}", getattr(self, name))


@dataclass(frozen=True)
class CustomLoss:
    """A loss added with ``register_loss``, by its name; it reads the shared options only."""

    loss_type: str

    def __post_init__(self) -> None:
        if is_builtin(self.loss_type):
            raise ValueError(
                f"CustomLoss.loss_type: {self.loss_type!r} is a built-in loss type; use its "
                "own record (ClippedLoss, DrGrpoLoss, CispoLoss, SapoLoss or VespoLoss)"
            )
        if not isinstance(self.loss_type, str) or not self.loss_type:
            raise ValueError(f"CustomLoss.loss_type: expected a name, got {self.loss_type!r}")


LossFamily = ClippedLoss | DrGrpoLoss | CispoLoss | SapoLoss | VespoLoss | CustomLoss
_FAMILIES = (ClippedLoss, DrGrpoLoss, CispoLoss, SapoLoss, VespoLoss, CustomLoss)


# ---- the options of a run ---------------------------------------------------------------------


def _check_shared(
    ratio_level: object, kl_estimator: object, clip_eps: object, clip_eps_high: object, beta: object
) -> None:
    """The options every loss type reads, in the order ``policy_loss`` always checked them."""
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level: expected one of {RATIO_LEVELS}, got {ratio_level!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    _check_positive("clip_eps", clip_eps)
    if clip_eps_high is not None and not (_is_number(clip_eps_high) and clip_eps_high > 0):
        raise ValueError(
            f"clip_eps_high: expected a positive number or None, got {clip_eps_high!r}"
        )
    if not (_is_number(beta) and beta >= 0):
        raise ValueError(f"beta: expected a number >= 0, got {beta!r}")


@dataclass(frozen=True)
class LossOptions:
    """The options of ``policy_loss``: the loss family with its own knobs, and the options
    every family reads. ``clip_eps_high`` None means ``clip_eps``; ``beta`` weighs the KL term
    (estimator ``kl_estimator``, times the importance ratio with ``kl_bias_correction``)."""

    family: LossFamily = field(default_factory=ClippedLoss)
    ratio_level: str = "token"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.family, _FAMILIES):
            raise ValueError(
                f"LossOptions.family: expected one of "
                f"{', '.join(f.__name__ for f in _FAMILIES)}, got {self.family!r}"
            )
        _check_shared(
            self.ratio_level, self.kl_estimator, self.clip_eps, self.clip_eps_high, self.beta
        )

    @property
    def loss_type(self) -> str:
        return self.family.loss_type

    @property
    def eps_high(self) -> float:
        """The upper clip epsilon: ``clip_eps_high``, or ``clip_eps`` when None."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


# the flat keyword names loss_options takes, with their defaults
_SHARED_DEFAULTS = {
    "ratio_level": "token",
    "clip_eps": 0.2,
    "clip_eps_high": None,
    "beta": 0.0,
    "kl_estimator": "k3",
    "kl_bias_correction": False,
}
_FAMILY_DEFAULTS = {
    "delta": None,
    "max_completion_length": None,
    "cispo_cap": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


def loss_options(loss_type: str = "grpo", **knobs: object) -> LossOptions:
    """``LossOptions`` from the flat keyword names (``algo.*`` keys; see the module docstring).

    Every knob is checked, those of another family too (then left out): the messages and their
    order are those of ``policy_loss``'s keyword form. Unknown names are refused.
    """
    unknown = sorted(set(knobs) - set(_SHARED_DEFAULTS) - set(_FAMILY_DEFAULTS))
    if unknown:
        raise TypeError(
            f"loss_options: unknown option(s) {unknown}; expected loss_type and "
            f"{', '.join(sorted({**_SHARED_DEFAULTS, **_FAMILY_DEFAULTS}))}"
        )
    if loss_type not in loss_names():
        raise ValueError(unknown_loss_message(loss_type))
    k = {**_SHARED_DEFAULTS, **_FAMILY_DEFAULTS, **knobs}
    _check_shared(k["ratio_level"], k["kl_estimator"], k["clip_eps"], k["clip_eps_high"], k["beta"])
    family = _family(loss_type, k)
    shared = {name: k[name] for name in _SHARED_DEFAULTS}
    return LossOptions(family, **shared)


def _family(loss_type: str, k: dict) -> LossFamily:
    """The family record of ``loss_type`` from the flat knobs ``k``, after checking them all."""
    delta, cap = k["delta"], k["cispo_cap"]
    _check_delta(delta)
    if delta is not None and loss_type not in CLIPPED_TYPES:
        raise ValueError(
            f"delta: applies to the clipped loss types {CLIPPED_TYPES} only, not "
            f"loss_type={loss_type!r}"
        )
    sapo = SapoLoss(k["sapo_temperature_pos"], k["sapo_temperature_neg"])
    vespo = VespoLoss(
        k["vespo_k_pos"], k["vespo_lambda_pos"], k["vespo_k_neg"], k["vespo_lambda_neg"]
    )
    dr_grpo = DrGrpoLoss(k["max_completion_length"], delta) if loss_type == "dr_grpo" else None
    cispo = CispoLoss(cap)
    if cap is not None and loss_type != "cispo":
        raise ValueError(f"cispo_cap: applies to loss_type='cispo' only, not {loss_type!r}")
    if dr_grpo is not None:
        return dr_grpo
    if loss_type in CLIPPED_TYPES:
        return ClippedLoss(loss_type, delta)
    own = {"cispo": cispo, "sapo": sapo, "vespo": vespo}
    return own[loss_type] if loss_type in own else CustomLoss(loss_type)


# ---- one call's tensors and counts --------------------------------------------------------------


@dataclass(frozen=True)
class LossCounts:
    """The counts that replace the local ones in the normalisers (docs/algorithms.md):
    ``num_tokens`` the minibatch's counted tokens (token-mean types; default: this batch's);
    ``num_sequences`` the minibatch's sequences (gradient accumulation: the per-batch
    normalised types are scaled by their share B / num_sequences); ``stands_for`` and
    ``batch_tokens`` the sequences (>= B) and counted tokens these rows stand for when rows of
    loss exactly 0 were left out (exact elision)."""

    num_tokens: float | int | torch.Tensor | None = None
    num_sequences: int | None = None
    stands_for: float | None = None
    batch_tokens: float | int | torch.Tensor | None = None


@dataclass(frozen=True)
class LossBatch:
    """One ``policy_loss`` call's tensors (checked for shape): ``logp`` ``[B, T]`` with
    gradient, ``old_logp`` ``[B, T]``, ``advantages`` ``[B]`` or ``[B, T]``, ``mask`` ``[B, T]``
    (1 = counts), optional ``ref_logp``, off-policy ``weights`` and ``keep`` (all ``[B, T]``),
    and the normalisers' ``counts``. What a registered loss function receives."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    counts: LossCounts = field(default_factory=LossCounts)


#: a policy loss ``register_loss`` takes: ``fn(batch, options) -> (loss, metrics)``, the loss a
#: scalar tensor (this micro-batch's share of its minibatch's loss) and metrics python floats
LossFn = Callable[[LossBatch, LossOptions], "tuple[torch.Tensor, dict[str, float]]"]
