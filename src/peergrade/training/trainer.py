"""The training loop, top to bottom: ``setup`` builds a run, ``train_step`` is one step, ``train``
loops over steps and finishes with the held-out table.

One step (``train_step`` = ``collect`` then ``learn``; the loop and ``peergrade memory`` both
call it), with one ``Experience`` (``peergrade.training.experience``) travelling through it:
  ``collect``: P prompts (with solved example turns early on when ``data.few_shot`` is set)
    -> G completions each (``rollout.generate``), or G episodes each with tools or an
       environment (``env:``, ``envs.run_episodes``: environment tokens attended to, never
       trained on) -> rewards (weighted reward functions)
    -> reference log-probs (beta > 0)
    -> advantages (``run.algo.advantages``: group-relative for GRPO, critic + GAE for PPO)
  With ``rollout.dynamic_sampling`` (``fill_step``), ``collect`` samples and scores rounds of P
  prompts until P groups whose rewards differ are kept (``peergrade.training.dynamic``), then builds
  the experience of those.
  ``learn``: mu passes of minibatch updates (``run.algo.update``)
  -> metrics and sampled completions, which the loop logs, then evaluation and checkpoints.
GRPO and PPO differ only behind ``run.algo`` (``update.Algorithm``: ``update.GRPO``,
``ppo.PPO``). docs/architecture.md draws the data flow and the Experience's fields.

Pipelined rollouts (``rollout.async_steps`` = k >= 1, ``peergrade.training.pipeline``): ``train`` starts
a producer (a forked process on the CPU, a thread on a GPU: ``rollout.producer``) that runs
``collect`` (without the advantages) for the next steps with its own copy of the policy, at version max(0, step - 1 - k), and each step is ``pipelined_step``: take
that experience, advantages, ``learn``, hand the new weights to the producer. k = 0 runs
``train_step`` exactly as before.

Exact resume: everything random is derived from (seed, step) (``peergrade.seeds``) -- the
prompts of step s are rows [s*P, (s+1)*P) of the task's seeded stream, every sampling draw
is a function of (seed, step, the prompt's index in the step, the sample's index in its group),
minibatch shuffles and the global random/numpy generators that reward functions may use are
functions of (seed, step), dynamic sampling's extra rounds of (seed, step, round) -- so a run
resumed from
``checkpoints/step-s`` (model, optimizer, scheduler, RNG states) produces the same metrics and
weights as one never stopped.

Under torchrun (``peergrade.distributed``) the same loop runs on every rank: ``train_step``
keeps this rank's whole groups of the step's P prompts, batch statistics and metrics span every
rank, and rank 0 alone writes logs and checkpoints. In one process every ``dist.*`` call is the
identity.

This module does not implement the math (``algo``), the update (``update``, ``ppo``), the
sampler (``rollout``; ``sampling`` calls it and the reward mix), log-probs and loading (``logprobs``, ``models``), rewards or tasks, the
run directory and resume (``checkpoint``) or the held-out evaluator (``evaluation``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade.config import Config, ConfigError, off_policy_correction, to_yaml
from peergrade.envs.scoring import EPISODE_COLUMNS
from peergrade.envs.verifiers import is_verifiers_spec
from peergrade.files import read_jsonl
from peergrade.generation import SamplerSettings
from peergrade.monitoring import flops
from peergrade.monitoring.detectors import Detectors, repetition_rate
from peergrade.monitoring.metrics import Display, check_backends, quiet_hf_progress
from peergrade.rewards import RewardSpec
from peergrade.rewards.audit import at_startup as audit_at_startup
from peergrade.seeds import step_seed
from peergrade.tasks.curriculum import FewShot
from peergrade.training import checkpoint as ckpt
from peergrade.training import harness, pipeline, ppo, turn_credit
from peergrade.training.checkpoint import RunDir, resume_from_checkpoint
from peergrade.training.components import (  # importable from here too: Given, setup_models, ...)
    Given,
    build_env,
    build_few_shot,
    build_rewards,
    build_task,
    check_context,
    check_env_template,
    encode_rows,
    env_reward_spec,
    episode_rows,
    epoch_metric,
    run_header,
    setup_models,
)
from peergrade.training.dynamic import fill_groups
from peergrade.training.experience import Experience, Sampled
from peergrade.training.held_out import (
    HeldOut,
    check_reward_columns,
    held_out_scorer,
    results_table,
)
from peergrade.training.sampling import (  # importable from here too (tests patch trainer.sample)
    build_engine,
    close_engine,
    concat_sampled,
    engine_gap,
    episode_step_metrics,
    merge_round_scores,
    push_weights,
    reward_inputs_of,
    sample,
    score,
    take_groups,
)
from peergrade.training.teacher import Distill, load_teacher
from peergrade.training.update import (
    GRPO,
    Algorithm,
    Models,
    autocast,
    autocast_note,
    build_optimizer,
    build_scheduler,
    ref_logprobs,
)

# ----------------------------------------------------------------------------- setup


@dataclass
class Done:
    """The last step whose update happened: its number, its metrics and logged groups (None
    until the step's result is computed: the loop logs them if it was interrupted before it
    could), and dynamic sampling's ``informative_seen`` as it stood after that step."""

    step: int
    result: Any = None
    informative_seen: bool = False


@dataclass
class Run:
    """Everything one training run holds between steps."""

    cfg: Config
    task: Any
    rewards: list[RewardSpec]
    accuracy: RewardSpec  # the held-out scorer (train.eval_reward; evaluation.held_out_scorer)
    accuracy_in_mix: bool  # the verifier is one of the rewards: reuse its scores
    few_shot: FewShot
    models: Models
    optimizer: Any
    scheduler: Any
    critic: ppo.Critic | None  # PPO only
    algo: Algorithm  # advantages + update: update.GRPO or ppo.PPO
    accuracy_why: str = ""  # how the scorer was chosen, for the run header
    make_env: Any = None  # env: row -> environment (episodes); None = single replies
    harness: Any = None  # harness: fn(row, base_url, model), the episode source (or None)
    harness_runner: Any = None  # its endpoint (training.harness.start)
    harness_pool: Any = None  # its worker processes (harness.processes; training.harness.start)
    harness_episodes: Any = None  # the held-out evaluation's episodes through the harness
    # dynamic sampling: some group's rewards have differed in this run (a checkpoint keeps it);
    # until then a step that finds none stops the run (dynamic.fill_groups' require_one)
    informative_seen: bool = False
    # the last step whose update happened (its weights are the model's), recorded together
    # with the update (``commit``): what an interrupted run saves, whatever the moment
    done: Done = field(default_factory=lambda: Done(0))
    engine: Any = None  # rollout.engine other than the own kernel (sampling.build_engine)

    @property
    def optimizer_state(self):
        """What a checkpoint saves as the optimizer (PPO's also carries the critic)."""
        if self.critic is None:
            return self.optimizer
        return ppo.CriticCheckpointState(self.optimizer, self.critic)

    def encode(self, rows: list[dict]) -> list[list[int]]:
        return encode_rows(self.cfg, self.task, self.models.tokenizer, rows)

    @functools.cached_property
    def sampler(self) -> SamplerSettings:
        """How this run samples (``rollout`` / ``env``), built once from the config."""
        return self.cfg.sampler_settings()


def setup(cfg: Config, given: Given | None = None) -> Run:
    """Task, rewards and curriculum (cheap, checked first), then models and optimizers."""
    given = given or Given()
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    ckpt.seed_step_rngs(step_seed(t.seed, 0, salt=REWARD_RNG_SALT))  # the evaluation before step 1
    task = given.task
    if task is None and not is_verifiers_spec(cfg.env.factory):
        task = build_task(cfg)
    # env: the user's tools and environment class (or the Python caller's), loaded and checked
    make_env = build_env(cfg, given.tools, given.environment_factory)
    if task is None:  # a verifiers environment's taskset is the data
        task = build_task(cfg, make_env)
    harness_fn = harness.load(cfg, given.harness)  # an external agent: its reward is the mix
    rewards = [] if harness_fn and not cfg.rewards else build_rewards(cfg, task, given.reward_fns)
    # the environments' own reward (episodes give its column) and what the harness returned
    own = env_reward_spec(make_env) + (harness.reward_specs() if harness_fn else [])
    acc, why = held_out_scorer(task, rewards + own, t.eval_reward)  # the training reward
    in_mix = any(
        s.name == acc.name and s.fn is acc.fn and s.kwargs == acc.kwargs for s in rewards + own
    )
    # a column a reward cannot score without, checked in every row before the model loads
    check_reward_columns(
        task, rewards, None if in_mix else acc, EPISODE_COLUMNS if make_env or harness_fn else ()
    )
    rewards += own
    if make_env is None and harness_fn is None:  # its exploits are single replies
        audit_at_startup(cfg, task, rewards, show=dist.is_main())  # train.audit_rewards, no model
    few_shot = build_few_shot(cfg, task)
    if make_env is not None or harness_fn is not None:  # a template that cannot render tool turns
        check_env_template(cfg, given.tokenizer, make_env)  # fails before the model loads
    check_context(cfg, given.policy)  # before the model loads, where its config says
    engine = build_engine(cfg)  # rollout.engine: vLLM missing fails here, before the model
    models = setup_models(cfg, given.policy, given.tokenizer)
    check_context(cfg, models.policy)  # a GGUF file's context, known once loaded
    trainable = (p for p in models.policy.parameters() if p.requires_grad)
    optimizer = build_optimizer(trainable, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg)
    if cfg.algo.name == "ppo":  # a critic (value model + its AdamW), the memory GRPO does without
        critic = ppo.build_critic(cfg, models)
        algo = ppo.PPO(models, critic, optimizer, scheduler, cfg)
    elif cfg.algo.teacher_path is not None or cfg.algo.teacher_url is not None:  # distillation
        teacher = load_teacher(cfg, models)  # tokenizers checked here, before any step
        critic, algo = None, Distill(models, optimizer, scheduler, cfg, teacher=teacher)
    elif turn_credit.settings(cfg.algo)[0] != "episode":  # per-turn advantages [N, C]
        critic, algo = None, turn_credit.TurnCredit(models, optimizer, scheduler, cfg)
    else:
        critic, algo = None, GRPO(models, optimizer, scheduler, cfg)
    run = Run(
        cfg,
        task,
        rewards,
        acc,
        in_mix,
        few_shot,
        models,
        optimizer,
        scheduler,
        critic,
        algo,
        why,
        make_env,
    )
    run.engine = engine
    if harness_fn is not None:  # serve the policy to the harness (a free local port)
        run.harness = harness_fn
        run.harness_runner = harness.start(run)
        run.harness_episodes = harness.episode_fn(run)
    return run


# ----------------------------------------------------------------------------- one step

REWARD_RNG_SALT = 1000  # peergrade.seeds: the stream of the global random/numpy generators


class NoMeter:
    """The phase meter of a plain training step: measures nothing (see ``peergrade.planning.memory``)."""

    def reset(self) -> None:
        pass

    def record(self, phase: str) -> None:
        pass


@dataclass
class StepResult:
    metrics: dict[str, Any]
    samples: list[dict] = field(default_factory=list)  # the logged groups (train.log_samples)
    shapes: dict[str, int] = field(default_factory=dict)  # prompt/sequence/completion lengths
    # every score of the scorer was 0 or 1: reward/accuracy is a share correct (else a mean score)
    all_or_nothing: bool = True


NO_METER = NoMeter()


def collect(
    run: Run, step: int, rows: list[dict], meter=NO_METER, *, advantages: bool = True
) -> Experience:
    """Step ``step``'s experience on ``rows`` (P prompts): sample, score, reference log-probs,
    advantages (``advantages=False``: left to the caller, as the pipelined step does: under
    torchrun they gather every rank's rewards). ``meter`` brackets the generate / rewards /
    reference phases. With ``rollout.dynamic_sampling`` the batch is filled with groups whose
    rewards differ (``fill_step``)."""
    cfg, models = run.cfg, run.models
    # Python's random and numpy's global generator, which reward functions may use (a stream
    # per rank under torchrun, rank 0's the single-process one: a reward function scores a
    # batch, so its draws cannot be keyed per completion as the sampler's are)
    ckpt.seed_step_rngs(dist.rank_seed(step_seed(cfg.train.seed, step, salt=REWARD_RNG_SALT)))
    if cfg.rollout.dynamic_sampling:
        s, t_gen, t_reward = fill_step(run, step, rows, meter)
    else:
        rows, few_shot_frac = run.few_shot.apply(rows, step)
        keys = dist.shard_range(len(rows))  # the global indices of this rank's P / world prompts
        s, t_gen, t_reward = sample_round(run, step, rows[keys.start : keys.stop], keys, meter)
        s.few_shot_frac = few_shot_frac
    t_scored = time.perf_counter()
    exp = experience_of(run, step, s)

    meter.reset()  # 4. reference log-probs for the KL term; advantages
    exp.ref_logprobs = ref_logprobs(models, exp.batch, cfg)  # [N, C] or None
    if advantages:
        run.algo.advantages(exp)
    meter.record("reference")
    exp.seconds = {"generate": t_gen, "reward": t_reward, "ref": time.perf_counter() - t_scored}
    return exp


def sample_round(
    run: Run, step: int, rows: list[dict], keys: Sequence[int], meter=NO_METER
) -> tuple[Sampled, float, float]:
    """This rank's ``rows`` sampled (G completions or episodes each, every draw keyed by the
    prompt's global sampling key in ``keys``) and scored; returns them with the seconds spent
    generating and scoring."""
    t_start = time.perf_counter()
    if run.make_env is not None or run.harness is not None:  # an episode starts from messages
        rows = episode_rows(run.cfg, run.task, rows)
    meter.reset()  # 1. sample G completions (or episodes) per prompt
    with autocast(run.cfg, run.models.device, run.models.policy):  # bf16 rollouts where it pays
        samples = sample(run, rows, step, keys)
    meter.record("generate")
    t_generated = time.perf_counter()

    # what the model sampled counts (repetition, lengths); rewards see every token
    completion_ids = samples.completion_id_lists()
    meter.reset()  # 2. score them (a reward model's forward is the memory here)
    scores, acc_values = score(run, step, *reward_inputs_of(run, rows, samples))
    meter.record("rewards")
    prompt_ids = samples.prompt_ids[:: run.cfg.rollout.group_size]
    s = Sampled(rows, prompt_ids, samples, scores, acc_values, completion_ids, 0.0)
    return s, t_generated - t_start, time.perf_counter() - t_generated


def experience_of(run: Run, step: int, s: Sampled) -> Experience:
    """3. the experience of what was sampled and scored: the attention mask says which tokens
    exist, the loss mask (the sampler's own, kept apart) which are trained on: an episode's
    environment tokens are attended to and never trained on; DAPO's overlong filtering masks
    truncated completions out of the loss only."""
    cfg, device, samples = run.cfg, run.models.device, s.samples
    input_ids, attention_mask, _ = samples.training_batch(run.models.tokenizer.pad_token_id)
    loss_mask, truncated = samples.loss_mask, samples.truncated  # [N, C], [N]
    if cfg.algo.mask_truncated_completions:
        loss_mask = loss_mask * (~truncated).unsqueeze(1).to(loss_mask.dtype)
    sampler_lp = samples.sampler_logprobs
    return Experience(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        loss_mask=loss_mask.to(device),
        rewards=s.scores.total,
        truncated=truncated,
        policy_version=step - 1,  # the weights after step - 1 updates (pipeline: older)
        sampler_logprobs=None if sampler_lp is None else sampler_lp.to(device),
        sampled=s,
    )


#: peergrade.seeds: the stream of dynamic sampling's extra prompts (one per step)
DYNAMIC_ROWS_SALT = 2000


def fill_step(
    run: Run, step: int, rows: list[dict], meter=NO_METER
) -> tuple[Sampled, float, float]:
    """Dynamic sampling (``rollout.dynamic_sampling``, ``peergrade.training.dynamic``): this rank's
    share of P groups whose rewards differ, out of at most ``rollout.max_rounds`` rounds;
    returns them with the seconds spent generating and scoring over every round.

    Round 0 is the step's ``rows``, exactly as without dynamic sampling. Round r >= 1 takes
    rows [(r-1)P, rP) of a stream of the task's training rows seeded by (seed, step)
    (``DYNAMIC_ROWS_SALT``) -- extra data, beside the main stream, whose offsets (resume,
    ``data/epoch``) do not move -- and samples them with keys rP + i, distinct from every
    other round's. So round r is a function of (seed, step, r) alone, whatever the rank
    count, and a resumed run redraws it exactly. With ``rollout.rounds_ahead`` the extra rounds
    the step is expected to need come as one batch (``dynamic.rounds_ahead``): each keeps its
    prompts and keys, so only the batch size changes. Under torchrun each rank samples its block
    of every round, the rounds' rewards are gathered, every rank makes the same global picks,
    and the kept groups move to the rank that trains them (``dist.exchange``): rank k trains
    slots [kP/W, (k+1)P/W) of the kept list, whole groups, as one process would.

    Slots no round could fill hold groups that did not differ (advantage 0). They count in
    every loss normaliser like any zero-spread group of a plain step: the batch is always
    P * G rows, so the loss scale does not jump with how full a step was, and a step that
    found one informative group does not weigh it P times (the gradient is the one a plain
    step with those groups would take). With ``algo.skip_zero_advantage`` (beta = 0) they
    cost no forward/backward."""
    cfg = run.cfg
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    shard = dist.shard_range(P)  # this rank's block of every round
    k = len(shard)
    raw, extra = list(rows), None  # extra: the step's stream of extra prompts, opened lazily
    calls: list[tuple[range, Sampled]] = []  # the rounds of each sampling call, what it drew
    seconds = [0.0, 0.0]
    few_shot_frac = 0.0

    def sample_rounds(rs: range) -> list[torch.Tensor]:  # each round's global rewards [P, G]
        nonlocal extra, few_shot_frac
        if rs.stop > 1:
            if extra is None:
                seed = step_seed(cfg.train.seed, step, salt=DYNAMIC_ROWS_SALT)
                extra = run.task.train_rows(seed)
            raw.extend(next(extra) for _ in range((rs.stop - max(rs.start, 1)) * P))
        # few-shot turns on round 0 and the extra rounds in one call: round 0's draws are the
        # plain step's, and an extra prompt gets draws of its own
        shown, frac = run.few_shot.apply(raw, step)
        few_shot_frac = frac if rs.start == 0 else few_shot_frac
        # this rank's block of each round, one batch: round r's keys rP + shard, whatever call
        keys = [r * P + i for r in rs for i in shard]
        s, t_gen, t_reward = sample_round(run, step, [shown[i] for i in keys], keys, meter)
        seconds[0] += t_gen
        seconds[1] += t_reward
        calls.append((rs, s))
        mine = s.scores.total.view(len(rs), k, G).to(torch.float32)
        everyone = dist.gather_rows(mine.reshape(len(rs) * k, G))  # rank-major
        return list(everyone.view(-1, len(rs), k, G).transpose(0, 1).reshape(len(rs), -1, G))

    fill = fill_groups(
        sample_rounds,
        P,
        cfg.rollout.max_rounds,
        require_one=not run.informative_seen,
        ahead=cfg.rollout.rounds_ahead,
    )
    run.informative_seen = run.informative_seen or bool(fill.picks)
    s = kept_groups(run, fill.slots(P), calls, shard)
    s.few_shot_frac = few_shot_frac
    s.dynamic = fill.metrics(G)
    s.generated_tokens = sum(x.samples.num_generated_tokens for _, x in calls)
    s.generated_lengths = tuple(torch.cat(t) for t in zip(*(sequence_lengths(x) for _, x in calls)))
    return s, seconds[0], seconds[1]


def kept_groups(
    run: Run, slots: list[tuple[int, int]], calls: list[tuple[range, Sampled]], shard: range
) -> Sampled:
    """This rank's share of the groups dynamic sampling kept (``fill_step``): ``slots`` is the
    kept list, [P] (round, global group), picks first; ``calls`` the rounds of each sampling
    call and what it drew; ``shard`` this rank's block of every round. The kept groups move to
    the rank that trains them (``dist.exchange``: rank k trains slots [kP/W, (k+1)P/W)), with
    every round's scores merged."""
    G, k = run.cfg.rollout.group_size, len(shard)
    where = {r: (s, (r - rs.start) * k) for rs, s in calls for r in rs}  # round -> its call
    owned = {}  # the kept groups this rank sampled, keyed by slot
    for r, g in slots:
        if shard.start <= g < shard.stop:
            src, offset = where[r]
            owned[(r, g)] = take_groups(
                src, [offset + g - shard.start], G, portable=dist.parallel()
            )
    mine = dist.exchange(owned, slots[shard.start : shard.start + k])
    return concat_sampled(
        mine,
        run.models.tokenizer.pad_token_id,
        merge_round_scores([x.scores for _, x in calls], [len(rs) for rs, _ in calls]),
    )


def sequence_lengths(s: Sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N], [N])`` prompt and completion token counts of one round's sequences (an
    episode's completion: every token after its prompt, the environment's included)."""
    p = [len(ids) for ids in s.samples.prompt_ids]
    return torch.tensor(p), s.samples.lengths.cpu()


def learn(run: Run, exp: Experience, step: int) -> dict[str, float]:
    """The update of step ``step`` on ``exp``; returns its metrics (the advantage phase's too).
    Another rollout engine (vLLM) gets the gap to the trainer's forward measured with the
    weights that sampled, then the new weights."""
    gap = engine_gap(run, exp)
    metrics = exp.metrics | gap | run.algo.update(exp, step)
    push_weights(run, step)
    return metrics


def train_step(run: Run, step: int, rows: list[dict], meter=NO_METER) -> StepResult:
    """One step on ``rows`` (P prompts): ``collect`` then ``learn``, then the step's metrics.
    ``meter`` brackets the generate / rewards / reference / update phases (``peergrade memory``)."""
    exp = collect(run, step, rows, meter)
    t_ref = time.perf_counter()
    meter.reset()  # 5. policy update
    # a second Ctrl-C waits: the update, its record and the step's metrics are one
    with ckpt.critical():
        upd = learn(run, exp, step)
        run.done = Done(step, None, run.informative_seen)
        meter.record("update")
        exp.seconds["update"] = time.perf_counter() - t_ref
        run.done.result = step_result(run, exp, upd, step)
    return run.done.result


def pipelined_step(run: Run, producer, step: int) -> StepResult:
    """Step ``step`` with ``rollout.async_steps`` = k >= 1 (``peergrade.training.pipeline``): the
    experience the producer collected with the weights of version max(0, step - 1 - k) while
    earlier steps trained, its advantages, the update, then the new weights to the producer."""
    t_wait = time.perf_counter()
    exp = producer.take(step)
    t_got = time.perf_counter()
    run.algo.advantages(exp)  # every rank's rewards under torchrun: on this thread
    if run.cfg.rollout.dynamic_sampling:  # what fill_step did to the producer's copy, in order
        kept = run.cfg.rollout.prompts_per_step - exp.sampled.dynamic["dynamic/unfilled_groups"]
        run.informative_seen = run.informative_seen or kept > 0
    t_adv = time.perf_counter()
    # a second Ctrl-C waits: the update, its record and the step's metrics are one
    with ckpt.critical():
        upd = learn(run, exp, step)
        t_learned = time.perf_counter()
        producer.publish(step, run.models.policy)  # version `step` samples step + 1 + k
        t_published = time.perf_counter()
        run.done = Done(step, None, run.informative_seen)
        # the phases mean what they mean in a synchronous step: the advantages count with the
        # reference phase (collect computes them there), the update is learn() alone
        exp.seconds["ref"] += t_adv - t_got
        exp.seconds["update"] = t_learned - t_adv
        result = step_result(run, exp, upd, step)
        staleness = (step - 1) - exp.policy_version  # version trained - version sampled
        result.metrics.update(
            {
                "async/staleness_mean": float(staleness),  # one version per step's experience
                "async/staleness_max": staleness,
                "async/policy_version": exp.policy_version,
                "time/wait_s": t_got - t_wait,  # the trainer idle, waiting for the producer
                "time/publish_s": t_published - t_learned,  # the new weights to the producer
            }
        )
        run.done.result = result
    return result


#: rollout.async_steps above this warns: staleness, and the versions kept, grow with it
ASYNC_STEPS_WARN = 4


def check_run_conflicts(cfg: Config) -> None:
    """Conflicts of the config with how the run is launched (torchrun's world size, the
    device), found before any model loads or run directory is made: a ``ConfigError``. Also
    warns (one line) of a pipelined run far ahead of its trainer."""
    r = cfg.rollout
    world = int(os.environ["WORLD_SIZE"]) if dist.launched() else dist.world()
    if r.dynamic_sampling and r.async_steps and world > 1:
        raise ConfigError(
            "rollout.dynamic_sampling with rollout.async_steps >= 1 runs one process only: its "
            "rounds gather every rank's rewards, and those collectives would race the trainer's "
            f"in the producer; under torchrun ({world} processes) set one of them off"
        )
    if r.async_steps:
        from peergrade.model.load import resolve_device

        try:
            pipeline.producer_kind(r.producer, resolve_device(cfg.model.device), engine=r.engine)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if r.async_steps > ASYNC_STEPS_WARN and os.environ.get("RANK", "0") == "0":
            print(
                f"warning: rollout.async_steps {r.async_steps} samples each step with weights "
                f"{r.async_steps} updates old (more than {ASYNC_STEPS_WARN}: the off-policy "
                f"correction has more to correct) and keeps {r.async_steps + 1} copies of the "
                "trainable weights; 1 or 2 usually hides generation as well",
                file=sys.stderr,
                flush=True,
            )


def start_producer(run: Run, out: RunDir, rows, start_step: int, display):
    """The producer (``rollout.producer``: a forked process or a thread) of a pipelined run,
    from ``start_step`` on. It starts with the
    trainer's weights (version ``start_step``) and, on resume, the older versions the
    checkpoint saved for its in-flight steps. A producer thread and the trainer each get half
    of torch's threads (at least one); a producer process gets one, the trainer the rest."""
    cfg = run.cfg
    k, P = cfg.rollout.async_steps, cfg.rollout.prompts_per_step
    if cfg.rollout.dynamic_sampling and dist.parallel():
        raise ConfigError(
            "rollout.dynamic_sampling with rollout.async_steps >= 1 runs one process only: its "
            "rounds gather every rank's rewards, and those collectives would race the trainer's "
            "in the producer; under torchrun set one of them off"
        )
    versions = {start_step: pipeline.trainable_state(run.models.policy)}
    saved = out.path / "checkpoints" / f"step-{start_step}" / pipeline.VERSIONS_FILE
    if saved.is_file():
        versions |= torch.load(saved, map_location=run.models.device, weights_only=True)
    elif start_step > 0 and pipeline.sampled_version(start_step + 1, k) < start_step:
        display.print(
            f"checkpoint step-{start_step} has no {pipeline.VERSIONS_FILE} (saved with "
            f"rollout.async_steps 0?): steps {start_step + 1}..{start_step + k} are sampled by "
            f"its weights (staleness below {k}), not by the older versions a run never "
            "stopped would use",
            always=True,
        )
    total = torch.get_num_threads()
    try:
        kind = pipeline.producer_kind(
            cfg.rollout.producer, run.models.device, total, engine=cfg.rollout.engine
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kind == "process":  # one thread for the producer (pipeline.PROCESS_THREADS), the rest here
        threads = pipeline.PROCESS_THREADS
        torch.set_num_threads(max(1, total - threads))
    else:
        threads = max(1, total // 2)
        torch.set_num_threads(threads)
    # a forked process starts as a copy of this one: its policy is its own already
    cls, prun = (
        (pipeline.ProcessProducer, run)
        if kind == "process"
        else (pipeline.Producer, pipeline.producer_run(run))
    )
    producer = cls(
        partial(collect, advantages=False),
        prun,
        k,
        range(start_step + 1, cfg.train.steps + 1),
        lambda: [next(rows) for _ in range(P)],
        versions,
        threads,
    )
    producer.timeout_s = cfg.rollout.producer_timeout_s
    display.print(
        f"pipelined rollouts: a producer {kind} ({threads} torch thread"
        f"{'s' if threads > 1 else ''}) samples up to {k} step{'s' if k > 1 else ''} ahead of "
        f"the update (rollout.async_steps {k}); stale samples are corrected by "
        f"algo.off_policy_correction {off_policy_correction(cfg)}",
        always=True,
    )
    return producer.start()


def step_result(run: Run, exp: Experience, upd: dict[str, float], step: int) -> StepResult:
    """The step's metrics (over every rank's rows under torchrun) and its logged groups."""
    cfg, s, sec = run.cfg, exp.sampled, exp.seconds
    G, P = cfg.rollout.group_size, len(s.rows)
    samples, scores = s.samples, s.scores
    g = dist.gather_rows
    # an answer's length is what the model sampled; an episode's environment tokens do not count
    local_lens = samples.sampled_lengths  # [N]
    completions, finish = samples.completions, samples.finish_reason
    gen_tokens = dist.sum_int(int(local_lens.sum()))  # the trained batch's
    if s.generated_tokens is not None:  # dynamic sampling: every round's count
        sampled_tokens = dist.sum_int(s.generated_tokens)
    else:
        sampled_tokens = gen_tokens
    lens = g(local_lens.to(exp.loss_mask.device))  # [N]
    rewards = scores.total.view(P, G).to(torch.float32)  # [P, G]
    group_std = torch.nan_to_num(g(rewards), nan=0.0).std(dim=1)  # [P]
    all_scores, truncated = dist.gather_scores(scores), g(exp.truncated)
    acc = g(s.accuracy).nan_to_num(0.0)  # [N] the held-out scorer's scores (train.eval_reward)
    metrics = {
        "step": step,
        **all_scores.metrics(),
        "reward/accuracy": acc.mean().item(),
        "rollout/len_mean": lens.float().mean().item(),
        "rollout/len_max": lens.max().item(),
        "rollout/frac_truncated": truncated.float().mean().item(),
        "rollout/frac_zero_std_groups": (group_std < 1e-6).float().mean().item(),
        "rollout/repetition": dist.mean_over_ranks(repetition_rate(s.completion_ids)),
        **({"curriculum/few_shot_frac": s.few_shot_frac} if run.few_shot.k else {}),
        **epoch_metric(run.task, step * cfg.rollout.prompts_per_step),
        **episode_step_metrics(samples),
        **upd,
        **s.dynamic,
        "time/generate_s": sec["generate"],
        "time/reward_s": sec["reward"],
        "time/ref_s": sec["ref"],
        "time/update_s": sec["update"],
        "perf/tokens_per_s": sampled_tokens / max(sec["generate"], 1e-9),
        "perf/train_tokens_per_s": gen_tokens * cfg.algo.num_iterations / max(sec["update"], 1e-9),
        **flop_rates(run, exp, sec),
    }
    if getattr(run, "harness", None) is not None:  # failed episodes, for the progress line
        errors = dist.gather_objects(scores.extra.get("harness_error") or [])
        episodes = int(metrics.get("dynamic/sampled_groups") or cfg.rollout.prompts_per_step) * G
        metrics.update(harness.step_metrics(metrics, [e for p in errors for e in p], episodes))
    per_completion = exp.advantages is not None and exp.advantages.dim() == 1  # GRPO's
    samples = []
    for p in range(min(cfg.train.log_samples, P)):
        group = slice(p * G, (p + 1) * G)
        samples.append(
            {
                "step": step,
                "prompt": s.samples.prompts[p * G],  # an episode's: its messages after reset
                # what the model saw: chat template, system prompt, few-shot turns applied
                "prompt_rendered": run.models.tokenizer.decode(s.prompt_ids[p]),
                "answer": s.rows[p].get("answer"),
                "completions": completions[group],
                "rewards": scores.total[group].tolist(),
                **scores.sample_fields(group),  # rewards_by_fn, and log_extra columns
                "advantages": exp.advantages[group].tolist() if per_completion else None,
                "finish_reason": finish[group],
            }
        )
    if dist.parallel() and cfg.train.log_samples > P:  # rank 0 holds the first P of them:
        # the rest live on the next ranks (whole, contiguous blocks), as one process logs them
        samples = [x for part in dist.gather_objects(samples) for x in part]
        samples = samples[: cfg.train.log_samples]
    shapes = {
        "prompt_len": max(len(ids) for ids in s.prompt_ids),
        "seq_len": exp.input_ids.shape[1],
        "completion_len": exp.loss_mask.shape[1],
    }
    return StepResult(metrics, samples, shapes, bool(((acc == 0) | (acc == 1)).all()))


def phase_work(run: Run, exp: Experience) -> dict[str, flops.Work]:
    """This rank's model work (``peergrade.monitoring.flops``) per phase of the step on ``exp``: ``gen``,
    ``ref`` (with a reference) and ``update`` (GRPO's, its old-policy pass included; PPO's
    critic is not counted). Generation counts every round dynamic sampling sampled. Empty for
    a model whose config does not give the shapes."""
    try:
        shape = flops.Shape.of(getattr(run.models.policy, "config", {}))
    except ValueError:
        return {}
    G = run.cfg.rollout.group_size
    p, c = flops.split_lengths(exp.attention_mask, exp.loss_mask.shape[1])
    # dynamic sampling generated every round's groups, not only the kept ones
    generated = exp.sampled.generated_lengths or (p, c)
    work = {"gen": flops.generation(shape, *generated, G)}
    if exp.ref_logprobs is not None:
        work["ref"] = flops.logprob_pass(shape, p, c, exp.loss_mask.sum(dim=1), G)
    update_work = getattr(run.algo, "update_work", None)  # GRPO's
    if update_work is not None:
        work["update"] = update_work(exp, shape)
    return work


PHASE_SECONDS = {"gen": "generate", "ref": "ref", "update": "update"}


def flop_rates(run: Run, exp: Experience, sec: dict[str, float]) -> dict[str, float]:
    """``perf/<phase>_tflops``: every rank's model FLOPs of each phase (``phase_work``) per
    second of it, and ``perf/step_tflops``: the phases' work over the step's compute time
    (generate + reward + reference + update), when the update is counted."""
    work = phase_work(run, exp)
    if not work:
        return {}
    total = dist.all_sum(torch.tensor([w.flops for w in work.values()], dtype=torch.float64))
    out = {
        f"perf/{k}_tflops": float(f) / max(sec[PHASE_SECONDS[k]], 1e-9) / 1e12
        for k, f in zip(work, total)
    }
    if "update" in work:
        seconds = sec["generate"] + sec["reward"] + sec["ref"] + sec["update"]
        out["perf/step_tflops"] = float(total.sum()) / max(seconds, 1e-9) / 1e12
    return out


# ----------------------------------------------------------------------------- the loop


def open_run_dir(run: Run, out: RunDir, display, detectors, *, resume: bool, overwrite: bool):
    """Resume into ``out`` or start it (``claimed_run_dir`` made it; ``overwrite`` empties it);
    returns the step to start after."""
    if resume:
        # damaged checkpoints passed over are named in one line, whatever the display
        last = resume_from_checkpoint(
            run, out, say=lambda line: display.print(line, always=True, literal=True)
        )
        detectors.replay(read_jsonl(out.path / "metrics.jsonl"))  # windows continue
        display.print(
            f"resuming {out.path} from {last.name}"
            if last is not None
            else f"resuming {out.path} from step 0 (it stopped before its first checkpoint)"
        )
        return out.last_saved
    if dist.is_main() and overwrite:
        # only now: a failure while loading left the old run intact; the lock file stays
        for p in out.path.iterdir():
            if p.name == ckpt.LOCK_NAME:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    return 0


def bf16_probe(run: Run):
    """A ``precision.Bf16StepProbe`` of the policy when its forwards run under bf16 autocast
    with float32 weights, else None."""
    from peergrade.training.precision import Bf16StepProbe
    from peergrade.training.update import use_bf16_autocast

    policy = run.models.policy
    if not use_bf16_autocast(run.cfg.model.autocast, run.models.device, policy):
        return None
    return Bf16StepProbe(policy)


def evaluate_start(held_out: HeldOut, out: RunDir, display, metrics_log, detectors) -> None:
    """The run header (components.run_header), then the starting model on the held-out split,
    once per run (a resumed run has it)."""
    run = held_out.run
    header = run_header(
        run.cfg,
        run.task,
        run.models.tokenizer,
        run.accuracy,
        run.accuracy_why,
        run.make_env,
        len(held_out.rows),  # what the split holds (0: no evaluation), not train.eval_size
    )
    if run.harness is not None:
        header.append(harness.describe(run))
    precision = autocast_note(run.cfg, run.models.device, run.models.policy)
    header += [precision] if precision else []
    if run.cfg.checkpointing_auto is not None:  # planning.memory.resolve_checkpointing
        on, why = run.cfg.checkpointing_auto
        header.append(f"gradient checkpointing: {'on' if on else 'off'} (auto: {why})")
    for line in header:
        display.print(line, literal=True)
    if not held_out.rows:
        display.print(
            "no held-out split (set data.eval_path or task_options.eval_fraction): "
            "evaluation is skipped",
            always=True,
        )
    if "eval_before" in out.trainer_state:
        return
    if held_out.rows:
        display.print("evaluating the starting model on the held-out split ...")
    before = out.trainer_state["eval_before"] = held_out.evaluate(0)
    if before:
        line = {"step": 0, **{f"eval/{k}": v for k, v in before.items()}}
        metrics_log.write({**line, **detectors.update(line)})


@quiet_hf_progress()  # peergrade's display is the progress, from the CLI or from Python
def train(
    cfg: Config,
    run_dir: Path | str | None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    run: Run | None = None,
    on_log=None,
    resume_hint: str | None = None,
    count_steps=None,
    on_run_dir=None,
) -> dict[str, Any]:
    """Run (or resume) training into ``run_dir``; returns the final summary.

    ``run_dir`` None: a new ``runs/<date>-<time>`` (``-2``, ... when taken). The directory is
    held for the run's life (``checkpoint.claimed_run_dir``): a second writer is refused with
    this process's pid. A non-empty ``run_dir`` is refused unless ``resume`` (continue it) or
    ``overwrite`` (replace it, once everything has loaded). ``run``: one ``setup`` already
    built (the Python API builds it when the trainer is constructed); ``on_log(metrics)`` sees
    every line metrics.jsonl gets; ``resume_hint``: how the caller continues an interrupted run
    (default: the command line); ``count_steps(step)``: the step number the progress line shows
    (the Python API: TRL's optimizer steps, as its log_history); ``on_run_dir(path)``: told the
    run directory once it is held."""
    t = cfg.train
    check_run_conflicts(cfg)  # before the process group, the model and the run directory
    dist.init(cfg)  # under torchrun: join the process group (nothing in one process)
    with ckpt.claimed_run_dir(run_dir, resume=resume, overwrite=overwrite) as (run_dir, swept):
        if on_run_dir is not None:
            on_run_dir(run_dir)
        if dist.is_main():
            for line in swept:
                print(f"checkpoints: {line} (left by an interrupted run)", file=sys.stderr)
        if resume and (done := ckpt.finished_run(run_dir, t.steps)) is not None:
            return done  # a finished run stays as it is
        check_backends(t.report_to)  # a missing logging package fails here, before the model
        dist.barrier()
        run = setup(cfg) if run is None else run
        try:
            return _train_run(
                cfg, run, run_dir, resume, overwrite, on_log, resume_hint, count_steps
            )
        finally:  # the end, an error or Ctrl-C: no harness worker process outlives the run
            harness.close(run)
            close_engine(run)  # nor a vLLM engine (rollout.engine vllm)


def _train_run(cfg, run, run_dir, resume, overwrite, on_log, resume_hint, count_steps):
    """``train``'s steps once the run is built."""
    t = cfg.train
    held_out = HeldOut.of(run)
    out = RunDir(Path(run_dir), to_yaml(cfg), {})
    display_mode = t.display if dist.is_main() else "none"
    kl = cfg.algo.beta > 0  # a reference exists: kl/mean means something on the line
    main = dist.is_main()  # other ranks show nothing, not even the stop line rank 0 prints
    display = Display(display_mode, t.steps, count=count_steps, show_kl=kl, main=main)
    detectors = Detectors(t.alerts, cfg.updates_per_step)
    start_step = open_run_dir(run, out, display, detectors, resume=resume, overwrite=overwrite)
    metrics_log, samples_log = out.open_logs(cfg, resume=resume, on_log=on_log)
    # Ctrl-C / SIGTERM from here on (checkpoint.StopFlag): before the first step and after the
    # last there is nothing a step could add, so the first one stops at once
    stop = ckpt.StopFlag()
    with stop.installed(display):
        stop.immediate = True
        evaluate_start(held_out, out, display, metrics_log, detectors)
        display.close()  # the bar shown while loading/evaluating; a fresh one times the steps
        display = Display(
            display_mode, t.steps, start_step, count=count_steps, show_kl=kl, main=main
        )
        stop.say = display.print
        stop.immediate = False
        again = resume_hint or f"peergrade train --resume {out.path}"
        return _loop(
            run,
            held_out,
            out,
            display,
            metrics_log,
            samples_log,
            detectors,
            stop,
            start_step,
            again,
        )


def _loop(
    run, held_out, out, display, metrics_log, samples_log, detectors, stop, start_step, again
):
    """The steps after ``start_step``, then the final evaluation (``finish``); a stop asked for
    by ``stop`` saves the last step whose update happened (``Run.done``). ``again``: how the
    caller continues an interrupted run (a command, or the Python API's call)."""
    cfg = run.cfg
    t, P = cfg.train, cfg.rollout.prompts_per_step
    if cfg.rollout.dynamic_sampling:  # fill_step's require_one, as the checkpoint left it
        run.informative_seen = out.trainer_state.get("dynamic_informative_seen", False)
    run.done = Done(start_step, None, run.informative_seen)
    rows = itertools.islice(run.task.train_rows(t.seed), start_step * P, None)
    interrupted, t_run, stalled = False, time.perf_counter(), None
    logged = start_step  # the last step whose metrics line is written
    told_unfilled = False
    producer, threads = None, torch.get_num_threads()
    if cfg.rollout.async_steps and start_step < t.steps:  # pipelined: the producer owns `rows`
        producer = start_producer(run, out, rows, start_step, display)
    # the first step's update under bf16 autocast, against the float32 one (detector bf16_update)
    probe = bf16_probe(run) if start_step == 0 else None
    try:
        # a SIGTERM while the starting model was evaluated: stop before the first step
        if dist.any_true(stop.requested):
            raise KeyboardInterrupt
        for step in range(start_step + 1, t.steps + 1):
            t_step = time.perf_counter()
            if producer is None:
                result = train_step(run, step, [next(rows) for _ in range(P)])
            else:
                result = pipelined_step(run, producer, step)
            m = result.metrics
            if probe is not None:
                m.update(probe.metrics())
                probe = None
            if cfg.rollout.dynamic_sampling:
                told_unfilled = note_dynamic(run, out, display, step, m, told_unfilled)
            write_samples(samples_log, result)
            step_metrics(held_out, detectors, display, step, m, t_step)
            with ckpt.critical():
                metrics_log.write(m)
                logged = step
            if not result.all_or_nothing:  # a mean score from now on, not a share correct
                display.partial_scores()
            display.update(step, m)
            if t.save_every and step % t.save_every == 0:
                out.save(run, step, checkpoint_extra(producer, step))
            if dist.any_true(stop.requested):  # all ranks stop after the same step
                interrupted = True
                break
    except KeyboardInterrupt:
        # a second Ctrl-C (or a failure of this rank's peers' stop): the step in flight stops
        # where it is; run.done says whether its update happened
        interrupted = True
    except pipeline.ProducerStalled as e:  # the trainer is fine: keep what it finished
        stalled = e
    except ckpt.StorageError:
        raise
    except OSError as e:  # a log write the disk refused: named, with the last good checkpoint
        refused = storage_error(e, out.path)
        if refused is None:
            raise
        raise refused from None
    finally:
        # (OSError: the disk that refused a write refuses the logs' last flush too)
        with contextlib.suppress(KeyboardInterrupt, OSError), ckpt.critical():
            # a further Ctrl-C waits for the producer to go and the logs to be whole
            if producer is not None:  # Ctrl-C, an error, or the end: no thread outlives the loop
                producer.close(timeout=1.0 if interrupted or stalled else 60.0)
                torch.set_num_threads(threads)
            display.close()
            if interrupted:
                log_interrupted_step(run.done, logged, metrics_log, samples_log)
            samples_log.close()
    summary = end_steps(run, out, display, metrics_log, stop, again, producer, interrupted, stalled)
    if summary is not None:
        return summary
    return final_evaluation(run, held_out, out, display, metrics_log, detectors, stop, again, t_run)


def checkpoint_extra(producer, step: int) -> dict[str, Any] | None:
    """What a checkpoint of step ``step`` adds when pipelined: the policy versions the
    producer's experience came from (``pipeline.VERSIONS_FILE``); None without a producer."""
    if producer is None:
        return None
    return {pipeline.VERSIONS_FILE: producer.checkpoint_versions(step)}


def log_interrupted_step(done: Done, logged: int, metrics_log, samples_log) -> None:
    """After a stop: when the update of step ``done.step`` happened but its metrics line was not
    written (``logged``: the last step whose line is), its samples and its line, marked
    ``interrupted``."""
    if done.result is not None and done.step > logged:
        # interrupted after the update of step done.step, before its line was written
        for sample_row in done.result.samples:
            samples_log.write(sample_row)
        metrics_log.write({**done.result.metrics, "interrupted": True})


def note_dynamic(run: Run, out: RunDir, display, step: int, m: dict, told: bool) -> bool:
    """Dynamic sampling after step ``step`` (metrics ``m``): the checkpoint's state, and once
    (``told``: already) a line when the step could not fill every group; returns ``told``."""
    P = run.cfg.rollout.prompts_per_step
    out.trainer_state["dynamic_informative_seen"] = run.informative_seen
    if m["dynamic/unfilled_groups"] and not told:
        told = True  # once: the metric has every step's count
        display.print(
            f"step {step}: dynamic sampling filled "
            f"{P - int(m['dynamic/unfilled_groups'])} of {P} groups in "
            f"{int(m['dynamic/rounds'])} rounds (rollout.max_rounds); the rest "
            "are groups whose rewards agree (advantage 0). Each step's count: "
            "dynamic/unfilled_groups"
        )
    return told


def write_samples(samples_log, result: StepResult) -> None:
    """The step's logged groups to samples.jsonl, whole, and marked as written."""
    with ckpt.critical():  # the step's groups whole, and marked as written
        for sample_row in result.samples:
            samples_log.write(sample_row)
        result.samples = []


def step_metrics(held_out: HeldOut, detectors, display, step: int, m: dict, t_step: float) -> None:
    """What step ``step``'s metrics ``m`` get after the step: the held-out evaluation when
    ``train.eval_every`` says (not at the last step: ``finish`` evaluates), the step's seconds
    since ``t_step``, and the detectors' alerts."""
    t = held_out.run.cfg.train
    if held_out.rows and t.eval_every and step % t.eval_every == 0 and step != t.steps:
        t_eval = time.perf_counter()
        m.update(held_out.evaluate_logged(step, display))  # and a line on screen
        m["time/eval_s"] = time.perf_counter() - t_eval
    m["time/step_s"] = time.perf_counter() - t_step
    m.update(detectors.update(m))  # alert/<name> keys and their messages


def storage_error(e: OSError, path: Path) -> ckpt.StorageError | None:
    """A log write the disk refused (``e``), named, with the last good checkpoint of the run in
    ``path``; None when ``e`` is no storage problem."""
    problem = ckpt.storage_problem(e, path)
    if problem is None:
        return None
    last = ckpt.latest_checkpoint(path)
    return ckpt.StorageError(
        f"cannot write {str(e.filename or path)!r}: {problem}; "
        + (
            f"the last good checkpoint is {last.name} (intact): make room, then continue "
            f"with: peergrade train --resume {path}"
            if last is not None
            else f"no checkpoint yet: make room, then: peergrade train --resume {path}"
        )
    )


def end_steps(
    run: Run, out: RunDir, display, metrics_log, stop, again, producer, interrupted, stalled
) -> dict[str, Any] | None:
    """After the steps: the last step whose update happened (``Run.done``) saved unless it is;
    then a stalled producer is raised and a stop returns its summary. None: the run goes on to
    the final evaluation."""
    step = run.done.step
    if run.cfg.rollout.dynamic_sampling:
        out.trainer_state["dynamic_informative_seen"] = run.done.informative_seen
    hint = f"continue with: {again}"
    if step > out.last_saved and step > 0:
        try:
            out.save(run, step, checkpoint_extra(producer, step))
        except KeyboardInterrupt:  # a further Ctrl-C during this save: it is given up
            metrics_log.close()
            last = ckpt.latest_checkpoint(out.path)
            display.print(
                f"stopped at step {step} while saving its checkpoint: the save was abandoned; "
                + (
                    f"the last complete checkpoint is {last.name} in {out.path}; {hint}"
                    if last is not None
                    else f"nothing saved in {out.path}; start it again with: {again} (from step 0)"
                ),
                always=True,
            )
            return stopped(stop, last_step(last), out)
    if stalled is not None:
        metrics_log.close()
        raise pipeline.ProducerStalled(
            f"{stalled}; checkpoint saved at step {step} in {out.path}; {hint}"
            if step > 0
            else f"{stalled}; nothing saved in {out.path}"
        ) from None
    if interrupted:
        metrics_log.close()
        display.print(
            f"{stop_name(stop)}: stopped at step {step}; checkpoint saved at step {step} in "
            f"{out.path}; {hint}"
            if step > 0
            else f"{stop_name(stop)} before the first step finished: nothing saved in "
            f"{out.path}; start it again with: {again} (from step 0)"
            + (", or replace it with --overwrite" if again.startswith("peergrade ") else ""),
            always=True,
        )
        return stopped(stop, step, out)
    return None


def final_evaluation(
    run, held_out, out, display, metrics_log, detectors, stop, again, t_run: float
) -> dict[str, Any]:
    """The final evaluation (``finish``) of a run whose steps all ran; a Ctrl-C or SIGTERM stops
    it at once (the last checkpoint is saved: resuming runs it)."""
    step = run.done.step
    stop.immediate = True  # the final evaluation: a Ctrl-C or SIGTERM stops it at once
    try:
        with metrics_log:
            return finish(
                run, held_out, out, display, metrics_log, detectors, time.perf_counter() - t_run
            )
    except KeyboardInterrupt:
        display.print(
            f"{stop_name(stop)} during the final evaluation: checkpoint step-{step} is saved "
            f"in {out.path}; resuming runs the final evaluation: {again}",
            always=True,
        )
        return stopped(stop, step, out)


def stop_name(stop: ckpt.StopFlag) -> str:
    return "SIGTERM" if stop.signal == "SIGTERM" else "interrupted"


def last_step(ckpt_dir: Path | None) -> int:
    return int(ckpt.STEP_RE.match(ckpt_dir.name).group(1)) if ckpt_dir is not None else 0


def stopped(stop: ckpt.StopFlag, step: int, out: RunDir) -> dict[str, Any]:
    """The summary of a run stopped by Ctrl-C or SIGTERM (``signal``: which; the CLI exits
    143 for SIGTERM, 130 for Ctrl-C)."""
    return {
        "interrupted": True,
        "signal": stop.signal or "SIGINT",
        "step": step,
        "run_dir": str(out.path),
    }


def finish(run: Run, held_out: HeldOut, out: RunDir, display, metrics_log, detectors, wall: float):
    """Evaluate the trained model, log it, and print the before/after table."""
    t = run.cfg.train
    summary = {"interrupted": False, "step": t.steps, "run_dir": str(out.path), "wall_s": wall}
    if not held_out.rows:
        display.print(f"run directory: {out.path}   ({wall:.0f} s)")
        return summary
    display.print("evaluating the trained model on the held-out split ...")
    before, after = out.trainer_state["eval_before"], held_out.evaluate(t.steps)
    final = {"step": t.steps, **{f"eval/{k}": v for k, v in after.items()}, "final": True}
    final.update(detectors.update(final))  # the last evaluation can show reward hacking too
    metrics_log.write(final)
    display.show_alerts(t.steps, final)
    results_table(display, before, after, t.eval_samples)
    display.print(f"run directory: {out.path}   ({wall:.0f} s training)")
    return {**summary, "eval_before": before, "eval_after": after}
