"""The ``logic`` task and the ``reasoning_gym`` reward, through the ``reasoning-gym`` package.

``load_task("logic", dataset="leg_counting", **options)`` wraps any procedural dataset of
reasoning-gym (``reasoning_gym.create_dataset(name, size=, seed=, **dataset_options)``; its
names are listed by ``available_datasets()``). Rows are
``{"prompt": list, "answer": str, "question": str, "metadata": dict}``; the prompt is a chat
message list (``[system, user]`` with ``system_prompt``) whose user message is the question
followed by ``instruction`` (by default: put the final answer inside
``<answer></answer>``). Scoring uses the package's own ``score_answer`` for the row's source
dataset (``reasoning_gym.get_score_answer_fn``), which may give partial credit in [0, 1].

Splits: reasoning-gym generates item ``i`` of a dataset from ``(seed, i)``. Train rows come
from datasets seeded ``1_000_003 * seed + epoch`` (``chunk`` items each, a fresh seed every
epoch); eval rows from seed ``10**9 + seed``. Disjointness by construction: a question belongs
to eval iff ``blake2b(question) mod 10 == 0``; train skips those questions, eval keeps only
them (distinct).

The ``reasoning_gym`` reward picks the answer like the ``arithmetic`` reward's ``"auto"`` rule:
the single ``<answer>`` block if the completion has an answer tag (several blocks: 0), else
the whole completion stripped.

``reasoning_gym`` is imported lazily (it takes seconds); without it, ``load_task("logic")``
and the reward raise an ImportError that says how to install it.

This module does not apply chat templates.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from ..errors import require
from ..rewards.extract import answer_tag, completion_text
from .base import Task
from .prompts import chat_prompt

__all__ = ["LogicTask", "available_datasets", "reasoning_gym_reward"]

DEFAULT_INSTRUCTION = "\n\nPut your final answer inside <answer></answer>."


def _rg():
    return require(
        "reasoning_gym",
        needed_for="the 'logic' task and the 'reasoning_gym' reward",
        pip="reasoning-gym",
        extra="logic",
    )


def available_datasets() -> list[str]:
    """The dataset names reasoning-gym can generate."""
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _is_eval_question(question: str) -> bool:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10 == 0


class LogicTask(Task):
    """A reasoning-gym dataset as a task (see module docstring)."""

    name = "logic"
    columns = ("answer", "question", "metadata")
    default_rewards = [("reasoning_gym", 1.0)]

    def __init__(
        self,
        *,
        dataset: str = "leg_counting",
        dataset_options: dict | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        system_prompt: str | None = None,
        chunk: int = 1000,
    ):
        names = available_datasets()
        if dataset not in names:
            import difflib

            close = difflib.get_close_matches(dataset, names, n=1)
            raise ValueError(
                f"logic: unknown reasoning-gym dataset {dataset!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f". Available: {', '.join(names)}"
            )
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"logic: chunk must be an integer >= 1, got {chunk!r}")
        self.dataset = dataset
        self.dataset_options = dict(dataset_options or {})
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.chunk = chunk
        self._make(seed=0, size=1)  # fail now, with a clear message, on bad dataset_options

    def _make(self, *, seed: int, size: int):
        try:
            return _rg().create_dataset(self.dataset, size=size, seed=seed, **self.dataset_options)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(
                f"logic: reasoning-gym could not create {self.dataset!r} with options "
                f"{self.dataset_options}: {type(exc).__name__}: {exc}"
            ) from exc

    def _row(self, entry: dict) -> dict:
        prompt = chat_prompt(entry["question"] + self.instruction, self.system_prompt)
        return {
            "prompt": prompt,
            "answer": "" if entry["answer"] is None else str(entry["answer"]),
            "question": entry["question"],
            "metadata": entry["metadata"],
        }

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        epoch = 0
        while True:
            ds = self._make(seed=1_000_003 * seed + epoch, size=self.chunk)
            order = list(range(self.chunk))
            random.Random(f"logic/train/{seed}/{epoch}").shuffle(order)
            for i in order:
                entry = ds[i]
                if not _is_eval_question(entry["question"]):
                    yield self._row(entry)
            epoch += 1

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"logic: eval_rows n must be an integer >= 0, got {n!r}")
        size = max(20 * n, 100)
        ds = self._make(seed=10**9 + seed, size=size)
        seen, rows = set(), []
        for i in range(size):
            entry = ds[i]
            q = entry["question"]
            if q in seen or not _is_eval_question(q):
                continue
            seen.add(q)
            rows.append(self._row(entry))
            if len(rows) == n:
                return rows
        raise ValueError(
            f"logic: asked for {n} held-out {self.dataset!r} problems but only found {len(rows)}"
        )


def reasoning_gym_reward(
    prompts, completions, answer=None, metadata=None, question=None, **_columns
):
    """reasoning-gym's own ``score_answer`` of each completion's answer (0.0 if none)."""
    if answer is None or metadata is None:
        raise ValueError(
            "the 'reasoning_gym' reward needs the 'answer' and 'metadata' columns of a "
            "reasoning-gym row (load_task('logic', ...))"
        )
    rg = _rg()
    scores = []
    for i, completion in enumerate(completions):
        meta = metadata[i]
        if not isinstance(meta, dict) or "source_dataset" not in meta:
            raise ValueError(f"sample {i}: metadata has no 'source_dataset': {meta!r}")
        text = completion_text(completion)
        if "<answer>" in text or "</answer>" in text:
            pred = answer_tag(text)
        else:
            pred = text.strip()
        if not pred:
            scores.append(0.0)
            continue
        entry = {
            "question": question[i] if question is not None else "",
            "answer": answer[i],
            "metadata": meta,
        }
        score_fn = rg.get_score_answer_fn(meta["source_dataset"])
        scores.append(float(score_fn(answer=pred, entry=entry)))
    return scores
