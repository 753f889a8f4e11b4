"""Shared fixtures: tiny models built locally (no hub access on these machines)."""

from __future__ import annotations

import os

import pytest

# Two cores on CI: keep torch from oversubscribing them when tests run model code.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def char_tokenizer():
    from peergrade.model.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen2(char_tokenizer):
    """(model, tokenizer): a ~0.1M-param Qwen2ForCausalLM in float32, eval mode."""
    from peergrade.model.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen2", char_tokenizer, seed=0)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_llama(char_tokenizer):
    """(model, tokenizer): a ~0.1M-param LlamaForCausalLM in float32, eval mode."""
    from peergrade.model.tiny import build_tiny_model

    model, tok = build_tiny_model("llama", char_tokenizer, seed=1)
    return model.eval(), tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory holding a tiny Qwen2 model + char tokenizer in save_pretrained layout."""
    from peergrade.model.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), "qwen2", seed=0)
