"""What the GRPO and PPO updates share: the models bundle, micro-batches, log-prob passes, the
minibatch schedule, the optimizer and its schedule, metric averaging, and the update skeleton.

The update of one training step (``run_update``):

    for each of algo.num_iterations passes, for each minibatch (order seeded by seed, step, pass):
        zero the gradients
        for each micro-batch: trim its padding, loss = micro_loss(...), loss.backward()
        clip each network's gradient norm, optimizer.step(), scheduler.step()

``grpo_update`` is that skeleton with ``algo.policy_loss`` on one advantage per completion;
PPO's update (``peergrade.ppo.ppo_update``) is the same skeleton with per-token advantages and a
value loss for its critic. Minibatch orders are derived from (seed, step, pass) only
(``peergrade.seeds``), which is what makes a resumed run exact.

What it deliberately does not do: no loss math (``peergrade.algo``), no sampling or rewards, no
checkpoints, no loop. It reads the config (batch sizes, loss options) but never the whole run:
``peergrade.trainer`` owns setup and the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade.algo import policy_loss
from peergrade.logprobs import token_logprobs
from peergrade.models import disable_adapter
from peergrade.seeds import step_seed

__all__ = [
    "Models",
    "Trainee",
    "MeanMetrics",
    "micro_batches",
    "trim",
    "logprobs_of",
    "frozen_logprobs",
    "ref_logprobs",
    "minibatch_schedule",
    "build_optimizer",
    "build_scheduler",
    "lr_lambda",
    "run_update",
    "grpo_update",
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


def trim(input_ids, attention_mask, cmask):
    """Drop all-padding columns of a micro-batch: leading prompt padding, trailing completion padding."""
    C = cmask.shape[1]
    keep_c = int(cmask.sum(dim=0).nonzero().max().item()) + 1 if cmask.any() else 1
    L = input_ids.shape[1]
    prompt_cols = attention_mask[:, : L - C].sum(dim=0)
    first = int(prompt_cols.nonzero().min().item()) if prompt_cols.any() else L - C
    end = L - C + keep_c
    return input_ids[:, first:end], attention_mask[:, first:end], cmask[:, :keep_c]


def logprobs_of(model, input_ids, attention_mask, cmask, cfg, *, with_entropy=False):
    return token_logprobs(
        model,
        input_ids,
        attention_mask,
        cmask,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.model.logprob_chunk_size,
        with_entropy=with_entropy,
    )


@torch.no_grad()
def frozen_logprobs(model, batch, cfg):
    """Log-probs of ``model`` (no grad) for every sequence, [N, C]: the reference, the old
    policy (mu > 1 or minibatches) and PPO's KL reward use it."""
    input_ids, attention_mask, cmask = batch
    out = torch.zeros(cmask.shape, dtype=torch.float32, device=cmask.device)
    idx_all = torch.arange(cmask.shape[0], device=cmask.device)
    for mb in micro_batches(idx_all, cfg.micro_batch_size):
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


class MeanMetrics:
    """Weighted means of the scalar metrics of one update call."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float, w: int = 1) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * w
        self.counts[key] = self.counts.get(key, 0) + w

    def add_entropy(self, ent: torch.Tensor, cmask: torch.Tensor, w: int) -> None:
        """``entropy/mean``: the token mean of one micro-batch's entropies, weight ``w``."""
        n_tok = cmask.sum().item()
        if n_tok > 0:
            self.add("entropy/mean", (ent.detach() * cmask).sum().item() / n_tok, w)

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / max(self.counts[k], 1) for k in self.sums}


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
MicroLoss = Callable[[torch.Tensor, torch.Tensor, tuple, torch.Tensor, MeanMetrics], torch.Tensor]


def run_update(
    batch,
    cfg,
    step: int,
    trainees: list[Trainee],
    micro_loss: MicroLoss,
    *,
    skip: Callable[[torch.Tensor], bool] | None = None,
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
    (``update/nonfinite_frac``)."""
    input_ids, attention_mask, cmask = batch
    n = cmask.shape[0]
    W, offset = dist.world(), dist.rank() * n
    micro = cfg.micro_batch_size
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
    metrics = MeanMetrics()
    # Each row's counted tokens, for every rank's rows: the global minibatch normaliser.
    row_tokens = dist.gather_rows(cmask.sum(dim=1)) if W > 1 else None  # [N]
    for mini_idx in minibatch_schedule(cfg, step, n * W, cmask.device):
        if W > 1:  # this rank's rows of the global minibatch, in schedule order
            mine = mini_idx[(mini_idx >= offset) & (mini_idx < offset + n)] - offset
            num_tokens = row_tokens[mini_idx].sum().clamp(min=1)
        else:
            mine = mini_idx
            num_tokens = cmask[mini_idx].sum().clamp(min=1)
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
        for mb in [] if skipped else micro_batches(mine, micro):
            trimmed = trim(input_ids[mb], attention_mask[mb], cmask[mb])
            micro_loss(mb, mini_idx, trimmed, num_tokens, metrics).backward()
        # FSDP2: every rank runs as many forward/backward passes (each one communicates); a
        # rank with fewer rows in this minibatch adds zero-weight passes on its first row.
        for _ in range(0 if skipped else dist.pad_micro_batches(mini_idx, n, micro)):
            one = torch.arange(1, device=cmask.device)
            trimmed = trim(input_ids[one], attention_mask[one], cmask[one])
            (micro_loss(one, mini_idx, trimmed, num_tokens, MeanMetrics()) * 0.0).backward()
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
    for t in trainees:
        t.optimizer.zero_grad(set_to_none=True)
    metrics.sums, metrics.counts = dist.merge_sums(metrics.sums, metrics.counts)
    return metrics


def grpo_update(
    models: Models, optimizer, scheduler, batch, advantages, ref_lp, cfg, step: int
) -> dict[str, float]:
    """The GRPO update of one step: ``algo.policy_loss`` with one advantage per completion
    (``[N]``), over ``run_update``; returns the averaged metrics."""
    input_ids, attention_mask, cmask = batch
    N = cmask.shape[0]
    a = cfg.algo
    # Zero advantages and no KL term make every token's loss exactly 0, so the gradient is 0:
    # such a minibatch is skipped (zero gradients, no forward/backward). Common early on, when
    # a model never earns any reward.
    kl_on = cfg.uses_reference and ref_lp is not None

    def no_signal(idx) -> bool:
        return not kl_on and bool((advantages[idx] == 0).all())

    all_idx = torch.arange(N, device=cmask.device)
    # With one optimizer step per batch, the old policy is the current one: old = logp.detach().
    # (Under torchrun: zero signal on every rank, one decision.)
    need_old = cfg.updates_per_step > 1 and not dist.all_true(no_signal(all_idx))
    old_lp = frozen_logprobs(models.policy, batch, cfg) if need_old else None

    def micro_loss(mb, mini_idx, trimmed, num_tokens, metrics) -> torch.Tensor:
        ii, am, cm = trimmed
        Tc = cm.shape[1]
        logp, ent = logprobs_of(models.policy, ii, am, cm, cfg, with_entropy=True)
        loss, m = policy_loss(
            logp,
            logp.detach() if old_lp is None else old_lp[mb, :Tc],
            advantages[mb],
            cm,
            loss_type=a.loss_type,
            ratio_level=a.ratio_level,
            clip_eps=a.clip_eps,
            clip_eps_high=a.clip_eps_high,
            ref_logp=None if ref_lp is None else ref_lp[mb, :Tc],
            beta=a.beta,
            kl_estimator=a.kl_estimator,
            max_completion_length=cfg.rollout.max_completion_length,
            num_tokens=num_tokens,
            num_sequences=len(mini_idx),
        )
        for k, v in m.items():
            metrics.add(k, float(v), len(mb))
        metrics.add_entropy(ent, cm, len(mb))
        return loss

    params = [p for p in models.policy.parameters() if p.requires_grad]
    models.policy.train()
    trainee = Trainee(params, optimizer, scheduler)
    metrics = run_update(batch, cfg, step, [trainee], micro_loss, skip=no_signal)
    return {**metrics.means(), "optim/lr": scheduler.get_last_lr()[0]}
