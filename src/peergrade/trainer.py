"""The training loop, top to bottom: ``setup`` builds a run, ``train_step`` is one step, ``train``
loops over steps and finishes with the held-out table.

One step (``train_step``; the loop and ``peergrade memory`` both call it):
  P prompts (with solved example turns early on when ``data.few_shot`` is set)
  -> G completions each (``rollout.generate``) -> rewards (weighted reward functions)
  -> advantages: group-relative (``algo.group_advantages``), or PPO's critic + GAE
  -> reference log-probs (beta > 0)
  -> mu passes of minibatch updates (``update.grpo_update`` / ``ppo.ppo_update``)
  -> metrics and sampled completions, which the loop logs, then evaluation and checkpoints.

Exact resume: everything random is derived from (seed, step) (``peergrade.seeds``) -- the
prompts of step s are rows [s*P, (s+1)*P) of the task's seeded stream, the sampling seed of
step s is a function of (seed, step), minibatch shuffles and the global random/numpy generators
that reward functions may use likewise -- so a run resumed from
``checkpoints/step-s`` (model, optimizer, scheduler, RNG states) produces the same metrics and
weights as one never stopped.

Under torchrun (``peergrade.distributed``) the same loop runs on every rank: ``train_step``
keeps this rank's whole groups of the step's P prompts, batch statistics and metrics span every
rank, and rank 0 alone writes logs and checkpoints. In one process every ``dist.*`` call is the
identity.

This module does not implement the math (``algo``), the update (``update``, ``ppo``), the
sampler (``rollout``), log-probs and loading (``logprobs``, ``models``), rewards or tasks.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peergrade import checkpoint as ckpt
from peergrade import distributed as dist
from peergrade import ppo
from peergrade.algo import group_advantages
from peergrade.audit import at_startup as audit_at_startup
from peergrade.config import Config, to_yaml
from peergrade.detectors import Detectors, repetition_rate
from peergrade.errors import InputError, user_input
from peergrade.evaluation import (
    FORMAT_KEYS,
    accuracy_spec,
    answer_format_spec,
    asks_for_answer_tags,
    evaluate,
    reward_state,
)
from peergrade.metrics import (
    Display,
    JsonlWriter,
    MetricLogger,
    check_backends,
    quiet_hf_progress,
    read_jsonl,
)
from peergrade.models import (
    apply_lora,
    load_model,
    load_tokenizer,
    prepare_model,
    prepare_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from peergrade.reward_models import reward_or_model
from peergrade.rewards import RewardSpec, columns_for, make_reward_specs, score_rewards
from peergrade.rollout import Rollout, generate
from peergrade.seeds import step_seed
from peergrade.tasks import load_task
from peergrade.tasks.curriculum import FewShot
from peergrade.tasks.prompts import encode_prompts
from peergrade.update import (
    Models,
    autocast,
    build_optimizer,
    build_scheduler,
    grpo_update,
    ref_logprobs,
)

# ----------------------------------------------------------------------------- setup


def build_task(cfg: Config):
    d = cfg.data
    with user_input("data"):
        if d.path is not None:
            return load_task(
                "file", path=d.path, eval_path=d.eval_path, columns=d.columns, **d.task_options
            )
        return load_task(d.task, **d.task_options)


def build_rewards(cfg: Config, task, fns: list | None = None) -> list[RewardSpec]:
    """The configured reward mix, or the task's default rewards when none is configured.
    ``fns`` (aligned with ``cfg.rewards``): a callable there is used instead of resolving that
    item's name (the Python API's in-memory reward functions)."""
    fns = fns or [None] * len(cfg.rewards)
    with user_input("rewards"):
        if cfg.rewards:
            # a directory is a reward model (loaded on the training device), else a function
            device = resolve_device(cfg.model.device)
            dtype = resolve_dtype(cfg.model.dtype, device)
            items = [
                (
                    reward_or_model(i.name, device=device, dtype=dtype) if fn is None else fn,
                    i.weight,
                    i.kwargs,
                    i.display_name,
                )
                for i, fn in zip(cfg.rewards, fns)
            ]
        else:
            items = [(name, w, {}, None) for name, w in task.default_rewards]
        specs = make_reward_specs(items)
    if not specs:
        raise InputError(
            f"task {task.name!r} has no default reward: name one with --reward or `rewards:`"
        )
    return specs


def build_few_shot(cfg: Config, task) -> FewShot:
    d = cfg.data
    return FewShot(d.few_shot, d.few_shot_fade_steps, d.few_shot_answer, task, cfg.train.seed)


def encode_rows(cfg: Config, task, tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of the rows' prompts as the model sees them (system prompt, chat template)."""
    d = cfg.data
    return encode_prompts(
        rows,
        tokenizer,
        system_prompt=d.system_prompt or task.system_prompt,
        use_chat_template=d.use_chat_template,
        max_prompt_length=d.max_prompt_length,
    )


def setup_models(cfg: Config, policy=None, tokenizer=None) -> Models:
    """Policy and tokenizer; the reference when beta > 0 (the disabled adapter under LoRA).
    A ``policy`` (and ``tokenizer``) object given by a Python caller is used as it is, in its
    own dtype, instead of loading ``model.path``."""
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    path = resolve_model_path(cfg.model.path)
    gc = cfg.gradient_checkpointing_on(device.type)
    if policy is None:
        tokenizer = load_tokenizer(path)
        policy = load_model(path, dtype=dtype, device=str(device), gradient_checkpointing=gc)
    else:
        tokenizer = prepare_tokenizer(tokenizer) if tokenizer is not None else load_tokenizer(path)
        policy = prepare_model(policy, device=device, gradient_checkpointing=gc)
    reference = None
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        policy = apply_lora(
            policy, r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules
        )
        if cfg.uses_reference:
            reference = "adapter"
    elif cfg.uses_reference and cfg.model.ref_offload and device.type != "cpu":
        # loaded straight into host memory: never two copies on the device
        reference = load_model(path, dtype=dtype, device="cpu").eval().requires_grad_(False)
    elif cfg.uses_reference:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    # FSDP2 under torchrun shards both (before the optimizer sees the parameters)
    return Models(dist.prepare(policy), tokenizer, dist.prepare(reference), device)


@dataclass
class Run:
    """Everything one training run holds between steps."""

    cfg: Config
    task: Any
    rewards: list[RewardSpec]
    accuracy: RewardSpec  # the task's verifier (with its options if configured), or rewards[0]
    accuracy_in_mix: bool  # the verifier is one of the rewards: reuse its scores
    few_shot: FewShot
    models: Models
    optimizer: Any
    scheduler: Any
    critic: ppo.Critic | None  # PPO only

    @property
    def optimizer_state(self):
        """What a checkpoint saves as the optimizer (PPO's also carries the critic)."""
        if self.critic is None:
            return self.optimizer
        return ppo.CriticCheckpointState(self.optimizer, self.critic)

    def encode(self, rows: list[dict]) -> list[list[int]]:
        return encode_rows(self.cfg, self.task, self.models.tokenizer, rows)


@dataclass
class Given:
    """Objects a Python caller (``peergrade.api``) hands over instead of names in the config;
    each one left ``None`` is built from the config."""

    task: Any = None  # a Task, e.g. in-memory rows (tasks.files.FileTask(data=...))
    reward_fns: list | None = None  # aligned with cfg.rewards: a callable replaces that name
    policy: Any = None  # a loaded PreTrainedModel (model.path then only names it)
    tokenizer: Any = None


def setup(cfg: Config, given: Given | None = None) -> Run:
    """Task, rewards and curriculum (cheap, checked first), then models and optimizers."""
    given = given or Given()
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    ckpt.seed_step_rngs(step_seed(t.seed, 0, salt=REWARD_RNG_SALT))  # the evaluation before step 1
    task = given.task if given.task is not None else build_task(cfg)
    rewards = build_rewards(cfg, task, given.reward_fns)
    audit_at_startup(cfg, task, rewards, show=dist.is_main())  # train.audit_rewards, no model yet
    few_shot = build_few_shot(cfg, task)
    acc = accuracy_spec(task) if task.default_rewards else rewards[0]
    # the verifier as the recipe configures it (e.g. arithmetic with extract: last_number)
    acc = next((s for s in rewards if s.name == acc.name and s.fn is acc.fn), acc)
    in_mix = any(s.name == acc.name and s.fn is acc.fn and s.kwargs == acc.kwargs for s in rewards)
    models = setup_models(cfg, given.policy, given.tokenizer)
    trainable = (p for p in models.policy.parameters() if p.requires_grad)
    optimizer = build_optimizer(trainable, cfg.optim)
    # PPO: a critic (value model + its AdamW), the memory GRPO does without.
    critic = ppo.build_critic(cfg, models) if cfg.algo.name == "ppo" else None
    return Run(
        cfg,
        task,
        rewards,
        acc,
        in_mix,
        few_shot,
        models,
        optimizer,
        build_scheduler(optimizer, cfg),
        critic,
    )


# ----------------------------------------------------------------------------- one step

REWARD_RNG_SALT = 1000  # peergrade.seeds: the stream of the global random/numpy generators


def sample(run: Run, prompt_ids: list[list[int]], step: int) -> Rollout:
    """G completions for each prompt with the configured sampling settings, seeded by step."""
    r = run.cfg.rollout
    with dist.full_weights(run.models.policy) as policy:  # FSDP2: unsharded for sampling
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
            seed=dist.rank_seed(step_seed(run.cfg.train.seed, step)),
            batch_size=r.generation_batch_size,
        )


def score(run: Run, step: int, rows: list[dict], rollout: Rollout, completion_ids: list[list[int]]):
    """Every reward function on every completion (TRL's contract: the dataset columns,
    ``completion_ids``, ``trainer_state`` at this step), and the accuracy verifier's scores."""
    cfg = run.cfg
    G = cfg.rollout.group_size
    prompts = [row["prompt"] for row in rows for _ in range(G)]
    columns = {**columns_for(rows, G), "completion_ids": completion_ids}
    texts = rollout.completion_text
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


class NoMeter:
    """The phase meter of a plain training step: measures nothing (see ``peergrade.memory``)."""

    def reset(self) -> None:
        pass

    def record(self, phase: str) -> None:
        pass


@dataclass
class StepResult:
    metrics: dict[str, Any]
    samples: list[dict] = field(default_factory=list)  # the logged groups (train.log_samples)
    shapes: dict[str, int] = field(default_factory=dict)  # prompt/sequence/completion lengths


NO_METER = NoMeter()


def train_step(run: Run, step: int, rows: list[dict], meter=NO_METER) -> StepResult:
    """One step on ``rows`` (P prompts): sample, score, advantages, reference, update.
    ``meter`` brackets the generate / rewards / reference / update phases (``peergrade memory``)."""
    cfg, models = run.cfg, run.models
    P, G = len(rows), cfg.rollout.group_size
    # Python's random and numpy's global generator, which reward functions may use (a stream
    # per rank under torchrun; rank 0's is the single-process one)
    ckpt.seed_step_rngs(dist.rank_seed(step_seed(cfg.train.seed, step, salt=REWARD_RNG_SALT)))
    device = models.device
    t_start = time.perf_counter()
    rows, few_shot_frac = run.few_shot.apply(rows, step)
    rows = dist.shard_rows(rows)  # under torchrun: this rank's P / world whole prompts
    P = len(rows)
    prompt_ids = run.encode(rows)

    # 1. sample G completions per prompt
    meter.reset()
    with autocast(cfg, device, models.policy):  # model.autocast: bf16 rollouts where it pays
        rollout = sample(run, prompt_ids, step)
    meter.record("generate")
    t_generated = time.perf_counter()

    # 2. score them (a reward model's forward is the memory here)
    completion_ids = rollout.completion_id_lists()  # the counted tokens of each completion
    meter.reset()
    scores, acc_values = score(run, step, rows, rollout, completion_ids)
    meter.record("rewards")
    rewards = scores.total.view(P, G).to(torch.float32)  # [P, G]
    t_scored = time.perf_counter()

    # 3. the training batch; DAPO's overlong filtering masks truncated completions out
    input_ids, attention_mask, cmask = rollout.training_batch(models.tokenizer.pad_token_id)
    truncated = torch.tensor([f == "length" for f in rollout.finish_reason])  # [N]
    if cfg.algo.mask_truncated_completions:
        cmask = cmask * (~truncated).unsqueeze(1).to(cmask.dtype)
    batch = (input_ids.to(device), attention_mask.to(device), cmask.to(device))

    # 4. reference log-probs for the KL term; advantages
    meter.reset()
    ref_lp = ref_logprobs(models, batch, cfg)  # [N, C] or None
    if run.critic is None:  # GRPO: one group-relative advantage per completion
        a = cfg.algo
        # over every rank's groups ([P_global, G]; batch scaling needs them all), then ours
        adv = group_advantages(
            dist.gather_rows(rewards), scale=a.advantage_scale, baseline=a.advantage_baseline
        )
        adv = dist.local_rows(adv).reshape(P * G).to(device)  # [N]
        ppo_out = None
    else:  # PPO: token-level GAE advantages from the critic
        ppo_out = ppo.ppo_advantages(run.critic, models, batch, scores.total, ref_lp, cfg)
    meter.record("reference")
    t_ref = time.perf_counter()

    # 5. policy update
    meter.reset()
    if ppo_out is None:
        upd = grpo_update(models, run.optimizer, run.scheduler, batch, adv, ref_lp, cfg, step)
    else:
        upd = ppo_out["metrics"] | ppo.ppo_update(
            models,
            run.critic,
            run.optimizer,
            run.scheduler,
            batch,
            ppo_out["advantages"],
            ppo_out["returns"],
            ppo_out["old_values"],
            ppo_out["old_logp"],
            ref_lp,
            cfg,
            step,
        )
    meter.record("update")
    t_updated = time.perf_counter()

    # 6. metrics (over every rank's rows under torchrun) and sampled groups
    g = dist.gather_rows
    gen_tokens = dist.sum_int(rollout.num_generated_tokens)
    lens = g(rollout.completion_mask.sum(dim=1))  # [N]
    group_std = torch.nan_to_num(g(rewards), nan=0.0).std(dim=1)  # [P]
    all_scores, truncated = dist.gather_scores(scores), g(truncated)
    metrics = {
        "step": step,
        **all_scores.metrics(),
        "reward/accuracy": g(acc_values).nan_to_num(0.0).mean().item(),
        "rollout/len_mean": lens.float().mean().item(),
        "rollout/len_max": lens.max().item(),
        "rollout/frac_truncated": truncated.float().mean().item(),
        "rollout/frac_zero_std_groups": (group_std < 1e-6).float().mean().item(),
        "rollout/repetition": dist.mean_over_ranks(repetition_rate(completion_ids)),
        **({"advantage/std": g(adv).std().item()} if ppo_out is None else {}),
        **({"curriculum/few_shot_frac": few_shot_frac} if run.few_shot.k else {}),
        **upd,
        "time/generate_s": t_generated - t_start,
        "time/reward_s": t_scored - t_generated,
        "time/ref_s": t_ref - t_scored,
        "time/update_s": t_updated - t_ref,
        "perf/tokens_per_s": gen_tokens / max(t_generated - t_start, 1e-9),
        "perf/train_tokens_per_s": gen_tokens
        * cfg.algo.num_iterations
        / max(t_updated - t_ref, 1e-9),
    }
    samples = []
    for p in range(min(cfg.train.log_samples, P)):
        group = slice(p * G, (p + 1) * G)
        samples.append(
            {
                "step": step,
                "prompt": rows[p]["prompt"],
                "answer": rows[p].get("answer"),
                "completions": rollout.completion_text[group],
                "rewards": scores.total[group].tolist(),
                **scores.sample_fields(group),  # rewards_by_fn, and log_extra columns
                "advantages": (adv[group].tolist() if ppo_out is None else None),
                "finish_reason": rollout.finish_reason[group],
            }
        )
    shapes = {
        "prompt_len": max(len(ids) for ids in prompt_ids),
        "seq_len": input_ids.shape[1],
        "completion_len": cmask.shape[1],
    }
    return StepResult(metrics, samples, shapes)


# ----------------------------------------------------------------------------- evaluation


@dataclass
class HeldOut:
    """The held-out problems (empty for a user dataset without an eval split) and their
    prompt ids; ``evaluate`` scores the current policy on them (zero-shot, always)."""

    run: Run
    rows: list[dict]
    prompt_ids: list[list[int]]

    @classmethod
    def of(cls, run: Run) -> HeldOut:
        n = run.cfg.train.eval_size
        rows = run.task.eval_rows(n) if getattr(run.task, "has_eval", True) else []
        return cls(run, rows, run.encode(rows))

    def evaluate(self, after_step: int) -> dict[str, float] | None:
        """Scores after ``after_step`` training steps (reward functions see that global_step)."""
        if not self.rows:
            return None
        # Under torchrun every rank evaluates the same rows (rank 0 logs); FSDP2 unshards.
        with dist.full_weights(self.run.models.policy) as policy:
            return self._evaluate(policy, after_step)

    def _evaluate(self, policy, after_step: int) -> dict[str, float]:
        cfg, models = self.run.cfg, self.run.models
        r = cfg.rollout
        state = reward_state(
            self.run.task, after_step + 1, cfg.train.steps, r.prompts_per_step, r.group_size
        )
        return evaluate(
            policy,
            models.tokenizer,
            self.rows,
            self.prompt_ids,
            self.run.accuracy,
            k=cfg.train.eval_samples,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_completion_length,
            seed=step_seed(cfg.train.seed, 0, salt=99),
            batch_size=r.generation_batch_size,
            stop=r.stop,
            extra=[answer_format_spec()] if asks_for_answer_tags(self.rows) else [],
            trainer_state=state,
        )


def results_table(display: Display, before: dict, after: dict, k: int) -> None:
    names = ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS)
    display.table(
        f"held-out accuracy ({before['n']} problems)",
        ["metric", "before", "after", "change"],
        [
            [n, f"{before[n]:.3f}", f"{after[n]:.3f}", f"{after[n] - before[n]:+.3f}"]
            for n in names
            if n in before and n in after
        ],
    )


# ----------------------------------------------------------------------------- run directory


class _StopFlag:
    """First Ctrl-C: finish the current step, save, exit. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False

    @contextmanager
    def installed(self, display):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            display.print(
                "[interrupt] finishing this step, saving a checkpoint, then exiting "
                "(Ctrl-C again to stop at once)"
            )

        try:
            old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, old)


@dataclass
class RunDir:
    """The run directory: config, logs, checkpoints. ``trainer_state`` is what a checkpoint
    carries besides weights and optimizer (the starting model's evaluation)."""

    path: Path
    config_yaml: str
    trainer_state: dict[str, Any]
    last_saved: int = -1

    def open_logs(self, cfg: Config, *, resume: bool):
        """metrics.jsonl plus the ``train.report_to`` backends; samples.jsonl (rank 0 alone
        writes: the other ranks get writers that write nothing)."""
        if not dist.is_main():
            return dist.NullWriter(), dist.NullWriter()
        ckpt.atomic_write_text(self.path / "config.yaml", self.config_yaml)
        metrics = MetricLogger(
            self.path,
            cfg.train.report_to,
            project=cfg.train.project,
            config=dataclasses.asdict(cfg),
            resume=resume,
            start_step=max(self.last_saved, 0),
        )
        return metrics, JsonlWriter(self.path / "samples.jsonl")

    def save(self, run: Run, step: int) -> None:
        # FSDP2: gathering the full weights and optimizer state is a collective (all ranks)
        model, optimizer = dist.checkpoint_state(run.models.policy, run.optimizer_state)
        if dist.is_main():
            ckpt.save_checkpoint(
                self.path,
                step,
                model=model,
                tokenizer=run.models.tokenizer,
                optimizer=optimizer,
                scheduler=run.scheduler,
                trainer_state=self.trainer_state,
                config_yaml=self.config_yaml,
                keep_last=run.cfg.train.keep_last,
            )
        dist.barrier()  # the others wait until the checkpoint is complete
        self.last_saved = step


def resume_from_checkpoint(run: Run, run_dir: RunDir) -> Path | None:
    """Load the last checkpoint of ``run_dir`` into ``run`` and return it; ``run_dir.last_saved``
    is its step. Logs past that step (written after the checkpoint, before the stop) are cut.
    A run stopped before its first checkpoint starts again from step 0 (None): its logs are
    cut whole, the starting model's evaluation included."""
    last = ckpt.latest_checkpoint(run_dir.path)
    if last is None:
        if dist.is_main():
            for name in ("metrics.jsonl", "samples.jsonl"):
                ckpt.truncate_jsonl(run_dir.path / name, -1)
        run_dir.last_saved = 0
        return None
    run_dir.trainer_state.update(ckpt.read_trainer_state(last))
    step = run_dir.trainer_state.pop("step")
    device = run.models.device
    loaded = load_model(
        str(last), dtype=resolve_dtype(run.cfg.model.dtype, device), device=str(device)
    )
    dist.load_weights(run.models.policy, loaded.state_dict())
    del loaded
    training = ckpt.load_training_state(last)
    dist.load_optimizer(run.models.policy, run.optimizer_state, training["optimizer"])
    run.scheduler.load_state_dict(training["scheduler"])
    ckpt.set_rng_state(training["rng"])
    if dist.is_main():
        for name in ("metrics.jsonl", "samples.jsonl"):
            ckpt.truncate_jsonl(run_dir.path / name, step)
    run_dir.last_saved = step
    return last


# ----------------------------------------------------------------------------- the loop


@quiet_hf_progress()  # peergrade's display is the progress, from the CLI or from Python
def train(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    run: Run | None = None,
    on_log=None,
) -> dict[str, Any]:
    """Run (or resume) training into ``run_dir``; returns the final summary.

    A non-empty ``run_dir`` is refused unless ``resume`` (continue it) or ``overwrite`` (replace
    it, once everything has loaded). ``run``: one ``setup`` already built (the Python API builds
    it when the trainer is constructed); ``on_log(metrics)`` sees every line metrics.jsonl gets."""
    t, P = cfg.train, cfg.rollout.prompts_per_step
    dist.init(cfg)  # under torchrun: join the process group (nothing in one process)
    ckpt.check_run_dir(Path(run_dir), resume=resume, overwrite=overwrite)
    if resume:  # a finished run stays as it is: nothing is loaded, evaluated or written
        done, finished = ckpt.resume_point(Path(run_dir))
        if done > t.steps:
            raise ckpt.RunDirError(
                f"cannot resume: {str(run_dir)!r} is at step {done}, past train.steps "
                f"{t.steps}; to train further pass --train.steps N with N > {done}"
            )
        if done == t.steps and finished:
            if dist.is_main():
                print(
                    f"{run_dir} is finished (step {done} of {t.steps}, final evaluation "
                    "done): nothing to do. To train further: peergrade train --resume "
                    f"{run_dir} --train.steps N (N > {t.steps})",
                    flush=True,
                )
            return {"interrupted": False, "finished": True, "step": done, "run_dir": str(run_dir)}
    check_backends(t.report_to)  # a missing logging package fails here, before the model loads
    dist.barrier()  # every rank has checked the run dir before rank 0 creates it
    run = setup(cfg) if run is None else run
    held_out = HeldOut.of(run)
    out = RunDir(Path(run_dir), to_yaml(cfg), {})
    display_mode = t.display if dist.is_main() else "none"
    display = Display(display_mode, t.steps)
    detectors = Detectors(t.alerts, cfg.updates_per_step)
    start_step = 0
    if resume:
        last = resume_from_checkpoint(run, out)
        start_step = out.last_saved
        detectors.replay(read_jsonl(out.path / "metrics.jsonl"))  # windows continue
        display.print(
            f"resuming {out.path} from {last.name}"
            if last is not None
            else f"resuming {out.path} from step 0 (it stopped before its first checkpoint)"
        )
    elif dist.is_main():
        if overwrite and out.path.exists():
            shutil.rmtree(out.path)  # only now: a failure while loading left the old run intact
        out.path.mkdir(parents=True, exist_ok=True)
    metrics_log, samples_log = out.open_logs(cfg, resume=resume)
    if on_log is not None:
        metrics_log = _Tee(metrics_log, on_log)
    if not held_out.rows:
        display.print(
            "no held-out split (set data.eval_path or task_options.eval_fraction): "
            "evaluation is skipped",
            always=True,
        )
    if "eval_before" not in out.trainer_state:
        if held_out.rows:
            display.print("evaluating the starting model on the held-out split ...")
        before = out.trainer_state["eval_before"] = held_out.evaluate(0)
        if before:
            line = {"step": 0, **{f"eval/{k}": v for k, v in before.items()}}
            metrics_log.write({**line, **detectors.update(line)})
    display.close()  # the bar shown while loading/evaluating; a fresh one times the steps
    display = Display(display_mode, t.steps, start_step)

    rows = itertools.islice(run.task.train_rows(t.seed), start_step * P, None)
    stop, step, interrupted, t_run = _StopFlag(), start_step, False, time.perf_counter()
    try:
        with stop.installed(display):
            for step in range(start_step + 1, t.steps + 1):
                t_step = time.perf_counter()
                result = train_step(run, step, [next(rows) for _ in range(P)])
                m = result.metrics
                for sample_row in result.samples:
                    samples_log.write(sample_row)
                if held_out.rows and t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    m.update({f"eval/{k}": v for k, v in held_out.evaluate(step).items()})
                m["time/step_s"] = time.perf_counter() - t_step
                m.update(detectors.update(m))  # alert/<name> keys and their messages
                metrics_log.write(m)
                display.update(step, m)
                if t.save_every and step % t.save_every == 0:
                    out.save(run, step)
                if dist.any_true(stop.requested):  # all ranks stop after the same step
                    interrupted = True
                    break
    except KeyboardInterrupt:
        interrupted = True
        step -= 1  # the step in flight did not finish; the last complete one is saved below
    finally:
        display.close()
        samples_log.close()
    if step > out.last_saved and step > 0:
        out.save(run, step)
    if interrupted:
        metrics_log.close()
        display.print(
            f"interrupted: checkpoint saved at step {step} in {out.path}; "
            f"continue with: peergrade train --resume {out.path}"
            if step > 0
            else f"interrupted before the first step finished: nothing saved in {out.path}; "
            f"start it again with: peergrade train --resume {out.path} (from step 0), or "
            "replace it with --overwrite",
            always=True,
        )
        return {"interrupted": True, "step": step, "run_dir": str(out.path)}
    with metrics_log:
        return finish(
            run, held_out, out, display, metrics_log, detectors, time.perf_counter() - t_run
        )


class _Tee:
    """A metrics log that also hands every line to a caller's ``on_log``."""

    def __init__(self, log, on_log):
        self.log, self.on_log = log, on_log

    def write(self, line: dict) -> None:
        self.log.write(line)
        self.on_log(dict(line))

    def close(self) -> None:
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
