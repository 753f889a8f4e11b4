"""GPU benchmark: peergrade.generation.kernel.generate vs model.generate on one CUDA device (e.g. an H200).

Run from the repo root:  PYTHONPATH=src python bench/gpu_rollout.py [--passes 2] [--compile]
                                                                   [--hf-static] [--new-tokens 512]

Workload: a Qwen2.5-0.5B-shaped Qwen2 model (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocab 151,936, tied embeddings) with random weights built from its config in
bf16 on the GPU, 32 chat-templated prompts x 8 samples = 256 sequences x 512 new tokens,
temperature 1, no top-k/top-p. EOS never stops a sequence on either side (ours:
``ignore_eos=True``; HF: the generation config's eos is removed), so both produce exactly
256 * 512 tokens. The tokenizer is the character tokenizer padded with dummy tokens up to the
model's vocab.

Reported per side (median over alternated passes): tokens/s, peak CUDA memory
(``max_memory_allocated`` growth during the call), and memory-bandwidth utilisation:

    bytes/step(t) = weight bytes (every parameter read once per decode step, the tied LM head
                    included) + KV bytes read = B * (P + t) * 2 * layers * kv_heads * head_dim * 2
    utilisation   = sum_t bytes/step(t) / elapsed seconds / measured copy bandwidth

where the copy bandwidth is measured here with a 2 GiB device-to-device copy (read + write
bytes / time). Elapsed time includes prefill, so this slightly understates decode utilisation.

Flags: ``--compile`` wraps the model's forward in ``torch.compile(dynamic=True)`` for our side
(experimental: shapes change every step, so no CUDA graphs); ``--hf-static`` runs HF with
``cache_implementation="static"`` as an extra row. What it does not do: multi-GPU, quantised
models, or correctness checks (tests/generation/test_rollout.py covers correctness on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

N_PROMPTS, N_SAMPLES = 32, 8
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def build(device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from peergrade.model.tiny import CHARS, build_char_tokenizer

    base = build_char_tokenizer()
    extra = [f"<w{i}>" for i in range(QWEN25_05B["vocab_size"] - len(base))]
    tok = build_char_tokenizer(chars=CHARS + extra)
    assert len(tok) == QWEN25_05B["vocab_size"], len(tok)
    cfg = Qwen2Config(**QWEN25_05B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def prompts(tok) -> list[str]:
    out = []
    for i in range(N_PROMPTS):
        q = (
            f"Sam has {3 + i} boxes with {7 + 2 * i} pencils in each box. He gives away "
            f"{i + 2} pencils. How many pencils does he have left?"
        )
        msgs = [
            {"role": "system", "content": "Think step by step. End with: #### <answer>"},
            {"role": "user", "content": q},
        ]
        out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def copy_bandwidth(device) -> float:
    """Device copy bandwidth in bytes/s: (read + write bytes) / time of a 2 GiB copy."""
    import torch

    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--compile", action="store_true", help="torch.compile our decode forward")
    ap.add_argument("--hf-static", action="store_true", help="extra HF row with a static cache")
    ap.add_argument("--check-every", type=int, default=None, help="ours: steps between syncs")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "bench/gpu_rollout.py needs a CUDA device, and torch.cuda.is_available() is False "
            "here; nothing was measured. Run it on the GPU machine (CPU benchmark: "
            "bench/rollout.py)."
        )
    from peergrade.generation.kernel import generate

    device = torch.device("cuda")
    print(f"# device: {torch.cuda.get_device_name(device)}; {_common.load_note()}", flush=True)
    bw = copy_bandwidth(device)
    print(f"# measured device copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)

    model, tok = build(device)
    ps = prompts(tok)
    new_tokens = args.new_tokens
    n_seq = N_PROMPTS * N_SAMPLES
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    enc = tok(ps, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    p_len = enc["input_ids"].shape[1]
    mean_prompt = float(enc["attention_mask"].sum(-1).float().mean())
    # Per-step bytes read; the padded prompt length P is what both sides attend over.
    total_bytes = sum(
        weight_bytes + n_seq * (p_len + t) * kv_bytes_per_token for t in range(new_tokens)
    )
    print(
        f"# model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params bf16 "
        f"({weight_bytes / 2**30:.2f} GiB); {n_seq} seqs x {new_tokens} new tokens; "
        f"prompt {mean_prompt:.0f} tokens (padded {p_len})",
        flush=True,
    )

    forward = model.forward
    if args.compile:
        compiled = torch.compile(forward, dynamic=True)

    def ours(np_, n, t):
        if args.compile:
            model.forward = compiled
        try:
            r = generate(
                model,
                tok,
                ps[:np_],
                n=n,
                max_new_tokens=t,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                seed=1,
                ignore_eos=True,
                check_every=args.check_every,
            )
        finally:
            model.forward = forward
        return r.num_generated_tokens

    def hf(np_, n, t, static=False):
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None
        e = {k: v[:np_] for k, v in enc.items()}
        extra = {"cache_implementation": "static"} if static else {}
        try:
            with torch.no_grad():
                out = model.generate(
                    **e,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=t,
                    num_return_sequences=n,
                    pad_token_id=tok.pad_token_id,
                    **extra,
                )
        finally:
            model.generation_config.eos_token_id = saved
        return int(out.shape[0] * (out.shape[1] - e["input_ids"].shape[1]))

    sides = {"ours" + (" (compiled)" if args.compile else ""): ours, "HF generate": hf}
    if args.hf_static:
        sides["HF generate (static cache)"] = lambda a, b, c: hf(a, b, c, static=True)

    def measure(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        tokens = fn(N_PROMPTS, N_SAMPLES, new_tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        return {
            "tokens": tokens,
            "seconds": elapsed,
            "peak": torch.cuda.max_memory_allocated() - base,
        }

    for name, fn in sides.items():  # warm-up (kernels, allocator, compile)
        t = time.perf_counter()
        fn(2, 2, 16)
        torch.cuda.synchronize()
        print(f"# warm-up {name}: {time.perf_counter() - t:.1f}s", flush=True)

    results = _common.alternate(
        {name: (lambda fn=fn: measure(fn)) for name, fn in sides.items()}, args.passes
    )
    ref = "HF generate"
    ref_tps = _common.median([r["tokens"] / r["seconds"] for r in results[ref]])
    rows = []
    for name, res in results.items():
        tps = _common.median([r["tokens"] / r["seconds"] for r in res])
        sec = _common.median([r["seconds"] for r in res])
        peak = _common.median([r["peak"] for r in res]) / 2**30
        util = total_bytes / sec / bw
        rows.append(
            [
                name,
                f"{tps:,.0f}",
                f"{tps / ref_tps:.2f}x",
                f"{sec:.2f}",
                f"{peak:.2f}",
                f"{100 * util:.1f}%",
                " ".join(f"{r['tokens'] / r['seconds']:,.0f}" for r in res),
            ]
        )
    print()
    print(
        f"Qwen2.5-0.5B-shaped, bf16, {n_seq} seqs ({N_PROMPTS} prompts x {N_SAMPLES}) x "
        f"{new_tokens} new tokens, median of {args.passes} alternated passes"
    )
    print(
        _common.format_table(
            ["side", "tok/s", "vs HF", "seconds", "peak GiB", "BW util", "tok/s per pass"], rows
        )
    )
    print(
        f"BW util = (weights {weight_bytes / 2**30:.2f} GiB + KV read) per decode step, summed, "
        f"/ elapsed / copy bandwidth {bw / 1e12:.2f} TB/s. Targets: >= 5x HF, >= 40%."
    )


if __name__ == "__main__":
    main()
