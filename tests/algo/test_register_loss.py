"""The policy loss's typed boundary: ``register_loss`` (a loss added without forking, used by the
GRPO update through ``algo.loss_type``), its errors, and the typed ``LossOptions`` records
giving the keyword form's result bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

import peergrade
from peergrade.algo import (
    CispoLoss,
    ClippedLoss,
    CustomLoss,
    DrGrpoLoss,
    LossBatch,
    LossCounts,
    LossOptions,
    SapoLoss,
    VespoLoss,
    loss_names,
    loss_options,
    loss_registry,
    policy_loss,
    register_loss,
)
from peergrade.config import ConfigError
from peergrade.training.update import GRPO, Models, UpdateInputs, grpo_update, loss_options_for
from test_update_fast import ConstantSchedule, RecordingOptimizer, _batch, _cfg


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry: what a test registers is gone after it."""
    monkeypatch.setattr(loss_registry, "_REGISTRY", dict(loss_registry._REGISTRY))


def _tensors(seed: int = 0, B: int = 4, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    return logp, old, adv, mask


def scaled_dapo(scale: float, calls: list):
    """A registered loss: ``scale`` times the built-in dapo loss (token mean over the
    minibatch's ``num_tokens``), recording what it was given."""

    def fn(batch: LossBatch, options: LossOptions):
        calls.append((batch, options))
        dapo = LossOptions(
            ClippedLoss("dapo"),
            clip_eps=options.clip_eps,
            clip_eps_high=options.clip_eps_high,
        )
        loss, m = policy_loss(
            batch.logp, batch.old_logp, batch.advantages, batch.mask, dapo, counts=batch.counts
        )
        return loss * scale, {"custom/calls": float(len(calls))}

    return fn


def _grads(model, tok, batch, adv, cfg):
    policy = copy.deepcopy(model)
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    models = Models(policy, tok, None, torch.device("cpu"))
    m = grpo_update(models, opt, ConstantSchedule(), UpdateInputs(batch, adv), cfg, step=1)
    return opt.grads, m


def test_a_registered_loss_drives_the_grpo_update(tiny_qwen2, registry):
    """algo.loss_type names the registered loss: the update calls it on every micro-batch with
    the config's options, and its loss is what is backpropagated (3 x dapo's gradient)."""
    model, tok = tiny_qwen2
    batch = _batch(tok.vocab_size, [3, 5, 4], group=4, max_c=6, seed=2)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 2.0, 0.0, -2.0, 0.3, 0.7, -0.7, 0.0])
    calls: list = []
    register_loss("triple_dapo", scaled_dapo(3.0, calls))
    assert loss_names()[-1] == "triple_dapo"

    cfg = _cfg(**{"algo.loss_type": "dapo", "algo.clip_eps_high": 0.28})
    ref_grads, _ = _grads(model, tok, batch, adv, cfg)
    cfg.algo.loss_type = "triple_dapo"  # (config's Literal check: see the report)
    grads, metrics = _grads(model, tok, batch, adv, cfg)

    assert len(calls) == 4  # 2 minibatches of 6 rows x 2 micro-batches of 3, none left out
    got_batch, got_options = calls[0]
    assert got_options.family == CustomLoss("triple_dapo")
    assert (got_options.clip_eps, got_options.clip_eps_high) == (0.2, 0.28)
    assert got_batch.counts.num_sequences == 6 and got_batch.logp.requires_grad
    assert metrics["custom/calls"] > 0 and "loss/policy" in metrics
    assert len(grads) == len(ref_grads) == 2  # one optimizer step per minibatch
    for step_grads, step_ref in zip(grads, ref_grads):
        assert any(bool(g.abs().sum() > 0) for g in step_ref)
        for g, r in zip(step_grads, step_ref):
            torch.testing.assert_close(g, 3.0 * r, rtol=1e-4, atol=1e-6)


def test_loss_options_for_reads_the_config_and_refuses_unknown_names(registry):
    cfg = _cfg(**{"algo.loss_type": "sapo", "algo.sapo_temperature_neg": 1.2, "algo.beta": 0.05})
    opts = loss_options_for(cfg)
    assert opts.family == SapoLoss(temperature_pos=1.0, temperature_neg=1.2)
    assert opts.beta == 0.05 and opts.ratio_level == "token"
    cfg.algo.loss_type = "dr_grpo"
    assert loss_options_for(cfg).family == DrGrpoLoss(max_completion_length=6)

    cfg.algo.loss_type = "not_registered"
    with pytest.raises(ConfigError, match=r"algo\.loss_type: expected one of .*'grpo'.*'vespo'"):
        loss_options_for(cfg)
    with pytest.raises(ConfigError, match=r"not_registered"):
        GRPO(None, None, None, cfg)  # fails at setup, not at the first update
    register_loss("not_registered", scaled_dapo(1.0, []))
    assert loss_options_for(cfg).family == CustomLoss("not_registered")


def test_an_unknown_loss_type_names_every_registered_loss(registry):
    register_loss("my_loss", scaled_dapo(1.0, []))
    logp, old, adv, mask = _tensors()
    with pytest.raises(
        ValueError, match=r"loss_type: expected one of \('grpo', 'bnpo'.*'my_loss'\)"
    ):
        policy_loss(logp, old, adv, mask, loss_type="nope")
    options = LossOptions(CustomLoss("also_nope"))  # a record naming nothing registered
    with pytest.raises(ValueError, match=r"'vespo', 'my_loss'\).*got 'also_nope'"):
        policy_loss(logp, old, adv, mask, options)


def test_registering_a_name_twice_is_refused(registry):
    fn = scaled_dapo(1.0, [])
    for name in loss_registry.LOSS_TYPES:
        with pytest.raises(ValueError, match=rf"{name!r} is a built-in loss type"):
            register_loss(name, fn)
        with pytest.raises(ValueError, match=r"built-in"):
            register_loss(name, fn, replace=True)
    register_loss("mine", fn)
    with pytest.raises(ValueError, match=r"'mine' is already registered; pass replace=True"):
        register_loss("mine", scaled_dapo(2.0, []))
    other = scaled_dapo(2.0, [])
    assert register_loss("mine", other, replace=True) is other
    assert loss_registry.loss_function("mine") is other
    with pytest.raises(ValueError, match=r"name must be a non-empty identifier"):
        register_loss("", fn)
    with pytest.raises(ValueError, match=r"fn must be callable"):
        register_loss("not_callable", 3)


def test_register_loss_is_public_at_the_top_level():
    assert peergrade.register_loss is register_loss
    assert "register_loss" in peergrade.__all__


def test_a_registered_loss_without_loss_policy_reports_its_loss(registry):
    register_loss("plain", lambda batch, options: ((batch.logp * batch.mask).sum() * 0.5, {}))
    logp, old, adv, mask = _tensors(1)
    loss, m = policy_loss(logp, old, adv, mask, loss_type="plain")
    assert m == {"loss/policy": float(loss)}
    assert float(loss) == pytest.approx(0.5 * float((logp * mask).sum()))


@pytest.mark.parametrize(
    ("flat", "family"),
    [
        ({"loss_type": "grpo", "delta": 3.0}, ClippedLoss("grpo", delta=3.0)),
        ({"loss_type": "luspo", "ratio_level": "sequence"}, ClippedLoss("luspo")),
        ({"loss_type": "dr_grpo", "max_completion_length": 7}, DrGrpoLoss(7)),
        ({"loss_type": "cispo", "cispo_cap": 5.0}, CispoLoss(cap=5.0)),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.8}, SapoLoss(temperature_pos=0.8)),
        ({"loss_type": "vespo", "vespo_k_neg": 1.5}, VespoLoss(k_neg=1.5)),
    ],
)
def test_the_typed_records_give_the_keyword_form_bit_for_bit(flat, family):
    logp, old, adv, mask = _tensors(3)
    ref = logp + 0.1
    shared = {"clip_eps_high": 0.28, "beta": 0.04, "kl_estimator": "k2"}
    ratio_level = flat.get("ratio_level", "token")
    typed = LossOptions(family, ratio_level=ratio_level, **shared)
    assert loss_options(**flat, **shared) == typed
    counts = {"num_tokens": 40, "num_sequences": 8}
    results = []
    for call in ("flat", "typed"):
        x = logp.clone().requires_grad_(True)
        if call == "flat":
            loss, m = policy_loss(x, old, adv, mask, ref_logp=ref, **flat, **shared, **counts)
        else:
            loss, m = policy_loss(
                x, old, adv, mask, typed, ref_logp=ref, counts=LossCounts(**counts)
            )
        loss.backward()
        results.append((loss.detach(), x.grad, m))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


def test_the_records_check_their_values():
    with pytest.raises(ValueError, match=r"sapo_temperature_neg: expected a positive number"):
        SapoLoss(temperature_neg=0.0)
    with pytest.raises(ValueError, match=r"vespo_lambda_pos: expected a number >= 0"):
        VespoLoss(lambda_pos=-1.0)
    with pytest.raises(ValueError, match=r"max_completion_length: expected a positive int"):
        DrGrpoLoss(0)
    with pytest.raises(ValueError, match=r"ClippedLoss.loss_type: expected grpo, bnpo"):
        ClippedLoss("cispo")
    with pytest.raises(ValueError, match=r"'grpo' is a built-in loss type"):
        CustomLoss("grpo")
    with pytest.raises(ValueError, match=r"clip_eps: expected a positive number"):
        LossOptions(clip_eps=0.0)
    with pytest.raises(ValueError, match=r"LossOptions.family: expected one of"):
        LossOptions("grpo")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['clip_epsilon'\]"):
        loss_options("grpo", clip_epsilon=0.2)
    logp, old, adv, mask = _tensors()
    with pytest.raises(TypeError, match=r"the keyword options \['beta'\] would be ignored"):
        policy_loss(logp, old, adv, mask, LossOptions(), beta=0.1)
