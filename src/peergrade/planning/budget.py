"""Does it fit? GRPO, PPO and GRPO+LoRA of one config against a device's memory budget.

``peergrade memory --budget 24GiB`` calls ``budget_rows`` (the estimator in ``peergrade.planning.memory``
run for the three variants of the same config: plain GRPO, PPO with its critic, GRPO with a
LoRA adapter) and prints ``format_budget``: the breakdown, the estimated peak of each phase
(generate / reference / update, and evaluate: the held-out evaluation at its
``train.eval_batch_size``) and whether the run's peak fits under the budget with its headroom.
``parse_size`` reads sizes such as ``24GiB``, ``80GB`` or ``16G``.

``fit_search`` answers the next question, what to change so that it fits: it searches first the
knobs that change memory and not the objective (micro-batch, gradient checkpointing, reference
offload, log-prob chunk size, a set held-out evaluation batch back to auto), then, only if none of those is enough, the ones that change what
is optimised (LoRA, a smaller group, a shorter completion budget), and returns the cheapest
settings that fit; ``format_fits`` prints them as YAML lines to paste into a config.

It only formats, compares and searches: the memory model itself (what each phase holds) lives in
``peergrade.planning.memory.estimate_memory``, and nothing here measures or loads weights. A model given
as a directory holding only ``config.json`` (e.g. ``configs/models/qwen2.5-7b``) is enough.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

from peergrade.errors import InputError

__all__ = [
    "parse_size",
    "budget_rows",
    "format_budget",
    "fit_search",
    "format_fits",
    "VARIANTS",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}

# (label, algo, LoRA on)
VARIANTS = [("GRPO", "grpo", False), ("PPO", "ppo", False), ("GRPO+LoRA", "grpo", True)]


def parse_size(text: str) -> int:
    """``'24GiB'`` -> 25769803776 bytes. GiB/MiB/KiB/TiB are powers of 1024, GB/MB/KB/TB powers
    of 1000; a bare ``G``/``M``/``K``/``T`` means the binary unit (as nvidia-smi and torch
    report memory)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise InputError(
            f"--budget {text!r}: expected a size such as 24GiB, 80GB or 16G "
            "(units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise InputError(f"--budget {text!r}: must be positive")
    return int(value)


def _has_tokenizer(model_dir: str) -> bool:
    p = Path(model_dir)
    return any(
        (p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def budget_rows(cfg, *, device: str = "cuda", prompt_len: int | None = None):
    """[(label, estimate)] for GRPO, PPO and GRPO+LoRA of ``cfg`` (a peergrade Config), and the
    prompt length used. Without a tokenizer next to the model config, prompts are taken at
    ``data.max_prompt_length`` tokens (the longest the trainer admits)."""
    from peergrade.config import validate
    from peergrade.model.load import resolve_model_path
    from peergrade.planning.memory import estimate_for_config

    path = resolve_model_path(cfg.model.path)
    if not (Path(path) / "config.json").exists():
        raise InputError(
            f"model {cfg.model.path!r}: no config.json in {path} (give --model a model directory "
            "or a folder with just its config.json, e.g. configs/models/qwen2.5-7b)"
        )
    if prompt_len is None and not _has_tokenizer(path):
        prompt_len = cfg.data.max_prompt_length
    rows = []
    for label, algo, lora in VARIANTS:
        c = copy.deepcopy(cfg)
        c.algo.name = algo
        c.model.lora.enabled = lora
        validate(c)
        est = estimate_for_config(c, prompt_len=prompt_len, device=device)
        rows.append((label, est))
    if prompt_len is None:
        from peergrade.planning.memory import prompt_length

        prompt_len = prompt_length(cfg)
    return rows, prompt_len


def format_budget(rows, budget: int) -> str:
    """A plain-text table: the breakdown, each phase's estimated peak, the peak, and ``fits``
    (yes with the headroom left, or NO with how much is missing); in GiB, or in MiB when the
    budget and every peak are under 1 GiB; a last line names the unit."""
    big = max([budget, *(est["peak"] for _, est in rows)]) >= 2**30
    scale, unit = (2**30, "GiB") if big else (2**20, "MiB")

    def _size(x: float) -> str:
        return f"{x / scale:.2f}"

    phases: list[str] = []
    for _, est in rows:
        for p in est["phases"]:
            if p not in phases:
                phases.append(p)
    keys = ["weights", "grads", "optimizer", "reference", "critic", "activations", "kv_cache"]
    header = ["variant", *keys, *(f"{p} peak" for p in phases), "peak", "fits"]
    cells = [header]
    for label, est in rows:
        free = budget - est["peak"]
        fits = f"yes ({_size(free)} free)" if free >= 0 else f"NO ({_size(-free)} over)"
        cells.append(
            [
                label,
                *(_size(est[k]) for k in keys),
                *(_size(est["phases"][p]) if p in est["phases"] else "-" for p in phases),
                _size(est["peak"]),
                fits,
            ]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i in (0, len(header) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"({unit}; estimates from the model config, see peergrade.planning.memory; a phase's peak is "
        "what is resident while it runs)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- what fits

# Compute cost of each knob that leaves the objective alone (a rough fraction of a step's time:
# checkpointing recomputes the forward, ~1/3 of the update; each halving of the micro-batch
# loses some throughput; offloading copies the reference in and out; chunk size is ~free).
_COST_CKPT, _COST_HALVING, _COST_OFFLOAD, _COST_CHUNK = 0.33, 0.1, 0.05, 0.01
# train.eval_batch_size back to auto: held-out evaluation in more, smaller generation calls
# (a few percent of a run's time, at eval_every)
_COST_EVAL_AUTO = 0.02


def _divisors_below(n: int, top: int) -> list[int]:
    """Micro-batch sizes to try: every divisor of ``n`` up to ``top``, largest first."""
    return sorted((d for d in range(1, min(n, top) + 1) if n % d == 0), reverse=True)


def _with(cfg, changes: dict):
    from peergrade.config import validate

    c = copy.deepcopy(cfg)
    for key, value in changes.items():
        node = c
        *path, last = key.split(".")
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    validate(c)
    return c


def _objective_options(cfg, label_lora: bool):
    """(objective cost, changes) for the knobs that change what is trained, cheapest first:
    LoRA (when the variant is not LoRA already), then halving the group size (down to 2), then
    halving the completion budget (down to a quarter); each step costs 1."""
    r = cfg.rollout
    loras = [False] if label_lora or cfg.model.lora.enabled else [False, True]
    groups = [r.group_size]
    while groups[-1] // 2 >= 2:
        groups.append(groups[-1] // 2)
    lengths = [r.max_completion_length]
    while len(lengths) < 3 and lengths[-1] // 2 >= 1:
        lengths.append(lengths[-1] // 2)
    out = []
    for lora in loras:
        for gi, g in enumerate(groups):
            for li, length in enumerate(lengths):
                ch = {}
                if lora:
                    ch["model.lora.enabled"] = True
                if g != r.group_size:
                    ch["rollout.group_size"] = g
                if length != r.max_completion_length:
                    ch["rollout.max_completion_length"] = length
                out.append((int(lora) + gi + li, ch))
    return sorted(out, key=lambda x: x[0])


def _memory_options(cfg, device: str):
    """(compute cost, changes) for the knobs that keep the objective."""
    ckpt_now = cfg.gradient_checkpointing_on(device)
    ckpts = [False, True] if not ckpt_now else [False]
    offloads = [False]
    if device == "cuda" and cfg.uses_reference and not cfg.model.lora.enabled:
        offloads = [False] if cfg.model.ref_offload else [False, True]
    chunks = [cfg.model.logprob_chunk_size] + [
        c for c in (256, 64) if c < cfg.model.logprob_chunk_size
    ]
    micros = _divisors_below(cfg.minibatch_size, cfg.micro_batch_size)
    # a set evaluation batch above auto's (the step's generation call) may make the held-out
    # evaluation the run's peak: auto keeps it within the step
    t = cfg.train
    evals = [False]
    if t.eval_batch_size != "auto":
        auto = min(cfg.step_generation_batch(), t.eval_size * t.eval_samples)
        evals += [True] if t.eval_batch_size > auto else []
    out = []
    for ckpt, eval_auto in ((c, e) for c in ckpts for e in evals):
        for off in offloads:
            for ci, chunk in enumerate(chunks):
                for micro in micros:
                    ch, cost = {}, 0.0
                    if eval_auto:
                        ch["train.eval_batch_size"], cost = "auto", _COST_EVAL_AUTO
                    if ckpt:
                        ch["model.gradient_checkpointing"], cost = True, cost + _COST_CKPT
                    if off:
                        ch["model.ref_offload"], cost = True, cost + _COST_OFFLOAD
                    if ci:
                        ch["model.logprob_chunk_size"], cost = chunk, cost + ci * _COST_CHUNK
                    if micro != cfg.micro_batch_size:
                        halvings = math.log2(cfg.micro_batch_size / micro)
                        ch["optim.micro_batch_size"] = micro
                        cost += _COST_HALVING * halvings
                    out.append((cost, ch))
    return sorted(out, key=lambda x: x[0])


def fit_search(cfg, budget: int, *, device: str, prompt_len: int, lora: bool = False) -> dict:
    """The cheapest settings under which ``cfg`` (one variant: its algorithm and LoRA already
    set) fits in ``budget`` bytes. Returns ``{"changes": {key: value}, "peak": bytes,
    "objective": bool (True when the objective had to change), "fits": bool}``; when nothing
    fits, ``fits`` is False, ``changes`` / ``peak`` are those of the smallest peak found and
    ``floor`` is what no batch knob removes (weights, optimizer state, reference, critic).
    Cheapest: the fewest objective changes (LoRA, each halving of the group size or of the
    completion budget), then the least compute (``_COST_*``). Estimates only."""
    from peergrade.planning.memory import estimate_for_config

    best = None  # the smallest peak seen, for the answer when nothing fits
    levels: dict[int, list] = {}
    for cost, ch in _objective_options(cfg, lora):
        levels.setdefault(cost, []).append(ch)
    for objective_cost in sorted(levels):
        found = []
        for obj in levels[objective_cost]:
            try:
                base = _with(cfg, obj)
            except Exception:  # a combination the config rejects (e.g. minibatch no divisor)
                continue
            for compute_cost, mem in _memory_options(base, device):
                try:
                    c = _with(base, mem)
                except Exception:
                    continue
                est = estimate_for_config(c, prompt_len=prompt_len, device=device)
                peak = est["peak"]
                changes = {**obj, **mem}
                if best is None or peak < best["peak"]:
                    floor = sum(est[k] for k in ("weights", "optimizer", "reference", "critic"))
                    best = {"changes": changes, "peak": peak, "objective": bool(obj)}
                    best["floor"] = floor
                if peak <= budget:
                    found.append((compute_cost, peak, changes))
                    break  # options are sorted by cost: the first that fits is this one's best
        if found:
            cost, peak, changes = min(found, key=lambda x: (x[0], x[1]))
            return {"changes": changes, "peak": peak, "objective": objective_cost > 0, "fits": True}
    return {**best, "fits": False}


def _yaml(changes: dict) -> list[str]:
    """``{"model.lora.enabled": True}`` -> nested YAML lines, keys grouped by section."""
    tree: dict = {}
    for key, value in changes.items():
        node = tree
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value

    def lines(node: dict, depth: int) -> list[str]:
        out = []
        for k in sorted(node):
            v = node[k]
            if isinstance(v, dict):
                out.append("  " * depth + f"{k}:")
                out += lines(v, depth + 1)
            else:
                text = "true" if v is True else "false" if v is False else str(v)
                out.append("  " * depth + f"{k}: {text}")
        return out

    return lines(tree, 0)


def format_fits(results: list[tuple[str, float, dict]], budget: int) -> str:
    """``results`` = [(variant label, its peak as configured, ``fit_search`` answer)] -> what
    to paste per variant (or that it fits as configured), in GiB."""
    gib = 2**30
    out = [
        f"What fits in {budget / gib:.2f} GiB: first the knobs that keep the objective "
        "(micro-batch, gradient checkpointing, reference offload, chunk size, the held-out "
        "evaluation's batch), then LoRA, "
        "group size, completion length; the cheapest settings that fit, to paste into the "
        "config:"
    ]
    for label, peak, fit in results:
        if peak <= budget:
            out.append(f"  {label}: fits as configured ({peak / gib:.2f} GiB)")
            continue
        if not fit["fits"]:
            out.append(
                f"  {label}: nothing searched fits: the smallest peak found is "
                f"{fit['peak'] / gib:.2f} GiB, of which {fit['floor'] / gib:.2f} GiB stay "
                "whatever the batch (weights, optimizer state, reference, critic); a smaller "
                "model (or critic, algo.critic_path) or a larger device"
            )
            continue
        else:
            how = "changing the objective" if fit["objective"] else "the same objective"
            out.append(f"  {label}: {fit['peak'] / gib:.2f} GiB ({how}) with:")
        out += ["      " + line for line in _yaml(fit["changes"])]
    return "\n".join(out)
