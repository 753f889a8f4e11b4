"""Small shared helpers for the side-by-side benchmarks in bench/.

- ``run_child``: run one measurement in a fresh Python process (so each side's peak memory is its
  own) and read back the JSON dict it prints on its last stdout line.
- ``peak_rss_reset`` / ``rss_now`` / ``peak_rss``: resident memory of the current process from
  /proc/self/status (VmRSS / VmHWM). torch's CPU allocations are invisible to tracemalloc, so
  the kernel's high-water mark is the honest measure; the mark is reset (``clear_refs``) just
  before the timed region so that model building does not count.
- ``alternate``: run the sides A, B, A, B, ... so slow drifts of a shared machine hit both.
- ``median``, ``format_table``, ``load_note``.
- ``arguments``: a benchmark's argument parser with ``--passes`` and ``--threads``.
- ``seconds_table``: the sides' seconds (key ``s``) pass by pass and their medians, printed.
- ``build_random_qwen2``: a Qwen2-shaped model with random weights plus a character tokenizer
  padded to its vocabulary, saved as a model directory (nothing downloaded).

This module knows nothing about any particular benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence


def arguments(doc: str, passes: int) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--passes`` (alternated passes
    per side, default ``passes``) and ``--threads`` (torch threads, default 1); add more."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--passes", type=int, default=passes)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def load_note() -> str:
    """One line on how busy the machine is (1-minute load average vs CPU count)."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux/macOS
        return "load average unavailable"
    cpus = os.cpu_count() or 1
    busy = one > 0.5 * cpus
    note = f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {cpus} CPUs"
    if busy:
        note += ": other processes were busy, so timings are noisy"
    return note


def build_random_qwen2(out, shape: dict, dtype=None, rope_theta: float | None = None) -> int:
    """Save a random Qwen2 model of ``shape`` (vocab, hidden, layers, heads, kv_heads, inter and
    optionally max_pos) with a char tokenizer padded to the vocabulary into ``out``; returns
    the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from peergrade.model.tiny import CHARS, build_char_tokenizer, tiny_config

    tok = build_char_tokenizer(CHARS + [f"<x{i}>" for i in range(shape["vocab"] - len(CHARS) - 4)])
    extra = {"max_position_embeddings": shape["max_pos"]} if "max_pos" in shape else {}
    cfg = tiny_config(
        "qwen2",
        vocab_size=len(tok),
        hidden_size=shape["hidden"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        intermediate_size=shape["inter"],
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **extra,
    )
    if rope_theta is not None:
        cfg.rope_theta = rope_theta
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_now() -> int:
    """Current resident set size in bytes (0 if unknown)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def peak_rss_reset() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set size in bytes since start or the last ``peak_rss_reset``."""
    kib = _status_kib("VmHWM")
    if kib is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return ru if sys.platform == "darwin" else ru * 1024
    return kib * 1024


def emit(result: dict) -> None:
    """Print the child's result as the last stdout line (read by ``run_child``)."""
    print(json.dumps(result), flush=True)


def run_child(argv: Sequence[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``python argv...`` in a fresh process; return the JSON dict on its last stdout line."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"child {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(
            f"child {' '.join(argv)} printed nothing; stderr:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def alternate(sides: dict[str, Callable[[], dict]], passes: int) -> dict[str, list[dict]]:
    """Call each side once per pass, alternating the order every pass (A B, B A, A B, ...)."""
    names = list(sides)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(passes):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(sides[name]())
    return results


def seconds_table(res: dict[str, list[dict]], what: str, digits: int = 2) -> dict[str, float]:
    """Print each side's seconds (``"s"`` of each pass, ``alternate``'s results) and their
    median, headed ``what``; returns the medians by side."""
    med = {k: median([r["s"] for r in v]) for k, v in res.items()}
    rows = [
        [k, f"{med[k]:.{digits}f}", " ".join(f"{r['s']:.{digits}f}" for r in v)]
        for k, v in res.items()
    ]
    print(format_table(["side", f"{what} (median)", "s per pass"], rows))
    return med


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned columns (first column left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row):
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)
