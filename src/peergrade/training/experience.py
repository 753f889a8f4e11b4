"""``Experience``: the one record that travels from generation to the update.

``trainer.collect`` fills it (sample, score, reference log-probs, then the algorithm's
advantages) and ``trainer.learn`` hands it to the algorithm's update; torchtune's
``GRPOTrajectory`` is the model. N = sequences of this rank (P prompts x G completions), L =
prompt + completion columns, C = completion columns (the last C of L).

The attention mask and the loss mask are separate tensors: ``attention_mask`` says which
tokens exist (the model attends to them), ``loss_mask`` which ones the update trains on. A
token can be attended to and not trained on (an environment's answer inside an episode, or a
truncated completion under ``algo.mask_truncated_completions``); the reverse never happens.

What it deliberately does not do: no computation (advantages are ``algo``'s and the
algorithm's, log-probs ``logprobs``'s), no config, no I/O. The fields that only the step's
metrics and logged samples read (``Sampled``) ride along so that ``learn`` and the metrics need
nothing else from ``collect``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Experience", "Sampled"]


@dataclass
class Sampled:
    """What the step sampled and scored, for its metrics and logged groups (not the update)."""

    rows: list[dict]  # this rank's P prompts' dataset rows (few-shot turns applied)
    prompt_ids: list[list[int]]  # P encoded prompts
    samples: Any  # generation.Samples: what was sampled (replies or episodes), one record
    scores: Any  # rewards.Scores: per-function scores and their metrics
    accuracy: torch.Tensor  # [N] the accuracy verifier's scores
    completion_ids: list[list[int]]  # N lists: the counted tokens of each completion
    few_shot_frac: float = 0.0
    # dynamic sampling (rollout.dynamic_sampling): the step kept these groups out of several
    # rounds; the rounds' own figures, which the kept rows alone cannot tell
    dynamic: dict[str, float] = field(default_factory=dict)  # dynamic/* metrics, else empty
    generated_tokens: int | None = None  # this rank's sampled tokens over every round
    # ([N'] prompt, [N'] completion) token counts of every round's sequences (model FLOPs)
    generated_lengths: tuple | None = None


@dataclass
class Experience:
    """One step's experience, on the training device.

    Shapes: ``[N, L]`` input_ids / attention_mask; ``[N, C]`` loss_mask and every log-prob,
    value and return; ``[N]`` rewards and truncated; advantages ``[N]`` (GRPO: one per
    completion) or ``[N, C]`` (PPO: one per token)."""

    input_ids: torch.Tensor  # [N, L] long: left-padded prompts, right-padded completions
    attention_mask: torch.Tensor  # [N, L] long: 1 = a real token (attended to)
    loss_mask: torch.Tensor  # [N, C] float32: 1 = trained on (never derived from attention_mask)
    rewards: torch.Tensor  # [N] the weighted reward total of each completion
    truncated: torch.Tensor  # [N] bool: the completion hit max_completion_length
    policy_version: int  # the version that sampled it: the weights after this many updates
    sampler_logprobs: torch.Tensor | None = None  # [N, C] the behaviour policy (rollout)
    ref_logprobs: torch.Tensor | None = None  # [N, C] the reference (beta > 0), else None
    advantages: torch.Tensor | None = None  # [N] or [N, C], set by the algorithm
    values: torch.Tensor | None = None  # [N, C] PPO: the critic's rollout-time values
    returns: torch.Tensor | None = None  # [N, C] PPO: the critic's targets
    old_logprobs: torch.Tensor | None = None  # [N, C] PPO: policy before the update, or None
    metrics: dict[str, float] = field(default_factory=dict)  # the advantage phase's scalars
    sampled: Sampled | None = None  # what the metrics and logged samples read
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per collect phase

    @property
    def batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, loss_mask)``: what the log-prob passes and the update
        skeleton (``update.run_update``) take."""
        return self.input_ids, self.attention_mask, self.loss_mask

    @property
    def num_sequences(self) -> int:
        return self.loss_mask.shape[0]
