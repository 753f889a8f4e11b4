"""algo.off_policy_correction in the GRPO update and the trainer: behaviour log-probs equal to
pi_old change no bit of the gradient; a behaviour policy far from pi_old masks every token
(zero gradient); the config keys are validated; a real run logs the sampler/trainer mismatch."""

from __future__ import annotations

import copy

import pytest
import torch

from peergrade.config import ConfigError, load_config
from peergrade.training.trainer import train
from peergrade.training.update import Models, UpdateInputs, frozen_logprobs, grpo_update
from test_trainer import read_metrics, reward_file, tiny_overrides  # noqa: F401 (fixture)
from test_update_fast import ConstantSchedule, RecordingOptimizer, _batch, _cfg

ADV = torch.tensor([0.2, -0.4, 0.5, -0.3, 0.5, 0.1, -0.5, 0.7, 1.0, -1.0, 0.3, -0.3])


def _grads(model, tok, batch, cfg, behaviour):
    policy = copy.deepcopy(model)
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    models = Models(policy, tok, None, torch.device("cpu"))
    exp = UpdateInputs(batch, ADV, sampler_logprobs=behaviour)
    m = grpo_update(models, opt, ConstantSchedule(), exp, cfg, 3)
    return opt.grads, m


@pytest.mark.parametrize("correction", ["token_tis", "sequence_tis", "token_mis", "sequence_mis"])
def test_behaviour_equal_to_old_changes_no_bit(tiny_qwen2, correction):
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6)
    cfg = _cfg()  # two optimizer steps: pi_old is the frozen pass over every row
    plain, m_plain = _grads(model, tok, batch, cfg, None)
    behaviour = frozen_logprobs(model, batch, cfg)  # the same pass as pi_old's
    cfg_c = _cfg(**{"algo.off_policy_correction": correction})
    got, m = _grads(model, tok, batch, cfg_c, behaviour)
    assert len(got) == len(plain) == 2
    for a, b in zip(plain, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert m["correction/weight_mean"] == m["correction/weight_min"] == 1.0
    assert m["correction/weight_max"] == 1.0
    assert m["correction/masked_frac"] == m["correction/truncated_frac"] == 0.0
    assert m["loss/policy"] == m_plain["loss/policy"]


def test_far_behaviour_is_masked_out_of_the_gradient(tiny_qwen2):
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=1)
    behaviour = frozen_logprobs(model, batch, _cfg()) + 3.0  # r = exp(-3) < 0.5 everywhere
    plain, _ = _grads(model, tok, batch, _cfg(), behaviour)  # correction none: ignored
    assert any(g.abs().sum() > 0 for g in plain[0])
    got, m = _grads(
        model, tok, batch, _cfg(**{"algo.off_policy_correction": "token_mis"}), behaviour
    )
    assert all(g.abs().sum() == 0 for step in got for g in step)
    assert m["correction/masked_frac"] == 1.0
    assert m["correction/weight_max"] == 0.0
    # TIS keeps them all, at weight exp(-3)
    _, m = _grads(model, tok, batch, _cfg(**{"algo.off_policy_correction": "token_tis"}), behaviour)
    assert m["correction/weight_mean"] == pytest.approx(torch.exp(torch.tensor(-3.0)).item())


@pytest.mark.parametrize(
    "over,match",
    [
        ({"algo.off_policy_correction": "tis"}, "token_tis"),
        ({"algo.off_policy_cap": 0.9}, "algo.off_policy_cap"),
        ({"algo.off_policy_low": 1.5}, "algo.off_policy_low"),
        ({"algo.off_policy_high": 0.5}, "algo.off_policy_high"),
        ({"algo.off_policy_sequence_ratio": "mean"}, "geometric"),
        ({"algo.name": "ppo", "algo.off_policy_correction": "token_tis"}, "GRPO option"),
    ],
)
def test_config_keys_are_validated(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, list(over.items()))


def test_run_logs_the_sampler_trainer_mismatch(tiny_model_dir, reward_file, tmp_path):  # noqa: F811
    """The synchronous sampler's log-probs reach the update: TIS weights sit near 1 (the
    sampler's batched, cached logits vs the trainer's recomputation) but are logged."""
    over = {"train.steps": 1, "algo.off_policy_correction": "token_tis"}
    cfg = load_config(None, tiny_overrides(tiny_model_dir, reward_file, **over))
    train(cfg, tmp_path / "run")
    (row,) = [r for r in read_metrics(tmp_path / "run") if "loss/policy" in r]
    assert row["correction/weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert 0 < row["correction/weight_min"] <= 1.0 <= row["correction/weight_max"] <= 2.0
    assert row["correction/masked_frac"] == 0.0


@pytest.mark.parametrize(
    "over,expected",
    [
        ({}, "none"),  # synchronous: the sampler is the current policy
        ({"rollout.async_steps": 1}, "token_tis"),  # pipelined: samples a version old
        ({"rollout.async_steps": 2, "algo.off_policy_correction": "none"}, "none"),  # as set
        ({"algo.off_policy_correction": "sequence_mis"}, "sequence_mis"),
        ({"algo.name": "ppo"}, "none"),
    ],
)
def test_auto_correction_is_token_tis_exactly_when_rollouts_are_pipelined(over, expected):
    from peergrade.config import off_policy_correction

    cfg = load_config(None, list(over.items()))
    assert off_policy_correction(cfg) == expected


def test_a_pipelined_run_corrects_by_default(tiny_model_dir, reward_file, tmp_path):  # noqa: F811
    """rollout.async_steps 1 with the default algo.off_policy_correction (auto): the update
    weights stale samples (correction/* metrics logged); set none and it does not."""
    for correction, logged in (("auto", True), ("none", False)):
        over = {
            "train.steps": 3,
            "rollout.async_steps": 1,
            "algo.off_policy_correction": correction,
        }
        cfg = load_config(None, tiny_overrides(tiny_model_dir, reward_file, **over))
        train(cfg, tmp_path / correction)
        rows = [r for r in read_metrics(tmp_path / correction) if "loss/policy" in r]
        assert all(("correction/weight_mean" in r) == logged for r in rows), correction
