"""Tiny Hugging Face models and character-level tokenizers, built locally from a config.

Nothing here downloads anything: the tokenizer is a character-level ``tokenizers`` model
wrapped in ``PreTrainedTokenizerFast`` (so it saves/loads like any HF tokenizer) with a
ChatML-style chat template, and the model is a standard ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` with random weights. The bundled demo model and the test-suite fixtures
are both made here, so they take exactly the code path a real checkpoint takes.

The character-level tokenizer is written in the *byte-level BPE* form that Qwen2/GPT-2
tokenizers use (vocabulary symbols in the byte-level alphabet, so ``" "`` is ``"Ġ"`` and
``"\n"`` is ``"Ċ"``; no merges, so every character stays one token), with exactly the
normaliser and pre-tokenizer that ``Qwen2Tokenizer`` builds. That is what makes a saved
directory load with the same token ids through plain ``AutoTokenizer``: transformers v5 loads
a ``model_type: qwen2`` directory with ``Qwen2Tokenizer`` whatever ``tokenizer_config.json``
declares, and that class rebuilds the pipeline around the saved vocabulary (a plain
word-level vocabulary lost every space and newline there). ``to_byte_level`` converts a
tokenizer of the older word-level form (same ids) so that what peergrade saves from one
round-trips too. Characters outside the vocabulary (non-ASCII) are dropped, as before.

This module does not train anything (``peergrade sft`` does).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A compact template for the bundled demo model: with one token per character, ChatML's role
# headers would be most of every sequence. "S:" system, "Q:" user, "A:" assistant; an assistant
# turn ends with <|im_end|> (the eos token), so answers end exactly as in ChatML.
COMPACT_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q:{{ m['content'] }}\n"
    "{% else %}A:{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
# The compact template with tool turns, for the calculator demo's model (tiny-calc): "R:" a tool
# result, left-aligned in a field of 10 characters, so that a result's digits always sit at the
# same distance from the answer that copies them (a fixed-offset copy is what a 0.75M-parameter
# model learns in minutes). An assistant turn renders its calls in the Hermes / Qwen2 format
# after its text; tool schemas are not rendered (with one token per character they would dwarf
# the problem: the model learns its one tool from its warm-up). Prefix-preserving, as the
# episode runner needs.
COMPACT_TOOL_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}S:{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Q:{{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}R:{{ '%-10s' | format(m['content']) }}\n"
    "{% else %}A:{{ m['content'] or '' }}{% for tc in m.get('tool_calls') or [] %}<tool_call>"
    '{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{{ tc['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
# A Qwen2.5-style template that renders tools and tool turns (for episode tests and demos): a
# default system prompt when the conversation has none, the tool schemas in the system turn,
# assistant tool calls as <tool_call>{json}</tool_call>, consecutive tool results in one user
# turn as <tool_response> blocks. Like Qwen2.5's, it is prefix-preserving.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    'Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not (loop.first and tools) %}"
    "<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'user' or (m['role'] == 'assistant' and not m.get('tool_calls')) %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\\n' }}{{ m['content'] }}{% endif %}"
    "{% for tc in m['tool_calls'] %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{{ tc['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Printable ASCII plus newline: every character a prompt or an answer of the built-in tasks uses.
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


# Qwen2Tokenizer's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2): written
# out here because the saved tokenizer.json must match what that class rebuilds on load.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_symbols(text: str) -> str:
    """``text`` in the byte-level alphabet (GPT-2's bytes_to_unicode): ``" "`` -> ``"Ġ"``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _char_tokenizer_from_vocab(
    vocab: dict[str, int],
    special_tokens: list[str],
    *,
    pad: str,
    eos: str,
    chat_template,
    merges: tuple[tuple[str, str], ...] = (),
):
    """A byte-level BPE tokenizer over ``vocab`` (plain text -> id), without merges unless
    given (a merged pair must be in ``vocab``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt
    from transformers import PreTrainedTokenizerFast

    specials = set(special_tokens)
    bl_vocab = {(t if t in specials else _byte_symbols(t)): i for t, i in vocab.items()}
    if len(bl_vocab) != len(vocab):
        raise ValueError("character vocabulary has entries that collide in byte-level form")
    tk = Tokenizer(
        models.BPE(
            vocab=bl_vocab,
            merges=[(_byte_symbols(a), _byte_symbols(b)) for a, b in merges],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pt.Sequence(
        [
            pt.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token=pad, eos_token=eos, padding_side="left"
    )
    tok.chat_template = chat_template
    return tok


def build_char_tokenizer(
    chars: list[str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
    merges: tuple[tuple[str, str], ...] = (),
):
    """A fast character-level tokenizer: one token per character, ChatML special tokens.

    pad = ``<pad>`` (id 0), eos = ``<|im_end|>`` (the end of an assistant turn). Ids are the
    special tokens, then ``chars`` in order, then one token per pair in ``merges`` (BPE merges,
    e.g. ``("a", "b")`` makes ``"ab"`` one token: text then has two tokenisations, which tests of
    re-tokenisation need). Saved with ``save_pretrained`` it loads with the same ids through
    ``AutoTokenizer`` (see the module docstring).
    """
    chars = CHARS if chars is None else chars
    merged = [a + b for a, b in merges]
    vocab = {
        tok: i
        for i, tok in enumerate(
            SPECIAL_TOKENS + [c for c in chars if c not in SPECIAL_TOKENS] + merged
        )
    }
    return _char_tokenizer_from_vocab(
        vocab,
        SPECIAL_TOKENS,
        pad="<pad>",
        eos="<|im_end|>",
        chat_template=chat_template,
        merges=tuple(merges),
    )


def is_word_level_char_tokenizer(tok) -> bool:
    """Whether ``tok`` is the older word-level character tokenizer this module once built
    (``WordLevel`` model, one-character ``Split`` pre-tokenizer), which ``AutoTokenizer``
    misreads for a Qwen2 directory."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "WordLevel":
        return False  # cheap test first: a real BPE vocabulary's JSON is megabytes
    import json

    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("model", {}).get("type") == "WordLevel"
        and pre.get("type") == "Split"
        and pre.get("pattern", {}).get("Regex") == r"[\s\S]"
    )


def to_byte_level(tok):
    """The byte-level form of a word-level character tokenizer (same ids, same special tokens,
    pad/eos and chat template); any other tokenizer is returned unchanged."""
    if not is_word_level_char_tokenizer(tok):
        return tok
    specials = [t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()]
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    new = _char_tokenizer_from_vocab(
        vocab, specials, pad=tok.pad_token, eos=tok.eos_token, chat_template=tok.chat_template
    )
    new.padding_side = tok.padding_side
    return new


def tiny_config(
    arch: str = "qwen2",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    pad_token_id: int = 0,
    eos_token_id: int | None = None,
    tie_word_embeddings: bool = True,
):
    """A small ``Qwen2Config`` or ``LlamaConfig`` (``arch`` = "qwen2" | "llama")."""
    from transformers import LlamaConfig, Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    if arch == "qwen2":
        return Qwen2Config(**kwargs)
    if arch == "llama":
        return LlamaConfig(**kwargs)
    raise ValueError(f"unknown arch {arch!r}: expected 'qwen2' or 'llama'")


def build_tiny_model(arch: str = "qwen2", tokenizer=None, *, seed: int = 0, **sizes):
    """(model, tokenizer): a randomly initialised causal LM sized by ``sizes`` (see tiny_config)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or build_char_tokenizer()
    cfg = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def save_tiny_model(out_dir: str | Path, arch: str = "qwen2", *, seed: int = 0, **sizes) -> Path:
    """Build a tiny model + char tokenizer and ``save_pretrained`` both into ``out_dir``."""
    model, tok = build_tiny_model(arch, seed=seed, **sizes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
