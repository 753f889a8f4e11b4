"""bf16 autocast on the CPU vs float32: generation and the update's forward/backward, timed
on one random-init Qwen2 model (default ~34M parameters) at one thread.

    python bench/bf16_cpu.py                  # 34M, P = 4 x G = 8, 100-token prompts, 32 new
    python bench/bf16_cpu.py --size 1m --reps 5

Each repetition runs fp32 and bf16 autocast back to back (order alternating), in this one
process; the table gives medians of wall seconds and the ratio bf16 / fp32 (< 1: bf16 faster),
and the same ratio in this process's CPU seconds (the steadier one on a shared machine). The update is
what ``grpo_update`` runs per micro-batch: ``token_logprobs`` (shared-prompt forward) plus the
backward of a token-mean loss. The chunked lm_head stays in the weights' dtype (float32) inside
``token_logprobs`` by design, so autocast speeds up the backbone only.

The last lines name the CPU's bf16 units (AMX, AVX512-BF16 or none) and what
``model.autocast: auto`` chooses for this model here, and why: run it on each kind of CPU to
fill the table in docs/benchmarks.md. Whether bf16 may be a default is a question of learning
too: compare the demo with and without it; this script only measures time.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="34m", choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()

    import torch

    from peergrade.generation.kernel import generate
    from peergrade.model.load import load_model, load_tokenizer
    from peergrade.model.logprobs import token_logprobs

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        n_params = _common.build_random_qwen2(tmp, SIZES[a.size])
        tok = load_tokenizer(tmp)
        model = load_model(tmp, dtype="float32", device="cpu")
    prompts = [tok.encode(p) for p in make_prompts(a.prompts, a.prompt_len, "all")]

    def ctx(bf16: bool):
        if bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def gen(bf16: bool, seed: int):
        model.eval()
        t0, c0 = time.perf_counter(), time.process_time()
        with ctx(bf16), torch.no_grad():
            r = generate(model, tok, prompts, n=a.group, max_new_tokens=a.new_tokens, seed=seed)
        return (time.perf_counter() - t0, time.process_time() - c0), r

    def update(bf16: bool, batch):
        model.train()
        ids, am, cm = batch
        t0, c0 = time.perf_counter(), time.process_time()
        with ctx(bf16):
            lp = token_logprobs(model, ids, am, cm, share_prompts=True)
        (-(lp * cm).sum() / cm.sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    times = {k: [] for k in ("gen32", "gen16", "upd32", "upd16")}
    _, r = gen(False, 0)  # warm-up, and the batch every update below uses
    batch = r.training_batch(tok.pad_token_id)
    update(False, batch)
    for rep in range(a.reps):
        for bf16 in (False, True) if rep % 2 == 0 else (True, False):
            s = "16" if bf16 else "32"
            times["gen" + s].append(gen(bf16, rep + 1)[0])
            times["upd" + s].append(update(bf16, batch))
    med = {k: _common.median([w for w, _ in v]) for k, v in times.items()}
    cpu = {k: _common.median([c for _, c in v]) for k, v in times.items()}
    rows = [
        [
            phase,
            f"{med[k + '32']:.2f}",
            f"{med[k + '16']:.2f}",
            f"{med[k + '16'] / med[k + '32']:.2f}",
            f"{cpu[k + '16'] / cpu[k + '32']:.2f}",
        ]
        for phase, k in (("generate", "gen"), ("update fwd+bwd", "upd"))
    ]
    print(
        f"{a.size} ({n_params / 1e6:.1f}M params), {a.threads} thread(s), {a.reps} reps, "
        f"P={a.prompts} G={a.group}, {a.prompt_len}-token prompts, {a.new_tokens} new tokens"
    )
    headers = ["phase", "fp32 s", "bf16 autocast s", "bf16 / fp32", "bf16 / fp32 (CPU s)"]
    print(_common.format_table(headers, rows))
    from peergrade.training.update import auto_bf16, cpu_bf16_kind

    on, why = auto_bf16("cpu", torch.float32, n_params)
    print(
        f"CPU bf16 units: {cpu_bf16_kind() or 'none (emulated)'}; model.autocast auto would "
        f"choose {'bf16' if on else 'float32'} here ({why})"
    )
    print(_common.load_note())


if __name__ == "__main__":
    main()
