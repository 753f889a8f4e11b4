"""Distance to the machine's limit: model FLOP/s per phase of a training step, as a fraction of
the CPU's peak, and where the rest of the time goes.

    python bench/flops.py                                     # the CPU demo, one thread
    python bench/flops.py --size 34m --set algo.beta=0.04     # a random 34M Qwen2, with a reference
    python bench/flops.py --config configs/smollm2-add.yaml --model /tmp/smollm2-135m

One ``trainer.Run`` is set up (``--config`` or the demo's defaults, ``--set KEY=VALUE``
overrides), takes ``--warmup`` steps, then ``--steps`` timed steps through the trainer's own
``collect`` / ``learn``. Per phase (generation, the reference log-prob pass, the update with its
old-policy pass), summed over the timed steps: seconds, tokens fed, model GFLOP
(``peergrade.flops``: counted from the config's shapes and the tokens each phase fed),
achieved GFLOP/s and its fraction of the peak for the dtype the model computes in
(``flops.cpu_peak``: cores x clock x the widest unit's FLOPs per cycle; printed with how it was
derived; ``--peak-gflops`` or ``--ghz`` override it).

Where the rest goes: the model's own matmuls (each layer's linear maps, and the lm_head) are
timed alone at the same thread count, dtype and autocast, at the row counts each phase feeds
them (the decode batch for generation; the tokens of a micro-batch for the passes). A phase's
"matmul time" is its FLOPs at those rates: the time it would take if it were nothing but its
model matmuls. The gap from the peak to the matmul rate is the kernels' efficiency at these
shapes; the gap from the matmul time to the phase's seconds is everything else (Python and
dispatch per layer and per token, sampling, norms / softmax / rotary, padding, the chunked
lm_head's recomputation in the backward, AdamW).
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


def matmul_rate(shape, rows: int, dtype, autocast_bf16: bool, seconds: float = 0.4):
    """(layer GFLOP/s, lm_head GFLOP/s) of ``shape``'s linear maps on ``rows`` rows: one
    layer's q, k, v, o and MLP maps in the model's weight dtype under the run's autocast; the
    lm_head the same way (generation) -- timed until ``seconds`` have passed."""
    import torch
    import torch.nn.functional as F

    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    f = shape.intermediate
    g = torch.Generator().manual_seed(0)

    def w(o, i):
        return torch.randn(o, i, generator=g, dtype=dtype) * 0.02

    layer = [w(q, d), w(kv, d), w(kv, d), w(d, q)] + [w(f, d)] * (2 if shape.gated_mlp else 1)
    down = w(d, f)
    head = w(shape.vocab, d)
    x = torch.randn(rows, d, generator=g, dtype=dtype)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext()

    def one_layer():
        for m in layer:
            F.linear(x if m.shape[1] == d else x[:, : m.shape[1]], m)
        F.linear(torch.zeros(rows, f, dtype=dtype), down)

    def lm_head():
        F.linear(x, head)

    out = []
    for fn, flop in ((one_layer, shape.per_token / shape.layers), (lm_head, shape.per_logit_row)):
        with torch.no_grad(), ctx:
            fn()  # warm-up (weight casts, allocator)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            dt = time.perf_counter() - t0
        out.append(n * rows * flop / dt / 1e9)
    return tuple(out)


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

    from peergrade import flops, trainer
    from peergrade.config import load_config, parse_override_value
    from peergrade.update import use_bf16_autocast

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
    seconds = dict.fromkeys(passes, 0.0)
    calls = dict.fromkeys(passes, 0)  # rows per matmul call, summed over the steps
    step_s = 0.0
    for step in range(1, a.warmup + a.steps + 1):
        t0 = time.perf_counter()
        exp = trainer.collect(run, step, [next(rows) for _ in range(P)])
        t1 = time.perf_counter()
        trainer.learn(run, exp, step)
        exp.seconds["update"] = time.perf_counter() - t1
        if step <= a.warmup:
            continue
        step_s += time.perf_counter() - t0
        N = exp.num_sequences
        for k, w in trainer.phase_work(run, exp).items():
            work[k] = work[k] + w if k in work else w
            seconds[k] += exp.seconds[trainer.PHASE_SECONDS[k]]
            # the rows a linear map sees per call: the decode batch; a micro-batch's tokens
            micro = math.ceil(N / cfg.micro_batch_size)
            calls[k] += N if k == "gen" else w.tokens // passes[k] // micro
    steps = a.steps
    print(
        f"{a.config or 'the CPU demo'}, model {a.size or cfg.model.path} ({n_params / 1e6:.1f}M "
        f"parameters, {dtype}{' autocast' if bf16 else ''}), {P} prompts x G = "
        f"{cfg.rollout.group_size}, {cfg.rollout.max_completion_length} new tokens at most, "
        f"algo.beta {cfg.algo.beta}, {steps} timed steps after {a.warmup}, {a.threads} "
        f"thread(s); {_common.load_note()}"
    )
    print(f"peak: {peak_gflops:.0f} GFLOP/s" + (" (given)" if a.peak_gflops else f" = {peak.how}"))
    names = {"gen": "generation", "ref": "reference pass", "update": "update (+ old-policy pass)"}
    table, all_s, all_f, all_mm = [], 0.0, 0.0, 0.0
    for k, w in work.items():
        sec, fl = seconds[k] / steps, w.flops / steps
        m = max(calls[k] // steps, 1)
        layer_rate, head_rate = matmul_rate(shape, m, weight_dtype, bf16)
        if k != "gen" and bf16:  # the passes' chunked lm_head runs in the weights' dtype
            head_rate = matmul_rate(shape, m, weight_dtype, False)[1]
        head = w.logit_rows * shape.per_logit_row / steps
        mm = (fl - head) / 1e9 / layer_rate + head / 1e9 / head_rate  # seconds
        rate = fl / sec / 1e9
        all_s, all_f, all_mm = all_s + sec, all_f + fl, all_mm + mm
        table.append(
            [
                names[k],
                f"{sec:.3f}",
                f"{w.tokens / passes[k] / steps:.0f}",
                f"{fl / 1e9:.2f}",
                f"{rate:.1f}",
                f"{rate / peak_gflops:.1%}",
                f"{head / fl:.0%}",
                f"{m}",
                f"{layer_rate:.0f} / {head_rate:.0f}",
                f"{mm:.3f} ({mm / sec:.0%})",
            ]
        )
    rate = all_f / all_s / 1e9
    table.append(
        [
            "these phases",
            f"{all_s:.3f}",
            "",
            f"{all_f / 1e9:.2f}",
            f"{rate:.1f}",
            f"{rate / peak_gflops:.1%}",
            "",
            "",
            "",
            f"{all_mm:.3f} ({all_mm / all_s:.0%})",
        ]
    )
    print(
        _common.format_table(
            [
                "per step",
                "s",
                "tokens fed",
                "GFLOP",
                "GFLOP/s",
                "of peak",
                "lm_head",
                "matmul rows",
                "matmul GFLOP/s layer / lm_head",
                "matmul-only s",
            ],
            table,
        )
    )
    print(
        f"whole step (rewards, bookkeeping): {step_s / steps:.3f} s, "
        f"{all_f / (step_s / steps) / 1e9:.1f} GFLOP/s"
    )
    print(_common.load_note())
    tmp.cleanup()


if __name__ == "__main__":
    main()
