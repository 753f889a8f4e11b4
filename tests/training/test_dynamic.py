"""peergrade.training.dynamic: which groups teach, and the filling loop of dynamic sampling (exactly the
target when it can be filled, at most max_rounds rounds, what is short is reported, an
all-degenerate source raises, deterministic under a seed)."""

from __future__ import annotations

import math

import pytest
import torch

from peergrade.algo import group_advantages
from peergrade.errors import InputError
from peergrade.training.dynamic import Fill, fill_groups, informative_groups, rounds_ahead

NAN = math.nan


def test_informative_groups_are_those_with_a_nonzero_advantage():
    rewards = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # all alike
            [0.0, 1.0, 0.0, 0.0],  # differ
            [NAN, 1.0, NAN, NAN],  # one scored member
            [NAN, 1.0, 0.5, NAN],  # two scored, differ
            [NAN, 0.5, 0.5, NAN],  # two scored, alike
            [NAN, NAN, NAN, NAN],  # none scored
        ]
    )
    ok = informative_groups(rewards)
    assert ok.tolist() == [False, True, False, True, False, False]
    adv = group_advantages(rewards)
    assert ((adv != 0).any(dim=1) == ok).all()


def _round(seed: int, p_informative: float, r: int, P: int = 4, G: int = 3) -> torch.Tensor:
    """Round r's rewards: each group informative with probability p_informative, drawn from
    (seed, r) only, as the trainer draws its rounds."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    differ = torch.rand(P, generator=g) < p_informative  # [P]
    rewards = torch.zeros(P, G)
    rewards[:, 0] = differ.float()  # one member differs in an informative group
    return rewards


def _source(seed: int, p_informative: float, P: int = 4, G: int = 3):
    """A fake sampler (``_round``) for ``fill_groups``; records the rounds it was asked
    (``asked``) and how they were batched (``calls``)."""
    asked, calls = [], []

    def sample_rounds(rs: range) -> list[torch.Tensor]:
        asked.extend(rs)
        calls.append(rs)
        return [_round(seed, p_informative, r, P, G) for r in rs]

    sample_rounds.calls = calls
    return sample_rounds, asked


@pytest.mark.parametrize("seed", range(5))
def test_every_filled_step_has_exactly_the_target_of_informative_groups(seed):
    sample_rounds, asked = _source(seed, 0.4)
    fill = fill_groups(sample_rounds, target=4, max_rounds=50)
    assert len(fill.picks) == 4 and fill.unfilled == 0
    assert asked == list(range(fill.rounds)) and fill.rounds <= 50
    replay = {r: _round(seed, 0.4, r) for r in range(fill.rounds)}
    assert all(informative_groups(replay[r])[g] for r, g in fill.picks)
    assert fill.picks == sorted(fill.picks)  # round order, then group order
    assert fill.sampled_groups == 4 * fill.rounds


def test_rounds_never_exceed_max_rounds_and_the_shortfall_is_reported():
    sample_rounds, asked = _source(0, 0.1)
    fill = fill_groups(sample_rounds, target=8, max_rounds=3)
    assert asked == [0, 1, 2]
    assert fill.unfilled == 8 - len(fill.picks) > 0
    m = fill.metrics(group_size=3)
    assert m["dynamic/rounds"] == 3.0 and m["dynamic/unfilled_groups"] == float(fill.unfilled)
    assert m["dynamic/sampled_groups"] == 12.0
    # every informative group was kept (the step is short), so the rest had no spread
    assert m["dynamic/frac_zero_std_groups_sampled"] == 1 - len(fill.picks) / 12
    if fill.picks:
        assert m["dynamic/completions_per_informative_group"] == 12 * 3 / len(fill.picks)
    # the slots: the picks, then the first groups not picked, none of them informative
    slots = fill.slots(4)
    assert len(slots) == 8 and slots[: len(fill.picks)] == fill.picks
    pads = slots[len(fill.picks) :]
    assert len(set(slots)) == 8 and pads == sorted(pads)
    assert not any(informative_groups(_round(0, 0.1, r))[g] for r, g in pads)


def test_all_degenerate_source_raises_a_clear_error():
    sample_rounds, asked = _source(0, 0.0)
    with pytest.raises(InputError, match=r"none of the 12 groups.*rollout\.max_rounds"):
        fill_groups(sample_rounds, target=2, max_rounds=3, require_one=True)
    assert asked == [0, 1, 2]  # stopped, no endless loop
    fill = fill_groups(_source(0, 0.0)[0], target=2, max_rounds=3)  # later steps: reported
    assert fill.unfilled == 2
    assert fill.metrics(3)["dynamic/completions_per_informative_group"] == 0.0
    assert fill.slots(4) == [(0, 0), (0, 1)]


def test_deterministic_under_a_seed():
    a = fill_groups(_source(7, 0.3)[0], target=5, max_rounds=20)
    b = fill_groups(_source(7, 0.3)[0], target=5, max_rounds=20)
    c = fill_groups(_source(8, 0.3)[0], target=5, max_rounds=20)
    assert a == b
    assert a.picks != c.picks


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [0.05, 0.3, 0.8])
def test_asking_ahead_keeps_the_groups_one_round_at_a_time_keeps(seed, p):
    """rounds_ahead batches the rounds, never the choice: the picks (and the padding slots)
    are those of one round per call; it can only sample rounds one-at-a-time did not need."""
    one_src, one_asked = _source(seed, p)
    one = fill_groups(one_src, target=4, max_rounds=6, ahead=False)
    assert one_src.calls == [range(r, r + 1) for r in range(one.rounds)]
    src, asked = _source(seed, p)
    ahead = fill_groups(src, target=4, max_rounds=6)
    assert ahead.picks == one.picks
    assert asked == list(range(ahead.rounds)) and one.rounds <= ahead.rounds <= 6
    assert src.calls[0] == range(0, 1)  # round 0 alone: the plain step's prompts
    if one.unfilled:  # short: every round was needed either way
        assert ahead.rounds == one.rounds and ahead.slots(4) == one.slots(4)
    assert len(src.calls) <= len(one_src.calls)


def test_rounds_ahead_asks_for_the_rounds_the_missing_groups_need():
    fill = Fill(target=8)
    assert rounds_ahead(fill, left=5) == 1  # round 0 alone
    fill = Fill(target=8, picks=[(0, 1), (0, 2)], rounds=1, sampled_groups=8, informative=2)
    assert rounds_ahead(fill, left=5) == 3  # 6 missing at 2 a round
    assert rounds_ahead(fill, left=2) == 2  # no more than are left
    fill = Fill(
        target=8, picks=[(0, g) for g in range(7)], rounds=1, sampled_groups=8, informative=7
    )
    assert rounds_ahead(fill, left=5) == 1  # 1 missing at 7 a round
    fill = Fill(target=8, rounds=2, sampled_groups=16, informative=0)
    assert rounds_ahead(fill, left=4) == 4  # nothing found yet: every round left
    # a round-0-only step on a low-signal source: the rest come in one call
    src, _ = _source(0, 0.1)
    fill_groups(src, target=8, max_rounds=3)
    assert src.calls == [range(0, 1), range(1, 3)]


def test_a_caller_that_returns_the_wrong_number_of_rounds_is_named():
    with pytest.raises(ValueError, match=r"asked for 1 round\(s\), got 2"):
        fill_groups(lambda rs: [torch.zeros(2, 2)] * 2, target=1, max_rounds=3)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_rounds"):
        fill_groups(_source(0, 1.0)[0], target=2, max_rounds=0)
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        informative_groups(torch.zeros(3))
