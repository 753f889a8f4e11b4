"""The ``Episode`` record: one multi-turn episode as token ids, a loss mask that is 1 only on
tokens the model sampled, the sampler's log-probs, the message list and why it ended; plus
``episode_metrics``. ``generation.Samples.of_episodes`` turns episodes into the update's tensors.

It does not run episodes: ``peergrade.generation.episodes.run_episodes`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    """One episode. ``completion_ids``, ``loss_mask``, ``logprobs`` and ``sampler_logprobs`` have
    one entry per token after the prompt; ``loss_mask == 1`` marks tokens the model sampled, 0
    marks appended environment/template tokens (log-probs 0). ``logprobs`` are under the full
    tempered distribution, ``sampler_logprobs`` under the one drawn from (cut by top-k/top-p,
    renormalised; 0 when greedy): the behaviour policy. Every token is
    attended to: ``attention_mask`` is all ones, a separate thing from the loss mask."""

    row_index: int
    prompt_ids: list[int]
    messages: list[dict]
    num_prompt_messages: int
    env: Any = None
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)  # the distribution drawn from
    finish_reason: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_truncated: int = 0
    reward: float | None = None
    # per-turn credit (algo.turn_credit): the reward each model turn earned, in turn order
    # (None: that turn gave none; a list shorter than the turns: the rest gave none), and
    # the key of the state each environment answer left (None: the answer's tokens are it)
    turn_rewards: list[float | None] = field(default_factory=list)
    turn_states: list[Any] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def attention_mask(self) -> list[int]:
        return [1] * (len(self.prompt_ids) + len(self.completion_ids))

    @property
    def completion_messages(self) -> list[dict]:
        """The messages after the prompt (assistant, tool, assistant, ...): TRL's ``completions``."""
        return self.messages[self.num_prompt_messages :]

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def turn_spans(self) -> list[tuple[int, int]]:
        """``[(start, end), ...]``: each model turn's tokens ``completion_ids[start:end]``, one
        per maximal run of ``loss_mask == 1`` (a turn is sampled without a break, and every
        environment answer or template delta between two turns is masked; the same for
        episodes an external agent's requests recorded)."""
        spans, start = [], None
        for i, m in enumerate(self.loss_mask):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        if start is not None:
            spans.append((start, len(self.loss_mask)))
        return spans

    def turn_observations(self) -> list[Any]:
        """The state key of each model turn (what the turn was sampled in; step-level credit
        groups turns by it): turn 1's is the prompt's token ids; turn k's (k > 1) the
        environment's key for the answer before it (``Step.state``) when it gave one, else
        that answer's tokens (``completion_ids`` between turn k-1 and turn k)."""
        spans = self.turn_spans()
        keys: list[Any] = [("prompt", tuple(self.prompt_ids))]
        for k in range(1, len(spans)):
            given = self.turn_states[k - 1] if k - 1 < len(self.turn_states) else None
            if given is not None:
                keys.append(("state", given))
            else:
                keys.append(("tokens", tuple(self.completion_ids[spans[k - 1][1] : spans[k][0]])))
        return keys[: len(spans)] if spans else []


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Metrics of a batch of episodes, named as TRL names them where it has them:
    ``tools/call_frequency`` (tool calls per episode), ``tools/failure_frequency`` (failed calls
    per call, 0 without calls), ``tools/truncated_frequency`` (results cut to
    ``env.max_tool_output_chars``, per call), ``turns/mean``, ``episode/stop_reason/<reason>`` (fraction of
    episodes), ``episode/len_mean`` (tokens after the prompt) and ``episode/sampled_len_mean``
    (of them, tokens the model sampled: what length metrics of the loss should count).
    Local to this process: under torchrun, reduce the underlying sums instead."""
    n = len(episodes)
    if n == 0:
        return {}
    calls = sum(e.tool_calls for e in episodes)
    out = {
        "tools/call_frequency": calls / n,
        "tools/failure_frequency": sum(e.tool_failures for e in episodes) / calls if calls else 0.0,
        "tools/truncated_frequency": sum(e.tool_truncated for e in episodes) / calls
        if calls
        else 0.0,
        "turns/mean": sum(e.num_turns for e in episodes) / n,
        "episode/len_mean": sum(len(e.completion_ids) for e in episodes) / n,
        "episode/sampled_len_mean": sum(e.num_sampled_tokens for e in episodes) / n,
    }
    for reason in sorted({e.finish_reason for e in episodes}):
        out[f"episode/stop_reason/{reason}"] = sum(e.finish_reason == reason for e in episodes) / n
    return out
