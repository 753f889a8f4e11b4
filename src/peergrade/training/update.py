"""What the GRPO and PPO updates share: the models bundle, micro-batches, log-prob passes, the
minibatch schedule, the optimizer and its schedule, metric averaging, and the update skeleton.

The update of one training step (``run_update``):

    for each of algo.num_iterations passes, for each minibatch (order seeded by seed, step, pass):
        zero the gradients
        for each micro-batch: trim its padding, loss = micro_loss(...), loss.backward()
        clip each network's gradient norm, optimizer.step(), scheduler.step()

Micro-batches come from a ``plan``: by default the minibatch's rows longest completion first
(``by_length``), so each micro-batch's ``trim`` cuts more padding. GRPO's plan (``grpo_plan``)
also leaves out the completions whose gradient is exactly zero (advantage 0, no KL term:
``elided_rows``) while ``policy_loss`` still counts them in every normaliser, and every
log-prob pass runs each distinct prompt once (``model.shared_prompt_forward``). All three give
the plain update's gradient up to float summation order.

``grpo_update`` is that skeleton with ``algo.policy_loss`` on one advantage per completion,
its options one ``LossOptions`` record built from ``algo.*`` (``loss_options_for``; a name given
to ``peergrade.register_loss`` is a valid ``algo.loss_type``). PPO's update
(``peergrade.training.ppo.ppo_update``) is the same skeleton with per-token advantages and a
value loss for its critic. Both read one step's tensors from an ``Experience`` (or an
``UpdateInputs``: those fields alone). The trainer sees either through one small interface,
``Algorithm``: ``advantages(experience)`` then ``update(experience, step)`` (``GRPO`` here,
``peergrade.training.ppo.PPO``), both on an ``Experience``. Minibatch orders are derived from (seed, step, pass) only
(``peergrade.seeds``), which is what makes a resumed run exact.

What it deliberately does not do: no loss math (``peergrade.algo``), no sampling or rewards, no
checkpoints, no loop. It reads the config (batch sizes, loss options) but never the whole run:
``peergrade.training.trainer`` owns setup and the step.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from peergrade import distributed as dist
from peergrade.algo import (
    LossCounts,
    LossOptions,
    adaptive_entropy_coef,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    loss_options,
    off_policy_sequence_mask,
    off_policy_weights,
    policy_loss,
)
from peergrade.algo.advantages import gdpo_advantages
from peergrade.algo.loss_registry import is_builtin
from peergrade.config import off_policy_correction
from peergrade.errors import ConfigError
from peergrade.model.load import disable_adapter
from peergrade.model.logprobs import token_logprobs
from peergrade.monitoring.flops import Shape, Work, logprob_pass, split_lengths
from peergrade.seeds import step_seed
from peergrade.training.experience import Experience

__all__ = [
    "Models",
    "Trainee",
    "MeanMetrics",
    "micro_batches",
    "by_length",
    "trim",
    "autocast",
    "logprobs_of",
    "frozen_logprobs",
    "ref_logprobs",
    "minibatch_schedule",
    "build_optimizer",
    "build_scheduler",
    "lr_lambda",
    "run_update",
    "UpdateInputs",
    "loss_options_for",
    "elided_rows",
    "grpo_plan",
    "grpo_update",
    "grpo_update_work",
    "Algorithm",
    "GRPO",
]


@dataclass
class Models:
    policy: Any
    tokenizer: Any
    reference: Any  # None, a frozen copy, or "adapter" (LoRA: the policy with its adapter disabled)
    device: torch.device


def micro_batches(idx: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for i in range(0, len(idx), size):
        yield idx[i : i + size]


def by_length(rows: torch.Tensor, cmask: torch.Tensor) -> torch.Tensor:
    """``rows`` ordered longest completion first (stable: ties keep their order, so a group's
    completions stay together), so that consecutive micro-batches hold similar lengths and
    ``trim`` cuts more padding from each. Completion extent = last counted column + 1."""
    C = cmask.shape[1]
    cols = torch.arange(1, C + 1, device=cmask.device)
    extent = ((cmask[rows] > 0) * cols).amax(dim=1) if C else torch.zeros_like(rows)  # [n]
    return rows[torch.sort(extent, descending=True, stable=True).indices]


def trim(input_ids, attention_mask, cmask):
    """Drop all-padding columns of a micro-batch: leading prompt padding, trailing completion padding."""
    C = cmask.shape[1]
    keep_c = int(cmask.sum(dim=0).nonzero().max().item()) + 1 if cmask.any() else 1
    L = input_ids.shape[1]
    prompt_cols = attention_mask[:, : L - C].sum(dim=0)
    first = int(prompt_cols.nonzero().min().item()) if prompt_cols.any() else L - C
    end = L - C + keep_c
    return input_ids[:, first:end], attention_mask[:, first:end], cmask[:, :keep_c]


AUTO_BF16_MIN_PARAMS = 10_000_000  # below this, bf16 autocast measured slower on the CPU


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux: /proc/cpuinfo), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), None)
    except OSError:
        return None


def cpu_bf16_kind() -> str | None:
    """How this CPU multiplies bf16: ``"amx"`` (AMX tiles), ``"avx512_bf16"``, or None
    (emulated: torch converts to float32 and back, slower than float32 itself; also where the
    flags cannot be read)."""
    flags = _cpu_flags() or set()
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def _measured_bf16_ratio(n: int = 384, reps: int = 5) -> float:
    """bf16 / float32 time of one ``n x n`` matmul, medians of ``reps`` (about 50 ms in all):
    the question asked of a CPU whose flags say nothing."""
    import time

    a = torch.randn(n, n)
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for _ in range(reps):
        for dt in times:
            x = a.to(dt)
            t0 = time.perf_counter()
            x @ x
            times[dt].append(time.perf_counter() - t0)
    f32, b16 = (sorted(v)[len(v) // 2] for v in times.values())
    return b16 / max(f32, 1e-9)


@functools.cache
def cpu_bf16_pays() -> tuple[bool, str]:
    """Whether bf16 autocast pays on this CPU, and why, once per process: AMX or AVX512-BF16
    units, yes (measured 0.6x a step's time with AMX, 0.64x with AVX512-BF16 on an AMD EPYC:
    docs/benchmarks.md); flags that show neither, no (bf16 is emulated); no flags to read (not
    Linux), a short matmul measurement decides."""
    kind = cpu_bf16_kind()
    if kind == "amx":
        return True, "this CPU has AMX bf16 units"
    if kind == "avx512_bf16":
        return True, "this CPU has AVX512-BF16"
    if _cpu_flags() is not None:
        return False, "this CPU has neither AMX nor AVX512-BF16 (bf16 would be emulated)"
    ratio = _measured_bf16_ratio()
    return ratio < 0.8, f"a bf16 matmul measured {ratio:.2f}x float32's time here"


def bf16_cpu_note(cfg, device) -> str | None:
    """One start-up line when bf16 is asked for on a CPU that has no bf16 matrix units."""
    asked = cfg.model.autocast == "bf16" or cfg.model.dtype == "bfloat16"
    if not asked or torch.device(device).type != "cpu" or cpu_bf16_kind() is not None:
        return None
    what = "model.autocast bf16" if cfg.model.autocast == "bf16" else "model.dtype bfloat16"
    return (
        f"{what} on a CPU without bf16 matrix units (neither AMX nor AVX512-BF16): bf16 is "
        "emulated here and runs slower than float32; set model.autocast off / model.dtype "
        "float32 (GRPOConfig: bf16=False) unless you need bf16's numerics"
    )


def auto_bf16(device, dtype: torch.dtype | str, n_params: int) -> tuple[bool, str]:
    """``model.autocast: auto`` for a model of ``n_params`` weights of ``dtype`` on ``device``:
    (bf16 or not, why), the one decision the trainer and the memory planner share."""
    if torch.device(device).type != "cpu":
        return False, "not on a CPU: the weights' dtype (model.dtype) decides"
    if dtype not in (torch.float32, "float32"):
        return False, f"the weights are {str(dtype).replace('torch.', '')}, not float32"
    if n_params < AUTO_BF16_MIN_PARAMS:
        return False, (
            f"the model has {n_params / 1e6:.2g}M parameters, below the "
            f"{AUTO_BF16_MIN_PARAMS // 1_000_000}M where bf16 pays on a CPU"
        )
    return cpu_bf16_pays()


def autocast_note(cfg, device, model) -> str | None:
    """The start-up line of ``model.autocast: auto`` on a CPU: what it chose and why."""
    if cfg.model.autocast != "auto" or torch.device(device).type != "cpu":
        return None
    on, why = _auto_for(device, model)
    return f"precision: {'bf16 autocast' if on else 'float32'} (model.autocast auto: {why})"


def _auto_for(device, model) -> tuple[bool, str]:
    params = list(model.parameters())
    dtype = torch.float32 if all(p.dtype == torch.float32 for p in params) else params[0].dtype
    return auto_bf16(device, dtype, sum(p.numel() for p in params))


def use_bf16_autocast(setting: str, device, model) -> bool:
    """``model.autocast`` resolved: bf16, off, or auto (``auto_bf16``)."""
    if setting == "off":
        return False
    if setting == "bf16":
        return True
    if setting != "auto":
        raise ValueError(f"model.autocast={setting!r}: expected auto, off or bf16")
    if torch.device(device).type != "cpu" or model is None:
        return False
    return _auto_for(device, model)[0]


def autocast(cfg, device, model=None) -> contextlib.AbstractContextManager:
    """torch.autocast in bfloat16 on ``device`` when ``model.autocast`` resolves to bf16."""
    if use_bf16_autocast(cfg.model.autocast, device, model):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def logprobs_of(model, input_ids, attention_mask, cmask, cfg, *, with_entropy=False):
    with autocast(cfg, input_ids.device, model):
        return _logprobs_of(model, input_ids, attention_mask, cmask, cfg, with_entropy)


def _logprobs_of(model, input_ids, attention_mask, cmask, cfg, with_entropy):
    return token_logprobs(
        model,
        input_ids,
        attention_mask,
        cmask,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.model.logprob_chunk_size,
        with_entropy=with_entropy,
        share_prompts=cfg.model.shared_prompt_forward,
    )


@torch.no_grad()
def frozen_logprobs(model, batch, cfg, rows: torch.Tensor | None = None):
    """Log-probs of ``model`` (no grad) for every sequence, [N, C]: the reference, the old
    policy (mu > 1 or minibatches) and PPO's KL reward use it. ``rows``: only these (the
    others stay 0), longest first into micro-batches (``by_length``)."""
    input_ids, attention_mask, cmask = batch
    out = torch.zeros(cmask.shape, dtype=torch.float32, device=cmask.device)
    idx_all = torch.arange(cmask.shape[0], device=cmask.device) if rows is None else rows
    for mb in micro_batches(by_length(idx_all, cmask), cfg.micro_batch_size):
        ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
        out[mb, : cm.shape[1]] = logprobs_of(model, ii, am, cm, cfg).float()
    return out


def ref_logprobs(models: Models, batch, cfg) -> torch.Tensor | None:
    """Reference log-probs of every sequence, [N, C], or None without a reference."""
    if models.reference is None:
        return None
    if models.reference == "adapter":
        with disable_adapter(models.policy) as base:
            return frozen_logprobs(base, batch, cfg)
    ref = models.reference
    home = next(ref.parameters()).device
    if home == models.device:
        return frozen_logprobs(ref, batch, cfg)
    ref.to(models.device)  # model.ref_offload: on the device for this pass only
    try:
        return frozen_logprobs(ref, batch, cfg)
    finally:
        ref.to(home)


# algo.policy_loss's metrics that are token means of one micro-batch: weighted by its token
# count, their mean is the token mean of the whole update however rows are grouped into
# micro-batches or ranks (a weight per row would make 1 x P and N x P/N disagree).
TOKEN_MEANS = frozenset(
    {"clip/low_frac", "clip/high_frac", "clip/frac", "clip/delta_frac", "ratio/mean", "kl/mean"}
)


class MeanMetrics:
    """Weighted means of the scalar metrics of one update call."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float, w: int = 1) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * w
        self.counts[key] = self.counts.get(key, 0) + w

    def add_entropy(self, ent: torch.Tensor, cmask: torch.Tensor) -> None:
        """``entropy/mean``: the token mean over every micro-batch (and rank), so that how rows
        are grouped into micro-batches or ranks does not change it."""
        n_tok = int(cmask.sum().item())
        if n_tok > 0:
            self.add("entropy/mean", (ent.detach() * cmask).sum().item() / n_tok, n_tok)

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / max(self.counts[k], 1) for k in self.sums}


def token_normaliser(kind: str, row_tokens: torch.Tensor, mini_idx: torch.Tensor) -> torch.Tensor:
    """The counted-token normaliser of minibatch ``mini_idx`` (``algo.token_normaliser``), from
    every row's counted tokens ``row_tokens`` ``[N]`` of the generated batch: ``minibatch`` its
    own rows' total; ``batch_mean`` the batch's total times its share of the rows (the batch's
    tokens divided by its optimizer steps, TRL's rule, when the minibatches are equal)."""
    if kind == "minibatch":
        return row_tokens[mini_idx].sum().clamp(min=1)
    if kind == "batch_mean":
        share = len(mini_idx) / row_tokens.shape[0]
        return (row_tokens.sum().to(torch.float64) * share).clamp(min=1.0)
    raise ValueError(f"algo.token_normaliser: expected 'minibatch' or 'batch_mean', got {kind!r}")


def minibatch_schedule(cfg, step: int, N: int, device) -> Iterator[torch.Tensor]:
    """The minibatches (index tensors) of one update call: ``algo.num_iterations`` passes over
    the N rows, each pass in an order seeded by (seed, step, pass), cut into
    ``optim.minibatch_size`` pieces (one optimizer step each)."""
    mini = cfg.minibatch_size
    all_idx = torch.arange(N, device=device)
    for it in range(cfg.algo.num_iterations):
        g = torch.Generator().manual_seed(step_seed(cfg.train.seed, step, salt=1 + it))
        order = all_idx if mini == N else torch.randperm(N, generator=g).to(device)
        yield from micro_batches(order, mini)


def build_optimizer(params, cfg_optim, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over ``params``; the fused kernel when every tensor is a float on CPU or CUDA.

    Fused AdamW updates each parameter in one kernel with no temporaries, where the default
    CPU path allocates two buffers the size of the largest parameter per tensor step (the
    embedding, ~0.1 GB on a 30M model) and CUDA's foreach path one copy of all of them."""
    params = list(params)
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )
    # FSDP2 mixes sharded (DTensor) and whole parameters, which the multi-tensor kernels refuse
    sharded = any(hasattr(p, "to_local") for p in params)
    return torch.optim.AdamW(
        params,
        lr=cfg_optim.lr if lr is None else lr,
        betas=tuple(cfg_optim.adam_betas),
        weight_decay=cfg_optim.weight_decay,
        **({"foreach": False} if sharded else {"fused": fused or None}),
    )


def lr_lambda(cfg_optim, total_updates: int) -> Callable[[int], float]:
    warm, kind, floor = cfg_optim.warmup_steps, cfg_optim.lr_schedule, cfg_optim.min_lr_ratio

    def f(i: int) -> float:
        if warm > 0 and i < warm:
            return (i + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (i - warm) / max(1, total_updates - warm))
        if kind == "linear":
            return floor + (1 - floor) * (1 - frac)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        raise ValueError(f"unknown lr_schedule {kind!r}: expected constant, cosine or linear")

    return f


def build_scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """The configured warmup + schedule over every optimizer step of the run."""
    total = cfg.train.steps * cfg.updates_per_step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, total))


# ----------------------------------------------------------------------------- the skeleton


@dataclass
class Trainee:
    """A network the update trains: its trainable parameters, optimizer, schedule (or None),
    and the metric its gradient norm is logged under."""

    params: list
    optimizer: Any
    scheduler: Any = None
    norm_metric: str = "grad/norm"


# micro_loss(mb, mini_idx, (input_ids, attention_mask, cmask) trimmed, num_tokens, metrics)
MicroLoss = Callable[
    [torch.Tensor, torch.Tensor, tuple, torch.Tensor, MeanMetrics], torch.Tensor | None
]


def run_update(
    batch,
    cfg,
    step: int,
    trainees: list[Trainee],
    micro_loss: MicroLoss,
    *,
    skip: Callable[[torch.Tensor], bool] | None = None,
    plan: Callable[[torch.Tensor], Iterable[torch.Tensor]] | None = None,
) -> MeanMetrics:
    """mu passes of minibatch updates (module docstring). ``micro_loss`` returns one
    micro-batch's share of its minibatch's loss and adds its own metrics; ``num_tokens`` is the
    minibatch's counted-token total (the dapo/cispo/PPO normaliser). ``skip(mini_idx)`` true
    means the minibatch's gradient is exactly zero: it gets zero gradients without a
    forward/backward (the optimizer still steps, as it would have), counted in
    ``update/zero_signal_frac``.

    Under torchrun ``batch`` is this rank's rows [r*n, (r+1)*n) of the global batch of N = n*W:
    the schedule is the global one (the same on every rank), each rank runs the micro-batches
    of its own rows of each minibatch, ``num_tokens`` and ``mini_idx`` (so ``num_sequences``)
    are the global minibatch's, gradients are summed over ranks before clipping
    (``distributed.sync_grads``), the skip is one decision, and the metrics are every rank's.
    A minibatch whose (global) gradient norm is not finite steps no optimizer
    (``update/nonfinite_frac``).

    ``plan(mini_idx)`` cuts a minibatch into the row sets of its micro-batches; the default is
    ``by_length`` then chunks of ``optim.micro_batch_size`` (less padding per micro-batch; the
    float summation order differs from the unsorted order when a minibatch has more than one
    micro-batch). ``micro_loss`` may return None: that micro-batch adds no gradient."""
    input_ids, attention_mask, cmask = batch
    n = cmask.shape[0]
    W, offset = dist.world(), dist.rank() * n
    micro = cfg.micro_batch_size
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
    metrics = MeanMetrics()
    if plan is None:  # longest first: less padding (one process; ranks keep their order)

        def plan(idx):
            return micro_batches(by_length(idx, cmask) if W == 1 else idx, micro)

    # Each row's counted tokens, for every rank's rows: the global minibatch normaliser.
    row_tokens = dist.gather_rows(cmask.sum(dim=1)) if W > 1 else cmask.sum(dim=1)  # [N]
    for mini_idx in minibatch_schedule(cfg, step, n * W, cmask.device):
        mine = mini_idx
        if W > 1:  # this rank's rows of the global minibatch, in schedule order
            mine = mini_idx[(mini_idx >= offset) & (mini_idx < offset + n)] - offset
        num_tokens = token_normaliser(cfg.algo.token_normaliser, row_tokens, mini_idx)
        skipped = start_minibatch(trainees, skip, mine, metrics)
        for mb in [] if skipped else plan(mine):
            trimmed = trim(input_ids[mb], attention_mask[mb], cmask[mb])
            loss = micro_loss(mb, mini_idx, trimmed, num_tokens, metrics)
            if loss is not None:
                loss.backward()
        if not skipped:
            padding_passes(batch, mini_idx, num_tokens, micro_loss, micro)
        clip_and_step(trainees, skipped, max_norm, metrics)
    for t in trainees:
        t.optimizer.zero_grad(set_to_none=True)
    metrics.sums, metrics.counts = dist.merge_sums(metrics.sums, metrics.counts)
    return metrics


def start_minibatch(
    trainees: list[Trainee],
    skip: Callable[[torch.Tensor], bool] | None,
    mine: torch.Tensor,
    metrics: MeanMetrics,
) -> bool:
    """The start of one minibatch of ``run_update``: every network's gradients zeroed, then the
    skip test on this rank's rows ``mine`` (one decision over ranks). A skipped minibatch gets
    zero gradients and a policy loss of exactly 0; returns whether it is skipped."""
    for t in trainees:
        t.optimizer.zero_grad(set_to_none=True)
    skipped = skip is not None and dist.all_true(skip(mine))
    if skip is not None:
        metrics.add("update/zero_signal_frac", float(skipped))
    if skipped:
        metrics.add("loss/policy", 0.0, len(mine))  # exactly: every token's loss is 0
        for t in trainees:
            for p in t.params:
                p.grad = torch.zeros_like(p)
    return skipped


def padding_passes(batch, mini_idx, num_tokens, micro_loss: MicroLoss, micro: int) -> None:
    """FSDP2: every rank runs as many forward/backward passes (each one communicates); a rank
    with fewer rows in this minibatch adds zero-weight passes on its first row (their metrics
    are dropped)."""
    input_ids, attention_mask, cmask = batch
    for _ in range(dist.pad_micro_batches(mini_idx, cmask.shape[0], micro)):
        one = torch.arange(1, device=cmask.device)
        trimmed = trim(input_ids[one], attention_mask[one], cmask[one])
        (micro_loss(one, mini_idx, trimmed, num_tokens, MeanMetrics()) * 0.0).backward()


def clip_and_step(
    trainees: list[Trainee], skipped: bool, max_norm: float, metrics: MeanMetrics
) -> None:
    """The end of one minibatch of ``run_update``: each network's gradients summed over ranks
    (not a skipped minibatch's: zero everywhere) and clipped, its norm logged, then the
    optimizer and schedule steps."""
    norms = []
    for t in trainees:
        if not skipped:
            dist.sync_grads(t.params)  # summed over ranks (identity in one process)
        norms.append(dist.clip_grad_norm(t.params, max_norm))
        metrics.add(t.norm_metric, norms[-1])
    # A NaN/inf loss or gradient: no network steps (parameters and AdamW state untouched);
    # the schedule still advances, so it stays aligned with the batch count. The norm is
    # the global one, so every rank decides alike.
    nonfinite = not all(math.isfinite(x) for x in norms)
    metrics.add("update/nonfinite_frac", float(nonfinite))
    for t in trainees:
        if not nonfinite:
            t.optimizer.step()
        if t.scheduler is not None:
            t.scheduler.step()


def elided_rows(advantages: torch.Tensor, kl_on: bool, enabled: bool = True) -> torch.Tensor:
    """``[N]`` bool: the completions the GRPO update leaves out of its forward/backward.

    A completion whose advantage is exactly 0 has loss exactly 0 on every token when there is
    no KL term (every loss type multiplies the ratio or log-prob by the advantage), so its
    gradient is exactly 0. With a KL term (beta > 0) it still pulls toward the reference, so
    nothing is left out."""
    if kl_on or not enabled:
        return torch.zeros(advantages.shape[0], dtype=torch.bool, device=advantages.device)
    if advantages.dim() == 2:  # [N, C] per token (distillation): 0 on every token
        return (advantages == 0).all(dim=1)
    return advantages == 0


@dataclass
class EntropyControl:
    """The entropy bonus's state across optimizer steps (``algo.entropy_coef``): the coefficient
    (moved by ``algo.use_adaptive_entropy``) and the last optimizer step's mean entropy over
    the trained tokens (inf before the first: the adaptive bonus starts off, as in TRL)."""

    coef: float
    last_entropy: float = math.inf
    window: list | None = None  # [entropy sum, token count] of the current optimizer step
    window_metrics: Any = None  # the update's metrics (FSDP's padding passes bring others)

    def applied(self, adaptive: bool, target: float) -> float:
        """The coefficient the current optimizer step's loss uses."""
        if adaptive:
            return self.coef if self.last_entropy <= target else 0.0
        return self.coef

    def close_window(self, a) -> None:
        """End of an optimizer step: its (every rank's) mean entropy moves the coefficient
        (``algo.use_adaptive_entropy``). Called at the same points on every rank (a
        collective): before each minibatch (``run_update``'s skip test) and after the last."""
        if self.window is None:
            return
        s, n = dist.gather_rows(torch.tensor([self.window], dtype=torch.float64)).sum(0).tolist()
        self.window = None
        if n == 0:  # no token anywhere: nothing measured
            return
        self.last_entropy = s / n
        if not a.use_adaptive_entropy:  # a static coefficient never moves
            return
        self.coef = adaptive_entropy_coef(
            self.coef,
            self.last_entropy,
            target=a.entropy_target,
            step=a.entropy_coef_delta,
            coef_min=a.entropy_coef_min,
            coef_max=a.entropy_coef_max,
        )


@dataclass
class UpdateInputs:
    """What an update reads of one step's experience: ``Experience``'s fields of those names
    (an ``Experience`` serves as one), for a caller that has the tensors but no full record.

    ``batch`` is ``(input_ids, attention_mask, loss_mask)``; ``advantages`` ``[N]`` (GRPO) or
    ``[N, C]``; the rest ``[N, C]`` or None: ``ref_logprobs`` the reference's (a KL term),
    ``sampler_logprobs`` the behaviour policy's (GRPO's off-policy correction), and PPO's
    ``values`` (rollout-time), ``returns`` and ``old_logprobs`` (None: one optimizer step per
    batch, the old policy is the current one)."""

    batch: tuple
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None


def loss_options_for(cfg) -> LossOptions:
    """The GRPO update's policy-loss options from ``cfg.algo`` (``algo.loss_type`` and its
    family's keys, the clip and KL keys) and ``rollout.max_completion_length`` (Dr. GRPO's
    normaliser): ``algo.loss_options`` of the same names, which checks every value. A
    ``loss_type`` that is neither built in nor registered (``peergrade.register_loss``) is a
    ``ConfigError`` naming the registered ones."""
    a = cfg.algo
    knobs = {
        name: getattr(a, name)
        for name in (
            *("ratio_level", "clip_eps", "clip_eps_high", "beta", "kl_estimator"),
            *("kl_bias_correction", "delta", "cispo_cap"),
            *("sapo_temperature_pos", "sapo_temperature_neg"),
            *("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
        )
    }
    try:
        return loss_options(
            a.loss_type, max_completion_length=cfg.rollout.max_completion_length, **knobs
        )
    except ValueError as e:
        section = "rollout" if str(e).startswith("max_completion_length") else "algo"
        raise ConfigError(f"{section}.{e}") from e


def grpo_plan(mini_idx, drop, cmask, micro: int, loss_type: str) -> list[torch.Tensor]:
    """The micro-batches of one GRPO minibatch.

    ``bnpo`` normalises by each micro-batch's own token count, so its micro-batches keep the
    composition of the unsorted plan (rows are left out inside ``micro_loss``, which passes the
    full micro-batch's counts on). Every other loss type normalises by minibatch-wide counts,
    so the kept rows are packed, longest first, into as few micro-batches as they need."""
    if loss_type == "bnpo":
        return list(micro_batches(mini_idx, micro))
    return list(micro_batches(by_length(mini_idx[~drop[mini_idx]], cmask), micro))


class GrpoLoss:
    """One ``grpo_update`` call's micro-batch loss (``run_update``'s ``micro_loss``), its
    minibatch skip test and plan, and what they share: the completions left out (``drop``),
    pi_old, the off-policy correction and the entropy bonus's state (``grpo_update``'s
    docstring says what each does). Made before the policy goes into training mode: pi_old's
    pass runs here. A registered (not built-in) loss is never elided or skipped: its loss at
    advantage 0 need not be 0. A subclass whose loss has another term sets ``elide = False``
    and overrides ``no_signal`` (on-policy distillation's divergence: ``training.teacher``)."""

    elide = True  # completions whose advantage is exactly 0 may be left out (elided_rows)

    def __init__(self, models: Models, exp, cfg, entropy: EntropyControl | None):
        self.models, self.batch, self.cfg, self.a = models, exp.batch, cfg, cfg.algo
        self.advantages, self.ref_lp = exp.advantages, exp.ref_logprobs
        self.behaviour_lp = exp.sampler_logprobs  # algo.off_policy_correction's mu
        self.options = loss_options_for(cfg)
        self.builtin = is_builtin(self.options.loss_type)
        cmask = self.batch[2]
        N = cmask.shape[0]
        a = self.a
        self.kl_on = cfg.uses_reference and self.ref_lp is not None
        self.bonus_on = a.entropy_coef != 0 or a.use_adaptive_entropy
        if self.bonus_on and entropy is None:
            entropy = EntropyControl(a.entropy_coef)
        if self.bonus_on:
            entropy.window, entropy.window_metrics = None, None
        self.entropy: EntropyControl | None = entropy
        self.select = a.top_entropy_quantile < 1
        # Elision and the length-sorted plan count rows of the whole minibatch: one process only
        # (under torchrun each rank computes all of its rows, in schedule order).
        self.parallel = dist.world() > 1
        elide_ok = (
            a.skip_zero_advantage
            and self.elide
            and self.builtin
            and not (self.parallel or self.bonus_on or self.select)
        )
        self.drop = elided_rows(self.advantages, self.kl_on, elide_ok)  # [N]
        all_idx = torch.arange(N, device=cmask.device)
        # With one optimizer step per batch, the old policy is the current one:
        # old = logp.detach(). (Under torchrun: zero signal on every rank, one decision.)
        need_old = cfg.updates_per_step > 1 and not dist.all_true(self.no_signal(all_idx))
        self.old_lp = (
            frozen_logprobs(models.policy, self.batch, cfg, rows=all_idx[~self.drop])
            if need_old
            else None
        )
        self.correction = off_policy_correction(cfg)  # auto: token_tis with pipelined rollouts
        self.correct = self.correction != "none" and self.behaviour_lp is not None
        # the correction weight's min and max over computed tokens
        self.w_range = [math.inf, -math.inf]

    # Zero advantages and no KL term make every token's loss exactly 0, so the gradient is 0:
    # such a minibatch is skipped (zero gradients, no forward/backward). Common early on, when
    # a model never earns any reward. (Not with the entropy bonus: its gradient is not 0.)
    def no_signal(self, idx) -> bool:
        if self.kl_on or self.bonus_on or not self.builtin:
            return False
        return bool((self.advantages[idx] == 0).all())

    def skip(self, idx) -> bool:  # run_update's test, once per minibatch on every rank
        if self.bonus_on:  # a new optimizer step: the previous one's entropy moves the coefficient
            self.entropy.close_window(self.a)
            self.entropy.window = [0.0, 0.0]
        return self.no_signal(idx)

    def plan(self, mini_idx):
        cmask = self.batch[2]
        return grpo_plan(mini_idx, self.drop, cmask, self.cfg.micro_batch_size, self.a.loss_type)

    def micro_loss(self, mb, mini_idx, trimmed, num_tokens, metrics) -> torch.Tensor | None:
        """The policy loss of micro-batch ``mb`` (its rows not left out) in minibatch
        ``mini_idx``, less its share of the entropy bonus; adds its metrics."""
        cfg = self.cfg
        keep = mb[~self.drop[mb]]
        if len(keep) == 0:  # (bnpo only) every row's loss and gradient are exactly 0
            for k in ("loss/policy", "loss/kl", "advantage/mean"):
                metrics.add(k, 0.0, len(mb))
            return None
        stands_for, elide, trimmed = self.elision(mb, keep, mini_idx, trimmed)
        ii, am, cm = trimmed
        Tc = cm.shape[1]
        logp, ent = logprobs_of(self.models.policy, ii, am, cm, cfg, with_entropy=True)
        old = logp.detach() if self.old_lp is None else self.old_lp[keep, :Tc]
        weights = self.correction_weights(old, keep, cm, metrics) if self.correct else None
        keep_tok, ent_mask = self.token_masks(logp, old, ent, keep, cm, metrics)
        adv = self.advantages[keep]  # [b] or [b, C] (per token: distillation)
        loss, m = policy_loss(
            logp,
            old,
            adv if adv.dim() == 1 else adv[:, :Tc],
            cm,
            self.options,
            ref_logp=None if self.ref_lp is None else self.ref_lp[keep, :Tc],
            weights=weights,
            keep=keep_tok,
            counts=LossCounts(num_tokens, len(mini_idx), **elide),
        )
        if self.bonus_on:
            loss = self.entropy_term(loss, ent, ent_mask, len(keep) / len(mini_idx), metrics)
        self.add_metrics(m, metrics, len(keep), len(mini_idx), stands_for, cm)
        metrics.add_entropy(ent, cm)
        return loss

    def elision(self, mb, keep, mini_idx, trimmed) -> tuple[float, dict, tuple]:
        """What micro-batch ``mb``'s rows ``keep`` stand for (rows left out count in every
        normaliser): the completion count, ``policy_loss``'s elision arguments (only when rows
        were left out), and the trimmed tensors to compute (bnpo: of ``keep`` alone)."""
        input_ids, attention_mask, cmask = self.batch
        elide = {}  # policy_loss's elision arguments, only when rows were left out
        if self.a.loss_type == "bnpo":  # the full micro-batch's counts; its kept rows only
            stands_for = len(mb)
            if len(keep) < len(mb):
                elide = {"stands_for": stands_for, "batch_tokens": cmask[mb].sum()}
                trimmed = trim(input_ids[keep], attention_mask[keep], cmask[keep])
        else:  # the minibatch's left-out rows, spread over its micro-batches by size
            # (under torchrun nothing is left out and mini_idx is the global minibatch)
            kept = len(mini_idx) if self.parallel else int((~self.drop[mini_idx]).sum())
            stands_for = len(keep) * len(mini_idx) / kept
            if kept < len(mini_idx):
                elide = {"stands_for": stands_for}
        return stands_for, elide, trimmed

    def correction_weights(self, old, keep, cm, metrics) -> torch.Tensor:
        """The off-policy correction's per-token weights toward pi_old ``old`` (``[b, Tc]``);
        adds their token means and widens the update's min/max (``w_range``)."""
        a, Tc = self.a, cm.shape[1]
        weights, wm = off_policy_weights(
            old,
            self.behaviour_lp[keep, :Tc],
            cm,
            correction=self.correction,
            cap=a.off_policy_cap,
            low=a.off_policy_low,
            high=a.off_policy_high,
            sequence_ratio=a.off_policy_sequence_ratio,
        )
        n_tok = float(cm.sum())
        for k in ("weight_mean", "masked_frac", "truncated_frac"):
            metrics.add(f"correction/{k}", wm[f"correction/{k}"], n_tok)
        if n_tok > 0:
            self.w_range[0] = min(self.w_range[0], wm["correction/weight_min"])
            self.w_range[1] = max(self.w_range[1], wm["correction/weight_max"])
        return weights

    def token_masks(self, logp, old, ent, keep, cm, metrics) -> tuple:
        """``([b, Tc] bool or None, [b, Tc] bool)``: the tokens whose surrogate counts (OPSM,
        high entropy; None: every counted token) and the tokens of the entropy bonus."""
        a, Tc = self.a, cm.shape[1]
        keep_tok = None  # [b, Tc] bool: tokens whose surrogate counts (OPSM, high entropy)
        if a.off_policy_mask_threshold is not None:
            mu = old if self.behaviour_lp is None else self.behaviour_lp[keep, :Tc]
            seq_keep = off_policy_sequence_mask(
                logp, mu, self.advantages[keep], cm, a.off_policy_mask_threshold
            )  # [b]
            metrics.add("opsm/masked_frac", float((~seq_keep).float().mean()), len(keep))
            keep_tok = seq_keep[:, None].expand_as(cm) & (cm == 1)
        ent_mask = cm == 1  # [b, Tc]
        if self.select:
            ent_mask = high_entropy_mask(ent, cm, a.top_entropy_quantile)
            keep_tok = ent_mask if keep_tok is None else keep_tok & ent_mask
            metrics.add(
                "entropy/selected_frac",
                float(ent_mask.sum()) / max(float(cm.sum()), 1.0),
                float(cm.sum()),
            )
        return keep_tok, ent_mask

    def entropy_term(self, loss, ent, ent_mask, share: float, metrics) -> torch.Tensor:
        """L - coef * H over the trained tokens ``ent_mask``, this micro-batch's ``share`` of
        its minibatch; its entropy counts in the optimizer step's window."""
        a, entropy = self.a, self.entropy
        coef = entropy.applied(a.use_adaptive_entropy, a.entropy_target)
        h = entropy_bonus(ent, ent_mask)
        loss = loss - coef * h * share
        if entropy.window_metrics is None or metrics is entropy.window_metrics:
            entropy.window_metrics = metrics  # (not FSDP's zero-weight padding passes)
            entropy.window[0] += float((ent.detach() * ent_mask).sum())
            entropy.window[1] += float(ent_mask.sum())
            metrics.add("entropy/coef", coef)
        return loss

    def add_metrics(self, m, metrics, kept: int, mini: int, stands_for, cm) -> None:
        """``policy_loss``'s metrics ``m`` of a micro-batch of ``kept`` computed rows in a
        minibatch of ``mini``, each with its weight."""
        # dapo/cispo/vespo (and registered) losses are this micro-batch's share of the
        # minibatch's: scaled so that the weighted mean over a minibatch is the sum of the
        # shares (the minibatch's loss).
        shared = self.a.loss_type in ("dapo", "cispo", "vespo") or not self.builtin
        n_tok = int(cm.sum().item())
        for k, v in m.items():
            # whole-batch values weigh what they stand for; the others what was computed
            if k in ("loss/policy", "loss/kl"):
                scale = mini / stands_for if shared else 1.0
                metrics.add(k, float(v) * scale, stands_for)
            elif k == "advantage/mean":
                metrics.add(k, float(v), stands_for)
            elif k in TOKEN_MEANS:
                metrics.add(k, float(v), n_tok)
            else:
                metrics.add(k, float(v), kept)

    def weight_extremes(self) -> dict[str, float]:
        """``correction/weight_min`` / ``_max`` over every rank's computed tokens (a rank that
        computed no token holds +-inf); empty without a correction or a computed token."""
        if not self.correct:
            return {}
        lo_hi = dist.gather_rows(torch.tensor([self.w_range], dtype=torch.float64))  # [W, 2]
        mn, mx = lo_hi[:, 0].min().item(), lo_hi[:, 1].max().item()
        if math.isfinite(mn):
            return {"correction/weight_min": mn, "correction/weight_max": mx}
        return {}


def grpo_update(
    models: Models,
    optimizer,
    scheduler,
    exp: Experience | UpdateInputs,
    cfg,
    step: int,
    entropy: EntropyControl | None = None,
    loss: GrpoLoss | None = None,
) -> dict[str, float]:
    """The GRPO update of one step on ``exp``: ``algo.policy_loss`` (options:
    ``loss_options_for(cfg)``) with one advantage per completion (``exp.advantages`` ``[N]``),
    the KL term toward ``exp.ref_logprobs`` when given, over ``run_update``; returns the
    averaged metrics.

    Off-policy correction (``algo.off_policy_correction`` other than none, with
    ``behaviour_lp`` = ``exp.sampler_logprobs``, the sampler's ``[N, C]`` log-probs): each micro-batch's surrogate is
    weighted per token by ``algo.off_policy_weights(old, behaviour_lp)``, old being pi_old
    (the frozen log-probs, or the current ones detached with one optimizer step per batch).
    ``correction/weight_mean``, ``masked_frac`` and ``truncated_frac`` are token means and
    ``correction/weight_min`` / ``_max`` the extremes, over the computed completions (every
    rank's). Without ``behaviour_lp`` or with none, nothing is weighted.

    Exact elision (``algo.skip_zero_advantage``, no KL term): completions with advantage 0 are
    never forwarded (``elided_rows``); ``policy_loss`` gets ``stands_for`` / ``batch_tokens`` so
    every normaliser still counts them, and the gradient is the one of the full batch up to
    float summation order. ``update/elided_frac`` is the fraction left out. The clip, ratio,
    KL and entropy statistics are then over the computed completions only.

    Token selection and the entropy bonus: ``algo.off_policy_mask_threshold`` (OPSM, toward
    ``behaviour_lp``, else pi_old) and ``algo.top_entropy_quantile`` (the quantile over each
    micro-batch's counted tokens) give ``policy_loss`` its ``keep`` mask; ``algo.entropy_coef``
    subtracts coef x the micro-batch's mean entropy over the kept tokens, times its share of the
    minibatch (``entropy``: the coefficient's state, adaptive with ``algo.use_adaptive_entropy``).
    A completion with advantage 0 then still matters (its entropy has a gradient; its tokens
    enter the quantile), so nothing is elided or skipped with either on.

    ``loss``: the micro-batch loss to use instead of ``GrpoLoss(models, exp, cfg, entropy)``
    (a subclass made on the same arguments, e.g. on-policy distillation's ``DistillLoss``)."""
    loss = GrpoLoss(models, exp, cfg, entropy) if loss is None else loss
    params = [p for p in models.policy.parameters() if p.requires_grad]
    models.policy.train()
    metrics = run_update(
        exp.batch,
        cfg,
        step,
        [Trainee(params, optimizer, scheduler)],
        loss.micro_loss,
        skip=loss.skip,
        plan=None if loss.parallel else loss.plan,
    )
    if loss.bonus_on:
        # the last optimizer step's entropy moves the coefficient
        loss.entropy.close_window(cfg.algo)
        loss.entropy.window_metrics = None
    extremes = loss.weight_extremes()
    return {
        **metrics.means(),
        **extremes,
        "update/elided_frac": float(loss.drop.float().mean()),
        "optim/lr": scheduler.get_last_lr()[0],
    }


def grpo_update_work(shape: Shape, batch, advantages, cfg, kl_on: bool) -> Work:
    """The model work (``peergrade.monitoring.flops``) ``grpo_update``'s result needs: forward + backward
    (3 forwards) per pass (``algo.num_iterations``) over the completions whose gradient is not
    exactly 0 (every one with a KL term; else those with a nonzero advantage: what ``elided_rows``
    leaves), plus the old-policy pass over them when a batch takes several optimizer steps.
    Counted whether or not the update elides (``algo.skip_zero_advantage``, torchrun): a
    completion computed for nothing is overhead, not model work."""
    _, attention_mask, cmask = batch
    rows = ~elided_rows(advantages, kl_on).cpu()  # [N]
    if not rows.any():
        return Work(0, 0, 0, 0)
    p, c = split_lengths(attention_mask, cmask.shape[1])
    fwd = logprob_pass(shape, p, c, cmask.sum(dim=1), cfg.rollout.group_size, rows)
    old = fwd if cfg.updates_per_step > 1 else Work(0, 0, 0, 0)
    return fwd.times(3 * cfg.algo.num_iterations) + old


# ----------------------------------------------------------------------------- the interface


class Algorithm(Protocol):
    """What the trainer's step needs from an RL algorithm: advantages, then the update."""

    def advantages(self, exp: Experience) -> None:
        """Fill ``exp.advantages`` (and what else the update reads) and ``exp.metrics``."""

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """The policy update of one step on ``exp``; returns the averaged metrics."""


def gdpo_inputs(exp: Experience, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-function scores ``[P, G, K]`` (float32, NaN = not scored) and weights ``[K]`` of
    ``exp`` for ``gdpo_advantages``, in the reward functions' order."""
    scores = exp.sampled.scores if exp.sampled is not None else None
    if scores is None or not scores.per_fn:
        raise ValueError(
            "algo.multi_objective_aggregation=normalize_then_sum needs each reward function's "
            "scores, which this step's experience does not carry"
        )
    names = list(scores.per_fn)
    per_fn = torch.stack([scores.per_fn[k].to(torch.float32) for k in names], dim=1)  # [N, K]
    if per_fn.shape[0] != exp.rewards.shape[0]:
        raise ValueError(
            f"GDPO: {per_fn.shape[0]} per-function scores for {exp.rewards.shape[0]} completions"
        )
    weights = torch.tensor([float(scores.weights.get(k, 1.0)) for k in names])  # [K]
    return per_fn.view(-1, G, len(names)), weights.to(per_fn.device)


@dataclass
class GRPO:
    """Group-relative advantages (one per completion) and ``grpo_update``."""

    models: Models
    optimizer: Any
    scheduler: Any
    cfg: Any
    entropy: EntropyControl | None = None  # algo.entropy_coef's state across steps

    def __post_init__(self) -> None:
        # a bad or unregistered algo.loss_type fails here, at setup, not at the first update
        loss_options_for(self.cfg)

    def advantages(self, exp: Experience) -> None:
        a, G = self.cfg.algo, self.cfg.rollout.group_size
        rewards = exp.rewards.view(-1, G).to(torch.float32)  # [P, G]
        if a.multi_objective_aggregation == "normalize_then_sum":
            # GDPO: each function normalised in its group, the weighted sum over the batch
            per_fn, weights = gdpo_inputs(exp, G)  # [P, G, K], [K]
            adv = gdpo_advantages(dist.gather_rows(per_fn.to(self.models.device)), weights)
        elif a.multi_objective_aggregation == "sum_then_normalize":
            # over every rank's groups ([P_global, G]; batch scaling needs them all), then ours
            adv = group_advantages(
                dist.gather_rows(rewards), scale=a.advantage_scale, baseline=a.advantage_baseline
            )
        else:
            raise ValueError(
                "algo.multi_objective_aggregation: expected sum_then_normalize or "
                f"normalize_then_sum, got {a.multi_objective_aggregation!r}"
            )
        exp.advantages = dist.local_rows(adv).reshape(-1).to(self.models.device)  # [N]
        exp.metrics = {"advantage/std": dist.gather_rows(exp.advantages).std().item()}

    def update_work(self, exp: Experience, shape: Shape) -> Work:
        """The model work of ``update(exp)`` (``grpo_update_work``)."""
        kl_on = self.cfg.uses_reference and exp.ref_logprobs is not None
        # a registered loss is never elided: every completion is model work
        every_row = kl_on or not is_builtin(self.cfg.algo.loss_type)
        return grpo_update_work(shape, exp.batch, exp.advantages, self.cfg, every_row)

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        return grpo_update(
            self.models, self.optimizer, self.scheduler, exp, self.cfg, step, self.entropy_control()
        )

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of this object: the entropy bonus's coefficient (moved by
        ``algo.use_adaptive_entropy``) and the last optimizer step's mean entropy, which decides
        whether the adaptive bonus applies; nothing without a bonus."""
        e = self.entropy
        return {} if e is None else {"entropy_coef": e.coef, "last_entropy": e.last_entropy}

    def load_state(self, state: dict[str, float]) -> None:
        """The state ``state()`` gave, from a checkpoint (a resume)."""
        if "entropy_coef" in state:
            self.entropy = EntropyControl(
                float(state["entropy_coef"]), float(state["last_entropy"])
            )

    def entropy_control(self) -> EntropyControl | None:
        """The entropy bonus's state (None without one), made at the first update."""
        a = self.cfg.algo
        if self.entropy is None and (a.entropy_coef != 0 or a.use_adaptive_entropy):
            self.entropy = EntropyControl(a.entropy_coef)
        return self.entropy
