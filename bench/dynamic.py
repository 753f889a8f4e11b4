"""Dynamic sampling (``rollout.dynamic_sampling``) against the plain synchronous step: the same
recipe trained with and without it, side by side.

    python bench/dynamic.py                                   # the CPU demo, 250 steps
    python bench/dynamic.py --steps 5 --threads 1 --eval-size 32     # a smoke run
    python bench/dynamic.py --config configs/smollm2-add.yaml --set model.path=models/smollm2-135m \
        --seeds 0 1 --eval-every 10                           # issue 22's target

Each side is a whole training run (``trainer.train`` in a fresh process, evaluation before and
after), run A B, B A, ... (``--passes`` times per seed, alternating, so that slow drifts of a
shared machine hit both sides):

    A  the recipe as written (``--set`` overrides applied to both sides)
    B  the same with ``rollout.dynamic_sampling: true`` (``--max-rounds``; ``--set-b`` overrides
       for B alone, e.g. ``--set-b rollout.async_steps=1 --set-b train.threads=2``: dynamic
       sampling with pipelined rollouts, the producer process running the rounds)

Printed per side (medians over passes; one row per seed): training wall time
(``peergrade.monitoring.report.step_train_seconds``: a synchronous step's phases; a pipelined step's wall
time; evaluations excluded), held-out pass@1 greedy and sampled after the last step,
completions generated per informative group (every completion sampled, divided by the groups
whose rewards differed -- over the whole run: the plain step counts its zero-spread groups
as generated for nothing), the rounds per step and the groups left unfilled. With
``--eval-every K`` it also prints when B first reached A's final greedy accuracy (its training
time up to that evaluation, as a fraction of A's), issue 22's "the synchronous recipe's
accuracy in at most 0.7x its wall time".

Nothing here is timed inside the trainer that a user would not see in metrics.jsonl.

``--rounds-only`` times just the sampling of dynamic steps, ``rollout.rounds_ahead`` off
(one round per batch) against on (the extra rounds a step needs as one batch), in one process
with one model: for each of ``--steps`` steps both sides collect the same step (``trainer.collect``,
sampling and scoring every round, no update), alternating which goes first, and it prints the
median generation time per step, rounds, batches, and the ratio:

    python bench/dynamic.py --rounds-only --config configs/smollm2-add.yaml \
        --set model.path=models/smollm2-135m --steps 8 --max-rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def child(spec: dict) -> None:
    """One training run; prints its figures as JSON (the last stdout line)."""
    import yaml

    from peergrade.config import load_config
    from peergrade.monitoring.report import step_train_seconds
    from peergrade.training.trainer import train

    overrides = [(k, yaml.safe_load(v)) for k, v in spec["overrides"]]
    cfg = load_config(spec["config"] or None, overrides)
    summary = train(cfg, spec["dir"], overwrite=True)
    rows = [json.loads(line) for line in (Path(spec["dir"]) / "metrics.jsonl").open()]
    steps = [r for r in rows if "loss/policy" in r]
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    completions = informative = 0.0
    clock, reached = 0.0, []  # training time so far; (time, greedy) at each evaluation
    for r in rows:
        if "loss/policy" in r:
            clock += step_train_seconds(r)
            if "dynamic/sampled_groups" in r:
                completions += r["dynamic/sampled_groups"] * G
                kept = P - r["dynamic/unfilled_groups"]
                informative += kept
            else:
                completions += P * G
                informative += P * (1 - r["rollout/frac_zero_std_groups"])
        if "eval/pass@1_greedy" in r and not r.get("final"):
            reached.append((clock, r["eval/pass@1_greedy"]))
    after = summary.get("eval_after", {})
    reached.append((clock, after.get("pass@1_greedy", float("nan"))))
    _common.emit(
        {
            "train_s": clock,
            "greedy": after.get("pass@1_greedy", float("nan")),
            "sampled": after.get("pass@1_sampled", float("nan")),
            "completions_per_informative": completions / informative if informative else None,
            "rounds": sum(r.get("dynamic/rounds", 1.0) for r in steps) / len(steps),
            "unfilled": sum(r.get("dynamic/unfilled_groups", 0.0) for r in steps),
            "reached": reached,
        }
    )


def rounds_only(a, overrides: list) -> None:
    """rollout.rounds_ahead off vs on: the generation time of the same dynamic steps."""
    import yaml

    from peergrade.config import load_config
    from peergrade.training import trainer

    base = [(k, yaml.safe_load(v)) for k, v in overrides]
    base += [("rollout.dynamic_sampling", True), ("rollout.max_rounds", a.max_rounds)]
    cfg = {
        on: load_config(a.config or None, [*base, ("rollout.rounds_ahead", on)])
        for on in (False, True)
    }
    run = trainer.setup(cfg[False])
    P = cfg[False].rollout.prompts_per_step
    stream = run.task.train_rows(cfg[False].train.seed)
    res = {False: [], True: []}
    print(_common.load_note())
    for step in range(1, (a.steps or 8) + 1):
        rows = [next(stream) for _ in range(P)]
        for on in (False, True) if step % 2 else (True, False):
            run.cfg = cfg[on]
            run.informative_seen = True  # a short step is padded, not fatal
            exp = trainer.collect(run, step, rows)
            d = exp.sampled.dynamic
            res[on].append(
                (exp.seconds["generate"], d["dynamic/rounds"], d["dynamic/sampling_calls"])
            )
    rows_out = []
    for on in (False, True):
        rows_out.append(
            [
                f"rounds_ahead {str(on).lower()}",
                f"{_common.median([g for g, _, _ in res[on]]):.2f}",
                f"{sum(r for _, r, _ in res[on]) / len(res[on]):.2f}",
                f"{sum(c for _, _, c in res[on]) / len(res[on]):.2f}",
            ]
        )
    print(_common.format_table(["side", "generate s/step (median)", "rounds", "batches"], rows_out))
    ratio = _common.median([g for g, _, _ in res[True]]) / _common.median(
        [g for g, _, _ in res[False]]
    )
    print(f"rounds_ahead on / off, generation time per step: {ratio:.2f}")
    print(_common.load_note())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="recipe file ('' = the CPU demo's defaults)")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed values")
    ap.add_argument("--passes", type=int, default=1, help="runs per side and seed, alternating")
    ap.add_argument("--max-rounds", type=int, default=4, help="rollout.max_rounds of side B")
    ap.add_argument("--threads", type=int, default=0, help="train.threads (0 = the recipe's)")
    ap.add_argument("--eval-size", type=int, default=None, help="train.eval_size")
    ap.add_argument("--eval-every", type=int, default=0, help="train.eval_every (0 = none)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="both sides (YAML value)"
    )
    ap.add_argument(
        "--rounds-only",
        action="store_true",
        help="time only the sampling of dynamic steps, rollout.rounds_ahead off vs on",
    )
    ap.add_argument(
        "--set-b",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="side B only, after --set (e.g. rollout.async_steps=1 train.threads=2: pipelined)",
    )
    a = ap.parse_args()
    common = [kv.split("=", 1) for kv in a.set]
    common += [["train.display", "none"], ["train.eval_every", str(a.eval_every)]]
    if a.steps is not None:
        common.append(["train.steps", str(a.steps)])
    if a.threads:
        common.append(["train.threads", str(a.threads)])
    if a.eval_size is not None:
        common.append(["train.eval_size", str(a.eval_size)])
    if a.rounds_only:
        rounds_only(a, [c for c in common if c[0] != "train.steps"])
        return
    sides = {
        "A plain": [],
        "B dynamic": [
            ["rollout.dynamic_sampling", "true"],
            ["rollout.max_rounds", str(a.max_rounds)],
            *(kv.split("=", 1) for kv in a.set_b),
        ],
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-dynamic-"))
    print(_common.load_note())
    results = {}
    for seed in a.seeds:

        def side(name: str, seed=seed):
            spec = {
                "config": a.config,
                "dir": str(tmp / f"{name.split()[0]}-{seed}"),
                "overrides": [*common, ["train.seed", str(seed)], *sides[name]],
            }
            return lambda: _common.run_child([__file__, "--child", json.dumps(spec)])

        results[seed] = _common.alternate({n: side(n) for n in sides}, a.passes)
    headers = [
        "side",
        "seed",
        "train s",
        "greedy",
        "sampled",
        "compl/informative",
        "rounds",
        "unfilled",
    ]
    rows = []
    for seed, res in results.items():
        for name, runs in res.items():
            med = {
                k: _common.median([r[k] for r in runs])
                for k in ("train_s", "greedy", "sampled", "rounds")
            }
            cpi = [
                r["completions_per_informative"] for r in runs if r["completions_per_informative"]
            ]
            rows.append(
                [
                    name,
                    seed,
                    f"{med['train_s']:.1f}",
                    f"{med['greedy']:.3f}",
                    f"{med['sampled']:.3f}",
                    f"{_common.median(cpi):.1f}" if cpi else "-",
                    f"{med['rounds']:.2f}",
                    f"{_common.median([r['unfilled'] for r in runs]):.0f}",
                ]
            )
    print(_common.format_table(headers, rows))
    for seed, res in results.items():
        base, dyn = res["A plain"][0], res["B dynamic"][0]
        ratio = _common.median([d["train_s"] for d in res["B dynamic"]]) / _common.median(
            [b["train_s"] for b in res["A plain"]]
        )
        line = f"seed {seed}: B's training time / A's = {ratio:.2f}"
        if a.eval_every:
            hit = next((t for t, acc in dyn["reached"] if acc >= base["greedy"]), None)
            line += (
                f"; B reached A's final greedy {base['greedy']:.3f} after {hit / base['train_s']:.2f}x "
                "A's training time"
                if hit is not None
                else f"; B never reached A's final greedy {base['greedy']:.3f}"
            )
        print(line)
    print(f"run directories: {tmp}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
