"""Tests for the 2026 GRPO variants in peergrade.algo (issue 37): SAPO, LUSPO, VESPO, INTELLECT-2's
delta, the ``keep`` token mask, OPSM, IcePop (token_mis), top-entropy token selection, the entropy
bonus and its adaptive coefficient, and GDPO advantages.

Layers: hand-computed values (worked out in comments, 1e-6 or tighter), a slow per-token loop
reference against the vectorised code (loss and gradient), TRL 1.16's own helper functions on the
same tensors where TRL exposes them (skipped without trl), and input validation.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from peergrade.algo import (
    adaptive_entropy_coef,
    entropy_bonus,
    gae,  # noqa: F401  (the package still exports the old names)
    high_entropy_mask,
    off_policy_sequence_mask,
    off_policy_weights,
    policy_loss,
    vespo_weights,
)
from peergrade.algo.advantages import gdpo_advantages


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------------------------
# the hand-worked batch (as in test_algo_losses.py)
# --------------------------------------------------------------------------------------------
#
# B = 2, T = 3.
#   seq 0: A = +1, mask [1, 1, 0], logp [-1, -2, pad], ratios rho = [1.5, 0.5]
#   seq 1: A = -2, mask [1, 1, 1], logp [-0.5, -1, -3], ratios rho = [0.5, 1.1, 2.0]
# Clipped surrogate (eps 0.2) per token: seq 0 [-1.2, -0.5] (sum -1.7), seq 1 [1.6, 2.2, 4.0]
# (sum 7.8).


def _hand_inputs():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0]], dtype=torch.float64)
    rho = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.1, 2.0]], dtype=torch.float64)
    old = logp - torch.log(rho)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logp.requires_grad_(True), old, adv, mask


def test_sapo_hand_values_and_gradient():
    # f(rho) = (4 / tau) sigmoid(tau (rho - 1)), l = -f A; tau = 1 for A > 0, 1.05 for A <= 0.
    # seq 0 (tau 1): 4 sig(0.5) + 4 sig(-0.5) = 4 (sig(x) + sig(-x) = 1), l sum = -4, mean -2.
    # seq 1 (tau 1.05, A = -2): l = 2 f: (8 / 1.05)(sig(-0.525) + sig(0.105) + sig(1.05)) / 3
    #   = 7.6190476 * (0.3716867 + 0.5262257 + 0.7407749) / 3 = 4.1617...
    # grpo aggregation: (-2 + 4.1617...) / 2 = 1.0808...
    seq1 = (8 / 1.05) * (sig(-0.525) + sig(0.105) + sig(1.05)) / 3
    expected = (-2.0 + seq1) / 2
    assert expected == pytest.approx(1.0808694, abs=1e-6)
    logp, old, adv, mask = _hand_inputs()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="sapo")
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["clip/frac"] == 0.0 and m["loss/policy"] == pytest.approx(expected, abs=1e-12)
    # d l / d logp = -A f'(rho) rho = -A * 4 sig (1 - sig) * rho  (f' = 4 sig (1 - sig))
    # seq 0 token 0: -(4 sig(.5) sig(-.5)) * 1.5 / 2 (sequence mean over 2 tokens, mean over B=2)
    (g,) = torch.autograd.grad(loss, logp)
    g00 = -4 * sig(0.5) * sig(-0.5) * 1.5 / 2 / 2
    g12 = 2 * 4 * sig(1.05) * sig(-1.05) * 2.0 / 3 / 2  # seq 1 token 2, A = -2, rho = 2
    assert g[0, 0].item() == pytest.approx(g00, abs=1e-12)
    assert g[1, 2].item() == pytest.approx(g12, abs=1e-12)
    assert g[0, 2].item() == 0.0


def test_sapo_on_policy_gradient_is_grpos():
    # f'(1) = 1: at rho = 1 SAPO and GRPO have the same gradient (the gate only acts off-policy)
    logp, _, adv, mask = _hand_inputs()
    grads = []
    for lt in ("sapo", "grpo"):
        x = logp.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(x, logp.detach(), adv, mask, loss_type=lt)
        grads.append(torch.autograd.grad(loss, x)[0])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-14, rtol=0)


def test_luspo_hand_values():
    # luspo = mean_i sum_t l_it = (-1.7 + 7.8) / 2 = 3.05; with num_sequences 4: x 2/4 = 1.525
    logp, old, adv, mask = _hand_inputs()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="luspo")
    assert loss.item() == pytest.approx(3.05, abs=1e-12)
    assert m["clip/low_frac"] == pytest.approx(0.2, abs=1e-12)
    loss4, _ = policy_loss(logp, old, adv, mask, loss_type="luspo", num_sequences=4)
    assert loss4.item() == pytest.approx(1.525, abs=1e-12)
    # gradient of seq 1 token 1 (rho 1.1 inside the clip): -A rho / B = 2 * 1.1 / 2 = 1.1
    (g,) = torch.autograd.grad(loss, logp)
    assert g[1, 1].item() == pytest.approx(1.1, abs=1e-12)


def test_vespo_hand_values_and_gradient():
    # seq 0: log w = ln 1.5 + ln 0.5 = ln 0.75; A >= 0: k 2, lam 3:
    #   phi = e^3 0.75^2 e^{-2.25} = 0.5625 e^{0.75} = 1.1908125
    # seq 1: log w = ln (0.5 * 1.1 * 2) = ln 1.1; A < 0: k 3, lam 2:
    #   phi = e^2 1.1^3 e^{-2.2} = 1.331 e^{-0.2} = 1.0897306
    # l = -phi A logp: seq 0: -1.1908125 * 1 * (-3) = 3.5724375; seq 1: -1.0897306*(-2)*(-4.5)
    #   = -9.8075757; dapo over 5 tokens: -6.2351382 / 5 = -1.2470276
    phi0, phi1 = 0.5625 * math.exp(0.75), 1.331 * math.exp(-0.2)
    assert (phi0, phi1) == (pytest.approx(1.1908125, abs=1e-6), pytest.approx(1.0897306, abs=1e-6))
    expected = (3 * phi0 - 9 * phi1) / 5
    assert expected == pytest.approx(-1.2470276, abs=1e-6)
    logp, old, adv, mask = _hand_inputs()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="vespo")
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["vespo/phi_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(
        policy_loss(logp, old, adv, mask, loss_type="vespo", num_tokens=10)[0].item() * 2,
        abs=1e-12,
    )
    # phi is detached: d l / d logp_it = -phi_i A_i / num_tokens
    (g,) = torch.autograd.grad(loss, logp)
    expected_g = torch.tensor(
        [[-phi0 / 5, -phi0 / 5, 0.0], [2 * phi1 / 5, 2 * phi1 / 5, 2 * phi1 / 5]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(g, expected_g, atol=1e-12, rtol=0)


def test_vespo_phi_is_one_on_policy_and_folds_in_off_policy_weights():
    logp, _, adv, mask = _hand_inputs()
    phi = vespo_weights(logp.detach(), logp.detach(), adv, mask)
    torch.testing.assert_close(phi, torch.ones(2, dtype=torch.float64), atol=1e-15, rtol=0)
    # token weights join log w: weights 2 on seq 0's two tokens -> w = 4 (k 2, lam 3):
    #   phi = e^3 16 e^-12 = 16 e^-9 = 0.0019747; a weight 0 (masked) adds log 1e-8
    w = torch.tensor([[2.0, 2.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    phi = vespo_weights(logp.detach(), logp.detach(), adv, mask, weights=w)
    assert phi[0].item() == pytest.approx(16 * math.exp(-9), abs=1e-12)
    # seq 1: w = 1e-8 (k 3, lam 2): phi = e^2 1e-24 e^{-2e-8} ~ 7.389e-24
    assert phi[1].item() == pytest.approx(math.exp(2) * 1e-24, rel=1e-6)
    # the loss does not also multiply the surrogate by the weights
    loss_w, _ = policy_loss(logp, logp.detach(), adv, mask, loss_type="vespo", weights=w)
    expected = -(16 * math.exp(-9) * (-3.0) + phi[1].item() * (-2) * (-4.5)) / 5
    assert loss_w.item() == pytest.approx(expected, abs=1e-12)


def test_delta_caps_the_unclipped_ratio():
    # delta 1.5: seq 1 token 2 (rho 2 > 1.5, A = -2): -min(1.5 * -2, 1.2 * -2) = 3 (was 4),
    # its gradient 0; seq 1 sum 6.8; grpo = (-0.85 + 6.8 / 3) / 2 = 0.7083333
    logp, old, adv, mask = _hand_inputs()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="grpo", delta=1.5)
    assert loss.item() == pytest.approx((-0.85 + 6.8 / 3) / 2, abs=1e-12)
    assert m["clip/delta_frac"] == pytest.approx(0.2, abs=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[1, 2].item() == 0.0
    # delta above every ratio changes nothing
    loss_big, m_big = policy_loss(logp, old, adv, mask, loss_type="grpo", delta=10.0)
    assert loss_big.item() == pytest.approx(0.875, abs=1e-12) and m_big["clip/delta_frac"] == 0.0


def test_keep_masks_the_surrogate_not_the_normaliser_or_kl():
    # keep = 0 on seq 1 token 1 (l = 2.2): seq 1 sum 5.6 still over 3 tokens:
    #   grpo = (-0.85 + 5.6 / 3) / 2 = 0.5083333
    logp, old, adv, mask = _hand_inputs()
    keep = torch.tensor([[1, 1, 1], [1, 0, 1]])
    loss, _ = policy_loss(logp, old, adv, mask, keep=keep)
    assert loss.item() == pytest.approx((-0.85 + 5.6 / 3) / 2, abs=1e-12)
    # the KL term is not masked: beta 0.1, k3 = ln 2 - 0.5 per token, grpo adds 0.1 (ln 2 - 0.5)
    ref = logp.detach() - math.log(2.0)
    loss_kl, m = policy_loss(logp, old, adv, mask, keep=keep, ref_logp=ref, beta=0.1)
    assert m["loss/kl"] == pytest.approx(0.1 * (math.log(2) - 0.5), abs=1e-12)
    assert loss_kl.item() == pytest.approx(loss.item() + m["loss/kl"], abs=1e-12)


# --------------------------------------------------------------------------------------------
# loop reference: sapo / luspo / vespo / delta / keep / weights, token and sequence ratios
# --------------------------------------------------------------------------------------------


def _loop(logp, old, adv, mask, *, loss_type, ratio_level, delta, keep, weights, ref, beta, nt):
    """Slow reference: scalar ops token by token (k3 KL, eps 0.2, eps_high 0.28)."""
    eps, eps_high = 0.2, 0.28
    B, T = logp.shape
    zero = logp[0, 0] * 0.0
    sums, lens = [], []
    for i in range(B):
        idx = [t for t in range(T) if int(mask[i, t]) == 1]
        a = float(adv[i])
        if idx:
            s = sum(float(logp[i, t].detach()) - float(old[i, t]) for t in idx) / len(idx)
        if loss_type == "vespo":
            lw = sum(
                min(max(float(logp[i, t].detach()) - float(old[i, t]), -20.0), 20.0) for t in idx
            )
            if weights is not None:
                for t in idx:
                    wt = float(weights[i, t])
                    lw += min(max(math.log(wt), math.log(1e-8)), 20.0) if wt > 0 else math.log(1e-8)
            lw = min(max(lw, math.log(1e-8)), 20.0)
            k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
            phi = math.exp(lam + k * lw - lam * math.exp(lw))
        total = zero
        for t in idx:
            x = logp[i, t]
            if ratio_level == "token":
                r = torch.exp(x - float(old[i, t]))
            else:
                r = math.exp(s) * (1.0 + (x - x.detach()))
            rv = float(r.detach())
            if loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                term = -(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
            elif loss_type == "vespo":
                term = -phi * a * x
            else:  # clipped surrogate, branch by branch
                if a > 0:
                    term = -(1 + eps_high) * a + 0.0 * x if rv > 1 + eps_high else -a * r
                elif a < 0:
                    if rv < 1 - eps:
                        term = -(1 - eps) * a + 0.0 * x
                    elif delta is not None and rv > delta:
                        term = -delta * a + 0.0 * x
                    else:
                        term = -a * r
                else:
                    term = 0.0 * x
            if weights is not None and loss_type != "vespo":
                term = term * float(weights[i, t])
            if keep is not None and not bool(keep[i, t]):
                term = term * 0.0
            if beta > 0:
                d = float(ref[i, t]) - x
                term = term + beta * (torch.exp(d) - d - 1.0)
            total = total + term
        sums.append(total)
        lens.append(len(idx))
    if loss_type == "sapo":
        return sum(s / max(n, 1) for s, n in zip(sums, lens)) / B
    if loss_type == "luspo":
        return sum(sums) / B
    if loss_type == "vespo":
        return sum(sums) / (nt if nt is not None else max(sum(lens), 1))
    return sum(s / max(n, 1) for s, n in zip(sums, lens)) / B  # grpo (delta)


def _batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    lengths[2] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    keep = (torch.rand(B, T, generator=g) > 0.3).long()
    weights = torch.exp(0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
    weights[3, 0] = 0.0  # a masked (MIS) token
    logp = logp.masked_fill(mask == 0, -float("inf"))  # padding garbage must not matter
    return logp, old, ref, adv, mask, keep, weights


VARIANTS = [
    ("sapo", "token", None),
    ("sapo", "sequence", None),
    ("luspo", "token", None),
    ("luspo", "sequence", None),
    ("luspo", "sequence", 1.3),
    ("vespo", "token", None),
    ("grpo", "token", 1.3),
]


@pytest.mark.parametrize(("loss_type", "ratio_level", "delta"), VARIANTS)
@pytest.mark.parametrize(("use_keep", "use_weights", "beta"), [(0, 0, 0.0), (1, 1, 0.05)])
def test_variants_match_loop_reference(loss_type, ratio_level, delta, use_keep, use_weights, beta):
    for seed in (0, 1, 2):
        logp, old, ref, adv, mask, keep, weights = _batch(seed)
        nt = 41 if seed == 2 else None
        kw = dict(
            loss_type=loss_type,
            ratio_level=ratio_level,
            clip_eps=0.2,
            clip_eps_high=0.28,
            ref_logp=ref,
            beta=beta,
            delta=delta,
            keep=keep if use_keep else None,
            weights=weights if use_weights else None,
            num_tokens=nt,
        )
        x1 = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(x1, old, adv, mask, **kw)
        (g1,) = torch.autograd.grad(loss, x1)
        x2 = logp.clone().requires_grad_(True)
        ref_loss = _loop(
            x2,
            old,
            adv,
            mask,
            loss_type=loss_type,
            ratio_level=ratio_level,
            delta=delta,
            keep=kw["keep"],
            weights=kw["weights"],
            ref=ref,
            beta=beta,
            nt=nt,
        )
        (g2,) = torch.autograd.grad(ref_loss, x2)
        assert torch.isfinite(loss) and torch.isfinite(g1).all()
        torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(g1, g2, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------------------------
# OPSM, IcePop, entropy selection and bonus, adaptive coefficient, GDPO
# --------------------------------------------------------------------------------------------


def test_opsm_hand_values():
    # behaviour - logp per counted token: seq 0 [0.75, 0.25] -> D = 0.5; seq 1 [0.75, 0.25, pad]
    # -> D = 0.5; seq 2 [2, NaN] -> D = (2 + 0) / 2 = 1. Advantages [-1, 0, -1].
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -2.0, 5.0], [-1.0, -1.0, 0.0]])
    beh = logp + torch.tensor([[0.75, 0.25, 0.0], [0.75, 0.25, 9.0], [2.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([-1.0, 0.0, -1.0])
    # delta 0.5: seq 0 D = 0.5 <= 0.5 kept; seq 1 A = 0 kept; seq 2 D = 1 > 0.5 dropped
    got = off_policy_sequence_mask(logp, beh, adv, mask, 0.5)
    assert got.tolist() == [True, True, False]
    got = off_policy_sequence_mask(logp, beh, adv, mask, 0.4999)
    assert got.tolist() == [False, True, False]
    got = off_policy_sequence_mask(logp, beh, adv, mask, 1.0)
    assert got.tolist() == [True, True, True]
    with pytest.raises(ValueError, match="threshold: expected a positive number"):
        off_policy_sequence_mask(logp, beh, adv, mask, 0.0)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(3,\)"):
        off_policy_sequence_mask(logp, beh, adv[:2], mask, 0.5)


def test_icepop_is_the_bidirectional_token_mask():
    # IcePop [alpha, beta] = [0.5, 5]: r = pi_old / mu per token; r in {0.4, 1, 4, 6}
    # -> weights {0 (below), 1, 4, 0 (above)}
    r = torch.tensor([[0.4, 1.0, 4.0, 6.0]], dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    w, m = off_policy_weights(
        old, old - torch.log(r), torch.ones(1, 4), correction="token_mis", low=0.5, high=5.0
    )
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 4.0, 0.0]], dtype=torch.float64))
    assert m["correction/masked_frac"] == 0.5


def test_high_entropy_mask_hand_values():
    # counted entropies [0.1, 0.5, 0.9, 0.3, 0.7] (padding 100 ignored); rho = 0.4:
    # tau = quantile 0.6 = sorted [.1 .3 .5 .7 .9] at position 0.6 * 4 = 2.4 -> .5 + .4 * .2 = 0.58
    # -> keep {0.9, 0.7}
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = high_entropy_mask(ent, mask, 0.4)
    assert got.tolist() == [[False, False, True], [False, True, False]]
    assert high_entropy_mask(ent, mask, 1.0).tolist() == (mask == 1).tolist()
    assert high_entropy_mask(ent, mask, 0.0).tolist() == [[False, False, True], [False] * 3]
    assert not high_entropy_mask(ent, torch.zeros(2, 3), 0.5).any()
    with pytest.raises(ValueError, match=r"quantile: expected a number in \[0, 1\]"):
        high_entropy_mask(ent, mask, 1.5)


def test_entropy_bonus_and_adaptive_rule():
    ent = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 6.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    h = entropy_bonus(ent, mask)  # (1 + 2 + 3 + 6) / 4 = 3
    assert h.item() == pytest.approx(3.0, abs=1e-7)
    h.backward()
    assert ent.grad.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.25, 0.0]]
    kw = dict(target=0.2, step=0.005, coef_min=0.0, coef_max=0.012)
    assert adaptive_entropy_coef(0.01, 0.2, **kw) == pytest.approx(0.012)  # <= target: up, capped
    assert adaptive_entropy_coef(0.01, 0.1, **{**kw, "coef_max": 1.0}) == pytest.approx(0.015)
    assert adaptive_entropy_coef(0.003, 0.3, **kw) == 0.0  # above: down, floored
    with pytest.raises(ValueError, match="coef_min <= coef_max"):
        adaptive_entropy_coef(0.01, 0.3, target=0.2, step=0.005, coef_min=1.0, coef_max=0.5)


def test_gdpo_hand_values():
    # P = 2 groups of G = 2, K = 2 functions, weights [1, 0.5].
    # f0: group 0 [1, 0] -> mean .5, std (n-1) sqrt(.5) = 0.7071068 -> +-0.5 / (0.7071068 + 1e-4)
    #     group 1 [1, 1] -> std 0 -> [0, 0]
    # f1: group 0 [2, 2] -> [0, 0]; group 1 [0, 4] -> mean 2, std sqrt(8) = 2.8284271
    #     -> -+2 / (2.8284271 + 1e-4)
    # S = w . A^k = [a, -a, -b/2, b/2], batch mean 0, std (n-1) sqrt((2a^2 + b^2/2) / 3)
    #   = 0.64551; A = S / (0.64551 + 1e-4): [1.09525, -1.09525, -0.54768, 0.54768]
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # 0.70700
    b = 2.0 / (math.sqrt(8.0) + 1e-4)  # 0.70708
    S = [a, -a, -0.5 * b, 0.5 * b]
    mean = sum(S) / 4
    std = math.sqrt(sum((s - mean) ** 2 for s in S) / 3)
    expected = [(s - mean) / (std + 1e-4) for s in S]
    rewards = torch.tensor(
        [[[1.0, 2.0], [0.0, 2.0]], [[1.0, 0.0], [1.0, 4.0]]], dtype=torch.float64
    )  # [P, G, K]
    got = gdpo_advantages(rewards, torch.tensor([1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(
        got.reshape(-1), torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert expected[0] == pytest.approx(1.09525, abs=1e-5)  # the arithmetic above
    assert expected[3] == pytest.approx(0.54768, abs=1e-5)


def test_gdpo_nan_and_validation():
    # a NaN score is left out of its function's group statistics and adds 0; a completion no
    # function scored gets 0 and is left out of the batch statistics
    nan = float("nan")
    rewards = torch.tensor([[[1.0, nan], [0.0, nan], [nan, nan]]])  # [1, 3, 2]
    got = gdpo_advantages(rewards, torch.tensor([1.0, 1.0]))
    # f0 group [1, 0] -> +-0.70700; f1 unscored; S = [a, -a], batch mean 0, std sqrt(2) a
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    s = math.sqrt(2) * a
    torch.testing.assert_close(
        got, torch.tensor([[a / (s + 1e-4), -a / (s + 1e-4), 0.0]]), atol=1e-6, rtol=0
    )
    with pytest.raises(ValueError, match=r"weights: expected shape \(2,\)"):
        gdpo_advantages(rewards, torch.ones(3))
    with pytest.raises(ValueError, match=r"rewards: expected a \[P, G, K\]"):
        gdpo_advantages(torch.ones(2, 2), torch.ones(2))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "sapo2"}, "loss_type: expected one of .*'sapo', 'luspo', 'vespo'"),
        ({"delta": 1.0}, "delta: expected a number > 1"),
        ({"delta": 4.0, "loss_type": "sapo"}, "delta: applies to the clipped loss types"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos: expected"),
        ({"loss_type": "vespo", "vespo_k_neg": -1.0}, "vespo_k_neg: expected a number >= 0"),
        ({"keep": torch.full((2, 3), 2)}, "keep: expected only 0/1 values"),
    ],
)
def test_variant_bad_options(kwargs, match):
    logp, old, adv, mask = _hand_inputs()
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, old, adv, mask, **kwargs)


def test_vespo_needs_one_advantage_per_sequence():
    logp, old, _, mask = _hand_inputs()
    with pytest.raises(ValueError, match="loss_type='vespo' needs one advantage per sequence"):
        policy_loss(logp, old, torch.ones(2, 3, dtype=torch.float64), mask, loss_type="vespo")


# --------------------------------------------------------------------------------------------
# TRL 1.16's own helpers on the same tensors (skipped without trl)
# --------------------------------------------------------------------------------------------


def _trl_trainer():
    mod = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is not installed")
    return mod.GRPOTrainer


@pytest.mark.parametrize("with_is", [False, True])
def test_vespo_weights_match_trl_get_gamma_weights(with_is):
    T = _trl_trainer()
    for seed in (0, 1):
        logp, old, _, adv, mask, _, weights = _batch(seed)
        logp = logp.masked_fill(mask == 0, 0.0)  # TRL multiplies padding by the mask
        old = old.masked_fill(mask == 0, 0.0)
        kw = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
        w = torch.where(mask == 1, weights, torch.ones_like(weights)) if with_is else None
        theirs = T.get_gamma_weights(
            advantages=adv[:, None],
            log_ratio_per_token=logp - old,
            mask=mask,
            importance_sampling_ratio=w,
            **kw,
        )  # [B, 1]
        ours = vespo_weights(logp, old, adv, mask, weights=w, **kw)
        torch.testing.assert_close(ours, theirs[:, 0], atol=1e-12, rtol=1e-12)


def test_opsm_matches_trl_get_off_policy_mask():
    T = _trl_trainer()
    for seed, thr in itertools.product((0, 1, 2), (0.05, 0.3, 1.0)):
        logp, old, _, adv, mask, _, _ = _batch(seed)
        logp = logp.masked_fill(mask == 0, 0.0)
        theirs = T.get_off_policy_mask(
            advantages=adv[:, None],
            per_token_logps=logp,
            sampling_per_token_logps=old,
            mask=mask.to(torch.float64),
            off_policy_threshold=thr,
        )  # [B, 1]
        ours = off_policy_sequence_mask(logp, old, adv, mask, thr)
        assert ours.tolist() == theirs[:, 0].bool().tolist()


def test_high_entropy_mask_matches_trl():
    T = _trl_trainer()
    one_process = SimpleNamespace(
        accelerator=SimpleNamespace(
            pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t
        )
    )
    g = torch.Generator().manual_seed(0)
    ent = torch.rand(5, 9, generator=g) * 4
    mask = (torch.rand(5, 9, generator=g) > 0.3).long()
    for rho in (0.0, 0.2, 0.5, 0.9, 1.0):
        theirs = T.get_high_entropy_mask(one_process, ent, mask, 1 - rho)
        assert high_entropy_mask(ent, mask, rho).tolist() == theirs.tolist(), rho


# --------------------------------------------------------------------------------------------
# the CLI end to end (one tiny run per new loss type, every new option on)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--algo.loss_type", "sapo"],
        ["--algo.loss_type", "luspo", "--algo.ratio_level", "sequence", "--algo.delta", "4"],
        [
            "--algo.loss_type",
            "vespo",
            "--algo.off_policy_mask_threshold",
            "0.5",
            "--algo.top_entropy_quantile",
            "0.5",
            "--algo.entropy_coef",
            "0.01",
            "--algo.use_adaptive_entropy",
            "true",
            "--algo.entropy_target",
            "5",
            "--algo.multi_objective_aggregation",
            "normalize_then_sum",
        ],
    ],
    ids=["sapo", "luspo", "vespo+all"],
)
def test_cli_trains_two_steps_with_the_new_options(tmp_path, extra):
    import json

    from cli_helper import cli

    args = [
        "train",
        "--train.steps",
        "2",
        "--train.threads",
        "1",
        "--train.eval_size",
        "4",
        "--train.eval_every",
        "0",
        "--rollout.prompts_per_step",
        "4",
        "--train.display",
        "plain",
        "-o",
        str(tmp_path / "run"),
        *extra,
    ]
    out = cli(args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps)
    if "vespo" in extra:
        assert "vespo/phi_mean" in steps[-1] and "entropy/selected_frac" in steps[-1]
        assert "opsm/masked_frac" in steps[-1] and "entropy/coef" in steps[-1]
