"""The chunked log-prob backward with and without the forward's last chunk kept (``keep_last``).

``_ChunkedLogProbs`` (peergrade.model.logprobs) never holds the ``[M, V]`` logits: its backward
recomputes each chunk's logits. With ``keep_last`` the forward keeps its last chunk's
log-softmax and the backward starts from it, so a micro-batch of at most ``chunk_size``
completion tokens (one chunk: the vs_trl workload's 32 x 32) runs lm_head's ``[M, H] x [H, V]``
matmul and the log-softmax once instead of twice. Two sides, alternated every pass (A B, B A,
...), in one process on the same model and inputs:

    recompute   keep_last forced off (the backward recomputes every chunk: the old path)
    keep        token_logprobs as it is (keep_last on under grad mode)

``--baseline FILE`` puts another copy of logprobs.py's ``_ChunkedLogProbs`` in place of
``recompute`` (one change at a time: the copy before it). ``--entropy`` computes the entropy as
the update does (logged, not differentiated).

Two workloads: ``step`` is one update micro-batch of the vs_trl 34m model (vocab 32000, hidden
512, 6 layers; P prompts x G completions, prompt and completion lengths as vs_trl's defaults,
the trainer's shared-prompt forward): token_logprobs forward, a token-mean loss, backward.
``head`` is the autograd Function alone on ``[M, H]`` random hidden states (M = P G C).
Printed: each side's wall and CPU (this process's) seconds per step, per pass (``--reps`` steps
each) and their medians, the load average before and after. On a shared machine the CPU
seconds are the steadier measure (another process's load stretches wall time, not CPU time).

    OMP_NUM_THREADS=1 python bench/head_backward.py                 # both workloads, 5 passes
    OMP_NUM_THREADS=1 python bench/head_backward.py --workload head --passes 3
    OMP_NUM_THREADS=1 python bench/head_backward.py --entropy --baseline /tmp/old_logprobs.py
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPE = dict(vocab=32000, hidden=512, layers=6, heads=8, kv_heads=2, inter=1408)  # vs_trl's 34m


def build_model(torch):
    from transformers import AutoModelForCausalLM

    from peergrade.model.tiny import tiny_config

    cfg = tiny_config(
        "qwen2",
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        num_layers=SHAPE["layers"],
        num_heads=SHAPE["heads"],
        num_kv_heads=SHAPE["kv_heads"],
        intermediate_size=SHAPE["inter"],
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).train()


def step_inputs(torch, a):
    """P prompts of ``prompt_len`` tokens, each repeated G times, then C completion tokens."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, SHAPE["vocab"], (a.prompts, a.prompt_len), generator=g)
    comp = torch.randint(4, SHAPE["vocab"], (a.prompts * a.group, a.completion), generator=g)
    ids = torch.cat([prompts.repeat_interleave(a.group, 0), comp], dim=1)
    return ids, torch.ones_like(ids), torch.ones_like(comp)


def main() -> None:
    ap = _common.arguments(__doc__, passes=5)
    ap.add_argument("--workload", default="step,head", help="comma-separated of step, head")
    ap.add_argument("--reps", type=int, default=2, help="forward + backward steps per pass")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=1024, help="model.logprob_chunk_size")
    ap.add_argument(
        "--entropy", action="store_true", help="also the entropy (as the update: no gradient)"
    )
    ap.add_argument(
        "--baseline",
        metavar="FILE",
        help="a logprobs.py (e.g. an older copy) whose _ChunkedLogProbs is the first side "
        "instead of recompute",
    )
    a = ap.parse_args()

    import torch

    from peergrade.model import logprobs as lp

    torch.set_num_threads(a.threads)
    real_apply = lp._ChunkedLogProbs.apply

    def recompute_apply(*args):  # keep_last forced off: every chunk recomputed in the backward
        return real_apply(*args[:7], False)

    first, first_apply = "recompute", recompute_apply
    if a.baseline:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_logprobs", a.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        first, first_apply = "baseline", base._ChunkedLogProbs.apply

    model = build_model(torch)
    ids, am, cm = step_inputs(torch, a)
    M = int(cm.sum())
    h = torch.randn(M, SHAPE["hidden"], requires_grad=True)
    t = torch.randint(0, SHAPE["vocab"], (M,))
    w = model.lm_head.weight

    def one_step():
        out = lp.token_logprobs(
            model, ids, am, cm, chunk_size=a.chunk_size, with_entropy=a.entropy, share_prompts=True
        )
        logp, ent = out if a.entropy else (out, None)
        if ent is not None:
            float(ent.detach().sum())  # the update logs the entropy; it trains the log-probs
        (-logp.sum() / M).backward()
        model.zero_grad(set_to_none=True)

    def one_head():
        out = lp._ChunkedLogProbs.apply(h, w, None, t, 1.0, a.chunk_size, a.entropy, True)
        logp = out[0] if a.entropy else out
        (-logp.sum()).backward()
        h.grad, w.grad = None, None

    def side(fn, keep: bool):
        def run() -> dict:
            lp._ChunkedLogProbs.apply = real_apply if keep else first_apply
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.reps):
                    fn()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                return {"s": wall / a.reps, "cpu": cpu / a.reps}
            finally:
                lp._ChunkedLogProbs.apply = real_apply

        return run

    print(f"load before: {_common.load_note()}")
    print(
        f"34m Qwen2 shape, {a.prompts} x {a.group} rows, prompt {a.prompt_len}, completion "
        f"{a.completion} (M = {M} tokens), chunk {a.chunk_size}, entropy {a.entropy}, "
        f"{a.threads} thread(s), {a.passes} passes of {a.reps}"
    )
    for name in a.workload.split(","):
        fn = {"step": one_step, "head": one_head}[name]
        fn()  # warm-up
        res = _common.alternate({first: side(fn, False), "keep": side(fn, True)}, a.passes)
        med = _common.seconds_table(res, f"{name} wall s", digits=3)
        cpu = {k: [{"s": r["cpu"]} for r in v] for k, v in res.items()}
        med_cpu = _common.seconds_table(cpu, f"{name} CPU s", digits=3)
        print(
            f"{name}: keep / {first} = {med['keep'] / med[first]:.3f} (wall), "
            f"{med_cpu['keep'] / med_cpu[first]:.3f} (CPU)\n"
        )
    print(f"load after: {_common.load_note()}")


if __name__ == "__main__":
    main()
