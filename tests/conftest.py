"""Shared fixtures: tiny models built locally (no hub access on these machines).

The tests mirror ``src/peergrade/``: ``tests/algo/`` tests ``peergrade.algo``, and so on; what
spans the package (the docs, the layering, the examples, the README's commands) stays here.
A test module imports another's helpers by its name (``from test_envs import Steered``),
wherever each lives, so every test folder is on the import path, whichever file runs alone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Two cores on CI: keep torch from oversubscribing them when tests run model code.
os.environ.setdefault("OMP_NUM_THREADS", "2")

_TESTS = Path(__file__).resolve().parent
for _folder in sorted(_TESTS.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


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
