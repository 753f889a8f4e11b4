"""Benchmark: the endpoint's kept KV caches (``generation.sessions``) on agents in lock-step,
with the last call's batched cache going on vs written back and gathered at every call.

Run from the repo root:  PYTHONPATH=src python bench/sessions.py [--passes 5] [--threads 1]

Workload: bench/multiturn.py's model (a random Qwen2, hidden 128, 4 layers; every turn ends at
a multiple of 24 tokens), 32 episodes (8 prompts x 4), 4 calls of one turn each, a 20-odd token
delta fed after each turn, as 32 agents that each send their next turn would. No HTTP: each
side is ``Sessions.run`` alone. A, "kept": a call that answers the same episodes as the last one
goes on in its cache (the default); B, "written back": every call writes its rows back and the
next gathers them again (the code before the kept cache). Sides alternate A B / B A; the table
shows the medians of the seconds for the 4 calls and their ratio, and both sides' tokens are
checked equal. What it does not measure: calls over different episodes (both sides write back
then), the server, the agents.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from multiturn import build  # noqa: E402


def main() -> None:
    ap = _common.arguments(__doc__, passes=5)
    args = ap.parse_args()
    import torch

    from peergrade.generation.server import Job, default_eos_ids
    from peergrade.generation.sessions import Sessions

    torch.set_num_threads(args.threads)
    model, tok = build()
    eos = default_eos_ids(model, tok)
    prompts = [
        tok(f"What is {100 + 7 * i} * {30 + i}? Use the tool.")["input_ids"] for i in range(8)
    ]
    delta = tok("\n<tool>result 12345</tool>\nassistant:")["input_ids"]
    tokens = {}

    def side(name, keep):
        def run():
            s = Sessions(model, tok, eos, 10**5)
            if not keep:
                s._reusable = lambda jobs: False
            jobs = [Job(prompts[i // 4], 24, session=f"e{i}", key=i) for i in range(32)]
            t0, out = time.perf_counter(), []
            for turn in range(4):
                got = s.run(jobs)
                out.append([g[0] for g in got])
                jobs = [
                    Job(j.prompt_ids + g[0] + delta, 24, session=j.session, key=j.key + 100 * turn)
                    for j, g in zip(jobs, got)
                ]
            tokens[name] = out
            return {"s": time.perf_counter() - t0}

        return run

    sides = {"kept": side("kept", True), "written back": side("back", False)}
    for run in sides.values():
        run()  # warm-up
    load_before = _common.load_note()
    res = _common.alternate(sides, args.passes)
    assert tokens["kept"] == tokens["back"], "the two sides sampled different tokens"
    med = _common.seconds_table(res, "s for 4 calls", 3)
    print(f"kept / written back = {med['kept'] / med['written back']:.2f}x the time (same tokens)")
    print(f"({args.threads} thread(s)); before: {load_before}; after: {_common.load_note()}")


if __name__ == "__main__":
    main()
