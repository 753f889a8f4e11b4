"""The ``Task`` interface every built-in task and dataset loader implements.

A task is a source of rows (plain dicts). Every row has a ``"prompt"`` (a string, or a chat
message list ``[{"role": ..., "content": ...}]``) and the columns named in ``Task.columns``,
which the trainer passes to the reward functions as keyword lists aligned with the completions
(the TRL convention). ``default_rewards`` names built-in rewards (``peergrade.rewards``) with
their weights, used when the configuration names none.

This module holds no data and applies no chat template (``peergrade.tasks.prompts`` does).
"""

from __future__ import annotations

from collections.abc import Iterator


class Task:
    """Base class: subclasses set ``name``/``columns``/``default_rewards`` and the two methods."""

    name: str = "task"
    #: the non-prompt columns of every row, passed to reward functions
    columns: tuple[str, ...] = ()
    #: built-in reward names with weights used when the configuration names none
    default_rewards: list[tuple[str, float]] = []
    #: a system prompt the task wants prepended to every prompt (``None``: none)
    system_prompt: str | None = None
    #: whether ``eval_rows`` has a held-out split to draw from
    has_eval: bool = True

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        """An endless, seeded stream of training rows (same seed, same stream)."""
        raise NotImplementedError

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        """``n`` held-out rows, never seen by ``train_rows`` (same seed, same rows)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
