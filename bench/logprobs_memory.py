"""Peak memory and time of the log-prob + loss step: chunked ``token_logprobs`` vs naive.

The step is what the trainer does on every minibatch: per-token log-probs of the completion,
``loss = -(logp * mask).sum() / mask.sum()``, ``loss.backward()``. The model is a tiny-hidden,
large-vocabulary Qwen2 (hidden 64, 2 layers, vocab 151936 = Qwen2.5's), so the ``[B, C, V]``
logits are the whole story: 16 x 448 x 151936 float32 values are 4.4 GB per copy, and the naive
path keeps several copies (logits, log-softmax output, their gradients).

Each configuration runs in a fresh child process (this script with ``--child``), which builds the
model and inputs, records its RSS, runs the step, and reads ``ru_maxrss`` (the peak RSS of the
process). The step delta = peak after the step - RSS after building. Rounds alternate the
configurations; the peak comes from the first step of each child, the time is the median over
rounds of the child's second (warm) step.

    python bench/logprobs_memory.py                      # the issue's size: 16 x 512, C = 448
    python bench/logprobs_memory.py --batch 8            # if the machine has < ~20 GB free

This measures CPU memory only; it does not run on a GPU (there, CUDA max-allocated would be the
measure; see bench/gpu_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from peergrade.model.logprobs import naive_token_logprobs, token_logprobs
    from peergrade.model.tiny import tiny_config

    torch.set_num_threads(args.threads)
    cfg = tiny_config(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=max(512, args.seq),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    B, L, C = args.batch, args.seq, args.completion
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (B, L), generator=g)  # [B, L]
    attention_mask = torch.ones(B, L, dtype=torch.long)  # [B, L]
    completion_mask = torch.ones(B, C, dtype=torch.long)  # [B, C]: every completion token counts

    if args.child == "naive":

        def fn():
            return naive_token_logprobs(model, input_ids, attention_mask, completion_mask)

    else:
        chunk = int(args.child.split(":")[1])

        def fn():
            return token_logprobs(
                model, input_ids, attention_mask, completion_mask, chunk_size=chunk
            )

    def step():
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp = fn()  # [B, C]
        mask = completion_mask.float()
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        return time.perf_counter() - t0, loss.item()

    base = rss_mb()
    base_max = maxrss_mb()
    t_first, loss = step()
    peak = maxrss_mb()
    t_warm, _ = step()
    print(
        json.dumps(
            dict(
                base_mb=base,
                base_max_mb=base_max,
                peak_mb=peak,
                delta_mb=peak - base,
                t_first=t_first,
                t_warm=t_warm,
                loss=loss,
            )
        )
    )


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_child(args, mode: str) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode]
    for k in ("batch", "seq", "completion", "vocab", "hidden", "layers", "threads"):
        cmd += [f"--{k}", str(getattr(args, k))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"  [{mode}] child failed (rc {r.returncode}): {r.stderr.strip()[-400:]}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (prompt+completion)")
    ap.add_argument("--completion", type=int, default=448, help="completion tokens (last C)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk-sizes", default="1024,4096", help="comma-separated chunk sizes")
    ap.add_argument("--rounds", type=int, default=3, help="alternated passes per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    B, C, V = args.batch, args.completion, args.vocab
    logits_gb = B * C * V * 4 / 1e9
    print(
        f"log-prob + loss step, Qwen2-shaped: hidden {args.hidden}, {args.layers} layers, vocab {V}; "
        f"{B} x {args.seq} tokens, completion {C} (all counted, M = {B * C} positions); "
        f"{args.threads} threads; one [B, C, V] float32 copy = {logits_gb:.2f} GB"
    )
    print(
        f"note: shared machine, other processes may be busy (load {os.getloadavg()[0]:.1f}, "
        f"MemAvailable {mem_available_mb() / 1024:.1f} GB)"
    )
    modes = ["naive"] + [f"chunked:{int(c)}" for c in args.chunk_sizes.split(",")]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for m in order:
            out = run_child(args, m)
            if out is not None:
                results[m].append(out)
                print(
                    f"  round {r + 1} {m:>14}: peak {out['peak_mb']:8.0f} MB  step delta "
                    f"{out['delta_mb']:8.0f} MB  warm step {out['t_warm']:6.2f} s",
                    flush=True,
                )
    summary = {}
    for m, rs in results.items():
        if rs:
            summary[m] = dict(
                base=statistics.median(x["base_mb"] for x in rs),
                peak=statistics.median(x["peak_mb"] for x in rs),
                delta=statistics.median(x["delta_mb"] for x in rs),
                t=statistics.median(x["t_warm"] for x in rs),
                loss=rs[0]["loss"],
            )
    if "naive" not in summary:
        print("naive run failed: no ratios (try --batch 8)")
        return
    nv = summary["naive"]
    print()
    header = (
        f"{'config':>14} | {'base RSS MB':>11} | {'peak RSS MB':>11} | {'step delta MB':>13} | "
        f"{'delta / naive':>13} | {'peak / naive':>12} | {'step s':>7} | {'loss':>9}"
    )
    print(header)
    print("-" * len(header))
    for m, s in summary.items():
        print(
            f"{m:>14} | {s['base']:11.0f} | {s['peak']:11.0f} | {s['delta']:13.0f} | "
            f"{s['delta'] / nv['delta']:13.3f} | {s['peak'] / nv['peak']:12.3f} | "
            f"{s['t']:7.2f} | {s['loss']:9.5f}"
        )
    print(
        "(medians over rounds; step s = warm forward+backward; target: chunked delta <= 0.25 x naive)"
    )


if __name__ == "__main__":
    main()
