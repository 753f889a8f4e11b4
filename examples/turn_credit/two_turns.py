"""Answer, then log: a two-turn environment where the first turn decides success and the
second is decorative, so the episode's reward alone credits both turns alike.

Turn 1 answers the row's arithmetic question (``"37+25="``); the environment checks it at
once and gives that turn its reward: 1.0 when the last integer of the turn is the answer, else
0.0. It then asks for a log line (``"log:"``); whatever turn 2 says ends the episode with
reward 0. The episode's reward (the reward ``env``, the sum of the step rewards) is therefore
turn 1's alone, but with ``algo.turn_credit: episode`` every token of turn 2 gets the same
advantage as turn 1's; ``returns`` and ``step_groups`` give turn 2 a return of 0.

``solved`` logs the share of episodes whose first turn was right (weight 0 in config.yaml).
Run it: ``peergrade train --config examples/turn_credit/config.yaml`` (README.md beside this
file; ``measure.py`` compares the credit modes).
"""

from __future__ import annotations

import re

from peergrade.envs import Step

_INT = re.compile(r"-?\d+")

#: what the environment asks for after the answer (the decorative second turn)
LOG_REQUEST = "log:"


class AnswerThenLog:
    """One episode: ``reset(row)`` opens with the row's question, ``step`` judges turn 1 and
    ends the episode after turn 2."""

    def reset(self, row):
        self.secret, self.turns, self.solved = int(row["answer"]), 0, False
        return row["prompt"]  # the task's chat messages (its system prompt included)

    def step(self, message):
        self.turns += 1
        if self.turns == 1:
            found = _INT.findall(message["content"] or "")
            self.solved = bool(found) and int(found[-1]) == self.secret
            return Step([{"role": "user", "content": LOG_REQUEST}], reward=float(self.solved))
        return Step(done=True, reward=0.0, finish_reason="logged")


def solved(completions, environments, **kwargs):
    """1.0 for an episode whose first turn answered right (logged only: weight 0)."""
    return [float(env.solved) for env in environments]
