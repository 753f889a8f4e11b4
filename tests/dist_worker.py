"""A training driver for the distributed tests: runs ``trainer.train`` for each run in a JSON
spec, in one plain process or under torchrun (the same script either way).

With ``"fixed_rollouts": true`` the sampler is replaced by one that samples each prompt on its
own (keyed by its GLOBAL index, as the real sampler keys it), so 1 x P and N x P/N draw the same
completions even where the forward's float rounding at other batch shapes could flip a draw of
the real sampler. With ``"record": DIR`` the real sampler runs and each rank appends every completion
it sampled to ``DIR/<run name>.rank<r>.jsonl`` (step, prompt key, sample index, tokens).
Not collected by pytest (no test_ prefix); run as ``python tests/dist_worker.py SPEC.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from peergrade import distributed as dist
from peergrade.config import load_config
from peergrade.generation.kernel import Rollout, generate
from peergrade.seeds import step_seed
from peergrade.training import trainer


def per_prompt_sample(run, rows, step, row_keys):
    r = run.cfg.rollout
    parts = []
    with dist.full_weights(run.models.policy) as policy:
        for key, ids in zip(row_keys, run.encode(rows)):
            parts.append(
                generate(
                    policy,
                    run.models.tokenizer,
                    [ids],
                    n=r.group_size,
                    max_new_tokens=r.max_completion_length,
                    temperature=r.temperature,
                    stop=r.stop,
                    seed=step_seed(run.cfg.train.seed, step),
                    row_keys=[key],
                )
            )
    out = Rollout.concat(parts, run.models.tokenizer.pad_token_id)
    out.prompts = [row["prompt"] for row in rows for _ in range(r.group_size)]
    return out


def recording(sample, path: Path):
    """``sample`` that also appends each completion it returns to ``path`` as a JSON line."""

    def wrapped(run, rows, step, row_keys):
        rollout = sample(run, rows, step, row_keys)
        n = run.cfg.rollout.group_size
        with path.open("a", encoding="utf-8") as f:
            for i, tokens in enumerate(rollout.completion_id_lists()):
                rec = {"step": step, "key": row_keys[i // n], "sample": i % n, "tokens": tokens}
                f.write(json.dumps(rec) + "\n")
        return rollout

    return wrapped


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    real_sample = trainer.sample
    if spec.get("fixed_rollouts"):
        real_sample = trainer.sample = per_prompt_sample
    for run in spec["runs"]:
        if spec.get("record"):
            # the process group starts inside train(): torchrun's RANK names the rank now
            name = f"{Path(run['dir']).name}.rank{os.environ.get('RANK', '0')}.jsonl"
            trainer.sample = recording(real_sample, Path(spec["record"]) / name)
        cfg = load_config(run.get("config"), [tuple(kv) for kv in run["overrides"]])
        trainer.train(cfg, run["dir"], resume=run.get("resume", False))
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
