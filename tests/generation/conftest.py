"""Fixtures the vLLM engine tests share (tests/generation/test_vllm_*.py)."""

from __future__ import annotations

import pytest

from peergrade.config import load_config


@pytest.fixture(scope="module")
def bundled():
    """The bundled model, its tokenizer and 60 encoded prompts of its task."""
    from peergrade.training.components import build_task, encode_rows, setup_models

    cfg = load_config(None)
    task = build_task(cfg)
    models = setup_models(cfg)
    rows = task.train_rows(0)
    ids = encode_rows(cfg, task, models.tokenizer, [next(rows) for _ in range(60)])
    return models.policy, models.tokenizer, ids
