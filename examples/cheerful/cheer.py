"""A rule-based check of cheerfulness that does not ask the judge (the cheerful recipe,
configs/smollm2-judge-cheerful.yaml, docs/recipes.md).

``cheer_score(text)`` in [0, 1] is the mean of two rates:

- exclamation: the reply's exclamation marks, 3 or more counting as 1 (0, 1/3, 2/3, 1);
- lexicon: the share of its words found in ``POSITIVE`` (a small hand-written list of warm,
  upbeat words), 10% or more counting as 1.

It is a crude proxy, on purpose independent of the judge: if training raises the judge's score
and not this one, the policy learned to please the judge, not to sound cheerful (and the other
way round: a reply stuffed with "great!!!" scores high here whatever a reader thinks).
``cheer`` is the same score with TRL's reward signature (``peergrade train --reward
examples/cheerful/cheer.py:cheer`` would train on it directly; the recipe does not).
``cheerful`` is its pass/fail form (1.0 at ``cheer_score`` >= ``CHEERFUL``): the recipe logs it
beside the judge with weight 0 (never trained on) and names it ``train.eval_reward``, so the
held-out pass@1 is the share of held-out replies the rule calls cheerful, and the run warns
(``reward_vs_eval``) when the judge's score rises while that share does not.

``python examples/cheerful/cheer.py FILE.jsonl`` prints the mean score and both rates of the
``reply`` (or ``completion``) field of each line.
"""

from __future__ import annotations

import json
import re
import sys

POSITIVE = frozenset(
    [
        "great",
        "wonderful",
        "lovely",
        "fun",
        "happy",
        "glad",
        "love",
        "enjoy",
        "enjoying",
        "enjoyed",
        "amazing",
        "awesome",
        "fantastic",
        "delightful",
        "delicious",
        "yummy",
        "perfect",
        "excellent",
        "exciting",
        "excited",
        "joy",
        "joyful",
        "cheerful",
        "bright",
        "sunny",
        "sweet",
        "cozy",
        "cosy",
        "beautiful",
        "brilliant",
        "fabulous",
        "terrific",
        "superb",
        "marvelous",
        "marvellous",
        "smile",
        "smiles",
        "smiling",
        "laugh",
        "celebrate",
        "hooray",
        "yay",
        "wow",
        "thrilled",
        "nice",
        "super",
        "best",
        "favorite",
        "favourite",
        "treat",
        "magic",
        "magical",
        "refreshing",
    ]
)
_WORD = re.compile(r"[a-z']+")


def rates(text: str) -> tuple[float, float]:
    """(exclamation rate, lexicon rate) of ``text``, each in [0, 1] (module doc)."""
    words = _WORD.findall(text.lower())
    exclamation = min(text.count("!"), 3) / 3
    if not words:
        return exclamation, 0.0
    share = sum(w.strip("'") in POSITIVE for w in words) / len(words)
    return exclamation, min(share / 0.10, 1.0)


def cheer_score(text: str) -> float:
    """The mean of the two rates, in [0, 1]."""
    e, lex = rates(text)
    return (e + lex) / 2


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def cheer(completions, **kwargs) -> list[float]:
    """``cheer_score`` of each completion (TRL's reward contract)."""
    return [cheer_score(_text(c)) for c in completions]


#: ``cheerful``'s bar: a reply the rule calls cheerful scores at least this
CHEERFUL = 0.5


def cheerful(completions, **kwargs) -> list[float]:
    """1.0 for each completion whose ``cheer_score`` is at least ``CHEERFUL`` (e.g. two
    exclamation marks and one upbeat word in ten), else 0.0: the recipe's held-out scorer
    (``train.eval_reward``), whose pass@1 is the share of replies the rule calls cheerful. A
    held-out score counts 1.0 as correct, which the graded ``cheer`` almost never reaches."""
    return [1.0 if cheer_score(_text(c)) >= CHEERFUL else 0.0 for c in completions]


# a measure with weight 0, never trained on: the start-up exploit battery has nothing to protect
# (and, with no reference answer in these rows, no correct completion to attack it with)
cheerful.skip_startup_audit = True


def summary(texts: list[str]) -> dict[str, float]:
    """Mean cheer score, mean of each rate, and the share of replies with an '!'."""
    n = max(1, len(texts))
    rs = [rates(t) for t in texts]
    return {
        "cheer": sum(cheer_score(t) for t in texts) / n,
        "exclamation_rate": sum(e for e, _ in rs) / n,
        "lexicon_rate": sum(x for _, x in rs) / n,
        "with_exclamation": sum("!" in t for t in texts) / n,
        "cheerful": sum(cheer_score(t) >= CHEERFUL for t in texts) / n,
    }


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    texts = [r.get("reply", r.get("completion", "")) for r in rows]
    print(json.dumps({k: round(v, 4) for k, v in summary(texts).items()}))
