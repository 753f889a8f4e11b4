"""PPO with a critic: per-token rewards, whitening, the clipped surrogate against GRPO's, the
value model's alignment and gradient isolation, a few steps that learn, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from peergrade.algo import policy_loss, value_loss
from peergrade.algo.advantages import last_token_index, token_rewards, whiten
from peergrade.config import ConfigError, load_config
from peergrade.training.ppo import CriticCheckpointState, build_critic, ppo_advantages, ppo_update
from peergrade.training.trainer import setup_models
from peergrade.training.update import UpdateInputs


def ppo_policy_loss(logp, old, adv, mask, **kw):
    """PPO's surrogate: ``algo.policy_loss`` with per-token advantages, token mean (dapo)."""
    return policy_loss(logp, old, adv, mask, loss_type="dapo", **kw)


def ppo_step(models, critic, optimizer, scheduler, batch, seq_rewards, ref_lp, cfg, step):
    """What the trainer's step does for PPO: critic advantages, then the update."""
    pa = ppo_advantages(critic, models, batch, seq_rewards, ref_lp, cfg)
    exp = UpdateInputs(
        batch,
        pa["advantages"],
        ref_logprobs=ref_lp,
        values=pa["old_values"],
        returns=pa["returns"],
        old_logprobs=pa["old_logp"],
    )
    upd = ppo_update(models, critic, optimizer, scheduler, exp, cfg, step)
    return {**pa["metrics"], **upd}


def _cfg(model_dir, **over):
    base = {
        "algo.name": "ppo",
        "model.path": str(model_dir),
        "model.device": "cpu",
        "rollout.max_completion_length": 6,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
    }
    base.update(over)
    return load_config(None, list(base.items()))


# ----------------------------------------------------------------------------- pure parts


def test_last_token_index_and_token_rewards_hand_values():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 0, -1, 3]
    seq = torch.tensor([1.0, -0.5, 3.0, float("nan")])
    r = token_rewards(seq, mask)
    expected = torch.zeros(4, 4)
    expected[0, 2] = 1.0
    expected[1, 0] = -0.5
    # row 2 has no counted token: its reward is dropped; row 3's NaN counts as 0
    assert torch.equal(r, expected)

    old = torch.tensor([[-1.0, -2.0, -0.5, 9.0]]).expand(4, 4)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0]]).expand(4, 4)
    r = token_rewards(seq, mask, old_logp=old, ref_logp=ref, beta=0.1)
    # -beta * (old - ref) on counted tokens: [-0.05, +0.1, 0, (masked)]
    assert torch.allclose(r[0], torch.tensor([-0.05, 0.1, 0.0 + 1.0, 0.0]), atol=1e-7)
    assert torch.allclose(r[1], torch.tensor([-0.05 - 0.5, 0.0, 0.0, 0.0]), atol=1e-7)
    assert torch.equal(r[2], torch.zeros(4))
    assert torch.allclose(r[3], torch.tensor([-0.05, 0.1, 0.0, -1.8]), atol=1e-6)
    with pytest.raises(ValueError, match="seq_rewards"):
        token_rewards(torch.zeros(3), mask)


def test_whiten_masked_moments():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    w = whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ref = (vals - 2.5) / (vals.var(unbiased=False).sqrt() + 1e-8)
    assert torch.allclose(w[:, :2].reshape(-1), ref, atol=1e-6)
    assert torch.equal(w[:, 2], torch.zeros(2))


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_token_advantages_equal_sequence_advantages_when_constant(beta):
    """With A_t = A_i on every token, the [B, T] form of policy_loss is the [B] form."""
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, ref_logp=ref, beta=beta, kl_estimator="k3")
    mine, m1 = ppo_policy_loss(logp, old, adv[:, None].expand(B, T), mask, num_tokens=11, **kw)
    (g1,) = torch.autograd.grad(mine, logp)
    theirs, m2 = policy_loss(logp, old, adv, mask, loss_type="dapo", num_tokens=11, **kw)
    (g2,) = torch.autograd.grad(theirs, logp)
    assert torch.allclose(mine, theirs, atol=1e-6)
    assert torch.allclose(g1, g2, atol=1e-7)
    for k in ("loss/policy", "loss/kl", "kl/mean", "clip/frac", "ratio/mean"):
        assert m1[k] == pytest.approx(m2[k], abs=1e-6), k


def test_policy_loss_token_advantages_hand_value():
    # one sequence, two tokens: rho = [e^0.5, e^-0.1], A = [+1, -1], eps 0.2
    logp = torch.tensor([[0.5, -0.1]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps=0.2)
    # token 0: min(1.6487 * 1, 1.2 * 1) = 1.2 -> l = -1.2 (clipped high, no gradient)
    # token 1: rho = 0.9048 inside [0.8, 1.2]: l = +0.9048, dl/dlogp = rho
    rho1 = torch.exp(torch.tensor(-0.1)).item()
    assert loss.item() == pytest.approx((-1.2 + rho1) / 2, abs=1e-6)
    assert m["clip/frac"] == pytest.approx(0.5)
    assert m["ratio/mean"] == pytest.approx((torch.exp(torch.tensor(0.5)).item() + rho1) / 2)
    loss.backward()
    assert logp.grad[0, 0] == 0
    assert logp.grad[0, 1].item() == pytest.approx(rho1 / 2, abs=1e-6)
    # the low side: A < 0 and rho < 0.8 is clipped too
    loss2, m2 = ppo_policy_loss(
        torch.tensor([[-0.5]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1)
    )
    assert loss2.item() == pytest.approx(0.8) and m2["clip/frac"] == 1.0


# ----------------------------------------------------------------------------- critic wiring


@pytest.fixture(scope="module")
def ppo_setup(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, **{"algo.beta": 0.05})
    torch.manual_seed(0)
    models = setup_models(cfg)
    critic = build_critic(cfg, models)
    return cfg, models, critic


def _batch(tok, B=4, P=5, C=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(tok), (B, P + C), generator=g)
    am = torch.ones(B, P + C, dtype=torch.long)
    am[0, :2] = 0  # left padding
    ids[0, :2] = tok.pad_token_id
    cm = torch.ones(B, C, dtype=torch.long)
    cm[1, 2:] = 0  # right padding (early eos)
    am[1, P + 2 :] = 0
    return ids, am, cm


def test_value_model_alignment_is_causal(ppo_setup):
    cfg, models, critic = ppo_setup
    ids, am, cm = _batch(models.tokenizer)
    L, C = ids.shape[1], cm.shape[1]
    with torch.no_grad():
        v = critic.model(ids, am, C)  # [B, C]
        assert v.shape == (4, C) and v.dtype == torch.float32
        ids2 = ids.clone()
        ids2[:, -1] = (ids2[:, -1] + 1) % len(models.tokenizer)  # the last completion token
        assert torch.equal(critic.model(ids2, am, C), v)  # V_j never sees token j itself
        ids3 = ids.clone()
        ids3[:, L - C] = (ids3[:, L - C] + 1) % len(models.tokenizer)  # first completion token
        v3 = critic.model(ids3, am, C)
        assert torch.equal(v3[:, 0], v[:, 0])
        assert not torch.allclose(v3[:, 1:], v[:, 1:])
    with pytest.raises(ValueError, match="completion_len"):
        critic.model(ids, am, L)


def test_value_loss_gradient_reaches_only_the_critic(ppo_setup):
    cfg, models, critic = ppo_setup
    ids, am, cm = _batch(models.tokenizer)
    models.policy.zero_grad(set_to_none=True)
    critic.model.zero_grad(set_to_none=True)
    v = critic.model(ids, am, cm.shape[1])
    loss, _ = value_loss(v, v.detach() + 0.1, torch.ones_like(v), cm, clip_eps=0.2)
    loss.backward()
    assert all(p.grad is None for p in models.policy.parameters())
    grads = [p.grad for p in critic.model.parameters()]
    assert all(g is not None for g in grads)
    assert critic.model.value_head.weight.grad.abs().sum() > 0
    emb = critic.model.backbone.get_input_embeddings().weight
    assert emb.grad.abs().sum() > 0  # through the backbone too
    # and the critic shares no tensor with the policy (it is a separate copy)
    pol = {p.data_ptr() for p in models.policy.parameters()}
    assert not pol & {p.data_ptr() for p in critic.model.parameters()}
    critic.model.zero_grad(set_to_none=True)


def test_ppo_advantages_shapes_padding_and_gae(ppo_setup):
    cfg, models, critic = ppo_setup
    from peergrade.algo import gae

    ids, am, cm = _batch(models.tokenizer)
    seq_r = torch.tensor([1.0, 0.0, 0.5, -1.0])
    ref_lp = torch.full(cm.shape, -4.0)
    out = ppo_advantages(critic, models, (ids, am, cm), seq_r, ref_lp, cfg)
    for k in ("advantages", "returns", "old_values"):
        assert out[k].shape == cm.shape, k
        assert torch.equal(out[k][1, 2:], torch.zeros(2)), k  # padding stays 0
    adv = out["advantages"][cm == 1]
    assert adv.mean().abs() < 1e-5 and adv.std(unbiased=False) == pytest.approx(1, abs=1e-4)
    # returns = GAE of the KL-shaped token rewards on the rollout values
    r = token_rewards(seq_r, cm, old_logp=out["old_logp"], ref_logp=ref_lp, beta=cfg.algo.beta)
    _, ret = gae(r, out["old_values"], cm, gamma=cfg.algo.gamma, lam=cfg.algo.lam)
    assert torch.allclose(out["returns"], ret, atol=1e-6)
    # the KL penalty is there: old_logp != ref_lp, so reward != the plain sequence reward
    assert out["metrics"]["reward/kl_penalty_mean"] != 0.0


def test_checkpoint_state_round_trip(ppo_setup, tiny_model_dir):
    cfg, models, critic = ppo_setup
    opt = torch.optim.AdamW(models.policy.parameters(), lr=1e-3)
    state = CriticCheckpointState(opt, critic).state_dict()
    models2 = setup_models(cfg)
    critic2 = build_critic(cfg, models2)
    with torch.no_grad():
        critic2.model.value_head.weight.add_(1.0)
    CriticCheckpointState(torch.optim.AdamW(models2.policy.parameters()), critic2).load_state_dict(
        state
    )
    assert torch.equal(critic2.model.value_head.weight, critic.model.value_head.weight)
    with pytest.raises(ValueError, match="no critic state"):
        CriticCheckpointState(opt, critic2).load_state_dict(opt.state_dict())


def test_config_validation_for_ppo(tiny_model_dir):
    assert _cfg(tiny_model_dir, **{"rollout.group_size": 1}).rollout.group_size == 1
    with pytest.raises(ConfigError, match="group_size"):
        _cfg(tiny_model_dir, **{"algo.name": "grpo", "rollout.group_size": 1})
    with pytest.raises(ConfigError, match="algo.lam"):
        _cfg(tiny_model_dir, **{"algo.lam": 1.5})
    with pytest.raises(ConfigError, match="only ppo"):
        _cfg(tiny_model_dir, **{"algo.name": "grpo", "algo.critic_path": "x"})
    with pytest.raises(ConfigError, match="algo.name"):
        _cfg(tiny_model_dir, **{"algo.name": "a2c"})
    with pytest.raises(ConfigError, match="GRPO options"):
        _cfg(tiny_model_dir, **{"algo.loss_type": "dapo"})


# ----------------------------------------------------------------------------- it learns


@pytest.mark.slow
def test_a_few_ppo_steps_raise_a_dense_reward(tiny_model_dir):
    """Reward = fraction of digit characters in the completion. PPO must raise it."""
    from peergrade.generation.kernel import generate

    cfg = _cfg(
        tiny_model_dir,
        **{
            "optim.lr": 1e-2,
            "algo.critic_lr": 1e-2,
            "rollout.max_completion_length": 8,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "algo.lam": 0.9,
        },
    )
    torch.manual_seed(0)
    models = setup_models(cfg)
    critic = build_critic(cfg, models)
    tok, policy = models.tokenizer, models.policy
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    prompts = [
        tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]
    ]
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]

    def digit_mass():
        with torch.no_grad():
            ids = torch.tensor([prompts[0]])
            p = policy(ids).logits[0, -1].softmax(-1)
        return p[digits].sum().item()

    w0 = [p.detach().clone() for p in critic.model.parameters()]
    mass0 = digit_mass()
    rewards = []
    for step in range(12):  # enough steps that the rise clears the sampling noise of 16 draws
        policy.eval()
        ro = generate(policy, tok, prompts, n=4, max_new_tokens=8, temperature=1.0, seed=step)
        r = torch.tensor(
            [sum(c.isdigit() for c in t) / 8 for t in ro.completion_text], dtype=torch.float32
        )
        rewards.append(r.mean().item())
        batch = ro.training_batch(tok.pad_token_id)
        m = ppo_step(models, critic, optimizer, scheduler, batch, r, None, cfg, step)
        assert torch.isfinite(torch.tensor(m["loss/value"]))
    mass1 = digit_mass()
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    assert mass1 > 2 * mass0, (mass0, mass1)
    assert any(not torch.equal(a, b) for a, b in zip(w0, critic.model.parameters()))


# ----------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_train_algo_ppo(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "peergrade.cli",
        "train",
        "--model",
        str(tiny_model_dir),
        "--algo.name",
        "ppo",
        "--algo.beta",
        "0.04",
        "--train.steps",
        "2",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "2",
        "--rollout.max_completion_length",
        "6",
        "--train.eval_size",
        "2",
        "--train.eval_samples",
        "1",
        "--train.display",
        "none",
        "--train.threads",
        "1",
        "-o",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "loss/value" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert all(x["grad/critic_norm"] > 0 for x in steps)
    state = torch.load(
        out / "checkpoints" / "step-2" / "training_state.pt", map_location="cpu", weights_only=False
    )
    assert "value_head.weight" in state["optimizer"]["critic"]["model"]
