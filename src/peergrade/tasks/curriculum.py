"""The few-shot curriculum (``data.few_shot``): solved example turns before training prompts,
faded out over steps.

A model that never produces the rewarded format on its own gives GRPO no signal (every group
scores alike). ``FewShot`` bootstraps it: early training prompts carry ``k`` solved examples
(a user turn with the example's question, an assistant turn with ``data.few_shot_answer`` filled
from the example's columns), and the chance that a prompt carries them falls linearly to 0 over
``data.few_shot_fade_steps`` steps. Evaluation never sees examples.

The examples come from a pool of the task's own training problems drawn from a separate stream
(seed + 1), so held-out problems never appear, and an example never repeats the question it
precedes. Which prompts get examples, and which ones, depends on (seed, step) only, so a
resumed run sees the same prompts.

It does not tokenize and knows nothing of models; the trainer applies it to each step's rows.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from peergrade.errors import InputError
from peergrade.seeds import step_seed
from peergrade.tasks.prompts import with_examples

__all__ = ["FewShot"]


class FewShot:
    """``data.few_shot`` examples for ``task``'s training prompts (see the module docstring)."""

    POOL = 256
    SALT = 7  # this curriculum's random stream per step (peergrade.seeds)

    def __init__(self, k: int, fade_steps: int, answer_template: str, task, seed: int):
        self.k, self.fade, self.seed = k, fade_steps, seed
        self.pool: list[tuple[Any, str]] = []
        if self.k:
            rows = itertools.islice(task.train_rows(seed + 1), self.POOL)
            self.pool = [
                (row["prompt"], _reply(answer_template, row, i)) for i, row in enumerate(rows)
            ]

    def chance(self, step: int) -> float:
        """Probability that a prompt of ``step`` (1-based) carries the examples."""
        if not self.k:
            return 0.0
        if not self.fade:
            return 1.0
        return max(0.0, 1.0 - (step - 1) / self.fade)

    def apply(self, rows: list[dict], step: int) -> tuple[list[dict], float]:
        """``rows`` with examples put into some prompts, and the fraction that got them."""
        p = self.chance(step)
        if p == 0.0:
            return rows, 0.0
        rng = random.Random(step_seed(self.seed, step, salt=self.SALT))
        out, hits = [], 0
        for row in rows:
            if rng.random() < p:
                others = [ex for ex in self.pool if ex[0] != row["prompt"]]
                examples = rng.sample(others, min(self.k, len(others)))
                row = {**row, "prompt": with_examples(row["prompt"], examples)}
                hits += 1
            out.append(row)
        return out, hits / max(1, len(rows))


def _reply(template: str, row: dict, i: int) -> str:
    try:
        return template.format(**row)
    except (KeyError, IndexError, ValueError) as exc:
        raise InputError(
            f"data.few_shot_answer {template!r} cannot be filled from training row {i} "
            f"(its columns: {', '.join(row)}): {type(exc).__name__}: {exc}"
        ) from None
