"""Benchmark: peergrade.generation.kernel.generate vs model.generate(do_sample=True) on CPU.

Run from the repo root:  PYTHONPATH=src python bench/rollout.py [--passes 3]

Workload (the GRPO rollout step): 32 chat-templated arithmetic word problems (character
tokenizer, about 130 prompt tokens each) x 8 samples, 64 new tokens, temperature 1, no top-k/top-p,
float32, 2 torch threads (``--threads``). Two models with random weights:

  (a) tiny : Qwen2, hidden 128, 4 layers, char vocab (~100 tokens)          ~1.0M params
  (b) small: Qwen2, hidden 384, 8 layers, 32,000-token vocab               ~29.6M params

Fairness:
- Same model weights, prompts, sampling settings and thread count on both sides.
- EOS never ends a sequence on either side (ours: ``ignore_eos=True``; HF: the generation
  config's eos is removed, which adds no logits processor), so both generate exactly
  32 * 8 * 64 = 16,384 tokens and tokens/s counts the same tokens. Our row-dropping of finished
  sequences therefore gives no advantage here.
- The 32k vocab of (b) makes the LM head and the sampling over the vocabulary cost what they do
  in a real model; its tokenizer is the character tokenizer plus 31,900 dummy word tokens (the
  model can sample them; they decode to ``<w123>``-style strings).
- Each (side, model, pass) runs in a fresh subprocess: the model is built, one small warm-up
  call is made, the peak-RSS mark is reset, then the timed call runs. "peak MiB" is the growth
  of the peak RSS over the RSS just before the timed call (so the model itself is excluded);
  the timed call includes our final text decode.
- Sides alternate A B / B A across passes; the table shows medians.

What it does not measure: GPU speed (see bench/gpu_rollout.py), or stop strings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

N_PROMPTS, N_SAMPLES, NEW_TOKENS = 32, 8, 64
MODELS = {
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab=None),
    "small": dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, vocab=32000),
}


def _build(name: str):
    import torch

    from peergrade.model.tiny import CHARS, build_char_tokenizer, build_tiny_model

    spec = dict(MODELS[name])
    vocab = spec.pop("vocab")
    if vocab is None:
        tok = build_char_tokenizer()
    else:
        base = build_char_tokenizer()
        extra = [f"<w{i}>" for i in range(vocab - len(base))]
        tok = build_char_tokenizer(chars=CHARS + extra)
    model, tok = build_tiny_model("qwen2", tok, seed=0, **spec)
    model.eval()
    torch.manual_seed(0)
    return model, tok


def _prompts(tok) -> list[str]:
    out = []
    for i in range(N_PROMPTS):
        a, b = 3 + i, 7 + 2 * i
        q = (
            f"Sam has {a} boxes with {b} pencils in each box. He gives away {i + 2} pencils. "
            "How many pencils does he have left?"
        )
        msgs = [
            {"role": "system", "content": "Think step by step. End with: #### <answer>"},
            {"role": "user", "content": q},
        ]
        out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def child(side: str, name: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    model, tok = _build(name)
    prompts = _prompts(tok)
    n_params = sum(p.numel() for p in model.parameters())

    if side == "ours":
        from peergrade.generation.kernel import generate

        def call(ps, n, t):
            r = generate(
                model,
                tok,
                ps,
                n=n,
                max_new_tokens=t,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                seed=1,
                ignore_eos=True,
            )
            return r.num_generated_tokens

    elif side == "hf":
        model.generation_config.eos_token_id = None  # never stop early (see module docstring)

        def call(ps, n, t):
            enc = tok(ps, return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(1)
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=t,
                    num_return_sequences=n,
                    pad_token_id=tok.pad_token_id,
                )
            return int(out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1]))

    else:
        raise ValueError(f"unknown side {side!r}: expected 'ours' or 'hf'")

    call(prompts[:2], 2, 4)  # warm-up
    base_rss = _common.rss_now()
    reset_ok = _common.peak_rss_reset()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = call(prompts, N_SAMPLES, NEW_TOKENS)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "peak_bytes": _common.peak_rss() - base_rss,
        "peak_reset": reset_ok,
        "params": n_params,
        "prompt_len": sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        / len(prompts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--models", default="tiny,small", help="comma list of: tiny, small")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads per side (1 is steadier when busy)"
    )
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _common.emit(child(*args.child, args.threads))
        return

    print(f"# before: {_common.load_note()}", flush=True)
    me = os.path.abspath(__file__)
    rows = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}: expected one of {sorted(MODELS)}")
        sides = {
            side: (
                lambda side=side, name=name: _common.run_child(
                    [me, "--child", side, name, "--threads", str(args.threads)]
                )
            )
            for side in ("ours", "hf")
        }
        res = _common.alternate(sides, args.passes)
        tps = {s: _common.median([r["tokens"] / r["seconds"] for r in res[s]]) for s in res}
        cps = {s: _common.median([r["tokens"] / r["cpu_seconds"] for r in res[s]]) for s in res}
        mem = {s: _common.median([r["peak_bytes"] for r in res[s]]) / 2**20 for s in res}
        info = res["ours"][0]
        label = f"({'a' if name == 'tiny' else 'b'}) {name} {info['params'] / 1e6:.1f}M"
        rows.append(
            [
                label,
                f"{info['prompt_len']:.0f}",
                f"{tps['ours']:.0f}",
                f"{tps['hf']:.0f}",
                f"{tps['ours'] / tps['hf']:.2f}x",
                f"{cps['ours']:.0f}",
                f"{cps['hf']:.0f}",
                f"{cps['ours'] / cps['hf']:.2f}x",
                f"{mem['ours']:.0f}",
                f"{mem['hf']:.0f}",
                f"{mem['ours'] / max(mem['hf'], 1e-9):.2f}",
            ]
        )
        per_pass = ", ".join(
            f"{s}: " + " ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in res[s]) for s in res
        )
        print(f"# {name} tokens/s per pass -> {per_pass}", flush=True)
    print()
    print(
        f"{N_PROMPTS} prompts x {N_SAMPLES} samples x {NEW_TOKENS} new tokens, fp32, "
        f"{args.threads} thread(s), "
        f"median of {args.passes} alternated passes, each side in a fresh process"
    )
    print(
        _common.format_table(
            [
                "model",
                "prompt tok",
                "ours tok/s",
                "HF tok/s",
                "speedup",
                "ours tok/cpu-s",
                "HF tok/cpu-s",
                "cpu speedup",
                "ours peak MiB",
                "HF peak MiB",
                "mem ratio",
            ],
            rows,
        )
    )
    print(
        "tok/s = generated tokens / wall seconds; tok/cpu-s = per CPU-second of the process "
        "(less sensitive to other processes on a shared machine); peak MiB = peak-RSS growth "
        "during the timed call"
    )
    print(f"# after: {_common.load_note()}")


if __name__ == "__main__":
    main()
