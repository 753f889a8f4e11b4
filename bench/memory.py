"""Peak training memory on CPU: GRPO vs PPO, LoRA vs full fine-tuning, measured vs estimated.

For each model size (random weights from a Qwen2-shaped config, saved with save_pretrained into
a temporary directory, with a tokenizer padded to the model's vocabulary) and each configuration

    grpo       full fine-tuning, beta 0.04 -> a frozen reference copy
    ppo        the same plus a critic (a copy of the backbone + value head, with its AdamW)
    grpo-lora  LoRA r=16 on all linear layers, beta 0.04 -> reference = the adapter disabled

``peergrade.planning.memory.measure_memory`` runs two training steps (rollout, rewards, reference,
update) in a fresh child process and reports the peak RSS *above the child's baseline* (the
process after imports and a warm-up step on a toy copy of the model; printed once per row as
"base"). ``estimate_for_config`` predicts the same peak from the config alone.

    python bench/memory.py                     # ~30M and ~150M models (the issue's table)
    python bench/memory.py --sizes 30m         # just the small one
    python bench/memory.py --allocator default # glibc's default policy (RSS keeps freed heap)

By default the child runs with MALLOC_MMAP_THRESHOLD_=131072 so that RSS follows the live
tensors (what the estimate models and CUDA's max-allocated reports); ``--allocator default``
measures what a plain process shows, which is higher by what glibc's heap keeps after the
activations are freed, and varies from run to run.

Targets: GRPO peak <= 0.6 x PPO's; LoRA <= 0.5 x full fine-tuning with a reference copy;
the estimate within 15% of the measured peak on every row.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = {
    "30m": dict(vocab=32000, hidden=512, layers=6, heads=8, kv_heads=2, inter=1408),
    "150m": dict(vocab=50000, hidden=768, layers=12, heads=12, kv_heads=4, inter=3072),
    "tiny": dict(vocab=2000, hidden=64, layers=2, heads=4, kv_heads=2, inter=256),
}
CONFIGS = {
    "grpo": [],
    "ppo": [("algo.name", "ppo")],
    "grpo-lora": [("model.lora.enabled", True)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="30m,150m", help=f"comma-separated of {', '.join(SIZES)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configs")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=4, help="group size (G)")
    ap.add_argument("--completion", type=int, default=32, help="max completion tokens")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--allocator",
        choices=["returning", "default"],
        default="returning",
        help="glibc policy in the child: returning = freed blocks >= 128 KiB go back to the OS "
        "(RSS follows live tensors); default = glibc's own (keeps freed activations in the heap)",
    )
    args = ap.parse_args()

    from peergrade.config import load_config
    from peergrade.planning.memory import GB, estimate_for_config, format_table, measure_memory

    print(f"note: {_common.load_note()}")
    print(
        "CPU, float32, AdamW; peak RSS above the child's baseline (imports + warm-up), "
        f"max over {args.steps} steps; allocator {args.allocator}; batch {args.prompts} x {args.group} completions, "
        f"{args.completion} completion tokens, beta {args.beta}"
    )
    summary = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"peergrade-bench-{size}-") as tmp:
            n = _common.build_random_qwen2(Path(tmp), SIZES[size])
            print(
                f"\n== {size}: Qwen2-shaped, {n / 1e6:.1f}M parameters, vocab {SIZES[size]['vocab']}"
            )
            base = [
                ("model.path", tmp),
                ("model.device", "cpu"),
                ("rollout.prompts_per_step", args.prompts),
                ("rollout.group_size", args.group),
                ("rollout.max_completion_length", args.completion),
                ("algo.beta", args.beta),
                ("train.threads", args.threads),
            ]
            rows, peaks = [], {}
            for name in args.configs.split(","):
                cfg = load_config(None, base + CONFIGS[name])
                t0 = time.perf_counter()
                m = measure_memory(
                    cfg,
                    steps=args.steps,
                    allocator=args.allocator,
                    env={"OMP_NUM_THREADS": str(args.threads)},
                )
                e = estimate_for_config(cfg, prompt_len=m["prompt_len"])
                rows.append((name, m, e))
                peaks[name] = m["peak"]
                print(
                    f"  {name:<10} measured {m['peak'] / GB:6.3f} GiB (base {m['baseline_bytes'] / GB:.2f})"
                    f"  estimated {e['peak'] / GB:6.3f} GiB  error "
                    f"{100 * (e['peak'] - m['peak']) / m['peak']:+5.1f}%  ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            print()
            print(format_table(rows))
            errs = [abs(e["peak"] - m["peak"]) / m["peak"] for _, m, e in rows]
            line = {"size": size, "max_err": max(errs)}
            if "grpo" in peaks and "ppo" in peaks:
                line["grpo/ppo"] = peaks["grpo"] / peaks["ppo"]
            if "grpo" in peaks and "grpo-lora" in peaks:
                line["lora/full"] = peaks["grpo-lora"] / peaks["grpo"]
            summary.append(line)
    print("\nsummary (targets: grpo/ppo <= 0.6, lora/full <= 0.5, |estimate error| <= 15%)")
    for s in summary:
        parts = [f"{s['size']:>5}"]
        if "grpo/ppo" in s:
            parts.append(f"GRPO/PPO {s['grpo/ppo']:.3f}")
        if "lora/full" in s:
            parts.append(f"LoRA/full {s['lora/full']:.3f}")
        parts.append(f"max |error| {100 * s['max_err']:.1f}%")
        print("  " + "   ".join(parts))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
