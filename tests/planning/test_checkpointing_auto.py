"""model.gradient_checkpointing: auto -- on only where the memory planner says the step does not
fit without it in the memory the run may use; the decision, its config plumbing and the
start-up line (no timing)."""

from __future__ import annotations

import pytest

from peergrade.config import load_config
from peergrade.config.load import ConfigError
from peergrade.planning import memory
from peergrade.planning.memory import (
    CHECKPOINTING_SHARE,
    checkpointing_decision,
    estimate_for_config,
    resolve_checkpointing,
)

GIB = 1024**3


def _cfg(model_dir, **over):
    base = {
        "model.path": str(model_dir),
        "model.device": "cpu",
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_completion_length": 8,
        "train.threads": 1,
    }
    base.update(over)
    return load_config(None, list(base.items()))


def test_decision_is_off_when_the_peak_fits_and_on_when_it_does_not():
    limit = int(10 * GIB * CHECKPOINTING_SHARE)
    on, why = checkpointing_decision(limit, 10 * GIB, "the available memory")
    assert not on and "fits in 9.00 GiB (90% of the available memory, 10.00 GiB)" in why
    on, why = checkpointing_decision(limit + 1, 10 * GIB, "the GPU's free memory")
    assert on and "does not fit" in why and "the GPU's free memory" in why


def test_default_is_auto_and_values_are_checked():
    assert load_config(None).model.gradient_checkpointing == "auto"
    for value in (True, False, None, "auto"):
        cfg = load_config(None, [("model.gradient_checkpointing", value)])
        assert cfg.model.gradient_checkpointing == value
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        load_config(None, [("model.gradient_checkpointing", "sometimes")])


def test_true_false_and_null_keep_their_meaning(tiny_model_dir):
    for value, cpu, cuda in ((True, True, True), (False, False, False), (None, False, True)):
        cfg = _cfg(tiny_model_dir, **{"model.gradient_checkpointing": value})
        assert resolve_checkpointing(cfg) is None and cfg.checkpointing_auto is None
        assert (cfg.gradient_checkpointing_on("cpu"), cfg.gradient_checkpointing_on("cuda")) == (
            cpu,
            cuda,
        )
    auto = _cfg(tiny_model_dir)  # auto, not decided (the trainer set up directly): as null
    assert (auto.gradient_checkpointing_on("cpu"), auto.gradient_checkpointing_on("cuda")) == (
        False,
        True,
    )


@pytest.mark.parametrize("room,expect", [(100.0, False), (0.5, True)])
def test_auto_compares_the_estimate_without_checkpointing_to_the_memory(
    tiny_model_dir, monkeypatch, room, expect
):
    """The memory is set to ``room`` times the step's estimated peak without checkpointing:
    plenty -> off; half of it -> on."""
    cfg = _cfg(tiny_model_dir, **{"model.gradient_checkpointing": "auto"})
    probe = _cfg(tiny_model_dir, **{"model.gradient_checkpointing": False})
    peak = estimate_for_config(probe, device="cpu")["step_peak"]
    with_ckpt = _cfg(tiny_model_dir, **{"model.gradient_checkpointing": True})
    assert estimate_for_config(with_ckpt, device="cpu")["step_peak"] < peak  # what on buys
    monkeypatch.setattr(memory, "run_memory", lambda device: (int(peak * room), "the test's"))
    on, why = resolve_checkpointing(cfg)
    assert on is expect and cfg.checkpointing_auto == (on, why)
    assert cfg.gradient_checkpointing_on("cpu") is expect
    assert cfg.model.gradient_checkpointing == "auto"  # config.yaml keeps auto
    assert f"{peak / GIB:.2f} GiB" in why and "the test's" in why


def test_auto_without_an_estimate_keeps_the_old_default_and_says_why(tmp_path, monkeypatch):
    cfg = load_config(None, [("model.path", str(tmp_path)), ("model.device", "cpu")])
    on, why = resolve_checkpointing(cfg)  # an empty model dir: nothing to estimate from
    assert on is False and why.startswith("no memory estimate (") and "off on the CPU" in why


def test_the_start_up_line_says_what_auto_chose(tiny_model_dir, monkeypatch):
    from peergrade.training import trainer

    cfg = _cfg(tiny_model_dir, **{"train.eval_size": 1})
    monkeypatch.setattr(memory, "run_memory", lambda device: (64 * GIB, "the available memory"))
    resolve_checkpointing(cfg)
    run = trainer.setup(cfg)
    policy = run.models.policy
    name = "is_activation_checkpointing"  # transformers 5's name, is_gradient_checkpointing before
    assert not getattr(policy, name if hasattr(policy, name) else "is_gradient_checkpointing")

    lines = []

    class Shown:
        def print(self, line, **_):
            lines.append(line)

    held_out = trainer.HeldOut.of(run)
    out = type("Out", (), {"trainer_state": {"eval_before": {}}})()
    trainer.evaluate_start(held_out, out, Shown(), None, None)
    assert any(
        line.startswith("gradient checkpointing: off (auto: the step's estimated peak")
        for line in lines
    ), lines
