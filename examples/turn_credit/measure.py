"""Held-out success of the credit modes on ``two_turns.py`` at a fixed step budget.

    OMP_NUM_THREADS=1 python examples/turn_credit/measure.py -o runs/turn-credit \
        --steps 30 --seeds 0 1 2 --modes episode returns step_groups

Each (mode, seed) trains ``config.yaml`` for ``--steps`` steps into ``OUT/<mode>-s<seed>``
and reads the final held-out evaluation (200 arithmetic rows, run as episodes: greedy and one
sampled pass; success = the first turn's answer is right). It prints one line per run and a
table of means. ``algo.turn_credit`` is set on the loaded config's ``algo`` section, so this
runs whether or not the config schema already lists the field.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_run(mode: str, seed: int, steps: int, out: Path, gamma: float, extra=()) -> dict:
    from peergrade.config import load_config
    from peergrade.training.trainer import train

    cfg = load_config(
        HERE / "config.yaml",
        [("train.seed", seed), ("train.steps", steps), ("train.display", "none"), *extra],
    )
    cfg.algo.turn_credit = mode  # the schema's field once it has one
    cfg.algo.turn_gamma = gamma
    tag = "".join(f"-{k.split('.')[-1]}{v}" for k, v in extra)
    run_dir = out / f"{mode}{tag}-s{seed}"
    t0 = time.perf_counter()
    train(cfg, run_dir, overwrite=True)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [m for m in lines if m.get("final")][-1]
    steps_logged = [m for m in lines if "reward/solved/mean" in m]
    return {
        "mode": mode,
        "seed": seed,
        "greedy": final["eval/pass@1_greedy"],
        "sampled": final["eval/pass@1_sampled"],
        "train_solved_last5": statistics.mean(m["reward/solved/mean"] for m in steps_logged[-5:]),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", type=Path, default=Path("runs/turn-credit"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=["episode", "returns", "step_groups"])
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--change", nargs="*", default=[], help="config KEY=VALUE for every run")
    args = p.parse_args()
    from peergrade.config import parse_override_value

    extra = [(kv.split("=", 1)[0], parse_override_value(kv.split("=", 1)[1])) for kv in args.change]
    results = []
    for mode in args.modes:
        for seed in args.seeds:
            r = one_run(mode, seed, args.steps, args.out, args.gamma, extra)
            print(json.dumps(r), flush=True)
            results.append(r)
    print(f"\n| turn_credit | held-out greedy (seeds {args.seeds}) | mean | sampled mean |")
    print("|---|---|---|---|")
    for mode in args.modes:
        rs = [r for r in results if r["mode"] == mode]
        g = [r["greedy"] for r in rs]
        s = [r["sampled"] for r in rs]
        print(
            f"| {mode} | {', '.join(f'{x:.3f}' for x in g)} | {statistics.mean(g):.3f} | "
            f"{statistics.mean(s):.3f} |"
        )


if __name__ == "__main__":
    main()
