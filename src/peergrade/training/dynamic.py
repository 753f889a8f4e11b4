"""Dynamic sampling (DAPO, Yu et al. 2025): fill a step with groups whose rewards differ.

What this module does
---------------------
A group whose scored rewards are all equal (or that has fewer than two scored members) gets
advantage exactly 0 for every member (``algo.group_advantages``), so it teaches nothing.
``informative_groups(rewards)`` marks the groups that do teach, and
``fill_groups(sample_rounds, target, max_rounds)`` runs the filling loop: round r = 0, 1, ...
samples and scores a batch of groups (``sample_rounds(range(r, r + n))`` returns the ``[P_r,
G]`` rewards of each of n rounds; the caller keeps what it generated), the informative ones are
kept in round order and group order until ``target`` are kept, for at most ``max_rounds``
rounds. Round 0 is asked alone; with ``ahead`` (the default) each later call asks for the
rounds the step is expected to still need (``rounds_ahead``: the missing groups over the
informative groups found per round so far), so the caller can generate them as one larger
batch. The kept groups are the same either way (they are picked in round order); asking
ahead can only sample a round that one-at-a-time would not have needed. Informative groups
beyond the target are dropped (as verl does), so every filled step has exactly ``target``
groups. What could not be filled is reported (``Fill.unfilled`` and ``Fill.metrics()``), not
looped on, and ``Fill.slots`` pads the batch with groups that did not differ; when no round found a single informative group and the caller says there must be
one (``require_one``: e.g. no group of the run has differed so far), it raises ``InputError``
naming the likely causes instead of training on nothing.

The result is a function of the rewards alone, so the loop is deterministic whenever the
caller's rounds are: it must draw round r's prompts and sampling keys from (seed, step, r)
only, which is also what keeps a resumed run exact. Under torchrun the caller passes each
round's global rewards (every rank's groups), so the *global* batch is filled.

What it deliberately does not do: no sampling, scoring, prompt drawing or sequence batching
(the trainer's step does those; this module only says which rounds to ask for together), no
config, no staleness bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peergrade.errors import InputError

__all__ = ["Fill", "fill_groups", "informative_groups", "rounds_ahead"]


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[P]`` bool: the groups of ``rewards`` (``[P, G]``, NaN = not scored) with at least two
    scored members whose rewards are not all equal (exactly the groups with a nonzero
    group-relative advantage)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
        raise ValueError(f"rewards: expected a [P, G] torch.Tensor, got {got}")
    r = rewards.detach().to(torch.float64)
    scored = ~torch.isnan(r)  # [P, G]
    big = torch.finfo(torch.float64).max
    hi = torch.where(scored, r, torch.full_like(r, -big)).amax(dim=1)  # [P]
    lo = torch.where(scored, r, torch.full_like(r, big)).amin(dim=1)  # [P]
    return (scored.sum(dim=1) >= 2) & (hi > lo)


@dataclass
class Fill:
    """The outcome of one step's filling loop."""

    target: int
    picks: list[tuple[int, int]] = field(default_factory=list)  # (round, group) kept, in order
    rounds: int = 0  # rounds sampled, 1..max_rounds
    sampled_groups: int = 0  # groups generated over every round
    informative: int = 0  # informative groups found over every round (kept or beyond the target)
    calls: int = 0  # sampling calls the rounds took (fewer than rounds when asked ahead)

    @property
    def unfilled(self) -> int:
        """Groups of the target that no round could fill."""
        return self.target - len(self.picks)

    def slots(self, groups_per_round: int) -> list[tuple[int, int]]:
        """The step's ``target`` groups as (round, group): the picks, then, when short, the
        groups not picked in (round, group) order -- none of them informative, since a step
        that is short kept every informative group it found. They fill the batch with
        advantage-0 groups so that its shape does not depend on the data."""
        picked = set(self.picks)
        spare = (
            (r, g)
            for r in range(self.rounds)
            for g in range(groups_per_round)
            if (r, g) not in picked
        )
        return self.picks + [rg for rg, _ in zip(spare, range(self.unfilled))]

    def metrics(self, group_size: int) -> dict[str, float]:
        """``dynamic/rounds``; ``dynamic/sampled_groups`` (over every round);
        ``dynamic/unfilled_groups`` (short of the target); ``dynamic/
        completions_per_informative_group`` (completions generated per kept group, 0 when
        none was kept); ``dynamic/frac_zero_std_groups_sampled`` (the sampled groups whose
        rewards did not differ); ``dynamic/sampling_calls`` (the batches the rounds took)."""
        kept = len(self.picks)
        n = max(self.sampled_groups, 1)
        return {
            "dynamic/rounds": float(self.rounds),
            "dynamic/sampled_groups": float(self.sampled_groups),
            "dynamic/unfilled_groups": float(self.unfilled),
            "dynamic/completions_per_informative_group": (
                self.sampled_groups * group_size / kept if kept else 0.0
            ),
            "dynamic/frac_zero_std_groups_sampled": 1.0 - self.informative / n,
            "dynamic/sampling_calls": float(self.calls),
        }


def rounds_ahead(fill: Fill, left: int) -> int:
    """How many rounds to sample next (1..``left``, ``left`` >= 1 rounds remaining): round 0
    alone (it is the plain step's); then the rounds the missing groups need at the rate of
    informative groups per round seen so far this step, ceil(missing / rate), or every round
    left when none has been found yet."""
    if fill.rounds == 0:
        return 1
    rate = fill.informative / fill.rounds
    if rate == 0:
        return left
    return max(1, min(left, math.ceil((fill.target - len(fill.picks)) / rate)))


def fill_groups(
    sample_rounds: Callable[[range], list[torch.Tensor]],
    target: int,
    max_rounds: int,
    *,
    require_one: bool = False,
    ahead: bool = True,
) -> Fill:
    """Sample rounds until ``target`` informative groups are kept, at most ``max_rounds``.

    Args:
        sample_rounds: ``range(r, r + n) -> [rewards of round r, ..., of round r + n - 1]``,
            each ``[P_r, G]`` (sampled and scored by the caller, round r deterministically from
            (seed, step, r), whichever rounds it is asked with).
        target: the informative groups the step needs (``rollout.prompts_per_step``), >= 1.
        max_rounds: the most rounds sampled, >= 1.
        require_one: raise ``InputError`` when no round found any informative group.
        ahead: ask for the rounds the step is expected to need in one call (``rounds_ahead``);
            False: one round per call.

    Returns:
        A ``Fill`` whose ``picks`` name the kept groups as (round, group index in the round).
    """
    for name, v in (("target", target), ("max_rounds", max_rounds)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    fill = Fill(target=target)
    while fill.rounds < max_rounds and len(fill.picks) < target:
        r = fill.rounds
        n = rounds_ahead(fill, max_rounds - r) if ahead else 1
        rewards = sample_rounds(range(r, r + n))
        fill.calls += 1
        if len(rewards) != n:
            raise ValueError(f"sample_rounds: asked for {n} round(s), got {len(rewards)}")
        for rr, round_rewards in zip(range(r, r + n), rewards):
            ok = informative_groups(round_rewards)  # [P_r]
            fill.rounds, fill.sampled_groups = rr + 1, fill.sampled_groups + len(ok)
            fill.informative += int(ok.sum())
            room = target - len(fill.picks)
            fill.picks += [(rr, int(g)) for g in ok.nonzero().flatten().tolist()[:room]]
    if require_one and not fill.picks:
        raise InputError(
            f"rollout.dynamic_sampling: none of the {fill.sampled_groups} groups sampled in "
            f"{fill.rounds} round(s) (rollout.max_rounds) had rewards that differ, so there is "
            "nothing to learn from: check that the rewards are not constant (a reward that "
            "always fails or always passes), try easier data or a stronger starting model, "
            "raise rollout.max_rounds, or turn rollout.dynamic_sampling off"
        )
    return fill
