"""Load test: 64 concurrent chat clients on ``peergrade serve``, with and without bad clients.

Run from the repo root:  OMP_NUM_THREADS=1 PYTHONPATH=src python bench/serve_load.py
[--passes 3] [--clients 64] [--requests 2] [--kv-memory-gb 0.125]

One server process (``peergrade serve --model bundled:tiny-calc``, 1 torch thread, loopback
only, bodies up to 1 MiB, admission control within ``--kv-memory-gb``: the server's own
``--kv-memory-gb``, the memory sampling may take beside the model), driven from this process
by asyncio + httpx. Two loads alternate A B A B ... on the same server:

- A, "clean": ``--clients`` clients at once, each sending ``--requests`` chat requests one after
  the other, of mixed lengths: prompts padded with 0 to 360 characters, ``max_tokens`` 8 to
  96, every other request streamed, temperature 1.
- B, "with bad clients": A's clients plus, at the same time, 10 that open a stream asking for
  400 tokens and disconnect after its second chunk, and 5 oversized requests: 2 bodies of
  2 MiB (past the 1 MiB limit: a 413) and 3 asking for n=64 x 400 tokens after a 300-character
  prompt (past the admission budget: a 400 at once).

It reports, per load, the median over passes of the normal requests' p50 and p95 latency (the
whole reply, or the whole stream), the ratio of B's p95 to A's (target: within 2x), whether
every normal request completed (HTTP 200, a finish_reason, a streamed ``[DONE]``), the count
of each status (5xx: target 0), the server's resident memory when idle after the warm-up and
its peak (``VmHWM``, reset before each pass) against the admission budget in bytes
(``max_batch_tokens`` x the KV cache bytes per slot: the bound the server plans its batches
by, counting the KV cache, the sampler's buffers and the prefill's activations), and the load
average before and after. Exit status 1 when a target is missed.

What it does not measure: GPU serving, training episodes (``/v1/episodes``), keep-alive
behaviour across runs, bigger models (the tiny model's KV cache is small next to Python's
own memory, so the peak is mostly the interpreter and torch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

MODEL = "bundled:tiny-calc"
BODY_LIMIT_MB = 1
DISCONNECTORS, BIG_BODIES, TOO_MANY_TOKENS = 10, 2, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, kv_memory_gb: float, log_path: str) -> subprocess.Popen:
    """``peergrade serve`` on 127.0.0.1:``port``; returns once ``/v1/models`` answers."""
    import httpx

    cmd = [
        sys.executable,
        "-m",
        "peergrade",
        "serve",
        "--model",
        MODEL,
        "--name",
        "calc",
        "--port",
        str(port),
        "--threads",
        "1",
        "--kv-memory-gb",
        str(kv_memory_gb),
        "--max-body-mb",
        str(BODY_LIMIT_MB),
    ]
    log = open(log_path, "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not answer within 180 s; see {log_path}")


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of ``pid`` in KiB (Linux's /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def reset_peak(pid: int) -> None:
    """Start ``pid``'s VmHWM again from its resident memory now (Linux's clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def admission(log_path: str) -> tuple[int, int]:
    """(KV cache token slots per batch, bytes per slot) from the server's start-up line."""
    with open(log_path) as f:
        m = re.search(r"at most (\d+) KV cache token slots per batch \((\d+) bytes each", f.read())
    if m is None:
        raise SystemExit(f"no admission line in {log_path}")
    return int(m.group(1)), int(m.group(2))


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


# ----------------------------------------------------------------------------- the clients


def chat_body(i: int, r: int, stream: bool, max_tokens: int, pad: int) -> dict:
    a, b = 100 + 37 * i + r, 10 + 7 * i
    note = ("context " * (pad // 8))[:pad]
    content = f"{note}What is {a} + {b}?" if pad else f"What is {a} + {b}?"
    return {
        "model": "calc",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "stream": stream,
    }


async def one_request(http, url: str, body: dict, statuses: list) -> dict:
    """A whole chat reply (streamed or not): its status, latency and whether it completed."""
    t0 = time.perf_counter()
    if not body["stream"]:
        r = await http.post(url, json=body)
        statuses.append(r.status_code)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
        return {"s": time.perf_counter() - t0, "ok": ok}
    done = finish = False
    async with http.stream("POST", url, json=body) as r:
        statuses.append(r.status_code)
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                finish = finish or any(c.get("finish_reason") for c in chunk.get("choices", []))
    return {"s": time.perf_counter() - t0, "ok": r.status_code == 200 and done and finish}


async def normal_client(http, url: str, i: int, requests: int, statuses: list) -> list[dict]:
    out = []
    for r in range(requests):
        k = i + r
        body = chat_body(
            i, r, stream=k % 2 == 1, max_tokens=(8, 24, 48, 96)[k % 4], pad=(k * 45) % 400
        )
        out.append(await one_request(http, url, body, statuses))
    return out


async def disconnector(url: str, i: int, statuses: list) -> bool:
    """A stream asking for 400 tokens, dropped after its second chunk; True if it got there."""
    import httpx

    await asyncio.sleep(0.05 * i)  # spread over the clean clients' first batches
    body = chat_body(1000 + i, 0, stream=True, max_tokens=400, pad=0)
    seen = 0
    own = httpx.AsyncClient(timeout=120)  # its own connection, closed on leaving
    async with own, own.stream("POST", url, json=body) as r:
        statuses.append(r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= 2:
                    break
    return seen >= 2


async def oversized(http, url: str, i: int, statuses: list) -> int:
    if i < BIG_BODIES:
        pad = "x" * (2 * 2**20)
        body = {"model": "calc", "messages": [{"role": "user", "content": pad}]}
    else:
        body = chat_body(2000 + i, 0, stream=False, max_tokens=400, pad=300) | {"n": 64}
    r = await http.post(url, json=body)
    statuses.append(r.status_code)
    return r.status_code


async def one_pass(port: int, clients: int, requests: int, bad: bool) -> dict:
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        normal = [normal_client(http, url, i, requests, statuses) for i in range(clients)]
        extra = []
        if bad:
            extra = [disconnector(url, i, statuses) for i in range(DISCONNECTORS)]
            extra += [
                oversized(http, url, i, statuses) for i in range(BIG_BODIES + TOO_MANY_TOKENS)
            ]
        got = await asyncio.gather(*normal, *extra)
        wall = time.perf_counter() - t0
    replies = [x for per_client in got[:clients] for x in per_client]
    lat = [x["s"] for x in replies]
    return {
        "p50": pct(lat, 0.5),
        "p95": pct(lat, 0.95),
        "wall": wall,
        "completed": sum(x["ok"] for x in replies),
        "normal": len(replies),
        "statuses": statuses,
        "dropped": sum(x is True for x in got[clients : clients + DISCONNECTORS]) if bad else 0,
        "oversized": list(got[clients + DISCONNECTORS :]) if bad else [],
    }


# ----------------------------------------------------------------------------- the report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3, help="passes of each load, alternated")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per normal client")
    ap.add_argument(
        "--kv-memory-gb", type=float, default=0.125, help="the server's sampling memory"
    )
    ap.add_argument("--log", default=None, help="the server's log (default: a temp file)")
    args = ap.parse_args()
    import tempfile

    log_path = args.log or os.path.join(tempfile.mkdtemp(prefix="serve_load-"), "server.log")
    load_before = _common.load_note()
    port = free_port()
    proc = start_server(port, args.kv_memory_gb, log_path)
    try:
        slots, per_slot = admission(log_path)
        fresh = memory_kb(proc.pid)["VmRSS"]  # the model loaded, nothing asked yet
        # warm-up: one clean pass (the first big batches allocate torch's and the C
        # allocator's buffers once; the idle server keeps them)
        asyncio.run(one_pass(port, args.clients, 1, bad=False))
        idle = memory_kb(proc.pid)["VmRSS"]
        res: dict[str, list[dict]] = {"clean": [], "with bad clients": []}
        peak = idle
        for _ in range(args.passes):
            for name in res:
                reset_peak(proc.pid)
                got = asyncio.run(one_pass(port, args.clients, args.requests, name != "clean"))
                got["peak_kb"] = memory_kb(proc.pid)["VmHWM"]
                peak = max(peak, got["peak_kb"])
                res[name].append(got)
        end = memory_kb(proc.pid)["VmRSS"]
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    memory = {"fresh": fresh, "idle": idle, "peak": peak, "end": end}
    return report(res, args, slots, per_slot, memory, alive, load_before)


def report(res, args, slots, per_slot, memory, alive, load_before) -> int:
    """The table and lines of the module doc; 0 when every target is met, else 1."""
    med = {
        k: {q: _common.median([p[q] for p in v]) for q in ("p50", "p95", "wall")}
        for k, v in res.items()
    }
    rows = []
    for k, v in res.items():
        done = sum(p["completed"] for p in v)
        total = sum(p["normal"] for p in v)
        rows.append(
            [
                k,
                f"{med[k]['p50']:.2f}",
                f"{med[k]['p95']:.2f}",
                " ".join(f"{p['p95']:.2f}" for p in v),
                f"{med[k]['wall']:.2f}",
                f"{done}/{total}",
                f"{max(p['peak_kb'] for p in v) / 1024:.0f}",
            ]
        )
    print(
        _common.format_table(
            [
                "load",
                "p50 s (median)",
                "p95 s (median)",
                "p95 per pass",
                "pass s",
                "completed",
                "peak RSS MiB",
            ],
            rows,
        )
    )
    statuses: dict[int, int] = {}
    for v in res.values():
        for p in v:
            for s in p["statuses"]:
                statuses[s] = statuses.get(s, 0) + 1
    five = sum(n for s, n in statuses.items() if s >= 500)
    ratio = med["with bad clients"]["p95"] / med["clean"]["p95"]
    dropped = sum(p["dropped"] for p in res["with bad clients"])
    budget_mb = slots * per_slot / 2**20
    fresh_mb, idle_mb, peak_mb, end_mb = (
        memory[k] / 1024 for k in ("fresh", "idle", "peak", "end")
    )
    growth_mb = peak_mb - idle_mb
    all_done = all(p["completed"] == p["normal"] for v in res.values() for p in v)
    refused = [c for p in res["with bad clients"] for c in p["oversized"]]
    print(
        f"statuses: {dict(sorted(statuses.items()))}; 5xx: {five}; the oversized requests' "
        f"{sorted(set(refused))} ({len(refused)})"
    )
    print(
        f"disconnected mid-stream: {dropped} of {DISCONNECTORS * args.passes}; "
        f"p95 with bad clients / clean = {ratio:.2f}x (target <= 2)"
    )
    print(
        f"server memory: {fresh_mb:.0f} MiB before any request, idle {idle_mb:.0f} MiB after "
        f"the warm-up, peak (VmHWM) "
        f"{peak_mb:.0f} MiB, growth {growth_mb:.0f} MiB, {end_mb:.0f} MiB at the end; "
        f"admission budget {slots} KV "
        f"cache slots x {per_slot} bytes = {budget_mb:.0f} MiB; server alive at the end: {alive}"
    )
    print(
        f"({args.clients} clients x {args.requests} requests, {args.passes} passes per load, "
        f"alternated; before: {load_before}; after: {_common.load_note()})"
    )
    ok = (
        all_done
        and five == 0
        and set(refused) <= {400, 413}
        and ratio <= 2.0
        and growth_mb <= budget_mb
        and alive
    )
    print("targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
