"""Several processes under ``torchrun``: the process group, rank-aware sharding of the prompts,
the reductions that keep N ranks x P/N prompts the same objective as 1 x P, the gradient
all-reduce (``dist.strategy: ddp``) and FSDP2 sharding (``dist.strategy: fsdp``).

What it does
------------
* ``init(cfg)`` joins the process group torchrun describes in the environment (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``...), backend gloo on the CPU and nccl on CUDA, with the
  collective timeout ``dist.timeout_s``. Without torchrun it does nothing, and every helper
  below is the identity: a single process runs exactly the code it ran before.
* Layout: the P prompts of a step are cut into ``world`` consecutive blocks of P/world whole
  prompts (``shard_range``); rank r samples the G completions of block r, so a group never
  spans ranks. Rank r's completions are rows [r*N/W, (r+1)*N/W) of the global batch of N.
  Sampling needs no per-rank seed: a completion's draws are keyed by the prompt's global index
  in the step (``shard_range``), so N ranks sample the tokens one process samples
  (``rollout.generate``'s ``row_keys``). The global ``random``/numpy generators that reward
  functions may use still get a stream per rank (``rank_seed``): reward functions see a batch,
  not one completion, so their draws cannot be keyed per completion from outside.
* Reductions: ``gather_rows`` (per-completion vectors: rewards, lengths, token counts; tiny)
  lets batch statistics and metrics be computed by the same formulas as in one process;
  ``exchange`` moves picklable objects (dynamic sampling's kept groups) to the ranks that ask;
  ``all_true`` makes the zero-signal skip one decision; ``merge_sums`` sums the metric sums and
  counts of every rank; ``masked_moments`` gives global token means and variances (PPO).
* ``sync_grads`` all-reduces (sums) the gradients after a minibatch's micro-batches and before
  clipping, in buckets of ``dist.bucket_mb``. The DistributedDataParallel wrapper is not used on
  purpose: a shuffled global minibatch splits unevenly across ranks, so ranks run different
  numbers of micro-batches, which DDP's per-backward hooks cannot express (it would hang or
  need ``no_sync`` bookkeeping); one explicit all-reduce per optimizer step is what DDP does
  under ``no_sync`` for gradient accumulation, minus the overlap with the last backward.
* FSDP2: ``prepare`` applies ``fully_shard`` to every decoder layer and the root, gradients are
  reduce-scattered as sums (divide factor 1: the losses are already normalised globally);
  ``pad_micro_batches`` tells a rank how many zero-weight micro-batches it must add so that
  every rank runs the same number of forward/backward passes (each one all-gathers);
  ``full_weights`` unshards the whole model for the rollout and evaluation (ranks generate
  different lengths, so their forward counts differ; unsharded, a forward needs no collective);
  ``checkpoint_state`` gathers full weights and optimizer state for rank 0 to save.
* ``main_guard`` turns an exception on any rank into one line naming the rank on stderr and a
  non-zero exit; torchrun then stops the other ranks.

What it deliberately does not do: no loss math, no loop, no launcher (torchrun is the launcher
and the rendezvous), no tensor or pipeline parallelism, no sharded evaluation (every rank
evaluates the same held-out rows; rank 0 logs).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import traceback
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as tdist

from peergrade.errors import InputError

__all__ = [
    "launched",
    "init",
    "shutdown",
    "world",
    "rank",
    "is_main",
    "parallel",
    "strategy",
    "barrier",
    "shard_range",
    "rank_seed",
    "gather_rows",
    "local_rows",
    "all_sum",
    "all_true",
    "any_true",
    "merge_sums",
    "sum_int",
    "gather_scores",
    "gather_objects",
    "exchange",
    "NullWriter",
    "masked_moments",
    "masked_mean",
    "masked_std",
    "whiten",
    "sync_grads",
    "prepare",
    "is_sharded",
    "pad_micro_batches",
    "full_weights",
    "clip_grad_norm",
    "checkpoint_state",
    "load_weights",
    "load_optimizer",
    "rank_memory",
    "main_guard",
]

_state: dict[str, Any] = {"strategy": "ddp", "bucket_mb": 25.0, "comm": torch.device("cpu")}


# ----------------------------------------------------------------------------- the group


def launched() -> bool:
    """Started by torchrun (or any launcher that sets the env:// variables)?"""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init(cfg) -> bool:
    """Join torchrun's process group (no-op without torchrun); True when a group is active.

    Checks that the P prompts split into whole blocks per rank."""
    if tdist.is_initialized():  # a later run in the same processes (tests): its strategy
        _state["strategy"] = cfg.dist.strategy
        return True
    if not launched():
        return False
    d = cfg.dist
    dev = cfg.model.device
    cuda = dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())
    backend = d.backend if d.backend != "auto" else ("nccl" if cuda else "gloo")
    W = int(os.environ["WORLD_SIZE"])
    P = cfg.rollout.prompts_per_step
    if P % W:
        raise InputError(
            f"rollout.prompts_per_step = {P} is not divisible by the {W} processes torchrun "
            f"started: each rank samples whole groups of P / world prompts, so P must be a "
            f"multiple of {W}"
        )
    if d.strategy == "fsdp" and (cfg.algo.name == "ppo" or cfg.model.lora.enabled):
        raise InputError(
            "dist.strategy=fsdp supports full fine-tuning with GRPO; PPO's critic and LoRA "
            "run under dist.strategy=ddp"
        )
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        _state["comm"] = torch.device("cuda", torch.cuda.current_device())
    tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=d.timeout_s))
    _state["strategy"] = d.strategy
    _state["bucket_mb"] = d.bucket_mb
    return True


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def world() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 writes logs, samples, the display and checkpoints."""
    return rank() == 0


def parallel() -> bool:
    """More than one process: the reductions below communicate."""
    return world() > 1


def strategy() -> str:
    return _state["strategy"] if parallel() else "none"


def barrier() -> None:
    if parallel():
        tdist.barrier()


# ----------------------------------------------------------------------------- the layout


def shard_range(num_rows: int) -> range:
    """The global indices of this rank's block of ``num_rows`` prompts (P / world consecutive
    whole prompts); ``range(num_rows)`` in one process."""
    W = world()
    if num_rows % W:
        raise InputError(
            f"{num_rows} prompts cannot be split into whole groups over {W} ranks "
            f"(rollout.prompts_per_step must be a multiple of the world size)"
        )
    k = num_rows // W
    return range(rank() * k, (rank() + 1) * k)


def rank_seed(seed: int) -> int:
    """Rank 0 keeps ``seed`` (a world of one is the plain run); rank r gets its own stream."""
    r = rank()
    return seed if r == 0 else (seed + r * 0x9E3779B97F4A7C15) % (2**63 - 1)


def _comm(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    return x.to(_state["comm"]).contiguous()


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on all ranks) concatenated along dim 0, in rank order:
    the global batch's per-row values. Identity in one process."""
    if not parallel():
        return t
    x = _comm(t)
    parts = [torch.empty_like(x) for _ in range(world())]
    tdist.all_gather(parts, x)
    return torch.cat(parts).to(device=t.device, dtype=t.dtype)


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global per-row tensor (the inverse of ``gather_rows``)."""
    if not parallel():
        return t
    k = t.shape[0] // world()
    return t[rank() * k : (rank() + 1) * k]


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks (a new tensor). Identity in one process."""
    if not parallel():
        return t
    x = _comm(t).clone()
    tdist.all_reduce(x, op=tdist.ReduceOp.SUM)
    return x.to(device=t.device, dtype=t.dtype)


def all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (one decision, e.g. the zero-signal skip)."""
    if not parallel():
        return flag
    x = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_state["comm"])
    tdist.all_reduce(x, op=tdist.ReduceOp.MIN)
    return bool(x.item())


def any_true(flag: bool) -> bool:
    """True when ``flag`` is true on some rank (e.g. a Ctrl-C seen by one rank first)."""
    return not all_true(not flag)


def merge_sums(sums: dict[str, float], counts: dict[str, int]) -> tuple[dict, dict]:
    """Per-key sums and counts of every rank added up (keys missing on a rank count 0)."""
    if not parallel():
        return sums, counts
    parts: list[Any] = [None] * world()
    tdist.all_gather_object(parts, (sums, counts))
    keys: list[str] = []
    for s, _ in parts:
        keys += [k for k in s if k not in keys]
    out_s = {k: sum(s.get(k, 0.0) for s, _ in parts) for k in keys}
    out_c = {k: sum(c.get(k, 0) for _, c in parts) for k in keys}
    return out_s, out_c


def sum_int(x: int) -> int:
    """An integer count summed over ranks."""
    if not parallel():
        return x
    return int(all_sum(torch.tensor([int(x)], dtype=torch.int64)).item())


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` in one process."""
    return _gather_objects(obj) if parallel() else [obj]


def _gather_objects(obj) -> list:
    out = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out


def exchange(owned: dict, wanted: list) -> list:
    """The objects named by ``wanted``, in that order, wherever they live: every rank offers
    ``owned`` (key -> picklable object, keys unique over ranks) and gets back the ones it asks
    for (e.g. dynamic sampling's kept groups, moved to the rank that trains them). Every rank
    receives every rank's offer (one all_gather_object): offer only what some rank needs.
    In one process: ``[owned[k] for k in wanted]``."""
    if parallel():
        merged: dict = {}
        for part in _gather_objects(owned):
            merged.update(part)
        owned = merged
    return [owned[k] for k in wanted]


def mean_over_ranks(x: float) -> float:
    """The mean of a per-rank value over ranks (each rank holds as many rows)."""
    if not parallel():
        return x
    return float(all_sum(torch.tensor(float(x), dtype=torch.float64))) / world()


def gather_scores(scores):
    """A ``rewards.RewardScores`` of every rank's completions (per-function scores and totals
    gathered in rank order, error counts summed, ``log_metric`` means averaged over ranks --
    each rank scores as many completions; the error messages and ``log_extra`` columns, which
    only rank 0 logs, stay local). Keys are gathered as objects: a count one rank has and
    another lacks cannot leave the collectives out of step."""
    if not parallel():
        return scores
    counts, logged = {}, {}
    for c, lg in _gather_objects((scores.counts, scores.logged)):
        for k, v in c.items():
            counts[k] = counts.get(k, 0.0) + v
        for k, v in lg.items():
            logged.setdefault(k, []).append(v)
    return dataclasses.replace(
        scores,
        per_fn={k: gather_rows(v) for k, v in scores.per_fn.items()},
        total=gather_rows(scores.total),
        num_errors=sum_int(scores.num_errors),
        counts=counts,
        logged={k: sum(v) / len(v) for k, v in logged.items()},
    )


class NullWriter:
    """What a rank other than 0 gets instead of a log file: writes nothing."""

    def write(self, obj) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (count, sum) of ``x`` over ``mask == 1`` entries, every rank's included."""
    from peergrade.algo.advantages import local_moments

    if not parallel():
        return local_moments(x, mask)
    return tuple(all_sum(torch.stack(local_moments(x, mask))))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> float:
    """``scale`` times the token mean of ``x`` over ``mask == 1`` entries of every rank."""
    valid = mask == 1
    if not parallel():
        if scale == 1.0:
            return ((x * valid).sum() / valid.sum().clamp(min=1)).item()
        return (scale * (x * valid).sum() / valid.sum().clamp(min=1)).item()
    n, s = masked_moments(x, mask)
    return (scale * s / n.clamp(min=1)).item()


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> float:
    """``algo.masked_std`` over every rank's counted entries."""
    from peergrade.algo.advantages import masked_std as std

    return std(x, mask, masked_moments)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``algo.whiten`` with the mean and std of every rank's counted entries."""
    from peergrade.algo.advantages import whiten as local_whiten

    return local_whiten(x, mask, eps, masked_moments)


# ----------------------------------------------------------------------------- gradients


def _is_dtensor(p) -> bool:
    return hasattr(p, "to_local")


def sync_grads(params: list) -> None:
    """Sum every parameter's gradient over the ranks (before clipping and the optimizer step).

    A parameter no rank gave a gradient stays ``None`` (so AdamW skips it, as in one process);
    one that some ranks lack gets zeros there. FSDP2-sharded parameters (DTensors) were
    reduce-scattered in backward already and are left alone."""
    if not parallel():
        return
    params = [p for p in params if not _is_dtensor(p)]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    has = all_sum(has).tolist()
    live = []
    for p, h in zip(params, has):
        if h == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        live.append(p)
    limit = int(_state["bucket_mb"] * 2**20)
    bucket: list = []
    size = 0
    for p in live + [None]:
        flush = p is None or (
            bucket
            and (
                size + p.grad.numel() * p.grad.element_size() > limit
                or p.grad.dtype != bucket[0].grad.dtype
            )
        )
        if flush and bucket:
            flat = torch.cat([q.grad.reshape(-1) for q in bucket]).to(_state["comm"])
            tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
            o = 0
            for q in bucket:
                n = q.grad.numel()
                q.grad.copy_(flat[o : o + n].view_as(q.grad))
                o += n
            bucket, size = [], 0
        if p is not None:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()


def clip_grad_norm(params: list, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (returned as a float); under FSDP2, where some
    gradients are shards (DTensor) and some whole, the norm sums the shards' squares over ranks."""
    params = list(params)
    if not any(_is_dtensor(p) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    shard_sq = sum((g.to_local().float() ** 2).sum() for g in grads if _is_dtensor(g))
    whole_sq = sum((g.float() ** 2).sum() for g in grads if not _is_dtensor(g))
    total = (all_sum(torch.as_tensor(shard_sq, dtype=torch.float32)) + whole_sq).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if _is_dtensor(g) else g).mul_(coef.to(g.device))
    return float(total)


# ----------------------------------------------------------------------------- FSDP2


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return isinstance(model, torch.nn.Module) and bool(_fsdp_modules(model))


def prepare(model):
    """Under ``dist.strategy: fsdp`` with several ranks, shard ``model`` with FSDP2: each
    decoder layer (HF's ``_no_split_modules`` classes) is one FSDP unit, and the backbone is
    the root unit. The parameters outside the layers (embedding, final norm, lm_head) stay
    whole on every rank and are all-reduced like ddp's: the log-prob engine calls the backbone
    and then the head's weight itself, chunk by chunk, which no FSDP hook would see.
    Otherwise ``model`` unchanged."""
    if strategy() != "fsdp" or not isinstance(model, torch.nn.Module):
        return model
    from torch.distributed.fsdp import fully_shard

    from peergrade.model.load import find_backbone_and_head

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise InputError(
            f"dist.strategy=fsdp: cannot find the decoder layers of {type(model).__name__} "
            "(its _no_split_modules is empty): use dist.strategy=ddp"
        )
    backbone, _ = find_backbone_and_head(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    outside = {p for p in model.parameters() if id(p) not in in_layers}
    for layer in layers:
        fully_shard(layer)
    fully_shard(backbone, ignored_params=outside)
    for m in _fsdp_modules(model):
        # The losses are normalised over the global batch already: reduce-scatter sums.
        # (plain SUM: gloo has no PREMUL_SUM)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return model


def pad_micro_batches(mini_global: torch.Tensor, n_local: int, micro: int) -> int:
    """Zero-weight micro-batches this rank adds to a minibatch so that every rank runs as many
    forward/backward passes as the busiest (FSDP2 all-gathers in each). 0 outside FSDP2."""
    if strategy() != "fsdp":
        return 0
    owner = torch.div(mini_global.cpu(), n_local, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=world())
    passes = (counts + micro - 1) // micro
    return int(passes.max() - passes[rank()])


@contextmanager
def full_weights(model):
    """The whole (unsharded) model for the duration: generation and evaluation, where ranks
    run different numbers of forward passes. A no-op unless ``model`` is FSDP2-sharded."""
    mods = _fsdp_modules(model) if isinstance(model, torch.nn.Module) else []
    if not mods:
        yield model
        return
    for m in mods:
        m.unshard()
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def checkpoint_state(model, optimizer) -> tuple[Any, Any]:
    """(model, optimizer) as ``checkpoint.save_checkpoint`` wants them. Under FSDP2 this is a
    collective: the full weights and optimizer state are gathered to rank 0's CPU."""
    if not is_sharded(model):
        return model, optimizer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    opt_state = get_optimizer_state_dict(model, optimizer, options=opts)

    class _Model:
        def save_pretrained(self, path):
            model.save_pretrained(path, state_dict=weights)

    class _Optimizer:
        def state_dict(self):
            return opt_state

    return _Model(), _Optimizer()


def load_weights(model, state_dict: dict) -> None:
    """Load full (unsharded) weights into ``model``, sharded or not."""
    if not is_sharded(model):
        model.load_state_dict(state_dict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def load_optimizer(model, optimizer, state: dict) -> None:
    """Load a full optimizer state (as saved) into ``optimizer``, sharded or not."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


# ----------------------------------------------------------------------------- memory


def rank_memory(
    phases: dict,
    parts: dict,
    *,
    static: int,
    world: int,
    strategy: str,
    lora: bool,
    layer_fraction: float,
    layer_bytes: int,
) -> tuple[dict, dict]:
    """Per-rank memory of a strategy, from the one-rank figures of a rank's batch share (bytes).

    ``parts``: weights, grads, optimizer, reference; ``static``: what stays resident through
    the step (weights, reference, optimizer, critic); ``layer_fraction``: the share of the
    parameters inside decoder layers (what FSDP2 shards here: embedding, final norm and lm_head
    stay whole); ``layer_bytes``: one layer's weights.
    ddp: everything whole on every rank, plus one gradient bucket flattened for the all-reduce.
    fsdp: the sharded share of each part divided by ``world``; the update all-gathers a layer
    and prefetches the next (2 x ``layer_bytes``); the rollout unshards every layer."""
    if strategy == "ddp" or lora:
        bucket = min(parts["grads"], int(_state["bucket_mb"] * 2**20))
        return {k: v + bucket if k == "update" else v for k, v in phases.items()}, parts
    if strategy != "fsdp":
        raise ValueError(f"strategy={strategy!r}: expected 'ddp' or 'fsdp'")
    keep = 1 - layer_fraction + layer_fraction / world
    new = {k: int(v * keep) for k, v in parts.items()}
    static_saved = sum(parts[k] - new[k] for k in ("weights", "optimizer", "reference"))
    unsharded = int(parts["weights"] * layer_fraction * (1 - 1 / world))
    out = dict(phases)
    out["generate"] = phases["generate"] - static_saved + unsharded
    if "evaluate" in out:  # held-out evaluation runs on the full weights too (full_weights)
        out["evaluate"] = phases["evaluate"] - static_saved + unsharded
    # update = static + max(backward, grads): the activations stay, the grads shrink
    above = phases["update"] - static
    backward = above if above > parts["grads"] else 0
    out["update"] = static - static_saved + max(backward, new["grads"]) + 2 * layer_bytes
    if "reference" in out:
        out["reference"] = phases["reference"] - static_saved + 2 * layer_bytes
    return out, new


# ----------------------------------------------------------------------------- failure


def main_guard(fn, *args, **kwargs):
    """Run ``fn``; under torchrun an exception becomes one line naming the rank and host on
    stderr (then re-raised: torchrun records it and stops the other ranks). The process group
    is destroyed on the way out either way."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        if launched():
            where = f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}"
            where += f" (local rank {os.environ.get('LOCAL_RANK', '?')}, {socket.gethostname()})"
            last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
            at = f" at {os.path.basename(last[0].filename)}:{last[0].lineno}" if last else ""
            print(
                f"peergrade: {where} failed: {type(e).__name__}: {e}{at}",
                file=sys.stderr,
                flush=True,
            )
        raise
    finally:
        shutdown()
