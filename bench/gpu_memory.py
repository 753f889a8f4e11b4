"""GPU peak memory on a Qwen2.5-0.5B-shaped model in bf16, in one call: GRPO vs PPO vs
GRPO+LoRA, and GRPO with the reference offloaded to host memory (``model.ref_offload``).

The model is Qwen2.5-0.5B's shape (vocab 151936, hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings) with random weights, saved with save_pretrained into a
temporary directory with a character tokenizer padded to the vocabulary (nothing downloaded).
Each configuration runs two training steps in a fresh child process
(``peergrade.planning.memory.measure_memory``); the measure is ``torch.cuda.max_memory_allocated`` per
phase, above what was allocated before loading (the CUDA context is not included), next to
``estimate_for_config``'s estimate.

    python bench/gpu_memory.py                 # on the device machine: one prepared call
    python bench/gpu_memory.py --cpu-dry-run   # the same code path on CPU at a toy size

Defaults: 8 prompts x 8 completions, 256 completion tokens, micro-batch 16, beta 0.04,
bf16 weights and AdamW state, gradient checkpointing on (the GPU default).
Targets: GRPO <= 0.6 x PPO; LoRA <= 0.5 x full fine-tuning with a reference copy; the
estimate within 15% of the measurement.
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

QWEN25_05B = dict(
    vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, inter=4864, max_pos=32768
)
TOY = dict(vocab=3000, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_pos=2048)
CONFIGS = {
    "grpo": [],
    "ppo": [("algo.name", "ppo")],
    "grpo-lora": [("model.lora.enabled", True)],
    "grpo-refoff": [("model.ref_offload", True)],  # reference in host memory between its passes
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the same code on CPU at a toy size (checks the script, measures nothing useful)",
    )
    args = ap.parse_args()

    import torch

    if args.cpu_dry_run:
        device, dtype_name, shape = "cpu", "float32", TOY
        args.prompts, args.group, args.completion, args.micro = 2, 2, 8, 4
    else:
        if not torch.cuda.is_available():
            print(
                "bench/gpu_memory.py needs a CUDA GPU: torch.cuda.is_available() is False on this "
                "machine. Run it on the device machine, or use --cpu-dry-run to check the script "
                "(CPU peak memory: bench/memory.py).",
                file=sys.stderr,
            )
            return 2
        device, dtype_name, shape = "cuda", "bfloat16", QWEN25_05B

    from peergrade.config import load_config
    from peergrade.planning.memory import estimate_for_config, format_table, measure_memory

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows, peaks = [], {}
    with tempfile.TemporaryDirectory(prefix="peergrade-gpu-bench-") as tmp:
        t0 = time.perf_counter()
        n = _common.build_random_qwen2(Path(tmp), shape, dtype, rope_theta=1_000_000.0)
        print(
            f"model: Qwen2.5-0.5B-shaped ({n / 1e6:.0f}M parameters, vocab {shape['vocab']}), "
            f"{dtype_name}, random weights (built in {time.perf_counter() - t0:.0f} s); batch "
            f"{args.prompts} x {args.group}, {args.completion} completion tokens, micro-batch "
            f"{args.micro}, beta {args.beta}",
            flush=True,
        )
        base = [
            ("model.path", tmp),
            ("model.device", device),
            ("model.dtype", dtype_name),
            ("rollout.prompts_per_step", args.prompts),
            ("rollout.group_size", args.group),
            ("rollout.max_completion_length", args.completion),
            ("optim.micro_batch_size", args.micro),
            ("algo.beta", args.beta),
        ]
        for name in args.configs.split(","):
            cfg = load_config(None, base + CONFIGS[name])
            t0 = time.perf_counter()
            try:
                m = measure_memory(cfg, steps=2)
            except RuntimeError as e:
                print(f"  {name}: measurement failed: {str(e)[-1500:]}", flush=True)
                continue
            e = estimate_for_config(cfg, prompt_len=m["prompt_len"], device=device)
            rows.append((name, m, e))
            peaks[name] = m["peak"]
            print(
                f"  {name:<11} measured {m['peak'] / 2**30:7.3f} GiB  estimated "
                f"{e['peak'] / 2**30:7.3f} GiB  error {100 * (e['peak'] - m['peak']) / m['peak']:+5.1f}%"
                f"  (seq {m['seq_len']}, {time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    if not rows:
        return 1
    print()
    print(format_table(rows))
    unit = "torch.cuda.max_memory_allocated" if device == "cuda" else "peak RSS"
    print(f"(MiB; measured = {unit} above the baseline, max over 2 steps)")
    if "grpo" in peaks and "ppo" in peaks:
        print(f"GRPO / PPO peak: {peaks['grpo'] / peaks['ppo']:.3f}   (target <= 0.6)")
    if "grpo" in peaks and "grpo-lora" in peaks:
        print(f"LoRA / full peak: {peaks['grpo-lora'] / peaks['grpo']:.3f}   (target <= 0.5)")
    if "grpo" in peaks and "grpo-refoff" in peaks:
        print(f"reference offloaded / resident peak: {peaks['grpo-refoff'] / peaks['grpo']:.3f}")
    errs = [abs(e["peak"] - m["peak"]) / m["peak"] for _, m, e in rows]
    print(f"max |estimate error|: {100 * max(errs):.1f}%   (target <= 15%)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
