"""Gradient checkpointing on vs off for one update micro-batch: what ``gradient_checkpointing:
auto`` saves where the memory planner says the step fits without it.

With checkpointing on (``model.gradient_checkpointing: true``) each decoder layer keeps only
its input in the forward and runs again in the backward; the log-prob pass also falls back
from the shared-prompt forward to the plain one (``model.logprobs``: the shared prompt's KV
cache would not survive the recompute). Two sides, alternated every pass (A B, B A, ...), in
one process on the same model and inputs, checkpointing switched on and off between passes:

    ckpt   the model with activation checkpointing on (non-reentrant, as ``prepare_model``)
    off    the same model with it off

The workload is ``bench/head_backward.py``'s ``step``: one update micro-batch of the vs_trl
34m model (vocab 32000, hidden 512, 6 layers; P prompts x G completions, prompt and completion
lengths as vs_trl's defaults): ``token_logprobs`` forward (with the entropy, as the update
logs it), a token-mean loss, backward. Printed: each side's wall and CPU (this process's)
seconds per step, per pass (``--reps`` steps each) and their medians, and the peak RSS growth
of one step per side; the load average before and after. On a shared machine the CPU seconds
are the steadier measure.

    OMP_NUM_THREADS=1 python bench/checkpointing.py                  # 5 passes of 2 steps
    OMP_NUM_THREADS=1 python bench/checkpointing.py --group 16 --passes 3
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from head_backward import SHAPE, build_model, step_inputs  # noqa: E402


def set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing on or off on a loaded model (transformers 5 names first)."""
    if on:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def main() -> None:
    ap = _common.arguments(__doc__, passes=5)
    ap.add_argument("--reps", type=int, default=2, help="forward + backward steps per pass")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--completion", type=int, default=32)
    a = ap.parse_args()

    import torch

    from peergrade.model import logprobs as lp

    torch.set_num_threads(a.threads)
    model = build_model(torch)
    ids, am, cm = step_inputs(torch, a)
    M = int(cm.sum())

    def one_step():
        logp, ent = lp.token_logprobs(model, ids, am, cm, with_entropy=True, share_prompts=True)
        float(ent.detach().sum())
        (-logp.sum() / M).backward()
        model.zero_grad(set_to_none=True)

    peaks: dict[str, int] = {}

    def side(on: bool):
        def run() -> dict:
            set_checkpointing(model, on)
            _common.peak_rss_reset()
            base = _common.rss_now()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.reps):
                one_step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            name = "ckpt" if on else "off"
            peaks[name] = max(peaks.get(name, 0), _common.peak_rss() - base)
            return {"s": wall / a.reps, "cpu": cpu / a.reps}

        return run

    print(f"load before: {_common.load_note()}")
    print(
        f"34m Qwen2 shape ({SHAPE['layers']} layers), {a.prompts} x {a.group} rows, prompt "
        f"{a.prompt_len}, completion {a.completion} (M = {M} tokens), {a.threads} thread(s), "
        f"{a.passes} passes of {a.reps}"
    )
    for on in (True, False):  # warm-up, both paths
        set_checkpointing(model, on)
        one_step()
    res = _common.alternate({"ckpt": side(True), "off": side(False)}, a.passes)
    med = _common.seconds_table(res, "step wall s", digits=3)
    cpu = {k: [{"s": r["cpu"]} for r in v] for k, v in res.items()}
    med_cpu = _common.seconds_table(cpu, "step CPU s", digits=3)
    print(
        f"off / ckpt = {med['off'] / med['ckpt']:.3f} (wall), "
        f"{med_cpu['off'] / med_cpu['ckpt']:.3f} (CPU); peak RSS growth of a step: "
        f"ckpt {peaks['ckpt'] / 2**20:.0f} MiB, off {peaks['off'] / 2**20:.0f} MiB"
    )
    print(f"load after: {_common.load_note()}")


if __name__ == "__main__":
    main()
