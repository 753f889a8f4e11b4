"""Does it fit? GRPO, PPO and GRPO+LoRA of one config against a device's memory budget.

``peergrade memory --budget 24GiB`` calls ``budget_rows`` (the estimator in ``peergrade.memory``
run for the three variants of the same config: plain GRPO, PPO with its critic, GRPO with a
LoRA adapter) and prints ``format_budget``: the breakdown, the estimated peak of each phase
(generate / reference / update) and whether the peak fits under the budget with its headroom.
``parse_size`` reads sizes such as ``24GiB``, ``80GB`` or ``16G``.

It only formats and compares: the memory model itself (what each phase holds) lives in
``peergrade.memory.estimate_memory``, and nothing here measures or loads weights. A model given
as a directory holding only ``config.json`` (e.g. ``configs/models/qwen2.5-7b``) is enough.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from peergrade.errors import InputError

__all__ = ["parse_size", "budget_rows", "format_budget", "VARIANTS"]

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
    from peergrade.memory import estimate_for_config
    from peergrade.models import resolve_model_path

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
        from peergrade.memory import prompt_length

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
        f"({unit}; estimates from the model config, see peergrade.memory; a phase's peak is "
        "what is resident while it runs)"
    )
    return "\n".join(lines)
