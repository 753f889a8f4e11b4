"""Scale-out: the same global batch on 1 process vs N processes under torchrun (strong scaling).

Each side is a real ``peergrade train`` run (``python -m peergrade`` for one process,
``python -m torch.distributed.run --nproc-per-node N -m peergrade`` for N) of a Qwen2-shaped
model with random weights (~30M parameters by default, saved into a temporary directory) and a
dense reward (a character score, so every step updates the weights). The sides alternate
(1, N, N, 1, ...) so that drifts of a shared machine hit both. Figures are medians over the
timed steps (``time/step_s`` from metrics.jsonl; the first step of every run is warm-up):

    steps/s      1 / step time
    tokens/s     completion tokens generated per step (the whole global batch) / step time
    efficiency   speed-up / N (1.0 = perfect strong scaling)

    python bench/distributed.py                         # CPU: 1 vs 2 processes, 1 thread each
    python bench/distributed.py --size tiny --steps 3   # a quick look
    python bench/distributed.py --device cuda --nproc 1 # GPU: ddp with world size 1 vs plain
    python bench/distributed.py --device cuda --nproc 8 # GPU: 1 vs 8 GPUs (one node)

On one GPU (``--nproc 1``) the torchrun side is a world of one: the process group exists, every
helper short-circuits, and the overhead vs the plain run must stay within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = {
    "30m": dict(vocab=32000, hidden=512, layers=6, heads=8, kv_heads=2, inter=1408),
    "tiny": dict(vocab=2000, hidden=64, layers=2, heads=4, kv_heads=2, inter=256),
}
REWARD = """
def char_score(prompts, completions, **kwargs):
    return [(sum(ord(ch) for ch in c) % 97) / 97.0 for c in completions]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(args, model: Path, reward: Path, nproc: int, out: Path) -> dict:
    """One training run with ``nproc`` processes (0 = plain, no torchrun); its step timings."""
    flags = [
        "train",
        "--model",
        str(model),
        "--reward",
        f"{reward}:char_score",
        "--rollout.prompts_per_step",
        str(args.prompts),
        "--rollout.group_size",
        str(args.group),
        "--rollout.max_completion_length",
        str(args.completion),
        "--optim.micro_batch_size",
        str(args.micro),
        "--model.device",
        args.device,
        "--train.steps",
        str(args.steps),
        "--train.save_every",
        "0",
        "--train.eval_size",
        "1",
        "--train.eval_samples",
        "1",
        "--train.display",
        "none",
        "--train.threads",
        str(args.threads),
        "--dist.strategy",
        args.strategy,
        "--train.output_dir",
        str(out),
        "--overwrite",
    ]
    if nproc == 0:
        cmd = [sys.executable, "-m", "peergrade", *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "peergrade",
            *flags,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r][1:]  # the first step is warm-up
    N = args.prompts * args.group
    step_s = _common.median([r["time/step_s"] for r in steps])
    tokens = _common.median([r["rollout/len_mean"] * N for r in steps])
    return {"step_s": step_s, "steps_per_s": 1 / step_s, "tokens_per_s": tokens / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="30m", choices=list(SIZES))
    ap.add_argument("--nproc", type=int, default=2, help="processes of the parallel side")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--prompts", type=int, default=4, help="P (global), a multiple of --nproc")
    ap.add_argument("--group", type=int, default=4, help="G")
    ap.add_argument("--completion", type=int, default=32, help="max completion tokens")
    ap.add_argument("--micro", type=int, default=8, help="optim.micro_batch_size")
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--passes", type=int, default=2, help="alternated runs per side")
    args = ap.parse_args()
    print(_common.load_note(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_params = _common.build_random_qwen2(tmp / "model", SIZES[args.size])
        (tmp / "reward.py").write_text(REWARD)
        # --nproc 1 on a GPU: plain vs a torchrun world of one (the overhead check)
        sides = {"1 process": 0, f"{args.nproc} processes": args.nproc}
        if args.nproc == 1:
            sides = {"plain": 0, "torchrun world 1": 1}
        runs = _common.alternate(
            {
                name: (
                    lambda n=n, name=name: one_run(
                        args, tmp / "model", tmp / "reward.py", n, tmp / name.replace(" ", "_")
                    )
                )
                for name, n in sides.items()
            },
            args.passes,
        )
    base = _common.median([r["steps_per_s"] for r in runs[next(iter(sides))]])
    rows = []
    for name, n in sides.items():
        sps = _common.median([r["steps_per_s"] for r in runs[name]])
        tps = _common.median([r["tokens_per_s"] for r in runs[name]])
        speedup = sps / base
        eff = speedup / max(1, n) if args.nproc > 1 else speedup
        rows.append([name, f"{sps:.3f}", f"{tps:.0f}", f"{speedup:.2f}x", f"{eff:.2f}"])
    print(
        f"model: {n_params / 1e6:.1f}M params ({args.size}), {args.device}, {args.strategy}; "
        f"global batch {args.prompts} x {args.group}, {args.completion} tokens, micro "
        f"{args.micro}, {args.threads} thread(s) per process; medians of {args.passes} runs "
        f"x {args.steps - 1} timed steps"
    )
    print(_common.format_table(["side", "steps/s", "tokens/s", "speed-up", "efficiency"], rows))
    print(_common.load_note(), flush=True)


if __name__ == "__main__":
    main()
