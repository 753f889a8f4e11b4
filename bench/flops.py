"""Distance to the machine's limit: model FLOP/s per phase of a training step, as a fraction of
the CPU's peak, and where the rest of the time goes.

    python bench/flops.py                                     # the CPU demo, one thread
    python bench/flops.py --size 34m --set algo.beta=0.04     # a random 34M Qwen2, with a reference
    python bench/flops.py --config configs/smollm2-add.yaml --model /tmp/smollm2-135m

One ``trainer.Run`` is set up (``--config`` or the demo's defaults, ``--set KEY=VALUE``
overrides), takes ``--warmup`` steps, then ``--steps`` timed steps through the trainer's own
``collect`` / ``learn``. Per phase (generation, the reference log-prob pass, the update with its
old-policy pass), summed over the timed steps: seconds, tokens fed, model GFLOP
(``peergrade.monitoring.flops``: counted from the config's shapes and the tokens each phase fed),
achieved GFLOP/s and its fraction of the peak for the dtype the model computes in
(``flops.cpu_peak``: cores x clock x the widest unit's FLOPs per cycle; printed with how it was
derived; ``--peak-gflops`` or ``--ghz`` override it).

Where the rest goes, as a product of four factors (printed per phase):

    achieved / peak = CPU share x matmul share x (shape rate / ceiling) x (ceiling / peak)

* CPU share: the CPU seconds the process got over the wall seconds (per thread): below 1 when
  other processes share the cores;
* matmul share: the model's own matmuls (each layer's linear maps, and the lm_head), timed
  alone at the same threads, dtype and autocast and at the row counts each phase feeds them (the
  decode batch for generation; a micro-batch's tokens for the passes), give the CPU seconds the
  phase's FLOPs would take if it were nothing but those matmuls; over the phase's CPU seconds.
  The rest is everything else: Python and dispatch per layer and per token, sampling, norms /
  softmax / rotary, padding, the chunked lm_head's recomputation in the backward, AdamW;
* shape rate / ceiling: those matmuls' rate against a 2048^3 matmul in the same dtype (the
  small-shape and weight-cast penalty);
* ceiling / peak: the library's best on this core against the derived peak.

Rates are per CPU-second (``process_time``), so the CPU share carries most of what a busy
machine costs; the caches and memory bandwidth other jobs share still move the rates (the
bf16 ceiling varied about 2x between runs on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(threads: int) -> float:
    """This process's CPU time per thread it was given: the core-seconds it actually got."""
    return time.process_time() / threads


def matmul_rate(shape, rows: int, dtype, autocast_bf16: bool, threads: int, seconds=0.4):
    """(layer, lm_head) GFLOP per CPU-second of ``shape``'s linear maps on ``rows`` rows: one
    layer's q, k, v, o and MLP maps in the weights' dtype under the run's autocast, and the
    lm_head; forward only. CPU time (``cpu_seconds``), not wall time: another process sharing
    the core does not lower it."""
    import torch
    import torch.nn.functional as F

    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    f = shape.intermediate
    g = torch.Generator().manual_seed(0)

    def w(*size):
        # a leaf that requires grad, as a parameter: autocast caches its bf16 copy as it
        # does the model's weights (a plain tensor would be cast again at every call)
        return (torch.randn(*size, generator=g, dtype=dtype) * 0.02).requires_grad_()

    x, xq, xf = (w(rows, n).detach() for n in (d, q, f))
    maps = [(x, w(q, d)), (x, w(kv, d)), (x, w(kv, d)), (xq, w(d, q)), (xf, w(d, f))]
    maps += [(x, w(f, d))] * (2 if shape.gated_mlp else 1)
    head = [(x, w(shape.vocab, d))]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext()
    out = []
    for pairs, flop in ((maps, shape.per_token / shape.layers), (head, shape.per_logit_row)):
        with torch.no_grad(), ctx:
            for inp, weight in pairs:  # warm-up (weight casts, allocator)
                F.linear(inp, weight)
            n, t0 = 0, cpu_seconds(threads)
            while cpu_seconds(threads) - t0 < seconds:
                for inp, weight in pairs:
                    F.linear(inp, weight)
                n += 1
            dt = cpu_seconds(threads) - t0
        out.append(n * rows * flop / dt / 1e9)
    return tuple(out)


def square_rate(dtype, threads: int, n: int = 2048, seconds=0.6) -> float:
    """GFLOP per CPU-second of an n x n x n matmul in ``dtype``: about the best the library and
    this core reach for the dtype at any shape (the ceiling below the derived peak)."""
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    k, t0 = 0, cpu_seconds(threads)
    while cpu_seconds(threads) - t0 < seconds:
        a @ b
        k += 1
    return 2 * n**3 * k / (cpu_seconds(threads) - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="recipe file ('' = the CPU demo's defaults)")
    ap.add_argument("--model", default="", help="model dir (default: the config's)")
    ap.add_argument("--size", default="", help="a random Qwen2 of bench/vs_trl.py's SIZES (34m)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ghz", type=float, default=None, help="the clock for the peak")
    ap.add_argument("--peak-gflops", type=float, default=None, help="override the peak")
    a = ap.parse_args()

    import torch

    from peergrade.config import load_config, parse_override_value
    from peergrade.monitoring import flops
    from peergrade.training import trainer
    from peergrade.training.update import use_bf16_autocast

    torch.set_num_threads(a.threads)
    over = [(k, parse_override_value(v)) for k, _, v in (s.partition("=") for s in a.set)]
    over.append(("train.threads", a.threads))
    tmp = tempfile.TemporaryDirectory()
    if a.size:
        from vs_trl import SIZES

        _common.build_random_qwen2(tmp.name, SIZES[a.size])
        a.model = tmp.name
    if a.model:
        over.append(("model.path", a.model))
    cfg = load_config(a.config or None, over)
    run = trainer.setup(cfg)
    policy = run.models.policy
    bf16 = use_bf16_autocast(cfg.model.autocast, run.models.device, policy)
    weight_dtype = next(policy.parameters()).dtype
    dtype = "bfloat16" if bf16 else str(weight_dtype).removeprefix("torch.")
    peak = flops.cpu_peak(dtype, cores=a.threads, ghz=a.ghz)
    peak_gflops = a.peak_gflops or peak.flops_per_s / 1e9
    shape = flops.Shape.of(policy.config)
    n_params = sum(p.numel() for p in policy.parameters())

    rows = run.task.train_rows(cfg.train.seed)
    P = cfg.rollout.prompts_per_step
    passes = {
        "gen": 1,
        "ref": 1,
        "update": 3 * cfg.algo.num_iterations + (cfg.updates_per_step > 1),
    }
    work: dict[str, flops.Work] = {}
    # (phase, segment) -> [Work, rows per linear-map call summed over steps]: generation's
    # prefill (the distinct prompts at once) and decode (one row per sequence) see other shapes
    segments: dict[tuple[str, str], list] = {}
    wall = dict.fromkeys(passes, 0.0)
    cpu = dict.fromkeys(("collect", "learn"), 0.0)  # CPU seconds; and their wall seconds
    cpu_wall = dict.fromkeys(("collect", "learn"), 0.0)
    step_s = 0.0

    def add(key, w, rows_per_call):
        seg = segments.setdefault(key, [flops.Work(0, 0, 0, 0), 0])
        seg[0], seg[1] = seg[0] + w, seg[1] + rows_per_call

    for step in range(1, a.warmup + a.steps + 1):
        t0, c0 = time.perf_counter(), cpu_seconds(a.threads)
        exp = trainer.collect(run, step, [next(rows) for _ in range(P)])
        t1, c1 = time.perf_counter(), cpu_seconds(a.threads)
        trainer.learn(run, exp, step)
        t2, c2 = time.perf_counter(), cpu_seconds(a.threads)
        exp.seconds["update"] = t2 - t1
        if step <= a.warmup:
            continue
        step_s += t2 - t0
        cpu["collect"] += c1 - c0
        cpu["learn"] += c2 - c1
        cpu_wall["collect"] += t1 - t0
        cpu_wall["learn"] += t2 - t1
        N = exp.num_sequences
        micro = math.ceil(N / cfg.micro_batch_size)
        for k, w in trainer.phase_work(run, exp).items():
            work[k] = work[k] + w if k in work else w
            wall[k] += exp.seconds[trainer.PHASE_SECONDS[k]]
            if k == "gen":  # the prompts once (a log-prob pass with no completion tokens)
                p, c = flops.split_lengths(exp.attention_mask, exp.loss_mask.shape[1])
                zero = torch.zeros_like(c)
                pre = flops.logprob_pass(shape, p, zero, zero, cfg.rollout.group_size)
                add(("gen", "prefill"), pre, pre.tokens)
                add(("gen", "decode"), flops.Work(*(x - y for x, y in zip(w, pre))), N)
            else:  # a micro-batch's tokens
                add((k, "pass"), w, w.tokens // passes[k] // micro)
    steps = a.steps
    share = {k: cpu[k] / max(cpu_wall[k], 1e-9) for k in cpu}
    print(
        f"{a.config or 'the CPU demo'}, model {a.size or cfg.model.path} ({n_params / 1e6:.1f}M "
        f"parameters, {dtype}{' autocast' if bf16 else ''}), {P} prompts x G = "
        f"{cfg.rollout.group_size}, {cfg.rollout.max_completion_length} new tokens at most, "
        f"algo.beta {cfg.algo.beta}, {steps} timed steps after {a.warmup}, {a.threads} "
        f"thread(s); {_common.load_note()}"
    )
    print(f"peak: {peak_gflops:.0f} GFLOP/s" + (" (given)" if a.peak_gflops else f" = {peak.how}"))
    print(
        f"CPU share (CPU seconds / wall seconds / threads): collect {share['collect']:.2f}, "
        f"update {share['learn']:.2f}"
    )
    ceiling = square_rate(torch.bfloat16 if bf16 else weight_dtype, a.threads)
    print(
        f"a 2048 x 2048 x 2048 {dtype} matmul: {ceiling:.0f} GFLOP per CPU-second "
        f"({ceiling / peak_gflops:.0%} of the peak): the library's ceiling on this core"
    )
    names = {"gen": "generation", "ref": "reference pass", "update": "update (+ old-policy pass)"}
    table, why = [], []
    tot = dict.fromkeys(("wall", "cpu", "flops", "mm"), 0.0)
    rates = {}  # rows -> (layer, lm_head in the weights' dtype) GFLOP per CPU-second

    def matmul_seconds(k: str, w, rows: int) -> float:
        """CPU seconds of ``w``'s FLOPs at the rates of the model's matmuls on ``rows`` rows."""
        if rows not in rates:
            rates[rows] = matmul_rate(shape, rows, weight_dtype, bf16, a.threads)
            if bf16:  # the passes' chunked lm_head runs in the weights' dtype, never autocast
                rates[rows] += (matmul_rate(shape, rows, weight_dtype, False, a.threads)[1],)
        layer_rate, head_rate = rates[rows][0], rates[rows][-1 if k != "gen" else 1]
        head = w.logit_rows * shape.per_logit_row
        return (w.flops - head) / 1e9 / layer_rate + head / 1e9 / head_rate

    for k, w in work.items():
        sec, fl = wall[k] / steps, w.flops / steps
        csec = sec * share["learn" if k == "update" else "collect"]  # CPU seconds
        mine = [(seg, v) for (ph, seg), v in segments.items() if ph == k]
        mm = sum(matmul_seconds(k, sw, max(r // steps, 1)) for _, (sw, r) in mine) / steps
        rows_txt = ", ".join(f"{seg} {max(r // steps, 1)}" for seg, (_, r) in mine)
        rate = fl / sec / 1e9
        head = w.logit_rows * shape.per_logit_row / steps
        for key, v in (("wall", sec), ("cpu", csec), ("flops", fl), ("mm", mm)):
            tot[key] += v
        table.append(
            [
                names[k],
                f"{sec:.3f}",
                f"{w.tokens / passes[k] / steps:.0f}",
                f"{fl / 1e9:.2f}",
                f"{rate:.1f}",
                f"{rate / peak_gflops:.2%}",
                f"{head / fl:.0%}",
                rows_txt,
                f"{fl / mm / 1e9:.0f}",
            ]
        )
        why.append((names[k], sec, csec, mm, fl / mm / 1e9))
    rate = tot["flops"] / tot["wall"] / 1e9
    table.append(
        ["these phases", f"{tot['wall']:.3f}", "", f"{tot['flops'] / 1e9:.2f}", f"{rate:.1f}"]
        + [f"{rate / peak_gflops:.2%}", "", "", ""]
    )
    why.append(("these phases", tot["wall"], tot["cpu"], tot["mm"], tot["flops"] / tot["mm"] / 1e9))
    print(
        _common.format_table(
            ["per step", "s", "tokens fed", "GFLOP", "GFLOP/s", "of peak", "lm_head"]
            + ["matmul rows per call", "its matmuls: GFLOP/CPU-s"],
            table,
        )
    )
    # achieved / peak = CPU share x (matmul CPU s / CPU s) x (shape rate / ceiling) x
    # (ceiling / peak)
    rows_why = [
        [
            name,
            f"{csec / sec:.2f}",
            f"{mm / csec:.2f}",
            f"{mm_rate / ceiling:.2f}",
            f"{ceiling / peak_gflops:.2f}",
            f"{(csec / sec) * (mm / csec) * (mm_rate / peak_gflops):.2%}",
        ]
        for name, sec, csec, mm, mm_rate in why
    ]
    print(
        "where the rest goes: of peak = CPU share x matmul share of the CPU time x "
        "(matmul rate at the model's shapes / the 2048^3 ceiling) x (ceiling / peak)"
    )
    print(
        _common.format_table(
            ["per step", "CPU share", "matmul share", "shapes / ceiling", "ceiling / peak"]
            + ["of peak"],
            rows_why,
        )
    )
    print(
        f"whole step (rewards, bookkeeping): {step_s / steps:.3f} s, "
        f"{tot['flops'] / (step_s / steps) / 1e9:.1f} GFLOP/s"
    )
    print(_common.load_note())
    tmp.cleanup()


if __name__ == "__main__":
    main()
