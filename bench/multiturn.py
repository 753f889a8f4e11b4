"""Benchmark: multi-turn episodes with a KV cache kept across turns vs re-prefilling the history.

Run from the repo root:  PYTHONPATH=src python bench/multiturn.py [--passes 3] [--threads 1]

Workload: 8 rows x 4 episodes of 4 model turns each; after each of the first 3 turns the
environment answers with a short tool result (about 40 template tokens). A random Qwen2 (hidden
128, 4 layers, character vocabulary, the Qwen2.5-style tool template of peergrade.model.tiny), float32,
temperature 1. Every turn ends at the next position that is a multiple of 24 (the wrapper below
forbids eos elsewhere and forces it there), so both sides sample exactly the same number of
tokens and append the same deltas.

- A, "cached": ``peergrade.envs.run_episodes``: one batched KV cache per episode kept across
  turns; a turn prefills only the environment's delta.
- B, "re-prefill": what a loop that rebuilds the prompt every turn does (TRL's tool loop,
  verifiers' chat harness): each turn calls ``peergrade.generation.kernel.generate`` on the whole history
  so far (prompt + turns + deltas as token ids, batched over the live episodes), so every turn
  prefills everything again. B is given the same token deltas and never re-tokenises, so only the
  prefill work differs (and at the first turn, A prefills a row's 4 identical prompts once, B
  four times).

Sides alternate A B / B A in one process; the table shows medians of episodes/s and the ratio.
What it does not measure: GPU speed, memory, or environments that take time to answer.
"""

from __future__ import annotations

import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROWS, N, TURNS, EVERY = 8, 4, 4, 24


def build():
    import torch

    from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, tok = build_tiny_model(
        "qwen2", tok, seed=0, hidden_size=128, num_layers=4, max_position_embeddings=2048
    )

    class TurnsOfFixedLength(torch.nn.Module):
        """eos exactly at positions p with (p + 1) % EVERY == 0, never elsewhere."""

        def __init__(self):
            super().__init__()
            self.inner, self.config = inner, inner.config
            self.generation_config = inner.generation_config

        def forward(
            self,
            input_ids,
            attention_mask=None,
            position_ids=None,
            cache=None,
            use_cache=None,
            logits_to_keep=0,
        ):
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
            )
            pos = position_ids[:, -out.logits.shape[1] :]
            at = ((pos + 1) % EVERY == 0).to(out.logits.dtype)
            out.logits[..., tok.eos_token_id] = 1e4 * at - 1e4 * (1 - at)
            return out

    return TurnsOfFixedLength().eval(), tok


def tool_result(turn: int, reply: str = "", varied: bool = False) -> str:
    """The tool's answer after model turn ``turn``. ``varied``: padded with 0 to EVERY - 1 dots,
    as many as a hash of the reply's text says, so the next turn (it ends at the next multiple
    of EVERY) has a length of its own in each episode, as real turns do."""
    return f"result {turn * 42}" + ("." * (zlib.crc32(reply.encode()) % EVERY) if varied else "")


class Tool:
    def __init__(self, varied: bool = False):
        self.turns, self.varied = 0, varied

    def reset(self, row):
        return [{"role": "user", "content": f"What is {row['a']} * {row['b']}? Use the tool."}]

    def step(self, message):
        from peergrade.envs import Step

        self.turns += 1
        if self.turns >= TURNS:
            return Step(done=True)
        text = tool_result(self.turns, message.get("content") or "", self.varied)
        return Step([{"role": "tool", "name": "multiply", "content": text}])


def rows():
    return [{"a": 100 + 7 * i, "b": 30 + i} for i in range(ROWS)]


def cached(model, tok, seed):
    from peergrade.generation.episodes import run_episodes

    eps = run_episodes(
        model,
        tok,
        rows(),
        lambda r: Tool(),
        n=N,
        max_completion_length=1000,
        temperature=1.0,
        seed=seed,
    )
    assert all(e.num_turns == TURNS for e in eps), [e.finish_reason for e in eps]
    return sum(len(e.completion_ids) for e in eps)


def reprefill(model, tok, seed):
    from peergrade.envs.template import render, turn_delta
    from peergrade.generation.kernel import generate

    envs = [Tool() for _ in range(ROWS * N)]
    msgs = [env.reset(rows()[i // N]) for i, env in enumerate(envs)]
    hist = [render(tok, m, add_generation_prompt=True) for m in msgs]
    start = [len(h) for h in hist]
    for t in range(TURNS):
        r = generate(
            model,
            tok,
            hist,
            n=1,
            max_new_tokens=EVERY,
            temperature=1.0,
            seed=seed + t,
            eos_token_ids=[tok.eos_token_id],
        )
        for i, ids in enumerate(r.completion_id_lists()):
            assert ids[-1] == tok.eos_token_id
            hist[i] = hist[i] + ids
            msgs[i].append(
                {"role": "assistant", "content": tok.decode(ids[:-1], skip_special_tokens=True)}
            )
            st = envs[i].step(msgs[i][-1])
            if not st.done:
                hist[i] += turn_delta(tok, msgs[i], st.messages, eos_ids=[tok.eos_token_id])
                msgs[i] += st.messages
    return sum(len(h) - s for h, s in zip(hist, start))


def main() -> None:
    ap = _common.arguments(__doc__, passes=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    model, tok = build()
    cached(model, tok, 0)  # warm-up
    reprefill(model, tok, 0)

    def side(fn):
        def run():
            t0 = time.perf_counter()
            tokens = fn(model, tok, 1)
            dt = time.perf_counter() - t0
            return {"s": dt, "episodes_per_s": ROWS * N / dt, "tokens": tokens}

        return run

    res = _common.alternate({"cached": side(cached), "re-prefill": side(reprefill)}, args.passes)
    med = {k: _common.median([r["episodes_per_s"] for r in v]) for k, v in res.items()}
    print(
        _common.format_table(
            ["side", "episodes/s (median)", "s per pass", "tokens after prompts"],
            [
                [k, f"{med[k]:.2f}", " ".join(f"{r['s']:.2f}" for r in v), v[0]["tokens"]]
                for k, v in res.items()
            ],
        )
    )
    print(
        f"cached / re-prefill = {med['cached'] / med['re-prefill']:.2f}x "
        f"({ROWS * N} episodes of {TURNS} turns, {args.threads} thread(s)); {_common.load_note()}"
    )


if __name__ == "__main__":
    main()
