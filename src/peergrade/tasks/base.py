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

    def check_columns(self, required: dict[str, list[str]]) -> None:
        """Raise ``ValueError`` when a column a reward requires (``{column: [reward names]}``)
        is not one of ``columns``. Generated rows always fill their columns; a dataset file
        checks every row (``FileTask``)."""
        for column, who in required.items():
            if column not in self.columns:
                raise ValueError(missing_column_message(column, who, self.name, self.columns))

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        """An endless, seeded stream of training rows (same seed, same stream)."""
        raise NotImplementedError

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        """``n`` held-out rows, never seen by ``train_rows`` (same seed, same rows)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def rewards_phrase(rewards: list[str]) -> str:
    """``reward 'a'`` or ``rewards 'a' and 'b'``, for the column messages."""
    names = [repr(r) for r in rewards]
    if len(names) == 1:
        return f"reward {names[0]}"
    return f"rewards {', '.join(names[:-1])} and {names[-1]}"


def missing_column_message(column: str, rewards: list[str], source: str, columns) -> str:
    """What to say when reward(s) ``rewards`` need ``column`` and ``source`` lacks it."""
    have = ", ".join(["prompt", *columns])
    other = next((c for c in columns if c != column), "answer")
    return (
        f"{rewards_phrase(rewards)} {'needs' if len(rewards) == 1 else 'need'} the column "
        f"{column!r} (a parameter without a default), which {source} does not have; its "
        f"columns: {have}. Rename the column in the file, or map one of yours to it with "
        f"data.columns, e.g. --data.columns '{{{column}: {other}}}' (or give the parameter a "
        "default)"
    )
