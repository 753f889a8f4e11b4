"""Before/after figures of the cheerful recipe (configs/smollm2-judge-cheerful.yaml).

    python examples/cheerful/measure.py --config configs/smollm2-judge-cheerful.yaml \
        --policy /tmp/smollm2-135m --judge /tmp/smollm2-135m --out before.json

For each prompt file (the recipe's ``data.eval_path`` and ``data.path``) the policy answers
every prompt greedily and once sampled (the config's ``rollout.temperature`` and
``max_completion_length``, seed 0, through its chat template as training encodes them), and
each reply is scored twice: by the config's judge (its ``judge`` reward's kwargs, with
``judge_model`` replaced by ``--judge``) and by the rule-based ``cheer_score`` of cheer.py,
which does not ask the judge (and its pass/fail form ``cheerful``, the run's held-out
scorer). Prints and writes the means and the replies. ``--heldout-only`` answers the held-out
prompts alone, ``--modes greedy`` the greedy answers alone; ``--per-check`` adds, for a
checklist rubric, the mean of each check asked alone (``check 1``, ``check 2``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cheer import summary  # noqa: E402


def _mean(scores) -> float:
    scored = [s for s in scores if s is not None]  # None: the judge could not score it
    return sum(scored) / len(scored) if scored else math.nan


def _per_check(make_judge, kwargs: dict, prompts: list[str], replies: list[str]) -> dict:
    """``{"check 1": mean, ...}``: each check of a checklist rubric asked alone, by a judge of
    that one check (its own examples); empty for a one-question rubric. Shows which check moves
    when the checklist's reward does."""
    rubric = kwargs.get("rubric")
    if not isinstance(rubric, list):
        return {}
    return {
        f"check {k}": _mean(make_judge(**dict(kwargs, rubric=[check]))(prompts, replies))
        for k, check in enumerate(rubric, 1)
    }


def _parse(argv) -> tuple[argparse.Namespace, set[str]]:
    """The command line and the set of modes it asks for."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--policy", required=True, help="a model directory, a run or a checkpoint")
    ap.add_argument("--judge", required=True, help="the judge model (replaces judge_model)")
    ap.add_argument("--out", required=True, help="a JSON file: figures and replies")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--heldout-only",
        action="store_true",
        help="answer only data.eval_path's prompts (a quarter of the time), not data.path's too",
    )
    ap.add_argument(
        "--per-check",
        action="store_true",
        help="with a checklist rubric, also the mean of each check asked alone (K more passes)",
    )
    ap.add_argument(
        "--modes",
        default="greedy,sampled",
        help="which answers to score, comma-separated: greedy (T = 0) and/or sampled",
    )
    args = ap.parse_args(argv)
    wanted = {m.strip() for m in args.modes.split(",") if m.strip()}
    if not wanted or wanted - {"greedy", "sampled"}:
        ap.error(f"--modes {args.modes!r}: expected greedy, sampled or greedy,sampled")
    return args, wanted


def main(argv=None) -> int:
    args, wanted = _parse(argv)

    import torch

    import peergrade.training.judge_local  # noqa: F401 - registers the judge_model loader
    from peergrade.config import load_config
    from peergrade.generation.kernel import generate
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_model_path,
    )
    from peergrade.rewards.judge import make_judge
    from peergrade.training import checkpoint as ckpt

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)  # its base: and relative paths resolved
    (item,) = [r for r in cfg.rewards if r.name == "judge"]  # the rule-based one is not asked
    kwargs = dict(item.kwargs, judge_model=args.judge, device="cpu")
    judge = make_judge(**kwargs)
    temperature = cfg.rollout.temperature
    max_new = cfg.rollout.max_completion_length

    path = ckpt.resolve_model_dir(resolve_model_path(args.policy))
    tok = prepare_tokenizer(load_tokenizer(path))
    model = load_model(path, device="cpu").eval()

    out: dict = {"policy": str(path), "judge": args.judge, "files": {}}
    modes = [(m, t) for m, t in (("greedy", 0.0), ("sampled", temperature)) if m in wanted]
    files = [Path(cfg.data.eval_path)] + ([] if args.heldout_only else [Path(cfg.data.path)])
    for f in files:
        prompts = [json.loads(x)["prompt"] for x in f.read_text().splitlines() if x.strip()]
        ids = [
            tok(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )["input_ids"]
            for p in prompts
        ]
        res = {}
        for mode, temp in modes:
            ro = generate(model, tok, ids, n=1, max_new_tokens=max_new, temperature=temp, seed=0)
            replies = list(ro.completion_text)
            scores = judge(prompts, replies)
            res[mode] = {
                "judge": _mean(scores),
                "judge_unscored": scores.count(None),
                **summary(replies),
                **(_per_check(make_judge, kwargs, prompts, replies) if args.per_check else {}),
                "replies": [
                    {"prompt": p, "reply": r, "judge": s}
                    for p, r, s in zip(prompts, replies, scores)
                ],
            }
        out["files"][str(f.name)] = res
        for mode, r in res.items():
            figures = {k: round(v, 4) for k, v in r.items() if k != "replies"}
            print(f"{f.name} {mode}: {json.dumps(figures)}", flush=True)
    out["judge_stats"] = dict(judge.stats)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
