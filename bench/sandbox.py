"""Benchmark: score 200 small programs (passing, failing, hostile) with ``code_tests``.

Prints, for each worker count N, the wall time, programs per second, the sandbox status counts
and the mean reward. Every program is distinct (a numbered comment) so none is deduplicated,
and every sample has one stdin/stdout case, so 200 programs = 200 sandboxed processes.

    python bench/sandbox.py --workers 1 2 4 --timeout 1.0 [--sandbox auto|root|userns]

The hostile share is dominated by programs that run until the wall-clock limit, so the figure
depends on ``--timeout`` and on how busy the machine is.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import peergrade.rewards.code as code_mod
from peergrade.rewards.code import code_tests

PASSING = [
    "print(int(input()) * 2)",
    "n = int(input())\nprint(sum(range(n + 1)) - sum(range(n + 1)) + 2 * n)",
    "import sys\nprint(2 * int(sys.stdin.read()))",
    "def f(n):\n    return n + n\nprint(f(int(input())))",
    "xs = [int(input())] * 2\nprint(sum(xs))",
]
FAILING = [
    "print(int(input()) * 3)",  # wrong answer
    "print(int(input()) +)",  # syntax error
    "raise ValueError('no')",  # exception
    "import sys\nsys.exit(2)",  # non-zero exit
]
HOSTILE = [
    "while True:\n    pass",  # infinite loop
    "import time\ntime.sleep(60)",  # sleep past the limit
    "x = bytearray(10 ** 10)",  # memory bomb
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "while True:\n    print('x' * 1000)",  # output flood
    "open('/tmp/peergrade_bench_escape', 'w').write('x')",  # write outside
    "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",  # network
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",  # kill the parent
]


def make_programs(n: int = 200) -> tuple[list[str], list[str]]:
    """n programs: 60% passing, 20% failing, 20% hostile; and their kind."""
    n_pass, n_fail = int(n * 0.6), int(n * 0.2)
    programs, kinds = [], []
    for i in range(n):
        if i < n_pass:
            pool, kind = PASSING, "passing"
        elif i < n_pass + n_fail:
            pool, kind = FAILING, "failing"
        else:
            pool, kind = HOSTILE, "hostile"
        programs.append(f"```python\n# program {i}\n{pool[i % len(pool)]}\n```")
        kinds.append(kind)
    return programs, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=1.0, help="wall-clock limit per program (s)")
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument(
        "--sandbox",
        default="auto",
        choices=["auto", "root", "userns"],  # never none: the hostile programs are real
        help="isolation mechanism: compares their cost",
    )
    args = ap.parse_args()

    programs, kinds = make_programs(args.n)
    tests = [[{"input": "21", "output": "42"}]] * len(programs)
    print(
        f"{len(programs)} programs: {dict(Counter(kinds))}, timeout {args.timeout:g} s, "
        f"sandbox {args.sandbox}"
    )
    print(f"{'workers':>7} {'wall_s':>7} {'prog/s':>7} {'reward':>7}  statuses")
    for n in args.workers:
        t0 = time.perf_counter()
        rewards = code_tests(
            None,
            programs,
            tests,
            timeout_s=args.timeout,
            memory_mb=args.memory_mb,
            workers=n,
            sandbox=args.sandbox,
        )
        wall = time.perf_counter() - t0
        statuses = Counter()
        for r in code_mod.last_report:
            statuses.update(r["statuses"])
        by_kind = {
            k: sum(r for r, kk in zip(rewards, kinds) if kk == k)
            for k in ("passing", "failing", "hostile")
        }
        assert by_kind["passing"] == kinds.count("passing"), by_kind
        assert by_kind["failing"] == 0 and by_kind["hostile"] == 0, by_kind
        mean = sum(rewards) / len(rewards)
        print(f"{n:>7} {wall:>7.2f} {len(programs) / wall:>7.1f} {mean:>7.3f}  {dict(statuses)}")


if __name__ == "__main__":
    main()
