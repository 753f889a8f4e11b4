"""Per-turn credit for multi-turn episodes (``algo.turn_credit``): GRPO whose advantages are
per token, one value per model turn over that turn's sampled tokens (``peergrade.algo.credit``
has the formulas and their sources).

- ``episode`` (the default): GRPO itself, untouched: every sampled token of an episode has the
  episode's advantage (this class is not used at all).
- ``returns``: discounted returns-to-go per turn (``algo.turn_gamma``), normalised within the
  prompt's group with every turn of the group pooled.
- ``step_groups``: GiGPO: the episode's advantage plus ``algo.turn_step_weight`` times the
  turn's return normalised among the group's turns that act in the same environment state
  (``Episode.turn_observations``: the environment's ``Step.state`` or the answer's tokens).

The turns and their rewards come from the episode records (``Episode.turn_spans``,
``Episode.turn_rewards``: an environment's step rewards, or the list a harness returned). The
update is GRPO's (``policy_loss`` takes ``[N, C]`` advantages), as distillation's is. Single
replies (no episodes) are one turn each, where every mode is GRPO's advantage: they keep it.

What it deliberately does not do: no critic, no credit inside a turn, no batch-wide std
(``algo.advantage_scale: batch`` is refused: its statistics would be this rank's alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peergrade.algo.credit import (
    returns_advantages,
    split_reward,
    step_group_advantages,
    token_advantages,
    turn_returns,
)
from peergrade.training.experience import Experience
from peergrade.training.update import GRPO


def settings(algo) -> tuple[str, float, float]:
    """``(turn_credit, turn_gamma, turn_step_weight)`` of an ``algo`` config section (checked
    when the config loaded: ``config.validate.check_turn_credit``)."""
    return algo.turn_credit, float(algo.turn_gamma), float(algo.turn_step_weight)


def turn_tensors(episodes, C: int):
    """``(step [N, K], turns [N], turn_of_token [N, C], states [N, K])`` of the episodes:
    their turns' own rewards (NaN = none), turn counts, each completion column's turn (-1 =
    not sampled) and each turn's state id (ids per distinct ``turn_observations`` key; -1 =
    no such turn)."""
    spans = [e.turn_spans() for e in episodes]
    N, K = len(episodes), max([len(s) for s in spans] + [1])
    step = torch.full((N, K), float("nan"), dtype=torch.float64)
    states = torch.full((N, K), -1, dtype=torch.long)
    turn_of_token = torch.full((N, C), -1, dtype=torch.long)
    ids: dict = {}
    for i, (e, sp) in enumerate(zip(episodes, spans)):
        given = list(e.turn_rewards or [])
        if len(given) > len(sp):
            raise ValueError(
                f"episode {i} (rows[{e.row_index}]) has {len(given)} turn rewards for "
                f"{len(sp)} model turns; a harness returns one reward per model turn"
            )
        for k, (a, b) in enumerate(sp):
            turn_of_token[i, a:b] = k
            if k < len(given) and given[k] is not None:
                step[i, k] = float(given[k])
        for k, key in enumerate(e.turn_observations()):
            states[i, k] = ids.setdefault(key, len(ids))
    turns = torch.tensor([len(s) for s in spans], dtype=torch.long)
    return step, turns, turn_of_token, states


@dataclass
class TurnCredit(GRPO):
    """GRPO with per-turn advantages ``[N, C]`` (see the module docstring)."""

    def advantages(self, exp: Experience) -> None:
        super().advantages(exp)  # the episode-level advantage [N] and its metrics
        episodes = getattr(getattr(exp.sampled, "samples", None), "episodes", None)
        if not episodes:
            return  # single replies: one turn each, GRPO's advantage is every mode's
        mode, gamma, weight = settings(self.cfg.algo)
        a, G = self.cfg.algo, self.cfg.rollout.group_size
        N, C = exp.loss_mask.shape
        step, turns, turn_of_token, states = turn_tensors(episodes, C)
        outside = (exp.loss_mask.cpu() > 0) & (turn_of_token < 0)
        if bool(outside.any()):  # the loss would train a token no turn owns
            raise ValueError("per-turn credit: a trained token lies outside every model turn")
        K = step.shape[1]
        u = split_reward(exp.rewards.detach().cpu().double(), step, turns)  # [N, K]
        ret = turn_returns(u, gamma).view(-1, G, K)  # [P, G, K]
        if mode == "returns":
            adv = returns_advantages(ret, scale=a.advantage_scale, baseline=a.advantage_baseline)
        else:
            ep = exp.advantages.detach().cpu().view(-1, G)  # [P, G]
            sid = states.view(-1, G, K)
            adv = step_group_advantages(ret, sid, ep, weight=weight, scale=a.advantage_scale)
        tok = token_advantages(adv.reshape(N, K), turn_of_token)  # [N, C]
        tok = torch.where(exp.loss_mask.cpu() > 0, tok, torch.zeros_like(tok))
        exp.advantages = tok.to(exp.loss_mask.device)
        on = exp.loss_mask > 0
        exp.metrics = {
            **exp.metrics,
            "advantage/std": float(exp.advantages[on].std()) if int(on.sum()) > 1 else 0.0,
            "credit/turns_mean": float(turns.double().mean()),
            "credit/step_groups": float(len(set(states[states >= 0].tolist()))),
        }
