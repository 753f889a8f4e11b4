"""Guess the number: a native-protocol environment that answers with feedback, not tools.

The secret is the answer of an arithmetic row (``answer``: ``"62"`` for ``"37+25="``). The
model guesses; the environment replies ``higher`` or ``lower`` until the guess is right or the
model has used its turns. The reward rewards solving in few turns: ``1 / turns`` when solved
(1.0 at the first guess, 0.5 at the second, ...), 0 otherwise; the trainer adds it as the
reward ``env``. ``solved`` is a reward function that only logs the solve rate.

Run it: ``peergrade train --config examples/guess_number/config.yaml`` (README.md beside this
file). It does not parse anything but the last integer of a turn and keeps no state beyond
one episode.
"""

from __future__ import annotations

import re

from peergrade.envs import Step

_INT = re.compile(r"-?\d+")


class GuessTheNumber:
    """One episode: ``reset(row)`` opens with the row's prompt, ``step`` judges each guess."""

    def reset(self, row):
        self.secret, self.turns, self.solved = int(row["answer"]), 0, False
        return row["prompt"]  # the question as chat messages (the task's, with its system prompt)

    def step(self, message):
        self.turns += 1
        found = _INT.findall(message["content"])
        if not found:
            return Step([{"role": "user", "content": "a number please"}], reward=0.0)
        guess = int(found[-1])
        if guess == self.secret:
            self.solved = True
            return Step(done=True, reward=1.0 / self.turns, finish_reason="solved")
        # reward 0, not None: an unsolved episode scores 0 rather than abstaining
        hint = "higher" if guess < self.secret else "lower"
        return Step([{"role": "user", "content": hint}], reward=0.0)


def solved(completions, environments, **kwargs):
    """Logged beside the reward (weight 0 in config.yaml): 1.0 for a solved episode, in any
    number of turns. ``environments`` holds each episode's ``GuessTheNumber``."""
    return [float(env.solved) for env in environments]
