"""A second rewards file whose functions share their names with recipes_a's (TRL accepts that;
peergrade logs the second one as ``<name>_2``)."""

from __future__ import annotations

from recording import recorded


@recorded
def accuracy_reward(completions, solution, **kwargs):
    """Exact string match, conversational."""
    return [
        1.0 if c[0]["content"].strip() == str(s) else 0.0 for c, s in zip(completions, solution)
    ]


@recorded
def exact_match(completions, ground_truth, **kwargs):
    """Exact match ignoring spaces, plain text."""
    return [
        1.0 if c.replace(" ", "") == str(gt) else 0.0 for c, gt in zip(completions, ground_truth)
    ]
