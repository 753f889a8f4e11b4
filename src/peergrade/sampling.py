"""Sampling and scoring one step's completions or episodes: the parts of ``trainer.collect``
that turn P rows into G completions (``rollout.generate``) or G episodes (``envs.run_episodes``)
each, and score them with the reward mix (TRL's calling contract).

Every draw is keyed by (train.seed, step, the prompt's global index in the step, sample index)
(docs/sampling.md), so 1 or N ranks sample the same tokens. ``run`` is the trainer's ``Run``
(duck-typed: this module sits below the trainer). It does not build the training batch, the
advantages or the update (``trainer.collect`` / ``learn``).
"""

from __future__ import annotations

import dataclasses

from peergrade import distributed as dist
from peergrade.envs import Episode, episode_metrics, reward_inputs, run_episodes
from peergrade.envs.scoring import env_reward, environment_rewards
from peergrade.evaluation import reward_state
from peergrade.rewards import columns_for, score_rewards
from peergrade.rollout import Rollout, generate
from peergrade.seeds import step_seed


def sample(run, prompt_ids: list[list[int]], step: int, row_keys: range) -> Rollout:
    """G completions for each prompt with the configured sampling settings. Every draw is keyed
    by (train.seed, step, the prompt's global index in the step ``row_keys``, sample index), so
    1 or N ranks and any generation_batch_size sample the same tokens."""
    r = run.cfg.rollout
    with dist.full_weights(run.models.policy) as policy:  # FSDP2: unshard for sampling
        return generate(
            policy,
            run.models.tokenizer,
            prompt_ids,
            n=r.group_size,
            max_new_tokens=r.max_completion_length,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop=r.stop,
            seed=step_seed(run.cfg.train.seed, step),
            row_keys=row_keys,
            batch_size=r.generation_batch_size,
        )


def sample_episodes(run, rows: list[dict], step: int, row_keys: range) -> list[Episode]:
    """G episodes for each row (``envs.run_episodes``), keyed by (seed, step, row) as ``sample`` is;
    ``rollout.max_completion_length`` is the budget of a whole episode."""
    r, e = run.cfg.rollout, run.cfg.env
    with dist.full_weights(run.models.policy) as policy:
        return run_episodes(
            policy,
            run.models.tokenizer,
            rows,
            run.make_env,
            n=r.group_size,
            max_completion_length=r.max_completion_length,
            max_turns=e.max_turns,
            max_tokens_per_turn=e.max_tokens_per_turn,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop=r.stop,
            seed=step_seed(run.cfg.train.seed, step),
            row_keys=row_keys,
            batch_size=r.generation_batch_size,
        )


def completion_inputs(run, rows: list[dict], rollout: Rollout, completion_ids):
    """``(prompts, completions, columns)`` of single replies for ``score``: the dataset
    columns and ``completion_ids``, each repeated G times."""
    G = run.cfg.rollout.group_size
    prompts = [row["prompt"] for row in rows for _ in range(G)]
    columns = {**columns_for(rows, G), "completion_ids": completion_ids}
    return prompts, rollout.completion_text, columns


def episode_inputs(run, rows: list[dict], episodes: list[Episode]):
    """``(prompts, completions, columns)`` of episodes for ``score``, in TRL's conversational
    form (``envs.reward_inputs``), plus the environments' own rewards for the reward ``env``."""
    prompts, completions, columns = reward_inputs(episodes, rows)
    if any(s.fn is env_reward for s in run.rewards):
        columns["env_reward"] = environment_rewards(episodes)
    return prompts, completions, columns


def score(run, step: int, prompts: list, texts: list, columns: dict[str, list]):
    """Every reward function on every completion (TRL's contract: the dataset columns,
    ``completion_ids``, ``trainer_state`` at this step), and the accuracy verifier's scores."""
    cfg = run.cfg
    G = cfg.rollout.group_size
    state = reward_state(run.task, step, cfg.train.steps, cfg.rollout.prompts_per_step, G)
    scores = score_rewards(
        run.rewards,
        prompts,
        texts,
        columns,
        on_error=cfg.train.on_reward_error,
        trainer_state=state,
    )
    acc = run.accuracy
    if run.accuracy_in_mix:
        return scores, scores.per_fn[acc.name]
    acc_scores = score_rewards([acc], prompts, texts, columns, on_error="zero", trainer_state=state)
    return scores, acc_scores.per_fn[acc.name]


def episode_step_metrics(episodes: list[Episode]) -> dict[str, float]:
    """``envs.episode_metrics`` over every rank's episodes (their counts, not their messages)."""
    light = [
        dataclasses.replace(e, env=None, messages=[], prompt_ids=[], logprobs=[]) for e in episodes
    ]
    return episode_metrics([e for part in dist.gather_objects(light) for e in part])
