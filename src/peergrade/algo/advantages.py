"""Advantages: group-relative (GRPO, Dr. GRPO, RLOO) and GAE (PPO with a critic).

What this module does
---------------------
``group_advantages(rewards, *, scale, baseline, eps)`` turns the rewards of P prompts x G
completions (``[P, G]``) into one scalar advantage per completion, measured against the
completion's own group (the other samples for the same prompt):

    A_pg = (r_pg - b_pg) / s

- baseline ``"mean"``: b_pg = mean of the scored rewards of group p (GRPO, DeepSeekMath,
  Shao et al. 2024, "outcome supervision" advantage).
- baseline ``"leave_one_out"``: b_pg = mean of the *other* scored rewards of group p
  (RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization...";
  Kool et al. 2019). With n scored members this equals n/(n-1) * (r_pg - mean_p).
- scale ``"group"``: s = std_p + eps, the Bessel-corrected (n-1) std of group p's scored
  rewards (GRPO).
- scale ``"batch"``: s = std + eps, the Bessel-corrected std of all scored rewards of the
  batch pooled around the batch mean (the "batch" reward scaling of TRL, suggested by
  "Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Liu et al. 2025).
- scale ``"none"``: s = 1 (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training":
  dividing by the std biases updates toward too-easy/too-hard prompts).

NaN rewards and edge cases (decided here, tested in tests/algo/test_algo_advantages.py):

- A NaN reward means "not scored" (e.g. the verifier failed and the run is configured to skip
  the sample): it is excluded from the baseline and from every std, and its advantage is 0.
- A group with fewer than 2 scored members gets advantage 0 for all members: its std is
  undefined and a lone sample has nothing to be compared against (leave-one-out has no
  "other" member). An all-NaN group therefore gets 0.
- A group whose scored rewards are all equal gets advantage exactly 0 (not a rounding residue
  of order 1e-17 / eps), so such groups contribute exactly zero policy gradient.
- +-inf rewards are rejected with ValueError: they are never a meaningful score.
- The statistics are computed in float64 (float32 on MPS, which has no float64) and the result
  is cast back to the input dtype (float32 for integer/bool input). With scale "group" every
  advantage is at most sqrt(n) in magnitude (n = scored members of the group), with "batch" at
  most about sqrt(N) (N = scored rewards of the batch), so the output is finite for any finite
  input. With scale "none" the output is r - b, which overflows only if the rewards of
  one group span more than the dtype's largest value.

``gdpo_advantages(rewards, weights, *, eps)`` is GDPO (Liu et al. 2026, "GDPO: Group reward-
Decoupled Normalization Policy Optimization for Multi-reward RL Optimization", arXiv 2601.05242;
TRL's ``multi_objective_aggregation="normalize_then_sum"``) for K reward functions, rewards
``[P, G, K]``, weights ``[K]``:

    A^k_pg = (r^k_pg - mean_g r^k_pg) / (std_g r^k_pg + eps)     each function within its group
    S_pg   = sum_k w_k A^k_pg
    A_pg   = (S_pg - mean S) / (std S + eps)                      over the whole batch

std is Bessel-corrected (n - 1), as TRL's ``nanstd``. NaN = not scored: a NaN score is left out
of its function's group statistics and adds 0 to S; a function with fewer than 2 scored members
in a group (its std undefined) adds 0 for that group; a completion that no function scored gets
advantage 0 and is left out of the batch statistics. Unlike ``group_advantages``, a group whose
scores are all equal does *not* get exactly 0: S = 0 there, and the batch normalisation shifts
it by -mean S / (std S + eps), as in TRL and the paper (the batch step is a plain z-score). With
fewer than 2 scored completions in the batch every advantage is 0.

``gae(rewards, values, mask, gamma, lam)`` is Generalized Advantage Estimation (Schulman et
al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation") on
token-level ``[B, T]`` tensors, as used by PPO for LLMs (Ouyang et al. 2022; Schulman et al.
2017 for PPO):

    delta_t = r_t + gamma * V_{t'} - V_t        t' = the next valid token after t
    A_t     = delta_t + gamma * lam * A_{t'}    (V_{t'} = A_{t'} = 0 when t is the last valid)
    R_t     = A_t + V_t                          (the critic's regression target)

Only tokens with ``mask == 1`` exist for the recursion: padded or masked positions are skipped
(the step goes straight to the next valid token), so right padding is handled and the value
bootstrapped after the last valid token is 0 (the episode ends there). Rewards and values at
``mask == 0`` positions are ignored, and advantages and returns there are 0.

PPO's token-level pieces around ``gae``:

- ``token_rewards(seq_rewards, mask, old_logp, ref_logp, beta)``: per-token rewards (Ouyang et
  al. 2022, "InstructGPT"; Ziegler et al. 2019): ``r_t = -beta * (old_logp_t - ref_logp_t)`` on
  counted tokens (k1 KL, when both log-probs are given and beta > 0), plus the sequence reward
  on the row's last counted token (``last_token_index``); NaN sequence rewards count as 0.
- ``whiten(x, mask)``: ``(x - mean) / (std + eps)`` over counted entries (population std), 0
  elsewhere; ``masked_std`` is that std, the ``advantage/std`` PPO logs.

What it deliberately does not do
--------------------------------
No reward functions, no gradients (all outputs are constants for the loss), no I/O, no config
objects. It imports torch only.
"""

from __future__ import annotations

import torch

from peergrade.algo.losses import kl_divergence

__all__ = [
    "gae",
    "gdpo_advantages",
    "group_advantages",
    "last_token_index",
    "masked_std",
    "token_rewards",
    "whiten",
]

_SCALES = ("group", "batch", "none")
_BASELINES = ("mean", "leave_one_out")


def _work_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else the statistics are computed in float64.
    return torch.float32 if device.type == "mps" else torch.float64


def group_advantages(
    rewards: torch.Tensor,
    *,
    scale: str = "group",
    baseline: str = "mean",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative advantages ``[P, G]`` from rewards ``[P, G]`` (see the module docstring).

    Args:
        rewards: ``[P, G]`` rewards, P prompts x G completions; NaN = not scored.
        scale: ``"group"`` (per-group std + eps), ``"batch"`` (batch std + eps) or ``"none"``.
        baseline: ``"mean"`` (group mean) or ``"leave_one_out"`` (mean of the other members).
        eps: positive constant added to the std before dividing.

    Returns:
        ``[P, G]`` advantages in the dtype of ``rewards`` (float32 for non-float input), no grad.
    """
    _check_group_args(rewards, scale, baseline, eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(rewards.shape, dtype=out_dtype, device=rewards.device)

    with torch.no_grad():
        r = rewards.detach().to(_work_dtype(rewards.device))  # [P, G]
        if torch.isinf(r).any():
            raise ValueError("rewards: +-inf is not a valid reward (use NaN for 'not scored')")
        scored = ~torch.isnan(r)  # [P, G], True = counts
        m = scored.to(r.dtype)  # [P, G]
        r0 = torch.where(scored, r, torch.zeros_like(r))  # [P, G], NaN -> 0 for the sums
        # Huge rewards (|r| > max**0.25, about 1e77 in float64) would overflow the sums of
        # squares: rescale r and eps by the same factor f (per group, or one factor for the
        # batch statistics), which leaves (r - b) / (s + eps) unchanged; "none" multiplies f
        # back. Ordinary rewards are never rescaled (f == 1).
        if scale == "batch":
            amax = r0.abs().amax()  # []
        else:
            amax = r0.abs().amax(dim=1, keepdim=True)  # [P, 1]
        f = torch.where(amax > torch.finfo(r.dtype).max ** 0.25, amax, torch.ones_like(amax))
        r0, eps = r0 / f, eps / f
        n = m.sum(dim=1, keepdim=True)  # [P, 1] scored members per group
        total = r0.sum(dim=1, keepdim=True)  # [P, 1]
        mean = total / n.clamp(min=1)  # [P, 1]

        b = _group_baseline(baseline, r0, n, total, mean)  # [P, G]
        denom = _group_scale(scale, r0, m, n, mean, eps)  # [P, 1], [] or None
        # [P, G]; for "none" undo the rescaling: r - b in the units of the rewards
        adv = (r0 - b) * f if denom is None else (r0 - b) / denom

        # Zero where the comparison is undefined or empty: unscored samples, groups with < 2
        # scored members, and groups whose scored rewards are all equal (exactly 0, not 1e-13).
        big = torch.finfo(r.dtype).max
        gmax = torch.where(scored, r0, torch.full_like(r0, -big)).amax(dim=1, keepdim=True)
        gmin = torch.where(scored, r0, torch.full_like(r0, big)).amin(dim=1, keepdim=True)
        informative = (n >= 2) & (gmax > gmin)  # [P, 1]
        adv = torch.where(scored & informative, adv, torch.zeros_like(adv))
    return adv.to(out_dtype)


def _check_group_args(rewards: torch.Tensor, scale: str, baseline: str, eps: float) -> None:
    """Check the arguments of ``group_advantages``."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards: expected a torch.Tensor of shape [P, G], got {type(rewards)}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards: expected shape [P, G] (prompts x completions), got {tuple(rewards.shape)}"
        )
    if scale not in _SCALES:
        raise ValueError(f"scale: expected one of {_SCALES}, got {scale!r}")
    if baseline not in _BASELINES:
        raise ValueError(f"baseline: expected one of {_BASELINES}, got {baseline!r}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: expected a positive number, got {eps!r}")


def _group_baseline(
    baseline: str, r0: torch.Tensor, n: torch.Tensor, total: torch.Tensor, mean: torch.Tensor
) -> torch.Tensor:
    """b ``[P, G]``: the group mean (GRPO) or the mean of the other scored members (RLOO), from
    the (rescaled, NaN -> 0) rewards r0, the scored count n, the sum and the mean per group."""
    if baseline == "mean":
        b = mean.expand_as(r0)  # [P, G]
    elif baseline == "leave_one_out":
        b = (total - r0) / (n - 1).clamp(min=1)  # [P, G]
    else:  # pragma: no cover - validated above
        raise ValueError(f"baseline: expected one of {_BASELINES}, got {baseline!r}")
    return b


def _group_scale(
    scale: str,
    r0: torch.Tensor,
    m: torch.Tensor,
    n: torch.Tensor,
    mean: torch.Tensor,
    eps: float | torch.Tensor,
) -> torch.Tensor | None:
    """s + eps: the Bessel-corrected std of each group (``[P, 1]``) or of all scored rewards of
    the batch (``[]``) plus eps, or None for scale ``"none"`` (s = 1)."""
    if scale == "group":
        var = (m * (r0 - mean) ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        denom = var.sqrt() + eps  # [P, 1]
    elif scale == "batch":
        n_all = m.sum()
        mean_all = r0.sum() / n_all.clamp(min=1)
        var_all = (m * (r0 - mean_all) ** 2).sum() / (n_all - 1).clamp(min=1)
        denom = var_all.sqrt() + eps  # []
    elif scale == "none":
        denom = None
    else:  # pragma: no cover - validated above
        raise ValueError(f"scale: expected one of {_SCALES}, got {scale!r}")
    return denom


def gdpo_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, *, eps: float = 1e-4
) -> torch.Tensor:
    """GDPO advantages ``[P, G]`` from per-function rewards ``[P, G, K]`` (module docstring).

    Args:
        rewards: ``[P, G, K]`` scores of K reward functions; NaN = not scored.
        weights: ``[K]`` the reward functions' weights.
        eps: positive constant added to every std before dividing.

    Returns:
        ``[P, G]`` advantages in the dtype of ``rewards`` (float32 for non-float input), no grad.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 3:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
        raise ValueError(f"rewards: expected a [P, G, K] torch.Tensor, got {got}")
    K = rewards.shape[2]
    if not isinstance(weights, torch.Tensor) or weights.shape != (K,):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"weights: expected shape ({K},) (one per reward function), got {got}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(rewards.shape[:2], dtype=out_dtype, device=rewards.device)
    with torch.no_grad():
        wd = _work_dtype(rewards.device)
        r = rewards.detach().to(wd)  # [P, G, K]
        if torch.isinf(r).any():
            raise ValueError("rewards: +-inf is not a valid reward (use NaN for 'not scored')")
        scored = ~torch.isnan(r)  # [P, G, K]
        m = scored.to(wd)
        r0 = torch.where(scored, r, torch.zeros_like(r))
        n = m.sum(dim=1, keepdim=True)  # [P, 1, K]
        mean = r0.sum(dim=1, keepdim=True) / n.clamp(min=1)  # [P, 1, K]
        var = (m * (r0 - mean) ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
        a_k = (r0 - mean) / (var.sqrt() + eps)  # [P, G, K]
        a_k = torch.where(scored & (n >= 2), a_k, torch.zeros_like(a_k))  # NaN -> adds 0
        total = (a_k * weights.detach().to(device=r.device, dtype=wd)).sum(dim=2)  # [P, G]
        any_scored = scored.any(dim=2)  # [P, G]
        mb = any_scored.to(wd)
        n_all = mb.sum()
        mean_all = (total * mb).sum() / n_all.clamp(min=1)
        var_all = (mb * (total - mean_all) ** 2).sum() / (n_all - 1).clamp(min=1)
        adv = (total - mean_all) / (var_all.sqrt() + eps)  # [P, G]
        ok = any_scored & (n_all >= 2)
        adv = torch.where(ok, adv, torch.zeros_like(adv))
    return adv.to(out_dtype)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation on token-level tensors (see the module docstring).

    Args:
        rewards: ``[B, T]`` per-token rewards (typically the score on the last valid token).
        values: ``[B, T]`` critic values V_t for the state before token t is emitted.
        mask: ``[B, T]``, ``mask == 1`` marks valid (completion) tokens; others are skipped.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` in the dtype of ``values``, 0 where
        ``mask == 0``, detached (no gradient).
    """
    for name, t in (("rewards", rewards), ("values", values), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor of shape [B, T], got {type(t)}")
    if values.dim() != 2:
        raise ValueError(f"values: expected shape [B, T], got {tuple(values.shape)}")
    for name, t in (("rewards", rewards), ("mask", mask)):
        if t.shape != values.shape:
            raise ValueError(
                f"{name}: expected the shape of values {tuple(values.shape)}, got {tuple(t.shape)}"
            )
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not (isinstance(x, (int, float)) and 0.0 <= x <= 1.0):
            raise ValueError(f"{name}: expected a number in [0, 1], got {x!r}")

    with torch.no_grad():
        dtype = values.dtype if values.is_floating_point() else torch.float32
        v = values.detach().to(dtype)  # [B, T]
        r = rewards.detach().to(dtype)  # [B, T]
        valid = mask.detach() == 1  # [B, T]
        B, T = v.shape
        adv = torch.zeros_like(v)  # [B, T]
        next_value = torch.zeros(B, dtype=dtype, device=v.device)  # V of the next valid token
        next_adv = torch.zeros(B, dtype=dtype, device=v.device)  # A of the next valid token
        for t in reversed(range(T)):
            ok = valid[:, t]  # [B]
            delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
            a_t = delta + gamma * lam * next_adv  # [B]
            # Masked positions are transparent: carry the next valid token's values through.
            adv[:, t] = torch.where(ok, a_t, torch.zeros_like(a_t))
            next_adv = torch.where(ok, a_t, next_adv)
            next_value = torch.where(ok, v[:, t], next_value)
        returns = torch.where(valid, adv + v, torch.zeros_like(v))  # [B, T]
    return adv, returns


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last ``mask == 1`` token (-1 for a row with none).  # [B]"""
    B, T = mask.shape
    cols = torch.arange(T, device=mask.device).expand(B, T)
    return torch.where(mask == 1, cols, torch.full_like(cols, -1)).amax(dim=1)


def token_rewards(
    seq_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: ``-beta * (old_logp - ref_logp)`` on counted tokens (when
    both log-probs are given and beta > 0) plus ``seq_rewards[b]`` on row b's last counted
    token. NaN sequence rewards count as 0; a row with no counted token gets nothing."""
    B, T = mask.shape
    if seq_rewards.shape != (B,):
        raise ValueError(f"seq_rewards: expected shape ({B},), got {tuple(seq_rewards.shape)}")
    valid = mask == 1  # [B, T]
    r = torch.zeros(B, T, dtype=torch.float32, device=mask.device)  # [B, T]
    if beta > 0 and old_logp is not None and ref_logp is not None:
        kl = kl_divergence(old_logp.float(), ref_logp.float(), "k1")  # [B, T]
        r = torch.where(valid, -beta * kl, r)
    last = last_token_index(mask)  # [B]
    rows = torch.nonzero(last >= 0).squeeze(1)  # [B']
    score = torch.nan_to_num(seq_rewards.float().to(mask.device), nan=0.0)  # [B]
    r[rows, last[rows]] += score[rows]
    return r


def local_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, sum) of ``x`` over ``mask == 1`` entries, float64. ``distributed.masked_moments``
    is the same over every rank; ``whiten`` and ``masked_std`` take either."""
    valid = mask == 1
    return valid.sum().to(torch.float64), torch.where(valid, x, 0).sum().to(torch.float64)


def masked_std(x: torch.Tensor, mask: torch.Tensor, moments=local_moments) -> float:
    """Population std of ``x`` over ``mask == 1`` entries (0 with none); ``moments`` says over
    which entries (this process's, or every rank's)."""
    n, s = moments(x, mask)
    n = n.clamp(min=1)
    mean = (s / n).to(x.dtype)
    _, ss = moments((x - mean) ** 2, mask)
    return (ss / n).sqrt().item()


def whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, moments=local_moments
) -> torch.Tensor:
    """(x - mean) / (std + eps) over ``mask == 1`` entries (population std); 0 elsewhere."""
    n, s = moments(x, mask)
    n = n.clamp(min=1)
    mean = (s / n).to(x.dtype)
    _, ss = moments((x - mean) ** 2, mask)
    std = (ss / n).sqrt().to(x.dtype)
    return torch.where(mask == 1, (x - mean) / (std + eps), torch.zeros_like(x))
