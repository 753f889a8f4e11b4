"""Tests for peergrade.algo.advantages: group_advantages and gae.

Hand-computed values (worked out in the comments), a per-element loop reference for GAE,
hypothesis properties (shift/scale invariance, finiteness) and input validation.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peergrade.algo import gae, group_advantages

NAN = float("nan")
EPS = 1e-4


# --------------------------------------------------------------------------------------------
# group_advantages: hand-computed values
# --------------------------------------------------------------------------------------------

# Three groups of G = 4:
#   g0 = [1, 0, 1, NaN]  3 scored: mean 2/3, Bessel var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
#   g1 = [2, 2, 2, 2]    all equal: advantage exactly 0
#   g2 = [0, 1, 2, 3]    mean 3/2, Bessel var (9/4 + 1/4 + 1/4 + 9/4) / 3 = 5/3
# Batch (11 scored): sum 16, sum of squares 32, mean 16/11, Bessel var (32 - 256/11) / 10 = 48/55.
REWARDS = [[1.0, 0.0, 1.0, NAN], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]]
S0, S2, SB = math.sqrt(1 / 3), math.sqrt(5 / 3), math.sqrt(48 / 55)
# Leave-one-out baselines: g0 -> [(0+1)/2, (1+1)/2, (1+0)/2] = [1/2, 1, 1/2], so r - b =
# [1/2, -1, 1/2]; g2 -> [(1+2+3)/3, (0+2+3)/3, (0+1+3)/3, (0+1+2)/3] = [2, 5/3, 4/3, 1],
# so r - b = [-2, -2/3, 2/3, 2].
D_MEAN = [[1 / 3, -2 / 3, 1 / 3, 0.0], [0.0] * 4, [-1.5, -0.5, 0.5, 1.5]]
D_LOO = [[0.5, -1.0, 0.5, 0.0], [0.0] * 4, [-2.0, -2 / 3, 2 / 3, 2.0]]


def _expected(diffs, denoms):
    return torch.tensor(
        [[d / s for d in row] for row, s in zip(diffs, denoms)], dtype=torch.float64
    )


@pytest.mark.parametrize(
    ("scale", "baseline", "expected"),
    [
        ("group", "mean", _expected(D_MEAN, [S0 + EPS, 1.0, S2 + EPS])),
        ("group", "leave_one_out", _expected(D_LOO, [S0 + EPS, 1.0, S2 + EPS])),
        ("batch", "mean", _expected(D_MEAN, [SB + EPS] * 3)),
        ("batch", "leave_one_out", _expected(D_LOO, [SB + EPS] * 3)),
        ("none", "mean", _expected(D_MEAN, [1.0] * 3)),
        ("none", "leave_one_out", _expected(D_LOO, [1.0] * 3)),
    ],
)
def test_group_advantages_hand_values(scale, baseline, expected):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = group_advantages(rewards, scale=scale, baseline=baseline)
    assert adv.shape == (3, 4)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # NaN (not scored) and the all-equal group are exactly zero.
    assert adv[0, 3].item() == 0.0
    assert torch.all(adv[1] == 0)


def test_group_advantages_default_is_group_mean_and_float32_kept():
    rewards = torch.tensor([[0.0, 1.0]])  # mean 1/2, Bessel std sqrt(1/2)
    adv = group_advantages(rewards)
    assert adv.dtype == torch.float32
    s = math.sqrt(0.5) + EPS
    torch.testing.assert_close(adv, torch.tensor([[-0.5 / s, 0.5 / s]]), rtol=0, atol=1e-7)


def test_group_advantages_eps_is_used():
    rewards = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    adv = group_advantages(rewards, eps=0.5)  # std sqrt(1/2) + 0.5
    torch.testing.assert_close(adv[0, 1].item(), 0.5 / (math.sqrt(0.5) + 0.5), rtol=0, atol=1e-15)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_group_advantages_edge_cases_are_zero(scale, baseline):
    rewards = torch.tensor(
        [
            [NAN, NAN, NAN],  # nothing scored
            [NAN, 5.0, NAN],  # one scored member: no comparison possible
            [0.1, 0.1, 0.1],  # all equal (0.1 * 3 / 3 != 0.1 in floating point)
            [0.0, 1.0, NAN],  # an ordinary group with one unscored member
        ],
        dtype=torch.float64,
    )
    adv = group_advantages(rewards, scale=scale, baseline=baseline)
    assert torch.all(adv[:3] == 0)
    assert adv[3, 2].item() == 0.0
    assert adv[3, 0].item() < 0 < adv[3, 1].item()


def test_group_advantages_single_completion_groups_and_int_input():
    assert torch.all(group_advantages(torch.tensor([[1.0], [0.0]])) == 0)
    adv = group_advantages(torch.tensor([[0, 1]]), scale="none")  # int rewards -> float32
    assert adv.dtype == torch.float32
    assert adv.tolist() == [[-0.5, 0.5]]


def test_group_advantages_leave_one_out_relation():
    # RLOO identity: r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_j r_j).
    torch.manual_seed(0)
    rewards = torch.randn(5, 6, dtype=torch.float64)
    loo = group_advantages(rewards, scale="none", baseline="leave_one_out")
    mean = group_advantages(rewards, scale="none", baseline="mean")
    torch.testing.assert_close(loo, mean * 6 / 5, rtol=0, atol=1e-12)


def test_group_advantages_loop_reference():
    """Per-element Python loop (statistics module) against the vectorised code."""
    import statistics

    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 5, generator=g, dtype=torch.float64)
    rewards[0, 1] = NAN
    rewards[1, :] = NAN
    rewards[2, 1:] = NAN
    rewards[3, ::2] = NAN
    rows = rewards.tolist()
    all_scored = [x for row in rows for x in row if not math.isnan(x)]
    for scale in ("group", "batch", "none"):
        for baseline in ("mean", "leave_one_out"):
            exp = []
            for row in rows:
                sc = [x for x in row if not math.isnan(x)]
                out = []
                for x in row:
                    if math.isnan(x) or len(sc) < 2:
                        out.append(0.0)
                        continue
                    if baseline == "mean":
                        b = sum(sc) / len(sc)
                    else:
                        b = (sum(sc) - x) / (len(sc) - 1)
                    if scale == "group":
                        s = statistics.stdev(sc) + EPS
                    elif scale == "batch":
                        s = statistics.stdev(all_scored) + EPS
                    else:
                        s = 1.0
                    out.append((x - b) / s)
                exp.append(out)
            got = group_advantages(rewards, scale=scale, baseline=baseline)
            torch.testing.assert_close(
                got, torch.tensor(exp, dtype=torch.float64), atol=1e-12, rtol=0
            )


def test_group_advantages_no_grad_and_extreme_values():
    rewards = torch.tensor([[1.0, 2.0]], requires_grad=True)
    assert not group_advantages(rewards).requires_grad
    # Huge but finite: rescaled internally, the group-normalised result is the ordinary one.
    big = torch.tensor([[1e308, -1.7e308, 3.0], [1.0, 2.0, NAN]], dtype=torch.float64)
    adv = group_advantages(big)
    assert torch.isfinite(adv).all()
    s = math.sqrt(0.5) + EPS
    torch.testing.assert_close(adv[1], torch.tensor([-0.5 / s, 0.5 / s, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        adv[0], group_advantages(big[:1] / 1e300, eps=EPS / 1e300)[0], rtol=1e-12, atol=0
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": "std"}, r"scale.*'group', 'batch', 'none'"),
        ({"baseline": "rloo"}, r"baseline.*'mean', 'leave_one_out'"),
        ({"eps": 0.0}, r"eps: expected a positive number"),
        ({"eps": -1e-4}, r"eps: expected a positive number"),
    ],
)
def test_group_advantages_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(2, 3), **kwargs)


def test_group_advantages_bad_inputs():
    with pytest.raises(ValueError, match=r"rewards: expected shape \[P, G\].*\(6,\)"):
        group_advantages(torch.zeros(6))
    with pytest.raises(ValueError, match=r"rewards: expected shape \[P, G\]"):
        group_advantages(torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match=r"torch.Tensor"):
        group_advantages([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"inf"):
        group_advantages(torch.tensor([[1.0, float("inf")]]))


# --------------------------------------------------------------------------------------------
# group_advantages: hypothesis properties
# --------------------------------------------------------------------------------------------

_G = 4
_reward = st.one_of(st.floats(-100, 100, allow_nan=False), st.just(NAN))
_groups = st.lists(st.lists(_reward, min_size=_G, max_size=_G), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=_groups,
    which=st.integers(0, 3),
    shift=st.floats(-1000, 1000),
    factor=st.floats(0.1, 10),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
)
def test_group_scale_invariant_to_shift_and_scale_of_one_group(
    groups, which, shift, factor, baseline
):
    rewards = torch.tensor(groups, dtype=torch.float64)  # [P, G]
    p = which % rewards.shape[0]
    moved = rewards.clone()
    moved[p] = rewards[p] * factor + shift  # NaN stays NaN
    a = group_advantages(rewards, scale="group", baseline=baseline)
    b = group_advantages(moved, scale="group", baseline=baseline)
    others = [i for i in range(rewards.shape[0]) if i != p]
    assert torch.equal(a[others], b[others])  # other groups untouched, bit for bit
    # A = d / (s + eps) and |d| / s <= sqrt(G) (both baselines), so each of
    # a, b is within 2 sqrt(G) eps / (s + eps) resp. (c s + eps) of the eps-free value d / s.
    sc = [x for x in groups[p] if not math.isnan(x)]
    s = float(torch.tensor(sc, dtype=torch.float64).std()) if len(sc) >= 2 else 0.0
    tol = 2 * math.sqrt(_G) * EPS * (1 / (s + EPS) + 1 / (factor * s + EPS)) + 1e-9
    assert torch.all((a[p] - b[p]).abs() <= tol), (a[p], b[p], tol)


_any32 = st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), st.just(NAN))
_any64 = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.just(NAN))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    p=st.integers(1, 4),
    g=st.integers(1, 5),
    scale=st.sampled_from(["group", "batch"]),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
)
def test_group_advantages_finite_for_any_finite_input(data, dtype, p, g, scale, baseline):
    elem = _any32 if dtype == torch.float32 else _any64
    rows = data.draw(st.lists(st.lists(elem, min_size=g, max_size=g), min_size=p, max_size=p))
    rewards = torch.tensor(rows, dtype=dtype)
    adv = group_advantages(rewards, scale=scale, baseline=baseline)
    assert adv.shape == (p, g) and adv.dtype == dtype
    assert torch.isfinite(adv).all()
    assert torch.all(adv[torch.isnan(rewards)] == 0)
    # |r - mean| <= (n-1)/sqrt(n) s and |r - loo| = n/(n-1) |r - mean| <= sqrt(n) s.
    if scale == "group":
        assert torch.all(adv.abs() <= math.sqrt(g) + 1e-3)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.one_of(st.floats(-(2.0**99), 2.0**99, width=32), st.just(NAN)),
            min_size=3,
            max_size=3,
        ),
        min_size=1,
        max_size=3,
    ),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
)
def test_group_advantages_scale_none_finite(rows, baseline):
    adv = group_advantages(torch.tensor(rows), scale="none", baseline=baseline)
    assert torch.isfinite(adv).all()


# --------------------------------------------------------------------------------------------
# gae
# --------------------------------------------------------------------------------------------


def _gae_loop(rewards, values, mask, gamma, lam):
    """Slow reference: per row, walk the valid tokens backwards (padding is skipped)."""
    B, T = len(values), len(values[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t] == 1]
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            a = delta + gamma * lam * next_a
            adv[b][t], ret[b][t] = a, a + values[b][t]
            next_v, next_a = values[b][t], a
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def test_gae_hand_values_right_padding():
    # Row 0: 3 valid tokens then padding (whose reward/value must be ignored), gamma=0.9, lam=0.5.
    #   t=2: delta = 1 + 0.9*0 - 0.3 = 0.7                   A2 = 0.7
    #   t=1: delta = 0 + 0.9*0.3 - 0.2 = 0.07                A1 = 0.07 + 0.45*0.7 = 0.385
    #   t=0: delta = 0 + 0.9*0.2 - 0.1 = 0.08                A0 = 0.08 + 0.45*0.385 = 0.25325
    #   returns = A + V = [0.35325, 0.585, 1.0]
    # Row 1: all 4 valid, reward 2 on the last token, V = 0, so every delta is the reward:
    #   A3 = 2, A2 = 0.45*2 = 0.9, A1 = 0.45*0.9 = 0.405, A0 = 0.45*0.405 = 0.18225.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(
        adv,
        torch.tensor([[0.25325, 0.385, 0.7, 0.0], [0.18225, 0.405, 0.9, 2.0]]),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(
        ret,
        torch.tensor([[0.35325, 0.585, 1.0, 0.0], [0.18225, 0.405, 0.9, 2.0]]),
        atol=1e-6,
        rtol=0,
    )


def test_gae_gamma_lam_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, returns = reward-to-go.
    rewards = torch.tensor([[0.5, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 0.8]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 1.0, 0.0]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(adv, torch.tensor([[1.3, 0.6, 0.4, 0.0]]), atol=1e-7, rtol=0)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 1.0)])
def test_gae_matches_loop_reference(gamma, lam):
    g = torch.Generator().manual_seed(11)
    B, T = 5, 7
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [7, 4, 1, 0, 5]  # right padding, incl. an empty row
    mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths])
    mask[4, 2] = 0  # a hole inside a row: skipped by the recursion
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-12, rtol=0)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_no_grad_and_padding_values_ignored():
    values = torch.tensor([[0.1, 0.2, 0.0]], requires_grad=True)
    adv, ret = gae(torch.tensor([[0.0, 1.0, 0.0]]), values, torch.tensor([[1, 1, 0]]))
    assert not adv.requires_grad and not ret.requires_grad
    adv2, _ = gae(
        torch.tensor([[0.0, 1.0, 123.0]]),
        torch.tensor([[0.1, 0.2, 1e6]]),
        torch.tensor([[1, 1, 0]]),
    )
    torch.testing.assert_close(adv, adv2, rtol=0, atol=0)


def test_gae_bad_inputs():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask: expected the shape of values \(2, 3\)"):
        gae(z, z, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"rewards: expected the shape of values"):
        gae(torch.zeros(2), z, z)
    with pytest.raises(ValueError, match=r"values: expected shape \[B, T\]"):
        gae(torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"gamma: expected a number in \[0, 1\]"):
        gae(z, z, z, gamma=1.5)
    with pytest.raises(ValueError, match=r"lam: expected a number in \[0, 1\]"):
        gae(z, z, z, lam=-0.1)
