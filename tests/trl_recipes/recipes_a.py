"""Reward functions written the way public TRL GRPO recipes write them (our own code, from
TRL's documented contract), each wrapped by ``recorded`` so the test sees every keyword
argument it was given. Conversational ones read ``completion[0]["content"]``; plain ones read
the completion text."""

from __future__ import annotations

import asyncio
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from recording import recorded

# ------------------------------------------------------------------ conversational datasets


@recorded
def accuracy_reward(completions, solution, **kwargs):
    """1 if the completion's final answer is mathematically equal to the solution, None if the
    solution itself cannot be parsed (the sample is skipped)."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        gold = parse(sol, extraction_mode="first_match")
        if len(gold) == 0:
            rewards.append(None)
            continue
        answer = parse(content, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
        rewards.append(float(verify(gold, answer)))
    return rewards


@recorded
def format_reward(completions, **kwargs):
    """R1's format: a <think> block, then an <answer> block, nothing else."""
    pattern = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c, re.DOTALL | re.MULTILINE) else 0.0 for c in contents]


@recorded
def tag_count_reward(completions, **kwargs):
    """A quarter point for each of the four tags appearing exactly once."""

    def count_tags(text: str) -> float:
        score = 0.0
        for tag in ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>"):
            if text.count(tag) == 1:
                score += 0.25
        return score

    return [count_tags(completion[0]["content"]) for completion in completions]


@recorded
def reasoning_steps_reward(completions, **kwargs):
    """Rewards step-by-step wording: full marks from three steps on."""
    pattern = r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)"
    contents = [completion[0]["content"] for completion in completions]
    return [min(1.0, len(re.findall(pattern, c)) / 3) for c in contents]


@recorded
def len_reward(completions, solution, **kwargs):
    """Kimi 1.5's length reward: shorter correct answers score more; wrong ones at most 0."""
    contents = [completion[0]["content"] for completion in completions]
    correct = [c.strip() == str(s).strip() for c, s in zip(contents, solution)]
    lengths = [len(c) for c in contents]
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(completions)
    rewards = []
    for length, ok in zip(lengths, correct):
        lam = 0.5 - (length - lo) / (hi - lo)
        rewards.append(lam if ok else min(0.0, lam))
    return rewards


def get_repetition_penalty_reward(ngram_size: int, max_penalty: float):
    """A factory, as recipes configure it: the penalty grows with repeated n-grams."""

    @recorded
    def repetition_penalty_reward(completions, **kwargs):
        rewards = []
        for completion in completions:
            words = completion[0]["content"].split()
            if len(words) < ngram_size:
                rewards.append(0.0)
                continue
            ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            scaling = 1 - len(set(ngrams)) / len(ngrams)
            rewards.append(scaling * max_penalty)
        return rewards

    return repetition_penalty_reward


repetition_penalty_reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)


@recorded
def curriculum_reward(completions, solution, trainer_state, **kwargs):
    """Early on any non-empty answer counts; the correct answer weighs more as training goes."""
    progress = trainer_state.global_step / trainer_state.max_steps
    out = []
    for completion, sol in zip(completions, solution):
        text = completion[0]["content"].strip()
        out.append((1 - progress) * float(bool(text)) + progress * float(text == str(sol)))
    return out


@recorded
def conv_logging_reward(completions, solution, log_extra=None, log_metric=None, **kwargs):
    """TRL's logging example on conversational completions."""
    extracted = [re.search(r"-?\d+", c[0]["content"]) for c in completions]
    extracted = [m.group(0) if m else None for m in extracted]
    rewards = [1.0 if e == str(s) else 0.0 for e, s in zip(extracted, solution)]
    if log_extra:
        log_extra("golden_answer", [str(s) for s in solution])
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


@recorded
async def async_judge_reward(prompts, completions, **kwargs):
    """TRL's async example: an I/O-bound judge, simulated."""
    await asyncio.sleep(0.01)
    return [1.0 if completion[0]["content"] else 0.0 for completion in completions]


# ------------------------------------------------------------------ both kinds


@recorded
def soft_overlong_punishment(completion_ids, max_completion_len, soft_punish_cache, **kwargs):
    """DAPO's soft overlong punishment on token counts (its two settings bound from config)."""
    rewards = []
    for ids in completion_ids:
        length = len(ids)
        if length <= max_completion_len - soft_punish_cache:
            rewards.append(0.0)
        elif length <= max_completion_len:
            rewards.append((max_completion_len - soft_punish_cache - length) / soft_punish_cache)
        else:
            rewards.append(-1.0)
    return rewards


# ------------------------------------------------------------------ plain-text datasets


@recorded
def token_length_reward(completion_ids, **kwargs):
    """TRL's example 1: longer completions (in tokens) score more."""
    return [float(len(ids)) for ids in completion_ids]


@recorded
def char_length_reward(completions, **kwargs):
    """TRL's example 1.1: the same in characters."""
    return [float(len(completion)) for completion in completions]


@recorded
def ground_truth_reward(completions, ground_truth, **kwargs):
    """TRL's example 3 on a typed column: the completion's number equals the ground truth."""
    matches = [re.search(r"-?\d+", completion) for completion in completions]
    return [1.0 if m and int(m.group(0)) == gt else 0.0 for m, gt in zip(matches, ground_truth)]


@recorded
def math_task_reward(prompts, completions, task, **kwargs):
    """TRL's example 4: None (not scored) for the rows of another task."""
    return [(1.0 if c.strip() else 0.0) if t == "math" else None for c, t in zip(completions, task)]


@recorded
def logging_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's example 6: extra columns and a metric."""
    extracted = [re.search(r"-?\d+", c) for c in completions]
    extracted = [m.group(0) if m else None for m in extracted]
    rewards = [1.0 if e == str(gt) else 0.0 for e, gt in zip(extracted, ground_truth)]
    if log_extra:
        log_extra("golden_answer", [str(gt) for gt in ground_truth])
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


@recorded
async def async_length_reward(prompts, completions, **kwargs):
    """TRL's example 5."""
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


@recorded
def plain_curriculum_reward(completions, trainer_state, **kwargs):
    """A curriculum over epochs: rewards brevity less as the epochs go by."""
    weight = 1.0 / (1.0 + trainer_state.epoch)
    return [weight * (1.0 if len(c) < 4 else 0.0) for c in completions]


@recorded
def exact_match(completions, ground_truth, **kwargs):
    """The completion is exactly the ground truth."""
    return [1.0 if c.strip() == str(gt) else 0.0 for c, gt in zip(completions, ground_truth)]
