"""Before/after figures of the cheerful recipe (configs/smollm2-judge-cheerful.yaml).

    python examples/cheerful/measure.py --config configs/smollm2-judge-cheerful.yaml \
        --policy /tmp/smollm2-135m --judge /tmp/smollm2-135m --out before.json

For each prompt file (the recipe's ``data.eval_path`` and ``data.path``) the policy answers
every prompt greedily and once sampled (the config's ``rollout.temperature`` and
``max_completion_length``, seed 0, through its chat template as training encodes them), and
each reply is scored twice: by the config's judge (its ``judge`` reward's kwargs, with
``judge_model`` replaced by ``--judge``) and by the rule-based ``cheer_score`` of cheer.py,
which does not ask the judge (and its pass/fail form ``cheerful``, the run's held-out
scorer). Prints and writes the means and the replies.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--policy", required=True, help="a model directory, a run or a checkpoint")
    ap.add_argument("--judge", required=True, help="the judge model (replaces judge_model)")
    ap.add_argument("--out", required=True, help="a JSON file: figures and replies")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

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
    for f in (Path(cfg.data.eval_path), Path(cfg.data.path)):
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
        for mode, temp in (("greedy", 0.0), ("sampled", temperature)):
            ro = generate(model, tok, ids, n=1, max_new_tokens=max_new, temperature=temp, seed=0)
            replies = list(ro.completion_text)
            scores = judge(prompts, replies)
            scored = [s for s in scores if s is not None]  # None: the judge could not score it
            res[mode] = {
                "judge": sum(scored) / len(scored) if scored else math.nan,
                "judge_unscored": len(scores) - len(scored),
                **summary(replies),
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
