"""Per-turn credit for multi-turn episodes: one advantage per model turn, spread over that
turn's sampled tokens, so ``policy_loss`` gets ``[N, C]`` advantages (no second update path).

Shapes: P prompts x G episodes each, K = the most model turns of any episode; a turn an
episode does not have is NaN (rewards, returns) or -1 (state ids, token turn index).

Turn rewards (``split_reward``): each turn before an episode's last keeps the reward its
environment (``Step.reward``) or harness (a returned list) gave it, 0 when none; the last turn
gets the rest of the episode's total, ``u_K = R - sum_{k<K} u_k``, so the turn rewards always
add up to the reward GRPO uses (the other reward functions judge the whole episode, which
ends at the last turn). Then, with ``gamma`` (``algo.turn_gamma``):

    G_k = u_k + gamma * G_{k+1}                 discounted return-to-go of turn k (G_{K+1} = 0)

``returns`` (``returns_advantages``): every turn's return normalised within its prompt's
group, all the group's turns pooled: ``A_k = (G_k - mean) / (std + eps)`` over the G
episodes' turns together (``group_advantages`` on ``[P, G*K]``, so its scale, baseline, NaN
and equal-rewards rules hold). The pooling follows GRPO's process supervision (Shao et al.
2024, "DeepSeekMath", section 4.1.3: every step reward of a group normalised together, a
token's advantage built from its step's and the later steps' rewards); the discounted
return-to-go per turn is the multi-turn agent RL form (Feng et al. 2025 below; verl-agent).
With one turn per episode it is exactly the episode-level GRPO advantage.

``step_groups`` (``step_group_advantages``): GiGPO (Feng et al. 2025, "Group-in-Group Policy
Optimization for LLM Agent Training", arXiv 2505.10978): the episode-level advantage ``A^E``
(GRPO's, one per episode) plus ``omega`` times a step-level one, ``A^S_k = (G_k - mean) /
(std + eps)`` over the turns of the prompt's group that act in the same environment state
(GiGPO's anchor-state groups; the caller gives the state ids, e.g. from the observation's
tokens or an environment's own key). A state only one turn reached gives ``A^S = 0``.

What it deliberately does not do: no episodes, tokens or config (the caller gives tensors),
no loss.
"""

from __future__ import annotations

import torch

from peergrade.algo.advantages import group_advantages

__all__ = [
    "returns_advantages",
    "split_reward",
    "step_group_advantages",
    "token_advantages",
    "turn_returns",
]


def split_reward(total: torch.Tensor, step: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` turn rewards: ``step[n, k]`` (the turn's own reward, NaN = none: 0) for every
    turn but episode n's last, the rest of ``total[n]`` on its last (turn ``turns[n] - 1``),
    NaN past its last turn; a NaN total (not scored) makes every turn NaN.

    Args: ``total`` [N] episode rewards; ``step`` [N, K]; ``turns`` [N] long, turns per episode.
    """
    N, K = step.shape
    if total.shape != (N,) or turns.shape != (N,):
        raise ValueError(
            f"split_reward: total {tuple(total.shape)} and turns {tuple(turns.shape)} must be "
            f"[N] for step rewards of shape {tuple(step.shape)}"
        )
    if bool((turns > K).any()) or bool((turns < 0).any()):
        raise ValueError(f"split_reward: turns must lie in [0, {K}], got {turns.tolist()}")
    k = torch.arange(K, device=step.device)[None, :]  # [1, K]
    last = (turns - 1)[:, None]  # [N, 1]
    s = torch.nan_to_num(step.double(), nan=0.0)  # [N, K]
    before = torch.where(k < last, s, torch.zeros_like(s))  # [N, K]
    rest = total.double() - before.sum(dim=1)  # [N]
    out = torch.where(k == last, rest[:, None].expand(N, K), before)  # [N, K]
    out = torch.where(k <= last, out, torch.full_like(out, float("nan")))
    return torch.where(torch.isnan(total.double())[:, None], torch.nan, out)


def turn_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[N, K]`` discounted returns-to-go ``G_k = u_k + gamma * G_{k+1}`` of turn rewards
    ``[N, K]`` (NaN past an episode's last turn, which stays NaN and adds nothing)."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"turn_returns: gamma must lie in [0, 1], got {gamma}")
    u = rewards.double()
    out = torch.full_like(u, float("nan"))  # [N, K]
    running = torch.zeros_like(u[:, 0])  # [N]
    for k in range(u.shape[1] - 1, -1, -1):
        present = ~torch.isnan(u[:, k])
        running = torch.where(present, u[:, k] + gamma * running, torch.zeros_like(running))
        out[:, k] = torch.where(present, running, out[:, k])
    return out


def returns_advantages(
    returns: torch.Tensor, *, scale: str = "group", baseline: str = "mean", eps: float = 1e-4
) -> torch.Tensor:
    """``[P, G, K]`` advantages of turn returns ``[P, G, K]``: each group's turns pooled and
    normalised as ``group_advantages`` normalises a group's rewards; 0 where no turn is."""
    P, G, K = returns.shape
    adv = group_advantages(returns.reshape(P, G * K), scale=scale, baseline=baseline, eps=eps)
    return adv.reshape(P, G, K).float()


def step_group_advantages(
    returns: torch.Tensor,
    states: torch.Tensor,
    episode_adv: torch.Tensor,
    *,
    weight: float = 1.0,
    scale: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """``[P, G, K]`` GiGPO advantages: ``episode_adv[p, g]`` (``[P, G]``) plus ``weight`` times
    the turn's return ``returns[p, g, k]`` normalised among the turns of group p with the same
    state id ``states[p, g, k]`` (long; -1 = no such turn, advantage 0)."""
    if states.shape != returns.shape or episode_adv.shape != returns.shape[:2]:
        raise ValueError(
            f"step_group_advantages: returns {tuple(returns.shape)}, states "
            f"{tuple(states.shape)} and episode_adv {tuple(episode_adv.shape)} must be "
            "[P, G, K], [P, G, K] and [P, G]"
        )
    P, G, K = returns.shape
    flat_r = returns.reshape(P, G * K).double()
    flat_s = states.reshape(P, G * K)
    members: list[list[int]] = []  # flat indices (p * G*K + j) of each (prompt, state) group
    for p in range(P):
        by_state: dict[int, list[int]] = {}
        for j, s in enumerate(flat_s[p].tolist()):
            if s >= 0:
                by_state.setdefault(s, []).append(p * G * K + j)
        members += list(by_state.values())
    step_adv = torch.zeros(P * G * K, dtype=torch.float64, device=returns.device)
    if members:
        width = max(len(m) for m in members)
        table = torch.full((len(members), width), float("nan"), dtype=torch.float64)
        for i, m in enumerate(members):
            table[i, : len(m)] = flat_r.reshape(-1)[m].cpu()
        a = group_advantages(table, scale=scale, eps=eps)  # [S, width]
        for i, m in enumerate(members):
            step_adv[m] = a[i, : len(m)].to(step_adv.device)
    present = (states >= 0).double()
    out = episode_adv.double()[:, :, None] * present + weight * step_adv.reshape(P, G, K)
    return out.float()


def token_advantages(turn_adv: torch.Tensor, turn_of_token: torch.Tensor) -> torch.Tensor:
    """``[N, C]``: each token's turn's advantage (``turn_adv`` [N, K]) where
    ``turn_of_token`` (``[N, C]`` long) names the turn, 0 where it is -1 (a prompt or
    environment token, padding)."""
    if turn_adv.shape[0] != turn_of_token.shape[0]:
        raise ValueError(
            f"token_advantages: {turn_adv.shape[0]} episodes of turn advantages, "
            f"{turn_of_token.shape[0]} rows of tokens"
        )
    on = turn_of_token >= 0  # [N, C]
    idx = turn_of_token.clamp(min=0)
    if turn_adv.shape[1] == 0:
        return torch.zeros(turn_of_token.shape, dtype=torch.float32, device=turn_of_token.device)
    vals = torch.gather(turn_adv.float(), 1, idx)  # [N, C]
    return torch.where(on, vals, torch.zeros_like(vals))
