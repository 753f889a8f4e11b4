"""Sampling and scoring one step's answers: the parts of ``trainer.collect`` that turn P rows
into G completions or G episodes each (``generation.sample`` with the run's ``SamplerSettings``,
``Config.sampler_settings``: one ``Samples`` record either way), and score them with the reward mix
(TRL's calling contract).

Every draw is keyed by (train.seed, step, the prompt's global index in the step, sample index)
(docs/sampling.md), so 1 or N ranks sample the same tokens. ``run`` is the trainer's ``Run``
(duck-typed: this module sits below the trainer).

Dynamic sampling (``rollout.dynamic_sampling``) keeps some groups of several sampling rounds:
``take_groups`` cuts groups out of one round's ``experience.Sampled`` (ready to move to another
rank: ``distributed.exchange``), and ``concat_sampled`` joins kept groups into the step's one
``Sampled``, whose batch-level reward counts (``merge_round_scores``) cover every round.

It does not build the training batch, the advantages or the update (``trainer.collect`` /
``learn``), nor decide which groups are kept (``peergrade.training.dynamic``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from peergrade import distributed as dist
from peergrade import generation
from peergrade.envs import episode_metrics
from peergrade.envs.scoring import env_reward
from peergrade.generation import Samples
from peergrade.rewards import RewardScores, score_rewards
from peergrade.rewards.registry import reward_state
from peergrade.seeds import step_seed
from peergrade.training import harness
from peergrade.training.experience import Sampled


def sample(run, rows: list[dict], step: int, row_keys: Sequence[int]) -> Samples:
    """G answers (completions, or episodes with ``env:``) for each row with the run's sampler
    settings. Every draw is keyed by (train.seed, step, the prompt's global index in the step
    ``row_keys``, sample index), so 1 or N ranks and any generation_batch_size sample the same
    tokens."""
    if getattr(run, "harness", None) is not None:  # an external agent through the endpoint
        episodes, results = harness.sample(run, rows, step, row_keys)
        samples = Samples.of_episodes(episodes, run.models.tokenizer.pad_token_id, run.sampler.n)
        samples.columns = {harness.COLUMN: results}  # what each run of the harness returned
        return samples
    with dist.full_weights(run.models.policy) as policy:  # FSDP2: unshard for sampling
        return generation.sample(
            policy,
            run.models.tokenizer,
            rows,
            run.sampler,
            seed=step_seed(run.cfg.train.seed, step),
            row_keys=row_keys,
            prompt_ids=None if run.make_env else run.encode(rows),
            make_env=run.make_env,
            engine=getattr(run, "engine", None),
        )


# ----------------------------------------------------------------------------- the engine


def build_engine(cfg):
    """The run's rollout engine: None for the own kernel (``rollout.engine peergrade``), else a
    ``VllmEngine`` (built lazily at the first sample), or with ``rollout.vllm_mode server`` a
    ``VllmServerEngine``. A missing vLLM (``MissingPackageError``; a server given by URL needs
    none here), a launch it does not serve or a server URL nothing answers at (``ConfigError``)
    fails before any model loads."""
    r = cfg.rollout
    if r.engine == "peergrade":
        return None
    from peergrade.config import ConfigError
    from peergrade.errors import MissingPackageError
    from peergrade.generation.vllm_engine import INSTALL_HINT, VllmEngine, vllm_available

    server, url = r.vllm_mode == "server", r.vllm_server_url
    if not vllm_available() and not (server and url):
        raise MissingPackageError(
            f"rollout.engine vllm needs vLLM, which is not installed: {INSTALL_HINT}"
        )
    if dist.launched() or dist.world() > 1:  # colocated: an engine per rank (docs/engines.md)
        if server:
            raise ConfigError(
                "rollout.vllm_mode server runs with one trainer process: launch without "
                "torchrun, or use rollout.vllm_mode colocate (an engine on every rank)"
            )
        if cfg.dist.strategy == "fsdp":
            raise ConfigError(
                "rollout.engine vllm under torchrun with dist.strategy fsdp: the weights pushed "
                "to each rank's engine must be whole; use dist.strategy ddp"
            )
    kw = dict(
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        kv_cache_gb=r.vllm_kv_cache_gb,
        max_model_len=r.vllm_max_model_len,
    )
    if not server:
        return VllmEngine(**kw)
    from peergrade.generation.vllm_server import VllmServerEngine, check_server

    if url:
        check_server(url, min(r.vllm_server_timeout, 30.0))  # a dead URL: before the model
    return VllmServerEngine(url=url, timeout=r.vllm_server_timeout, **kw)


def engine_gap(run, exp) -> dict[str, float]:
    """The train/inference gap of the step's samples (another engine only: the own kernel
    samples with the trainer's forward): the trainer's own log-probs of the sampled tokens
    (one no-grad pass with the weights that sampled them) against the engine's, over the
    tokens the loss counts. ``engine/logp_gap_mean`` / ``_max``: mean and max |delta logp|;
    ``engine/seq_kl``: the mean over sequences of sum_t (log mu - log pi), the k1 estimate of
    KL(engine || trainer) per sequence. A pipelined step's gap was measured by the producer
    with the version that sampled (``exp.engine_gap``, ``pipeline.Producer``): the trainer's
    weights are newer by then."""
    if getattr(run, "engine", None) is None or exp.sampler_logprobs is None:
        return {}
    measured = getattr(exp, "engine_gap", None)
    if measured is not None:
        return measured
    from peergrade.training.update import frozen_logprobs

    trainer_lp = frozen_logprobs(run.models.policy, exp.batch, run.cfg)  # [N, C]
    m = exp.loss_mask > 0  # [N, C]
    d = (exp.sampler_logprobs.to(trainer_lp.device) - trainer_lp) * m  # [N, C]
    if not bool(m.any()):
        return {}
    return {
        "engine/logp_gap_mean": float(d.abs().sum() / m.sum()),
        "engine/logp_gap_max": float(d.abs().max()),
        "engine/seq_kl": float(d.sum(dim=1).mean()),
    }


def close_engine(run) -> None:
    """Shut the rollout engine down at the end of a run (a later sample builds it again)."""
    engine = getattr(run, "engine", None)
    if engine is not None:
        engine.close()


def push_weights(run, step: int) -> None:
    """The policy's weights after step ``step``'s update into the rollout engine (in place;
    nothing for the own kernel, which samples with the policy itself)."""
    engine = getattr(run, "engine", None)
    if engine is not None:
        engine.push(run.models.policy, version=step)


def reward_inputs_of(run, rows: list[dict], samples: Samples):
    """``(prompts, completions, columns)`` for ``score`` in TRL's contract; episodes get the
    environments' own rewards (``env_reward``) when the reward ``env`` is in the mix."""
    wants_env = any(s.fn is env_reward for s in run.rewards)
    return samples.reward_inputs(rows, env_reward=wants_env)


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


def episode_step_metrics(samples: Samples) -> dict[str, float]:
    """``envs.episode_metrics`` over every rank's episodes (their counts, not their messages);
    empty for single replies."""
    light = [
        dataclasses.replace(
            e, env=None, messages=[], prompt_ids=[], logprobs=[], sampler_logprobs=[]
        )
        for e in samples.episodes or []  # single replies: none, and no metrics
    ]
    return episode_metrics([e for part in dist.gather_objects(light) for e in part])


# ----------------------------------------------------------------------------- dynamic sampling


def take_groups(s: Sampled, groups: list[int], group_size: int, *, portable: bool) -> Sampled:
    """Groups ``groups`` (indices into ``s``'s prompts) of one round, as a ``Sampled`` of their
    own. Only per-row reward fields come along (the batch-level counts stay with the round:
    ``merge_round_scores``). ``portable``: tensors on the CPU and episodes without their live
    environment, so the result can be pickled to another rank."""
    G = group_size
    seqs = [g * G + j for g in groups for j in range(G)]
    ix = torch.tensor(seqs, dtype=torch.long)

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t[ix.to(t.device)]
        return t.cpu() if portable else t

    sc = s.scores
    scores = RewardScores(
        per_fn={k: rows(v) for k, v in sc.per_fn.items()},
        total=rows(sc.total),
        extra={k: [v[i] for i in seqs] for k, v in sc.extra.items()},
        weights=sc.weights,
    )
    samples = s.samples.take(seqs)
    if portable:
        samples = samples.portable()
    return Sampled(
        rows=[s.rows[g] for g in groups],
        prompt_ids=[s.prompt_ids[g] for g in groups],
        samples=samples,
        scores=scores,
        accuracy=rows(s.accuracy),
        completion_ids=[s.completion_ids[i] for i in seqs],
        few_shot_frac=s.few_shot_frac,
    )


def merge_round_scores(calls: list[RewardScores], rounds: list[int] | None = None) -> dict:
    """The batch-level fields of several sampling calls' scores as one batch's: failures and
    counts summed, messages listed, ``log_metric`` means averaged, each call weighted by the
    rounds it scored (``rounds``, default 1 each: every round scores as many completions)."""
    weights = [1] * len(calls) if rounds is None else rounds
    counts: dict[str, float] = {}
    logged: dict[str, list[tuple[float, int]]] = {}
    for sc, w in zip(calls, weights):
        for k, v in sc.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        for k, v in sc.logged.items():
            logged.setdefault(k, []).append((v, w))
    return {
        "num_errors": sum(sc.num_errors for sc in calls),
        "errors": [e for sc in calls for e in sc.errors],
        "counts": counts,
        "logged": {
            k: sum(v * w for v, w in vw) / sum(w for _, w in vw) for k, vw in logged.items()
        },
    }


def concat_sampled(parts: list[Sampled], pad_token_id: int, batch_scores: dict) -> Sampled:
    """One ``Sampled`` of ``parts``' groups in order (``take_groups``'s), on the device of the
    first part; ``batch_scores`` (``merge_round_scores``) are its reward counts."""
    first = parts[0]
    dev = first.accuracy.device

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(dev) for t in ts])

    scores = RewardScores(
        per_fn={k: cat([p.scores.per_fn[k] for p in parts]) for k in first.scores.per_fn},
        total=cat([p.scores.total for p in parts]),
        extra={k: [x for p in parts for x in p.scores.extra[k]] for k in first.scores.extra},
        weights=first.scores.weights,
        **batch_scores,
    )
    return Sampled(
        rows=[r for p in parts for r in p.rows],
        prompt_ids=[ids for p in parts for ids in p.prompt_ids],
        samples=Samples.concat([p.samples for p in parts], pad_token_id),
        scores=scores,
        accuracy=cat([p.accuracy for p in parts]),
        completion_ids=[c for p in parts for c in p.completion_ids],
        few_shot_frac=first.few_shot_frac,
    )
