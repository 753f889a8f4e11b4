"""Benchmark: 32 concurrent chat agents through the OpenAI-compatible endpoint vs the same
episodes run in-process.

Run from the repo root:  PYTHONPATH=src python bench/serve.py [--passes 3] [--threads 1]
[--processes 2] [--lengths equal|varied]

Workload (bench/multiturn.py's): 8 rows x 4 episodes = 32 episodes of 4 model turns; after each
of the first 3 turns a tool answers with a short result. A random Qwen2 (hidden 128, 4 layers,
character vocabulary, the Qwen2.5-style tool template of peergrade.model.tiny), float32,
temperature 1; every turn ends at the next position that is a multiple of 24.

- ``--lengths equal`` (default): the tool's result is the same text in every episode, so every
  turn of every episode ends at the same step and both sides sample the same number of tokens.
  No agent can work while another's reply is still sampled: the endpoint's worst case.
- ``--lengths varied``: the tool's result is padded with 0-23 dots chosen by a hash of the
  reply it answers, so from the second turn on each episode's turns end at steps of their own,
  as real turns do. The two sides draw different tokens (their episodes' keys differ), so the
  number of tokens sampled differs a little between them (the last column).

- A, "in-process": ``peergrade.generation.episodes.run_episodes`` with a native environment:
  one batched KV cache kept across turns, all 32 episodes in lock-step.
- B, "endpoint, threads": ``peergrade.serving.harness.HarnessRunner``, what ``train
  --harness`` runs with ``harness.processes: 0`` (and ``GRPOTrainer(harness=fn)`` by
  default): 32 agents, each its own thread with its own ``openai.OpenAI`` client and tool
  loop, talking HTTP to the policy's endpoint on 127.0.0.1; every request is recorded into an
  Episode in tokens; the server batches the requests queued at each moment into one
  ``generate`` call.
- C, "endpoint, N processes" (``--processes N``, N >= 1; 0 leaves it out): B with the agents
  in N worker processes (``harness.processes: N``; ``envs.harness_pool``), each running its
  share of the 32 agents on threads of its own, so their client-side CPU (the openai client,
  httpx) is off the trainer's GIL. The pool starts during the warm-up, as a run's first step.
  What ``train --harness`` runs by default (``harness.processes: auto``: min(4, CPUs) workers).

Sides alternate A B (C) / (C) B A in one process; the table shows medians of episodes/s and
the ratio of the medians, then the ratio pass by pass (each pass's sides ran back to back) and its median,
and the machine's load average. Where the endpoint's time goes: its sampling calls' seconds a
pass, and the CPU seconds a pass of the trainer's process (sampling and the server; with
threads, the agents too) and of the agents' worker processes (Linux's /proc), beside
in-process's. What it does not measure: GPU speed, memory, agents that take
time between requests.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from multiturn import EVERY, TURNS, Tool, build, tool_result  # noqa: E402

ROWS, N = 8, 4


def rows():
    return [{"a": 100 + 7 * i, "b": 30 + i} for i in range(ROWS)]


def in_process(model, tok, seed, varied=False):
    from peergrade.generation.episodes import run_episodes

    eps = run_episodes(
        model,
        tok,
        rows(),
        lambda r: Tool(varied),
        n=N,
        max_completion_length=1000,
        temperature=1.0,
        seed=seed,
    )
    assert all(e.num_turns == TURNS for e in eps), [e.finish_reason for e in eps]
    return sum(len(e.completion_ids) for e in eps), {}


from openai import DefaultHttpxClient, OpenAI  # noqa: E402

HTTP = DefaultHttpxClient()  # one pool for all agents (an OpenAI() without one costs ~60 ms)


def agent(row, base_url, model, varied=False):
    """A chat agent on the official client: its own loop and tool, as a user writes one."""
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0, http_client=HTTP)
    messages = [{"role": "user", "content": f"What is {row['a']} * {row['b']}? Use the tool."}]
    for turn in range(1, TURNS + 1):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=EVERY)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        if turn < TURNS:
            text = tool_result(turn, r.choices[0].message.content or "", varied)
            messages.append({"role": "tool", "name": "multiply", "content": text})
    return 1.0


def varied_agent(row, base_url, model):
    """``agent`` on the ``--lengths varied`` workload."""
    return agent(row, base_url, model, varied=True)


def cpu_s(pids) -> float | None:
    """User + system CPU seconds these processes have used (Linux's /proc; None elsewhere)."""
    try:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def endpoint(runner, seed, pool=None, fn=agent):
    engine = runner.engine
    calls0, jobs0, busy0 = engine.calls, engine.jobs, engine.busy_s
    pids = [w.proc.pid for w in pool.workers] if pool is not None and pool.workers else []
    cpu0, workers0 = time.process_time(), cpu_s(pids)
    res = runner.run(
        fn, rows(), n=N, max_completion_length=1000, temperature=1.0, seed=seed, pool=pool
    )
    workers1 = cpu_s(pids)
    assert all(r.error is None and r.episode.num_turns == TURNS for r in res), [
        (r.error, r.episode.num_turns) for r in res
    ]
    calls = engine.calls - calls0
    return sum(len(r.episode.completion_ids) for r in res), {
        "generate calls": calls,
        "requests per call": (engine.jobs - jobs0) / max(calls, 1),
        "sampling s": engine.busy_s - busy0,
        "trainer cpu s": time.process_time() - cpu0,  # sampling, the server (and threads' agents)
        "workers cpu s": workers1 - workers0 if pids and None not in (workers0, workers1) else None,
    }


def main() -> None:
    ap = _common.arguments(__doc__, passes=3)
    ap.add_argument(
        "--processes", type=int, default=2, help="agents in N worker processes too (0: not)"
    )
    ap.add_argument(
        "--lengths",
        choices=["equal", "varied"],
        default="equal",
        help="equal: every turn of every episode ends at the same step; varied: after the "
        "first turn each episode's turns have lengths of their own (0-23 tokens apart)",
    )
    args = ap.parse_args()
    varied = args.lengths == "varied"
    fn = varied_agent if varied else agent
    import torch

    from peergrade.envs.harness_pool import HarnessPool
    from peergrade.serving.harness import HarnessRunner

    torch.set_num_threads(args.threads)
    model, tok = build()
    runner = HarnessRunner(model, tok, "bench")
    pool = (
        HarnessPool(f"{os.path.abspath(__file__)}:{fn.__name__}", args.processes)
        if args.processes
        else None
    )
    in_process(model, tok, 0, varied)  # warm-up
    endpoint(runner, 0, None, fn)
    if pool is not None:
        endpoint(runner, 0, pool, fn)

    def side(how, arg, pool=None):
        def run():
            t0 = time.perf_counter()
            if how is endpoint:
                tokens, extra = endpoint(arg, 1, pool, fn)
            else:
                cpu0 = time.process_time()
                tokens, extra = in_process(model, tok, 1, varied)
                extra = {"cpu s": time.process_time() - cpu0}
            dt = time.perf_counter() - t0
            return {"s": dt, "episodes_per_s": ROWS * N / dt, "tokens": tokens, **extra}

        return run

    load_before = _common.load_note()
    sides = {"in-process": side(in_process, None), "endpoint, threads": side(endpoint, runner)}
    proc = f"endpoint, {args.processes} processes"
    if pool is not None:
        sides[proc] = side(endpoint, runner, pool)
    try:
        res = _common.alternate(sides, args.passes)
    finally:
        if pool is not None:
            pool.close()
        runner.close()
    med = {k: _common.median([r["episodes_per_s"] for r in v]) for k, v in res.items()}
    print(
        _common.format_table(
            ["side", "episodes/s (median)", "s per pass", "tokens after prompts"],
            [
                [k, f"{med[k]:.2f}", " ".join(f"{r['s']:.2f}" for r in v), v[0]["tokens"]]
                for k, v in res.items()
            ],
        )
    )
    for name in [k for k in res if k != "in-process"]:
        ep = res[name]
        print(
            f"{name}: {_common.median([r['generate calls'] for r in ep]):.0f} generate calls "
            f"per pass, {_common.median([r['requests per call'] for r in ep]):.1f} requests per "
            f"call, {_common.median([r['sampling s'] for r in ep]):.2f} s sampling of "
            f"{_common.median([r['s'] for r in ep]):.2f} s (in-process: one lock-step batch of "
            f"{ROWS * N})"
        )
        workers = [r["workers cpu s"] for r in ep if r["workers cpu s"] is not None]
        print(
            f"{name}: CPU per pass (medians): the trainer's process "
            f"{_common.median([r['trainer cpu s'] for r in ep]):.2f} s (sampling, the server"
            + (
                f"), the agents' worker processes {_common.median(workers):.2f} s"
                if workers
                else ", the agents)"
            )
            + f"; in-process {_common.median([r['cpu s'] for r in res['in-process']]):.2f} s"
        )
    for name in [k for k in res if k != "in-process"]:
        # also pass by pass: each pass's two sides ran back to back, so the load drifts less
        # between them than across the run
        paired = [e["s"] and i["s"] / e["s"] for e, i in zip(res[name], res["in-process"])]
        print(
            f"{name} / in-process = {med[name] / med['in-process']:.2f}x (ratio of medians); "
            f"pass by pass {' '.join(f'{x:.2f}' for x in paired)}, median "
            f"{_common.median(paired):.2f}x"
        )
    print(
        f"({ROWS * N} episodes of {TURNS} turns, turn lengths {args.lengths}, "
        f"{args.threads} thread(s)); "
        f"before: {load_before}; after: {_common.load_note()}"
    )


if __name__ == "__main__":
    main()
