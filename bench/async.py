"""Pipelined rollouts (``rollout.async_steps``) against the synchronous step: training steps per
second, side by side.

    python bench/async.py                                   # the CPU demo, 20 steps a side
    python bench/async.py --config configs/smollm2-add.yaml --model /tmp/smollm2-135m \
        --steps 10 --passes 2
    python bench/async.py --steps 250 --passes 1 --eval     # + held-out accuracy at the end

Each side is one ``peergrade train`` run (the trainer's own loop, in a fresh process: its
memory and threads are its own) of ``--steps`` steps from the same start, run A B C D, D C B A,
... (``--passes``) so that drifts of a shared machine hit every side:

    sync@1   rollout.async_steps 0, 1 torch thread  (one core: the fair per-core baseline)
    sync@2   rollout.async_steps 0, 2 torch threads (every op on both cores)
    k=1      rollout.async_steps 1, train.threads 2: the trainer and the producer 1 thread each
             (the producer a forked process: rollout.producer auto on Linux's CPU)
    k=2      rollout.async_steps 2, the same threads
    k=1/thread  k=1 with rollout.producer thread (the producer a thread of the trainer's
             process, as on a GPU: the two share Python's GIL)

steps/s is measured over the steps after the first ``--warmup`` (the pipeline's first step has
nothing to overlap with, and AdamW allocates its state then): (steps - warmup) / the sum of
their ``time/step_s``. Also the medians per step of generation (``time/generate_s``, in the
producer when pipelined), update (``time/update_s``) and the trainer's wait for the producer
(``time/wait_s``), and the peak RSS of the trainer's process and of its producer process
(each counts the pages they share). With ``--eval`` each run ends with the held-out evaluation of the config
(greedy and sampled pass@1); without it the held-out split is cut to one problem.

The targets (issue 22): the demo k=1 at least 1.3x sync per step at equal accuracy, SmolLM2 k=1
at least 1.5x. The ratio printed is against sync@1 and sync@2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SIDES = {
    "sync@1": [("rollout.async_steps", 0), ("train.threads", 1)],
    "sync@2": [("rollout.async_steps", 0), ("train.threads", 2)],
    "k=1": [("rollout.async_steps", 1), ("train.threads", 2)],
    "k=2": [("rollout.async_steps", 2), ("train.threads", 2)],
    "k=1/thread": [
        ("rollout.async_steps", 1),
        ("train.threads", 2),
        ("rollout.producer", "thread"),
    ],
}


def child(a) -> None:
    """One side: a training run; prints its per-step timings (and accuracy) as JSON."""
    from peergrade.config import load_config
    from peergrade.training import trainer

    overrides = json.loads(a.overrides)
    cfg = load_config(a.config or None, [tuple(o) for o in overrides])
    with tempfile.TemporaryDirectory() as tmp:
        summary = trainer.train(cfg, Path(tmp) / "run")
        lines = [
            json.loads(x)
            for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
            if x.strip()
        ]
    steps = [m for m in lines if "time/step_s" in m]
    timed = steps[a.warmup :]

    def med(key):
        return _common.median([m.get(key, 0.0) for m in timed])

    out = {
        "steps_per_s": len(timed) / sum(m["time/step_s"] for m in timed),
        "generate_s": med("time/generate_s"),
        "update_s": med("time/update_s"),
        "wait_s": med("time/wait_s"),
        "staleness_max": max((m.get("async/staleness_max", 0) for m in steps), default=0),
        "reward": sum(m["reward/accuracy"] for m in steps) / len(steps),
        # peak RSS (GB) of this process (the trainer) and of its largest finished child (a
        # producer process; 0 with a thread): shared pages count in both
        "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "producer_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
    }
    after = summary.get("eval_after") or {}
    out.update({k: v for k, v in after.items() if k.startswith("pass@1")})
    _common.emit(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="recipe file ('' = the CPU demo)")
    ap.add_argument("--model", default=None, help="model dir (overrides model.path)")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset")
    ap.add_argument("--eval", action="store_true", help="held-out accuracy at the end")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.steps <= a.warmup:
        ap.error(f"--steps ({a.steps}) must be more than --warmup ({a.warmup})")

    common = [
        ("train.steps", a.steps),
        ("train.seed", a.seed),
        ("train.eval_every", 0),
        ("train.save_every", 0),
        ("train.display", "none"),
        ("train.audit_rewards", "off"),
    ]
    if a.model:
        common.append(("model.path", a.model))
    if not a.eval:
        common += [("train.eval_size", 1), ("train.eval_samples", 1)]
    names = [s for s in a.sides.split(",") if s]
    for s in names:
        if s not in SIDES:
            ap.error(f"--sides: unknown side {s!r}; choose from {', '.join(SIDES)}")

    def side(name):
        over = json.dumps(common + SIDES[name])
        argv = [__file__, "--child", "--config", a.config, "--warmup", str(a.warmup)]
        env = {"OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT / "src")}

        def one():
            r = _common.run_child([*argv, "--overrides", over], env=env)
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
            print(f"  {name}: {shown}  ({_common.load_note()})", flush=True)
            return r

        return one

    print(f"config: {a.config or 'the CPU demo'}  model: {a.model or '(config)'}")
    print(f"{a.steps} steps a run, {a.warmup} not timed, {a.passes} passes, seed {a.seed}")
    print("before: " + _common.load_note(), flush=True)
    t0 = time.perf_counter()
    results = _common.alternate({n: side(n) for n in names}, a.passes)
    print("after:  " + _common.load_note())
    print(f"({time.perf_counter() - t0:.0f} s)\n")

    med = {n: {k: _common.median([r[k] for r in rs]) for k in rs[0]} for n, rs in results.items()}
    base1, base2 = med.get("sync@1"), med.get("sync@2")
    rows = []
    for n in names:
        m = med[n]
        rows.append(
            [
                n,
                f"{m['steps_per_s']:.3f}",
                f"{m['steps_per_s'] / base1['steps_per_s']:.2f}x" if base1 else "-",
                f"{m['steps_per_s'] / base2['steps_per_s']:.2f}x" if base2 else "-",
                f"{m['generate_s']:.3f}",
                f"{m['update_s']:.3f}",
                f"{m['wait_s']:.3f}",
                int(m["staleness_max"]),
                f"{m['reward']:.3f}",
                f"{m['rss_gb']:.2f}",
                f"{m['producer_rss_gb']:.2f}",
                *(
                    [f"{m.get('pass@1_greedy', 0):.3f}", f"{m.get('pass@1_sampled', 0):.3f}"]
                    if a.eval
                    else []
                ),
            ]
        )
    headers = [
        "side",
        "steps/s",
        "vs sync@1",
        "vs sync@2",
        "generate s",
        "update s",
        "wait s",
        "stale max",
        "train acc",
        "RSS GB",
        "producer RSS GB",
    ]
    if a.eval:
        headers += ["greedy", "sampled"]
    print(_common.format_table(headers, rows))
    print(
        "\nthreads: sync@1 = 1 torch thread; sync@2 = 2; k=1 / k=2 = the trainer 1 + the "
        "producer 1 (a forked process; k=1/thread: a thread). Medians over passes; per-step "
        "columns are medians over the timed steps; train acc = mean reward/accuracy of all steps."
    )


if __name__ == "__main__":
    main()
