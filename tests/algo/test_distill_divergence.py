"""On-policy distillation's dense divergence (``algo.teacher_divergence: top_k``): the generalized
JSD and the top-k tail bucket by hand, and against TRL's ``generalized_jsd_loss``."""

from __future__ import annotations

import math

import pytest
import torch

from peergrade.algo.distill import add_tail_bucket, generalized_jsd, topk_divergence

L = math.log


def _lp(*p: float) -> torch.Tensor:
    return torch.tensor([[L(x) for x in p]])  # [1, K]


def test_generalized_jsd_hand_values():
    s, t = _lp(0.5, 0.5), _lp(0.75, 0.25)
    forward = 0.75 * L(0.75 / 0.5) + 0.25 * L(0.25 / 0.5)  # KL(teacher || student)
    reverse = 0.5 * L(0.5 / 0.75) + 0.5 * L(0.5 / 0.25)  # KL(student || teacher)
    m = (0.625, 0.375)  # 0.5 t + 0.5 s
    jsd = 0.5 * (0.75 * L(0.75 / m[0]) + 0.25 * L(0.25 / m[1])) + 0.5 * (
        0.5 * L(0.5 / m[0]) + 0.5 * L(0.5 / m[1])
    )
    m3 = (0.25 * 0.75 + 0.75 * 0.5, 0.25 * 0.25 + 0.75 * 0.5)  # beta 0.25: 0.25 t + 0.75 s
    jsd3 = 0.25 * (0.75 * L(0.75 / m3[0]) + 0.25 * L(0.25 / m3[1])) + 0.75 * (
        0.5 * L(0.5 / m3[0]) + 0.5 * L(0.5 / m3[1])
    )
    for beta, want in ((0.0, forward), (1.0, reverse), (0.5, jsd), (0.25, jsd3)):
        got = generalized_jsd(s, t, beta)
        assert got.shape == (1,)
        assert float(got) == pytest.approx(want, abs=1e-6), beta
    assert float(generalized_jsd(t, t, 0.5)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, 1.5)


def test_zero_probability_outcomes_count_zero_and_keep_gradients_finite():
    s = torch.tensor([[L(0.5), L(0.5), -math.inf]], requires_grad=True)
    t = torch.tensor([[L(0.75), L(0.25), -math.inf]])
    for beta in (0.0, 0.5, 1.0):
        d = generalized_jsd(s, t, beta)
        want = generalized_jsd(s[:, :2].detach(), t[:, :2], beta)
        assert float(d.detach()) == pytest.approx(float(want))
        (g,) = torch.autograd.grad(d.sum(), s)
        assert torch.isfinite(g).all()


def test_tail_bucket_and_topk_divergence_hand_values():
    # top-1: the student puts 0.5 on the teacher's best token, the teacher 0.75: the buckets
    # are (0.5, 0.5) and (0.75, 0.25)
    s_at, t_top = _lp(0.5), _lp(0.75)
    torch.testing.assert_close(add_tail_bucket(t_top), _lp(0.75, 0.25))
    reverse = 0.5 * L(0.5 / 0.75) + 0.5 * L(0.5 / 0.25)
    assert float(topk_divergence(s_at, t_top, beta=1.0)) == pytest.approx(reverse, abs=1e-6)
    # without the tail both are renormalised over the k tokens: (0.6, 0.4) and (0.75, 0.25)
    s2, t2 = _lp(0.3, 0.2), _lp(0.6, 0.2)
    forward = 0.75 * L(0.75 / 0.6) + 0.25 * L(0.25 / 0.4)
    got = topk_divergence(s2, t2, beta=0.0, add_tail=False)
    assert float(got) == pytest.approx(forward, abs=1e-6)
    # with it: (0.3, 0.2, 0.5) and (0.6, 0.2, 0.2)
    forward_tail = 0.6 * L(0.6 / 0.3) + 0.2 * L(0.2 / 0.2) + 0.2 * L(0.2 / 0.5)
    assert float(topk_divergence(s2, t2, beta=0.0)) == pytest.approx(forward_tail, abs=1e-6)
    # a support holding all the mass: the clamped tail (about 1e-7 each) adds about nothing
    full_s, full_t = _lp(0.5, 0.5), _lp(0.75, 0.25)
    assert float(topk_divergence(full_s, full_t, beta=1.0)) == pytest.approx(reverse, abs=1e-5)
    with pytest.raises(ValueError, match=r"\[M, k\]"):
        topk_divergence(s2, t_top, beta=1.0)


def test_generalized_jsd_matches_trls_generalized_jsd_loss():
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g) * 2
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    for beta in (0.0, 0.3, 0.5, 1.0):
        trl = gkd.GKDTrainer.generalized_jsd_loss(zs[None], zt[None], beta=beta, reduction="sum")
        ours = generalized_jsd(s, t, beta).sum()
        torch.testing.assert_close(ours, trl.float(), rtol=1e-5, atol=1e-6)
