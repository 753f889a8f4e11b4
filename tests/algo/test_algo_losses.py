"""Tests for peergrade.algo.losses: kl_divergence, policy_loss, value_loss.

Layers: hand-computed values (worked out in comments), a slow per-element Python-loop reference
compared with the vectorised code (loss, gradient w.r.t. logp, clip metrics) for every
loss_type x ratio_level x beta, gradient facts, hypothesis finiteness, input validation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peergrade.algo import group_advantages, kl_divergence, policy_loss, value_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
RATIO_LEVELS = ["token", "sequence"]
LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# kl_divergence
# --------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    # logp - ref = ln 2 (pi = 2 pi_ref), d = ref - logp = -ln 2:
    #   k1 = ln 2 = 0.693147, k2 = 0.5 ln^2 2 = 0.240227, k3 = e^{-ln 2} + ln 2 - 1 = ln 2 - 0.5
    # logp - ref = -ln 2 (d = ln 2): k1 = -ln 2, k2 = 0.240227, k3 = 2 - ln 2 - 1 = 1 - ln 2
    logp = torch.tensor([LN2, -LN2, -3.0], dtype=torch.float64)
    ref = torch.tensor([0.0, 0.0, -3.0], dtype=torch.float64)
    exp = {
        "k1": [LN2, -LN2, 0.0],
        "k2": [0.5 * LN2**2, 0.5 * LN2**2, 0.0],
        "k3": [LN2 - 0.5, 1 - LN2, 0.0],
    }
    for est, values in exp.items():
        got = kl_divergence(logp, ref, est)
        torch.testing.assert_close(
            got, torch.tensor(values, dtype=torch.float64), atol=1e-15, rtol=0
        )
    torch.testing.assert_close(kl_divergence(logp, ref), kl_divergence(logp, ref, "k3"))


def test_kl_k3_gradient():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp); at logp - ref = ln 2: 0.5
    logp = torch.tensor([LN2], dtype=torch.float64, requires_grad=True)
    kl_divergence(logp, torch.zeros(1, dtype=torch.float64)).sum().backward()
    assert logp.grad.item() == pytest.approx(0.5, abs=1e-15)


def test_kl_bad_inputs():
    with pytest.raises(ValueError, match=r"estimator: expected one of \('k1', 'k2', 'k3'\)"):
        kl_divergence(torch.zeros(3), torch.zeros(3), "k4")
    with pytest.raises(ValueError, match=r"ref_logp: expected shape \(3,\)"):
        kl_divergence(torch.zeros(3), torch.zeros(4))


# --------------------------------------------------------------------------------------------
# policy_loss: a hand-worked example
# --------------------------------------------------------------------------------------------
#
# B = 2, T = 3, clip_eps = 0.2.
#   seq 0: A = +1, mask [1, 1, 0], logp [-1, -2, pad], ratios rho = [1.5, 0.5]
#   seq 1: A = -2, mask [1, 1, 1], logp [-0.5, -1, -3], ratios rho = [0.5, 1.1, 2.0]
# Clipped surrogate per token, l = -min(rho A, clip(rho, 0.8, 1.2) A):
#   seq 0: min(1.5, 1.2) = 1.2 -> l = -1.2 (high-clipped);   min(0.5, 0.8) = 0.5 -> l = -0.5
#   seq 1: min(-1.0, -1.6) = -1.6 -> l = 1.6 (low-clipped);   min(-2.2, -2.2) -> l = 2.2;
#          min(-4.0, -2.4) = -4.0 -> l = 4.0 (rho > 1.2 but A < 0: not clipped)
# Sums: seq 0 -1.7 over 2 tokens, seq 1 7.8 over 3 tokens; all 5 tokens sum 6.1.
#   grpo    = (-1.7/2 + 7.8/3) / 2 = (-0.85 + 2.6) / 2 = 0.875
#   bnpo    = 6.1 / 5 = 1.22
#   dr_grpo = 6.1 / (2 * 4) = 0.7625                   (max_completion_length = 4)
#   dapo    = 6.1 / 10 = 0.61                          (num_tokens = 10)
# CISPO, l = -min(rho, 1.2) A logp (weights [1.2, 0.5], [0.5, 1.1, 1.2]):
#   seq 0: -(1.2)(1)(-1) = 1.2, -(0.5)(1)(-2) = 1.0
#   seq 1: -(0.5)(-2)(-0.5) = -0.5, -(1.1)(-2)(-1) = -2.2, -(1.2)(-2)(-3) = -7.2
#   sum = 2.2 - 9.9 = -7.7 -> cispo (num_tokens = 10) = -0.77
# Metrics: low = 1/5 (seq 1 tok 0), high = 1/5 (seq 0 tok 0), ratio mean 5.6/5 = 1.12,
#   min 0.5, max 2.0, advantage mean (1 - 2)/2 = -0.5. CISPO high: rho in {1.5, 2.0} -> 2/5.
# KL: ref = logp - ln 2 on every token -> k3 = e^{-ln 2} + ln 2 - 1 = ln 2 - 0.5 per token,
#   so with beta = 0.1 every aggregation adds 0.1 (ln 2 - 0.5) x (its normaliser applied to 1s).


def _hand_inputs():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0]], dtype=torch.float64)
    rho = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.1, 2.0]], dtype=torch.float64)
    old = logp - torch.log(rho)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("grpo", {}, 0.875),
        ("bnpo", {}, 1.22),
        ("dr_grpo", {"max_completion_length": 4}, 0.7625),
        ("dapo", {"num_tokens": 10}, 0.61),
        ("dapo", {}, 1.22),  # num_tokens defaults to the local active-token count, 5
        ("cispo", {"num_tokens": 10}, -0.77),
    ],
)
def test_policy_loss_hand_values(loss_type, kwargs, expected):
    logp, old, adv, mask = _hand_inputs()
    loss, metrics = policy_loss(logp, old, adv, mask, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["ratio/mean"] == pytest.approx(1.12, abs=1e-12)
    assert metrics["ratio/min"] == pytest.approx(0.5, abs=1e-12)
    assert metrics["ratio/max"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["advantage/mean"] == pytest.approx(-0.5, abs=1e-12)
    assert metrics["kl/mean"] == 0.0 and metrics["loss/kl"] == 0.0
    assert metrics["loss/policy"] == pytest.approx(expected, abs=1e-12)
    if loss_type == "cispo":
        assert metrics["clip/low_frac"] == 0.0
        assert metrics["clip/high_frac"] == pytest.approx(0.4, abs=1e-12)
    else:
        assert metrics["clip/low_frac"] == pytest.approx(0.2, abs=1e-12)
        assert metrics["clip/high_frac"] == pytest.approx(0.2, abs=1e-12)
    assert metrics["clip/frac"] == pytest.approx(
        metrics["clip/low_frac"] + metrics["clip/high_frac"], abs=1e-15
    )
    assert all(isinstance(v, float) for v in metrics.values())


def test_policy_loss_hand_gradient_grpo():
    # grpo weights token (i, t) by 1 / (n_i B): seq 0 -> 1/4, seq 1 -> 1/6. d l / d logp is
    # -rho A on unclipped tokens and 0 on clipped ones:
    #   seq 0: [0, -(0.5)(1)/4 = -0.125, 0 (pad)]
    #   seq 1: [0, -(1.1)(-2)/6 = 0.366667, -(2.0)(-2)/6 = 0.666667]
    logp, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    exp = torch.tensor([[0.0, -0.125, 0.0], [0.0, 2.2 / 6, 4.0 / 6]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, exp, atol=1e-12, rtol=0)


def test_policy_loss_hand_gradient_cispo():
    # CISPO keeps a gradient on every token: d l / d logp = -sg(min(rho, 1.2)) A / num_tokens.
    #   seq 0: [-1.2, -0.5, 0] / 5; seq 1: [1.0, 2.2, 2.4] / 5
    logp, old, adv, mask = _hand_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="cispo")
    loss.backward()
    exp = torch.tensor([[-1.2, -0.5, 0.0], [1.0, 2.2, 2.4]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, exp, atol=1e-12, rtol=0)


def test_policy_loss_hand_kl_term():
    logp, old, adv, mask = _hand_inputs()
    ref = logp.detach() - LN2
    k3 = LN2 - 0.5
    loss, m = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.875 + 0.1 * k3, abs=1e-12)
    assert m["kl/mean"] == pytest.approx(k3, abs=1e-12)
    assert m["loss/kl"] == pytest.approx(0.1 * k3, abs=1e-12)
    assert m["loss/policy"] == pytest.approx(0.875, abs=1e-12)
    # dr_grpo: 5 tokens of k3 over B * L = 8
    loss, _ = policy_loss(
        logp, old, adv, mask, loss_type="dr_grpo", max_completion_length=4, ref_logp=ref, beta=0.1
    )
    assert loss.item() == pytest.approx(0.7625 + 0.1 * 5 * k3 / 8, abs=1e-12)
    # beta = 0 with ref_logp: no KL in the loss, but kl/mean is still reported
    loss, m = policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.0, kl_estimator="k1")
    assert loss.item() == pytest.approx(0.875, abs=1e-12)
    assert m["kl/mean"] == pytest.approx(LN2, abs=1e-12)
    # beta > 0 without ref_logp: no KL term (documented behaviour)
    loss, m = policy_loss(logp, old, adv, mask, beta=0.1)
    assert loss.item() == pytest.approx(0.875, abs=1e-12)
    assert m["kl/mean"] == 0.0


def test_policy_loss_clip_eps_high():
    # clip_eps_high = 0.6: seq 0 tok 0 (rho 1.5) is no longer clipped -> l = -1.5, so
    # grpo = ((-1.5 - 0.5)/2 + 2.6) / 2 = 0.8; high_frac 0; low_frac still 1/5.
    logp, old, adv, mask = _hand_inputs()
    loss, m = policy_loss(logp, old, adv, mask, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(0.8, abs=1e-12)
    assert m["clip/high_frac"] == 0.0
    assert m["clip/low_frac"] == pytest.approx(0.2, abs=1e-12)


def test_gspo_sequence_ratio_values_and_gradient():
    # log s_0 = (ln 1.5 + ln 0.5) / 2 = ln(0.75)/2 -> s_0 = sqrt(0.75) = 0.866025 (in [0.8, 1.2])
    # log s_1 = (ln 0.5 + ln 1.1 + ln 2) / 3 = ln(1.1)/3 -> s_1 = 1.1^(1/3) = 1.032280
    # grpo: (-s_0 + 2 s_1) / 2; gradient per token -s_i A_i / (n_i B):
    #   seq 0: -s_0 / 4 on both tokens; seq 1: 2 s_1 / 6 on all three
    logp, old, adv, mask = _hand_inputs()
    s0, s1 = math.sqrt(0.75), 1.1 ** (1 / 3)
    loss, m = policy_loss(logp, old, adv, mask, ratio_level="sequence")
    assert loss.item() == pytest.approx((-s0 + 2 * s1) / 2, abs=1e-12)
    assert m["ratio/min"] == pytest.approx(s0, abs=1e-12)
    assert m["ratio/max"] == pytest.approx(s1, abs=1e-12)
    assert m["ratio/mean"] == pytest.approx((2 * s0 + 3 * s1) / 5, abs=1e-12)
    assert m["clip/frac"] == 0.0
    loss.backward()
    exp = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 3, s1 / 3, s1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, exp, atol=1e-12, rtol=0)


def test_gspo_clips_whole_sequences():
    # clip_eps = 0.1: s_0 = 0.866 < 0.9 but A_0 > 0 -> not clipped (min picks s_0 A);
    # with A_0 = -1 instead the whole sequence is low-clipped: 2 of 5 tokens, zero gradient.
    logp, old, _, mask = _hand_inputs()
    adv = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, mask, ratio_level="sequence", clip_eps=0.1)
    assert m["clip/low_frac"] == pytest.approx(0.4, abs=1e-12)
    assert m["clip/high_frac"] == 0.0
    loss.backward()
    assert torch.all(logp.grad[0] == 0)
    assert torch.all(logp.grad[1] != 0)


# --------------------------------------------------------------------------------------------
# policy_loss: per-element loop reference for every loss_type x ratio_level x beta
# --------------------------------------------------------------------------------------------


def _loop_policy_loss(
    logp, old, adv, mask, loss_type, ratio_level, eps, eps_high, ref, beta, est, L, num_tokens
):
    """Slow reference: scalar autograd ops token by token, branches instead of min/clamp.

    Returns (loss, low_count, high_count, active_count).
    """
    B, T = logp.shape
    zero = logp[0, 0] * 0.0  # keeps the graph even when nothing contributes (row 0 is full)
    seq_sums, seq_lens = [], []
    low = high = 0
    for i in range(B):
        idx = [t for t in range(T) if int(mask[i, t]) == 1]
        if ratio_level == "sequence" and idx:
            s = sum(float(logp[i, t].detach()) - float(old[i, t]) for t in idx) / len(idx)
        a = float(adv[i])
        total = zero
        for t in idx:
            x = logp[i, t]
            if ratio_level == "token":
                r = torch.exp(x - float(old[i, t]))
            else:  # value exp(s), derivative exp(s) w.r.t. this token's logp
                r = math.exp(s) * (1.0 + (x - x.detach()))
            rv = float(r.detach())
            if loss_type == "cispo":
                w = min(rv, 1.0 + eps_high)
                if rv > 1.0 + eps_high:
                    high += 1
                term = -w * a * x
            elif a > 0:
                if rv > 1.0 + eps_high:
                    term, high = -(1.0 + eps_high) * a + 0.0 * x, high + 1
                else:
                    term = -a * r
            elif a < 0:
                if rv < 1.0 - eps:
                    term, low = -(1.0 - eps) * a + 0.0 * x, low + 1
                else:
                    term = -a * r
            else:
                term = 0.0 * x
            if beta > 0 and ref is not None:
                d = float(ref[i, t]) - x
                if est == "k1":
                    kl = -d
                elif est == "k2":
                    kl = 0.5 * d * d
                else:
                    kl = torch.exp(d) - d - 1.0
                term = term + beta * kl
            total = total + term
        seq_sums.append(total)
        seq_lens.append(len(idx))
    n = sum(seq_lens)
    if loss_type == "grpo":
        loss = sum(s / max(k, 1) for s, k in zip(seq_sums, seq_lens)) / B
    elif loss_type == "bnpo":
        loss = sum(seq_sums) / max(n, 1)
    elif loss_type == "dr_grpo":
        loss = sum(seq_sums) / (B * L)
    else:
        loss = sum(seq_sums) / (num_tokens if num_tokens is not None else max(n, 1))
    return loss, low, high, n


def _random_batch(seed, B=6, T=7, with_empty=False):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # [B, T] in (-3, 0]
    old = logp + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios ~ e^N(0,.35)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if with_empty:
        lengths[2] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # right padding
    logp = logp.masked_fill(mask == 0, -float("inf"))  # padding garbage must not matter
    return logp, old, ref, adv, mask


CASES = list(itertools.product(LOSS_TYPES, RATIO_LEVELS, [0.0, 0.05]))


@pytest.mark.parametrize(("loss_type", "ratio_level", "beta"), CASES)
@pytest.mark.parametrize("kl_estimator", ["k3", "k1"])
def test_policy_loss_matches_loop_reference(loss_type, ratio_level, beta, kl_estimator):
    for seed, with_empty in ((0, False), (1, True), (2, False)):
        logp, old, ref, adv, mask = _random_batch(seed, with_empty=with_empty)
        kwargs = dict(
            loss_type=loss_type,
            ratio_level=ratio_level,
            clip_eps=0.2,
            clip_eps_high=0.28,
            ref_logp=ref,
            beta=beta,
            kl_estimator=kl_estimator,
            max_completion_length=9,
            num_tokens=37 if seed == 2 else None,
        )
        x1 = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(x1, old, adv, mask, **kwargs)
        (g1,) = torch.autograd.grad(loss, x1)

        x2 = logp.clone().requires_grad_(True)
        ref_loss, low, high, n = _loop_policy_loss(
            x2,
            old,
            adv,
            mask,
            loss_type,
            ratio_level,
            0.2,
            0.28,
            ref,
            beta,
            kl_estimator,
            9,
            kwargs["num_tokens"],
        )
        (g2,) = torch.autograd.grad(ref_loss, x2)

        assert torch.isfinite(loss) and torch.isfinite(g1).all()
        torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(g1, g2, atol=1e-12, rtol=1e-12)
        assert metrics["clip/low_frac"] == pytest.approx(low / n, abs=1e-12)
        assert metrics["clip/high_frac"] == pytest.approx(high / n, abs=1e-12)
        # the generated batches really exercise clipping (token level)
        if ratio_level == "token":
            assert low + high > 0


# --------------------------------------------------------------------------------------------
# policy_loss: gradient facts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_type", "ratio_level"), list(itertools.product(LOSS_TYPES, RATIO_LEVELS))
)
def test_equal_rewards_give_zero_advantage_and_zero_gradient(loss_type, ratio_level):
    rewards = torch.tensor([[0.3, 0.3, 0.3, 0.3], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards).reshape(-1)  # [P * G]
    assert torch.all(adv[:4] == 0)
    logp, _, _, _, mask = _random_batch(5, B=8, T=5)
    old = logp.detach() + 0.01  # rho = e^-0.01: nothing clipped, every other token has a gradient
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        x, old, adv, mask, loss_type=loss_type, ratio_level=ratio_level, max_completion_length=5
    )
    loss.backward()
    assert torch.all(x.grad[:4] == 0)  # the all-equal group contributes exactly nothing
    assert torch.all(x.grad[4:][mask[4:] == 1] != 0)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_grpo_at_rho_one_is_length_normalised_reinforce(ratio_level):
    # With old_logp == logp (rho == 1, nothing clipped) and beta == 0 the grpo gradient is that
    # of -(1/B) sum_i A_i (1/n_i) sum_t logp_it.
    logp, _, _, adv, mask = _random_batch(7)
    x = logp.clone().requires_grad_(True)
    loss, m = policy_loss(x, logp.detach(), adv, mask, ratio_level=ratio_level)
    (g,) = torch.autograd.grad(loss, x)
    y = torch.where(mask == 1, logp, torch.zeros_like(logp)).requires_grad_(True)
    n = mask.sum(dim=1).to(torch.float64)
    reinforce = -(adv * (y * mask).sum(dim=1) / n).mean()
    (g_ref,) = torch.autograd.grad(reinforce, y)
    torch.testing.assert_close(g, g_ref, atol=1e-14, rtol=0)
    assert loss.item() == pytest.approx(-(adv.mean()).item(), abs=1e-14)  # value: -mean(A)
    assert m["ratio/min"] == m["ratio/max"] == 1.0 and m["clip/frac"] == 0.0


def test_num_tokens_scales_dapo_and_accepts_tensor():
    logp, old, _, adv, mask = _random_batch(9)
    loss_local, _ = policy_loss(logp, old, adv, mask, loss_type="dapo")
    n = int(mask.sum())
    loss_global, _ = policy_loss(logp, old, adv, mask, loss_type="dapo", num_tokens=4 * n)
    loss_tensor, _ = policy_loss(
        logp, old, adv, mask, loss_type="dapo", num_tokens=torch.tensor(4.0 * n)
    )
    torch.testing.assert_close(loss_global * 4, loss_local, atol=1e-14, rtol=0)
    torch.testing.assert_close(loss_tensor, loss_global, atol=1e-14, rtol=0)
    # bnpo == dapo with the default num_tokens
    loss_bnpo, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo")
    torch.testing.assert_close(loss_bnpo, loss_local, atol=1e-14, rtol=0)


def test_only_logp_gets_gradient_and_padding_nan_is_harmless():
    logp, old, ref, adv, mask = _random_batch(4)
    old = old.masked_fill(mask == 0, float("nan")).requires_grad_(True)
    ref = ref.masked_fill(mask == 0, float("nan")).requires_grad_(True)
    adv = adv.clone().requires_grad_(True)
    x = logp.clone().requires_grad_(True)
    for loss_type in LOSS_TYPES:
        loss, m = policy_loss(
            x,
            old,
            adv,
            mask,
            loss_type=loss_type,
            ref_logp=ref,
            beta=0.1,
            max_completion_length=8,
        )
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
        loss.backward()
    assert old.grad is None and ref.grad is None and adv.grad is None
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[mask == 0] == 0)


def test_empty_mask_gives_zero_loss_and_zero_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert m["ratio/mean"] == m["ratio/min"] == m["ratio/max"] == m["clip/frac"] == 0.0
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_bool_mask_equals_int_mask():
    logp, old, _, adv, mask = _random_batch(12)
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv, mask == 1)
    assert a.item() == b.item() and ma == mb


# --------------------------------------------------------------------------------------------
# policy_loss: hypothesis finiteness
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 4),
    T=st.integers(1, 5),
    loss_type=st.sampled_from(LOSS_TYPES),
    ratio_level=st.sampled_from(RATIO_LEVELS),
    beta=st.sampled_from([0.0, 0.04]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
)
def test_policy_loss_finite_for_realistic_logprobs(
    data, B, T, loss_type, ratio_level, beta, kl_estimator
):
    # Log-probs of sampled tokens in [-30, 0] (ratios up to e^30 stay finite in float32).
    lp = st.floats(-30, 0, width=32)
    mat = st.lists(st.lists(lp, min_size=T, max_size=T), min_size=B, max_size=B)
    logp = torch.tensor(data.draw(mat)).requires_grad_(True)
    old, ref = torch.tensor(data.draw(mat)), torch.tensor(data.draw(mat))
    adv = torch.tensor(data.draw(st.lists(st.floats(-10, 10, width=32), min_size=B, max_size=B)))
    mask = torch.tensor(
        data.draw(
            st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=B, max_size=B)
        )
    )
    loss, m = policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        ratio_level=ratio_level,
        ref_logp=ref,
        beta=beta,
        kl_estimator=kl_estimator,
        max_completion_length=T,
    )
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# --------------------------------------------------------------------------------------------
# policy_loss: validation
# --------------------------------------------------------------------------------------------


def _ok_args():
    return torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, r"loss_type.*'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"),
        ({"ratio_level": "seq"}, r"ratio_level.*'token', 'sequence'"),
        ({"kl_estimator": "k4"}, r"kl_estimator.*'k1', 'k2', 'k3'"),
        ({"clip_eps": 0.0}, r"clip_eps: expected a positive number"),
        ({"clip_eps": -0.2}, r"clip_eps: expected a positive number"),
        ({"clip_eps_high": -0.1}, r"clip_eps_high: expected a positive number"),
        ({"beta": -0.01}, r"beta: expected a number >= 0"),
        ({"loss_type": "dr_grpo"}, r"max_completion_length: required for loss_type='dr_grpo'"),
        (
            {"loss_type": "dr_grpo", "max_completion_length": 0},
            r"max_completion_length: expected a positive int",
        ),
        ({"loss_type": "dapo", "num_tokens": 0}, r"num_tokens: expected a positive count"),
        ({"num_tokens": torch.ones(2)}, r"num_tokens: expected a scalar"),
        ({"ref_logp": torch.zeros(2, 4)}, r"ref_logp: expected shape \(2, 3\)"),
    ],
)
def test_policy_loss_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(*_ok_args(), **kwargs)


def test_policy_loss_bad_shapes():
    logp, old, adv, mask = _ok_args()
    with pytest.raises(ValueError, match=r"old_logp: expected shape \(2, 3\).*got \(3, 2\)"):
        policy_loss(logp, old.T, adv, mask)
    with pytest.raises(ValueError, match=r"mask: expected shape \(2, 3\)"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match=r"advantages: expected shape \(2,\).*got \(2, 1\)"):
        policy_loss(logp, old, adv[:, None], mask)
    with pytest.raises(ValueError, match=r"logp: expected shape \[B, T\]"):
        policy_loss(logp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match=r"mask: expected only 0/1 values"):
        policy_loss(logp, old, adv, mask * 2)
    with pytest.raises(ValueError, match=r"logp: expected a floating-point tensor"):
        policy_loss(logp.long(), old, adv, mask)


# --------------------------------------------------------------------------------------------
# value_loss
# --------------------------------------------------------------------------------------------


def test_value_loss_hand_values():
    # clip_eps = 0.2, 3 valid tokens (the 4th is padding):
    #   t0: v 1.0, old 0.5, R 2.0: clip(v) = 0.7; (v-R)^2 = 1.0, (0.7-R)^2 = 1.69 -> 1.69 clipped
    #   t1: v 0.0, old 0.1, R 0.0: clip(v) = 0.0 (inside); both 0 -> 0
    #   t2: v 1.0, old 0.5, R 0.0: clip(v) = 0.7; 1.0 vs 0.49 -> 1.0 (unclipped larger)
    #   loss = 0.5 * (1.69 + 0 + 1.0) / 3 = 0.448333; clip_frac = 1/3; value mean 2/3
    # gradient: t0 clipped -> 0; t2: 0.5 * 2 (v - R) / 3 = 1/3
    values = torch.tensor([[1.0, 0.0, 1.0, 5.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 0.5, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[2.0, 0.0, 0.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, ret, mask)
    assert loss.item() == pytest.approx(0.5 * 2.69 / 3, abs=1e-12)
    assert m["value/clip_frac"] == pytest.approx(1 / 3, abs=1e-12)
    assert m["value/mean"] == pytest.approx(2 / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(
        values.grad, torch.tensor([[0.0, 0.0, 1 / 3, 0.0]], dtype=torch.float64), atol=1e-12, rtol=0
    )


def test_value_loss_matches_loop_reference():
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = values + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ret = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    v = values.clone().requires_grad_(True)
    loss, m = value_loss(v, old, ret, mask, clip_eps=0.1)
    total, n, clipped = v.sum() * 0.0, 0, 0
    for i in range(B):
        for t in range(T):
            if mask[i, t] != 1:
                continue
            o, r, x = float(old[i, t]), float(ret[i, t]), v[i, t]
            xv = float(x.detach())
            xc = min(max(xv, o - 0.1), o + 0.1)
            if (xc - r) ** 2 > (xv - r) ** 2:  # clipped branch: constant
                total, clipped = total + 0.5 * (xc - r) ** 2 + 0.0 * x, clipped + 1
            else:
                total = total + 0.5 * (x - r) ** 2
            n += 1
    ref_loss = total / n
    g1 = torch.autograd.grad(loss, v)[0]
    v.grad = None
    g2 = torch.autograd.grad(ref_loss, v)[0]
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)
    assert m["value/clip_frac"] == pytest.approx(clipped / n, abs=1e-12)
    assert 0 < clipped < n


def test_value_loss_bad_inputs():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"returns: expected shape \(2, 3\)"):
        value_loss(z, z, torch.zeros(3), z)
    with pytest.raises(ValueError, match=r"clip_eps: expected a positive number"):
        value_loss(z, z, z, z, clip_eps=0)


def test_gspo_token_form_matches_sequence_objective_gradient():
    # GSPO paper: with one advantage per sequence, the GSPO-token form has the same gradient as
    # the pure sequence objective -mean_i min(s_i A_i, clip(s_i) A_i) with s_i differentiable.
    logp, old, _, adv, mask = _random_batch(21)
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask, ratio_level="sequence", clip_eps=0.1)
    (g,) = torch.autograd.grad(loss, x)
    y = torch.where(mask == 1, logp, torch.zeros_like(logp)).requires_grad_(True)
    m = mask.to(torch.float64)
    s = torch.exp(((y - old) * m).sum(dim=1) / m.sum(dim=1))  # [B]
    seq_loss = -torch.minimum(s * adv, s.clamp(0.9, 1.1) * adv).mean()
    (g_ref,) = torch.autograd.grad(seq_loss, y)
    torch.testing.assert_close(loss, seq_loss, atol=1e-14, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=1e-14, rtol=0)


# --------------------------------------------------------------------------------------------
# gradient accumulation (num_sequences) and per-token advantages
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_micro_batch_shares_add_up_to_the_minibatch_loss(loss_type, beta):
    """Split a minibatch of 6 into micro-batches of 2 and 4: with num_sequences (and the
    minibatch's num_tokens) the micro-batch losses and gradients sum to the whole-batch ones."""
    logp, old, ref, adv, mask = _random_batch(3)
    logp = logp.masked_fill(mask == 0, 0.0).requires_grad_(True)
    kw = dict(loss_type=loss_type, beta=beta, max_completion_length=7)
    n_tok = mask.sum()
    whole, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, num_tokens=n_tok, **kw)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts, grads = [], torch.zeros_like(logp)
    for idx in (slice(0, 2), slice(2, 6)):
        lp = logp[idx].detach().requires_grad_(True)
        args = (lp, old[idx], adv[idx], mask[idx])
        kw_i = dict(kw, ref_logp=ref[idx], num_tokens=n_tok)
        part, m = policy_loss(*args, num_sequences=6, **kw_i)
        unscaled, _ = policy_loss(*args, **kw_i)
        if loss_type in ("dapo", "cispo"):  # already normalised by the minibatch's tokens
            assert part.item() == unscaled.item()
        else:
            assert part.item() == pytest.approx(unscaled.item() * lp.shape[0] / 6, rel=1e-12)
        assert m["loss/policy"] == pytest.approx(
            unscaled.item() - (m["loss/kl"] if beta else 0.0), rel=1e-9, abs=1e-12
        )
        (g,) = torch.autograd.grad(part, lp)
        grads[idx] = g
        parts.append(part.item())
    assert sum(parts) == pytest.approx(whole.item(), rel=1e-10)
    assert torch.allclose(grads, g_whole, atol=1e-12)


def test_bnpo_micro_batch_share_is_size_weighted():
    logp, old, _, adv, mask = _random_batch(4)
    part, _ = policy_loss(logp[:2], old[:2], adv[:2], mask[:2], loss_type="bnpo", num_sequences=6)
    own, _ = policy_loss(logp[:2], old[:2], adv[:2], mask[:2], loss_type="bnpo")
    assert part.item() == pytest.approx(own.item() * 2 / 6, rel=1e-12)


def test_num_sequences_must_cover_the_rows():
    logp, old, adv, mask = _ok_args()
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="num_sequences: expected an int >= B = 2"):
            policy_loss(logp, old, adv, mask, num_sequences=bad)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_per_token_advantages_match_a_loop_reference(loss_type):
    """[B, T] advantages (PPO): each token's surrogate uses its own advantage."""
    g = torch.Generator().manual_seed(5)
    logp, old, ref, _, mask = _random_batch(5)
    adv_t = torch.randn(logp.shape, generator=g, dtype=torch.float64)
    logp = logp.masked_fill(mask == 0, float("nan")).requires_grad_(True)  # padding garbage
    loss, m = policy_loss(
        logp, old, adv_t, mask, loss_type=loss_type, max_completion_length=7, clip_eps_high=0.28
    )
    eps, hi = 0.2, 0.28
    B, T = logp.shape
    seq = []
    for i in range(B):
        terms = []
        for t in range(T):
            if mask[i, t] != 1:
                continue
            x = logp[i, t]
            r = torch.exp(x - old[i, t])
            a = float(adv_t[i, t])
            if loss_type == "cispo":
                terms.append(-min(float(r.detach()), 1 + hi) * a * x)
            else:
                terms.append(-torch.minimum(r * a, r.clamp(1 - eps, 1 + hi) * a))
        seq.append(terms)
    n = sum(len(s) for s in seq)
    total = sum(sum(s) for s in seq if s)
    if loss_type == "grpo":
        ref_loss = sum(sum(s) / len(s) for s in seq if s) / B
    elif loss_type == "dr_grpo":
        ref_loss = total / (B * 7)
    else:
        ref_loss = total / n
    assert loss.item() == pytest.approx(float(ref_loss.detach()), rel=1e-10)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref_loss, logp)
    assert torch.allclose(g1.nan_to_num(0.0), g2.nan_to_num(0.0), atol=1e-12)
    assert torch.isfinite(g1).all()
    adv_mean = float((adv_t * mask).sum() / mask.sum())
    assert m["advantage/mean"] == pytest.approx(adv_mean, rel=1e-9)
