"""Tiny Hugging Face models and character-level tokenizers, built locally from a config.

Nothing here downloads anything: the tokenizer is a character-level ``tokenizers`` model
wrapped in ``PreTrainedTokenizerFast`` (so it saves/loads like any HF tokenizer) with a
ChatML-style chat template, and the model is a standard ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` with random weights. The bundled demo model and the test-suite fixtures
are both made here, so they take exactly the code path a real checkpoint takes.

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
SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Printable ASCII plus newline: every character a prompt or an answer of the built-in tasks uses.
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]


def build_char_tokenizer(chars: list[str] | None = None, chat_template: str = CHAT_TEMPLATE):
    """A fast character-level tokenizer: one token per character, ChatML special tokens.

    pad = ``<pad>`` (id 0), eos = ``<|im_end|>`` (the end of an assistant turn).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = CHARS if chars is None else chars
    vocab = {
        tok: i
        for i, tok in enumerate(SPECIAL_TOKENS + [c for c in chars if c not in SPECIAL_TOKENS])
    }
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", padding_side="left"
    )
    tok.chat_template = chat_template
    return tok


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
