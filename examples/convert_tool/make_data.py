"""Rows for the convert example (docs/environments.md, 'Your tools on your model'): 60 held-out
questions (eval.jsonl), 200 warm-up rows with their call and answer (warmup.jsonl), the rest
for GRPO (train.jsonl), written next to this file."""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_tool import TO_M, convert  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(0)
units = list(TO_M)


def row():
    while True:
        a, b = rng.sample(units, 2)
        if 0.01 <= TO_M[a] / TO_M[b] <= 200:
            break
    v = rng.choice([rng.randint(2, 99), round(rng.uniform(1, 50), 1)])
    return {
        "prompt": f"How many {b} is {v} {a}?",
        "answer": convert(v, a, b),
        "call": {"name": "convert", "arguments": {"value": v, "from_unit": a, "to_unit": b}},
    }


rows = [row() for _ in range(600)]
seen: set = set()
uniq = []
for r in rows:
    if r["prompt"] not in seen:
        seen.add(r["prompt"])
        uniq.append(r)
ev, tr = uniq[:60], uniq[60:]
with open(os.path.join(HERE, "warmup.jsonl"), "w") as f:
    for r in tr[:200]:
        f.write(
            json.dumps(
                {
                    **r,
                    "answer": f"{r['call']['arguments']['value']} {r['call']['arguments']['from_unit']} is {r['answer']} {r['call']['arguments']['to_unit']}.",
                }
            )
            + "\n"
        )
for name, rs in (("train.jsonl", tr[200:]), ("eval.jsonl", ev)):
    with open(os.path.join(HERE, name), "w") as f:
        for r in rs:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n")
print(len(tr), len(ev))
