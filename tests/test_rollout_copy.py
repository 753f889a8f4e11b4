"""model.rollout_weights: rollouts sampled from a bfloat16 copy of the policy (issue 16's cut of
the step's biggest phase on an AMX CPU). The copy must follow the policy at every step, keep
float32 buffers, leave training alone, and be chosen by ``auto`` only where bf16 autocast is."""

from __future__ import annotations

import pytest
import torch

from peergrade.config import ConfigError, load_config
from peergrade.update import RolloutCopy, rollout_copy_on


def test_copy_is_bf16_and_follows_the_policy(tiny_qwen2):
    import copy

    model = copy.deepcopy(tiny_qwen2[0])
    rc = RolloutCopy(model)
    shadow = rc.refreshed()
    assert shadow is not model
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in shadow.parameters())
    # buffers (RoPE's inverse frequencies) stay in float32: positions keep their precision
    assert all(b.dtype == torch.float32 for b in shadow.buffers() if b.is_floating_point())
    pairs = list(zip(model.parameters(), shadow.parameters(), strict=True))
    assert all(torch.equal(p.detach().to(torch.bfloat16), q) for p, q in pairs)
    # the policy trains in float32 and is untouched by the copy
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    stale = [q.clone() for q in shadow.parameters()]
    shadow = rc.refreshed()
    assert not all(torch.equal(s, q) for s, q in zip(stale, shadow.parameters()))
    assert all(torch.equal(p.detach().to(torch.bfloat16), q) for p, q in pairs)

    # and it samples like the policy does in bf16: same greedy tokens on a tiny model
    from peergrade.rollout import generate

    tok = tiny_qwen2[1]
    ids = [tok("12+7=", add_special_tokens=False)["input_ids"]]
    ref = copy.deepcopy(model).to(torch.bfloat16)  # a bf16 model built the plain way...
    fp32_buffers = dict(model.named_buffers())
    for name, b in ref.named_buffers():  # ...with the float32 buffers the copy keeps
        b.data = fp32_buffers[name].clone()
    a = generate(shadow, tok, ids, n=1, max_new_tokens=6, temperature=0.0, seed=0)
    r = generate(ref, tok, ids, n=1, max_new_tokens=6, temperature=0.0, seed=0)
    assert a.completion_text == r.completion_text


def _cfg(setting: str, autocast: str = "auto"):
    return load_config(None, [("model.rollout_weights", setting), ("model.autocast", autocast)])


@pytest.mark.parametrize(
    "setting, autocast, device, dtype, params, plain, amx, want",
    [
        ("auto", "auto", "cpu", torch.float32, 135_000_000, True, True, True),
        ("auto", "auto", "cpu", torch.float32, 135_000_000, True, False, False),  # no AMX
        ("auto", "auto", "cpu", torch.float32, 1_000_000, True, True, False),  # tiny model
        ("auto", "auto", "cpu", torch.float32, 135_000_000, False, True, False),  # LoRA / FSDP
        ("auto", "off", "cpu", torch.float32, 135_000_000, True, True, False),  # no autocast
        ("auto", "auto", "cuda", torch.bfloat16, 135_000_000, True, True, False),
        ("auto", "bf16", "cpu", torch.float32, 1_000_000, True, False, True),  # forced autocast
        ("policy", "auto", "cpu", torch.float32, 135_000_000, True, True, False),
        ("bf16", "off", "cpu", torch.float32, 1_000_000, True, False, True),
    ],
)
def test_when_the_copy_is_used(monkeypatch, setting, autocast, device, dtype, params, plain, amx, want):
    import peergrade.update as upd

    monkeypatch.setattr(upd, "cpu_has_amx_bf16", lambda: amx)
    assert rollout_copy_on(_cfg(setting, autocast), device, dtype, params, plain) is want


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rollout_weights=bf16 needs a plain"):
        rollout_copy_on(_cfg("bf16"), "cpu", torch.float32, 10**8, plain=False)
    with pytest.raises(ConfigError, match="rollout_weights"):
        load_config(None, [("model.rollout_weights", "fp8")])


def test_training_with_the_copy_samples_from_it(tiny_model_dir, tmp_path, monkeypatch):
    """``model.rollout_weights=bf16`` on a real run: the copy is made once, generation gets the
    copy (refreshed, so it equals the policy's weights of that step), the update trains the
    float32 policy, and the estimate of ``peergrade memory`` counts the copy's 2 bytes/param."""
    import copy

    import peergrade.trainer as trainer
    from peergrade.memory import estimate_for_config

    reward = tmp_path / "r.py"  # a reward that differs between completions: updates happen
    reward.write_text(
        "def chars(prompts, completions, **kw):\n"
        "    return [float(sum(map(ord, str(c))) % 7) for c in completions]\n"
    )
    cfg = load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            ("rewards", [{"name": f"{reward}:chars", "weight": 1.0}]),
            ("model.rollout_weights", "bf16"),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("optim.lr", 1e-2),
            ("train.threads", 1),
        ],
    )
    run = trainer.setup(cfg)
    assert isinstance(run.rollout_copy, RolloutCopy)
    policy = run.models.policy
    seen = []
    real_generate = trainer.generate

    def spy(model, *args, **kw):
        same = all(
            torch.equal(p.detach().to(torch.bfloat16), q)
            for p, q in zip(policy.parameters(), model.parameters(), strict=True)
        )
        seen.append((model is run.rollout_copy.model, same))
        return real_generate(model, *args, **kw)

    monkeypatch.setattr(trainer, "generate", spy)
    rows = run.task.train_rows(0)
    before = [p.detach().clone() for p in policy.parameters()]
    for step in (1, 2):
        trainer.train_step(run, step, [next(rows) for _ in range(2)])
    assert seen == [(True, True), (True, True)]  # step 2 sampled with step 1's update
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    assert all(p.dtype == torch.float32 for p in policy.parameters())

    on = estimate_for_config(cfg, prompt_len=20, device="cpu")
    off_cfg = copy.deepcopy(cfg)
    off_cfg.model.rollout_weights = "policy"
    off = estimate_for_config(off_cfg, prompt_len=20, device="cpu")
    assert on["rollout_copy"] == 2 * on["params"] and off["rollout_copy"] == 0
    assert on["peak"] - off["peak"] == pytest.approx(2 * on["params"], rel=0.01)
