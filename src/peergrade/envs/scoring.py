"""What reward functions see of episodes: TRL's reward contract over whole conversations.

``reward_inputs(episodes, rows)`` returns the ``prompts``, ``completions`` and ``columns`` that
``rewards.score_rewards`` takes, as TRL's ``GRPOTrainer`` passes them with tools:

- ``prompts``: each episode's opening messages (after ``reset``, so with an environment's
  observation appended to the last one);
- ``completions``: each episode's messages after the prompt (assistant, tool, assistant, ...);
- ``completion_ids``: every token after the prompt, tool tokens included;
- ``environments``: the environment of each episode (for ``environment_factory``, the user's
  instance, so ``get_reward`` and any state it kept are at hand);
- every other dataset column, repeated for the episodes of its row.

The environments' own rewards (``environment_rewards``: an ``environment_factory`` instance's
``get_reward()``, sync or async, else a native environment's summed step rewards) reach the
total as one more reward function, ``env_reward`` (the trainer adds it, named ``env``, when the
environment class can give one), reading them from the ``env_reward`` column.

It does not score (``score_rewards`` does) or compute advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from peergrade.envs.episode import Episode
from peergrade.envs.protocol import maybe_await, run_sync

#: the columns ``reward_inputs`` adds to the dataset's (a reward may require them)
EPISODE_COLUMNS = ("completion_ids", "environments")


def environment_of(episode: Episode) -> Any:
    """The object a reward function gets in ``environments``: the user's instance behind the
    tool adapter when there is one, else the environment itself."""
    instance = getattr(episode.env, "instance", None)
    return episode.env if instance is None else instance


def reward_inputs(
    episodes: Sequence[Episode], rows: Sequence[dict]
) -> tuple[list, list, dict[str, list]]:
    """``(prompts, completions, columns)`` for ``rewards.score_rewards`` (see module doc)."""
    from peergrade.rewards.registry import columns_for

    prompts = [e.messages[: e.num_prompt_messages] for e in episodes]
    completions = [e.completion_messages for e in episodes]
    n = len(episodes) // max(1, len(rows))
    if n * len(rows) != len(episodes) or any(e.row_index != i // n for i, e in enumerate(episodes)):
        raise ValueError(
            f"reward_inputs: {len(episodes)} episodes are not n per row, in order, for {len(rows)} rows"
        )
    columns = columns_for(list(rows), n) if rows and isinstance(rows[0], dict) else {}
    columns.pop("environments", None)
    columns["completion_ids"] = [list(e.completion_ids) for e in episodes]
    columns["environments"] = [environment_of(e) for e in episodes]
    return prompts, completions, columns


def gives_reward(env_class: Any) -> bool:
    """Whether environments of ``env_class`` give their own reward: a ``get_reward`` method
    (TRL's environment_factory) or a ``step`` (a native environment, whose steps may); for a
    dict of classes (picked per row), any of them."""
    if isinstance(env_class, dict):
        return any(gives_reward(c) for c in env_class.values())
    return env_class is not None and any(
        callable(getattr(env_class, m, None)) for m in ("get_reward", "step")
    )


def environment_rewards(episodes: Sequence[Episode]) -> list[float | None]:
    """Each episode's own reward: its environment's ``get_reward()`` (awaited if async) when it
    has one, else the sum of its step rewards (``None``: no reward for that episode)."""

    async def one(e: Episode):
        get = getattr(environment_of(e), "get_reward", None)
        return await maybe_await(get()) if callable(get) else e.reward

    async def all_of():
        import asyncio

        return await asyncio.gather(*(one(e) for e in episodes))

    return [None if r is None else float(r) for r in run_sync(all_of())]


def env_reward(completions, env_reward, **kwargs) -> list[float | None]:
    """The reward function ``env``: the environments' own rewards (``environment_rewards``),
    which the trainer passes as the ``env_reward`` column."""
    return list(env_reward)
