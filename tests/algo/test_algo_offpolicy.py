"""Tests for peergrade.algo.offpolicy.off_policy_weights and the ``weights`` of policy_loss.

Known numbers (issue 22): pi_old = [-1.0, -2.0, -0.5], mu = [-1.2, -1.0, -0.5], so
d = log(pi_old / mu) = [0.2, -1.0, 0.0] and the token ratios are exp(d) = [1.2214, 0.3679, 1.0];
the sequence product is exp(-0.8) = 0.4493, the geometric mean exp(-0.8 / 3) = 0.7659.
"""

from __future__ import annotations

import math

import pytest
import torch

from peergrade.algo import off_policy_weights, policy_loss
from peergrade.algo.offpolicy import CORRECTIONS

OLD = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
MU = torch.tensor([[-1.2, -1.0, -0.5]], dtype=torch.float64)
ONES = torch.ones(1, 3)
TOKEN_RATIOS = [math.exp(0.2), math.exp(-1.0), 1.0]  # [1.2214, 0.3679, 1.0]


def weights(correction, old=OLD, mu=MU, mask=ONES, **kw):
    return off_policy_weights(old, mu, mask, correction=correction, **kw)


def test_known_token_ratios_and_tis_leaves_them_below_the_cap():
    w, m = weights("token_tis", cap=2.0)
    assert w[0].tolist() == pytest.approx(TOKEN_RATIOS, abs=1e-12)
    assert w[0].tolist() == pytest.approx([1.2214, 0.3679, 1.0], abs=1e-4)
    assert m["correction/truncated_frac"] == 0.0
    assert m["correction/masked_frac"] == 0.0
    assert m["correction/weight_min"] == pytest.approx(0.3679, abs=1e-4)
    assert m["correction/weight_max"] == pytest.approx(1.2214, abs=1e-4)
    assert m["correction/weight_mean"] == pytest.approx(sum(TOKEN_RATIOS) / 3, abs=1e-12)


def test_token_tis_truncates_at_the_cap():
    w, m = weights("token_tis", cap=1.1)
    assert w[0].tolist() == pytest.approx([1.1, math.exp(-1.0), 1.0], abs=1e-12)
    assert m["correction/truncated_frac"] == pytest.approx(1 / 3)


def test_token_mis_masks_the_token_outside_the_interval():
    w, m = weights("token_mis", low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([1.2214, 0.0, 1.0], abs=1e-4)
    assert w[0, 1].item() == 0.0
    assert m["correction/masked_frac"] == pytest.approx(1 / 3)
    assert m["correction/weight_min"] == 0.0


def test_sequence_product_is_masked_and_geometric_mean_kept():
    w, m = weights("sequence_mis", sequence_ratio="product", low=0.5, high=2.0)
    assert w[0].tolist() == [0.0, 0.0, 0.0]  # product 0.4493 < 0.5
    assert m["correction/masked_frac"] == 1.0
    w, _ = weights("sequence_tis", sequence_ratio="product", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.4493] * 3, abs=1e-4)
    w, m = weights("sequence_mis", low=0.5, high=2.0)  # geometric by default
    assert w[0].tolist() == pytest.approx([0.7659] * 3, abs=1e-4)
    assert w[0].tolist() == pytest.approx([math.exp(-0.8 / 3)] * 3, abs=1e-12)
    assert m["correction/masked_frac"] == 0.0


def test_product_masks_long_sequences_that_the_geometric_mean_keeps():
    # 0.002 nats per token of numerical mismatch over 500 tokens: product exp(-1) = 0.37
    T = 500
    old = torch.full((1, T), -1.0)
    mu = old + 0.002
    mask = torch.ones(1, T)
    w_prod, _ = off_policy_weights(
        old, mu, mask, correction="sequence_mis", sequence_ratio="product"
    )
    w_geo, _ = off_policy_weights(old, mu, mask, correction="sequence_mis")
    assert w_prod.abs().sum() == 0
    assert w_geo.min() > 0.99


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("sequence_ratio", ["geometric", "product"])
def test_identity_when_behaviour_equals_old_bitwise(correction, sequence_ratio):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 7, generator=g) * 5
    mask = torch.ones(4, 7)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    w, m = off_policy_weights(
        old, old.clone(), mask, correction=correction, sequence_ratio=sequence_ratio
    )
    assert torch.equal(w, mask)  # exactly 1 on counted tokens, exactly 0 on padding
    assert m["correction/masked_frac"] == 0.0
    assert m["correction/truncated_frac"] == 0.0
    assert m["correction/weight_min"] == m["correction/weight_max"] == 1.0


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_padding_gets_zero_and_does_not_change_the_counted_weights(correction):
    # The same sequence padded with -inf / NaN log-probs: its counted weights are unchanged.
    old = torch.cat([OLD, torch.tensor([[-float("inf"), float("nan")]], dtype=OLD.dtype)], 1)
    mu = torch.cat([MU, torch.tensor([[float("nan"), -3.0]], dtype=MU.dtype)], 1)
    mask = torch.tensor([[1.0, 1, 1, 0, 0]])
    w_pad, m_pad = off_policy_weights(old, mu, mask, correction=correction)
    w, m = weights(correction)
    assert torch.equal(w_pad[:, :3], w)
    assert w_pad[0, 3:].tolist() == [0.0, 0.0]
    assert m_pad == m


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    mu = MU.clone().requires_grad_(True)
    for c in CORRECTIONS:
        w, _ = off_policy_weights(old, mu, ONES, correction=c)
        assert not w.requires_grad and w.grad_fn is None


def test_options_are_validated_with_the_valid_choices():
    with pytest.raises(ValueError, match="token_tis"):
        weights("tis")
    with pytest.raises(ValueError, match="geometric"):
        weights("sequence_tis", sequence_ratio="mean")
    with pytest.raises(ValueError, match="cap"):
        weights("token_tis", cap=0.5)
    with pytest.raises(ValueError, match="low"):
        weights("token_mis", low=1.5)
    with pytest.raises(ValueError, match="high"):
        weights("token_mis", high=0.9)
    with pytest.raises(ValueError, match="behaviour_logp"):
        off_policy_weights(OLD, MU[:, :2], ONES)
    with pytest.raises(ValueError, match="0/1"):
        off_policy_weights(OLD, MU, ONES * 0.5)


# --------------------------------------------------------------------------------------------
# policy_loss(weights=...)
# --------------------------------------------------------------------------------------------


def _batch(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    if B > 2:
        mask[0, 4:] = 0
        mask[2, 2:] = 0
    ref = logp.detach() + 0.05 * torch.randn(B, T, generator=g)
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_with_unit_weights_equals_uncorrected_bitwise(loss_type, beta):
    logp, old, adv, mask, ref = _batch()
    kw = dict(loss_type=loss_type, beta=beta, ref_logp=ref, max_completion_length=6)
    plain, m_plain = policy_loss(logp, old, adv, mask, **kw)
    (g_plain,) = torch.autograd.grad(plain, logp)
    w, _ = off_policy_weights(old, old.clone(), mask, correction="token_tis")
    corrected, m_corr = policy_loss(logp, old, adv, mask, weights=w, **kw)
    (g_corr,) = torch.autograd.grad(corrected, logp)
    assert torch.equal(plain, corrected)
    assert torch.equal(g_plain, g_corr)
    assert m_plain == m_corr


def test_weights_multiply_the_surrogate_not_the_kl():
    logp, old, adv, mask, ref = _batch()
    w = torch.rand(4, 6, generator=torch.Generator().manual_seed(1))
    kw = dict(loss_type="dapo", beta=0.04, ref_logp=ref)
    _, m = policy_loss(logp, old, adv, mask, weights=w, **kw)
    _, m_plain = policy_loss(logp, old, adv, mask, **kw)
    assert m["loss/kl"] == m_plain["loss/kl"]
    # dapo surrogate = sum m w pg / sum m: compare with the hand-weighted per-token surrogate
    rho = torch.exp(logp.detach() - old)
    pg = -torch.minimum(rho * adv[:, None], rho.clamp(0.8, 1.2) * adv[:, None])
    expected = (pg * w * mask).sum() / mask.sum()
    assert m["loss/policy"] == pytest.approx(expected.item(), rel=1e-6)


def test_weighted_loss_is_the_same_padded_and_unpadded():
    logp, old, adv, _, ref = _batch(B=1, T=3)
    mu = old - torch.tensor([[0.3, -0.9, 0.0]])
    w, _ = off_policy_weights(old, mu, torch.ones(1, 3), correction="token_mis")
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 3), weights=w)
    pad = torch.full((1, 2), float("nan"))
    logp_p = torch.cat([logp.detach(), torch.full((1, 2), -float("inf"))], 1).requires_grad_(True)
    old_p, mu_p = torch.cat([old, pad], 1), torch.cat([mu, pad], 1)
    mask_p = torch.tensor([[1.0, 1, 1, 0, 0]])
    w_p, _ = off_policy_weights(old_p, mu_p, mask_p, correction="token_mis")
    loss_p, _ = policy_loss(logp_p, old_p, adv, mask_p, weights=w_p)
    assert torch.equal(loss, loss_p)
    loss_p.backward()
    assert torch.isfinite(logp_p.grad).all() and logp_p.grad[0, 3:].abs().sum() == 0


def test_loss_weights_shape_is_checked():
    logp, old, adv, mask, _ = _batch()
    with pytest.raises(ValueError, match="weights"):
        policy_loss(logp, old, adv, mask, weights=torch.ones(4, 5))
