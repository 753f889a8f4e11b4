"""The held-out evaluation the trainer runs: ``HeldOut`` (the run's eval rows, scored zero-shot
with the run's sampling settings before, during and after training), ``results_table`` (its
before/after table), the scorer (``held_out_scorer``) and the checks made before the model
loads (``check_reward_columns``), and ``evaluate_config``, the one evaluator ``HeldOut`` and
``peergrade eval`` share (``peergrade.evaluation.evaluate`` with a run's settings).

The scorer: ``train.eval_reward`` when set, else the training reward: the mix's only reward (a
harness run's: what the harness returns), or the first of several (a reward model skipped); a
scorer that is one of the training rewards takes that reward's options. The seed
(``eval_seed``): greedy answers are drawn with ``eval_seed(train.seed)`` and the k samples with
that + 1, whichever path evaluates.

One evaluator, two callers: ``HeldOut`` and ``peergrade eval`` (``cli.evaluate``) both go
through ``evaluate_config`` with the prompts ``components.encode_rows`` makes, so a run's
checkpoint evaluated with ``peergrade eval --model RUN_DIR`` (which reads the run's
config.yaml) gets the same prompts, sampler settings, scorer and seed as the table the run
printed. It takes the trainer's run duck-typed and never imports the trainer; the pass@k math
and the sampling of answers are ``peergrade.evaluation``'s, below this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peergrade import distributed as dist
from peergrade.config import Config
from peergrade.errors import InputError, user_input
from peergrade.evaluation import (
    FORMAT_KEYS,
    TOOL_KEYS,
    AnswerSource,
    EvalOptions,
    answer_format_spec,
    asks_for_answer_tags,
    evaluate,
)
from peergrade.rewards import RewardSpec, TrainerState, make_reward_spec, required_columns
from peergrade.rewards.registry import reward_state
from peergrade.seeds import step_seed

EVAL_SEED_SALT = 99  # peergrade.seeds: the held-out sampling stream


def eval_seed(seed: int) -> int:
    """The held-out sampling seed of a run seeded ``seed`` (greedy; the k samples use + 1)."""
    return step_seed(seed, 0, salt=EVAL_SEED_SALT)


def held_out_scorer(
    task, rewards: list[RewardSpec], name: str | None = None, options: dict | None = None
) -> tuple[RewardSpec, str]:
    """The reward that decides "correct" on held-out problems, and why it was chosen (for the
    run header): ``name`` (``train.eval_reward``: a reward of the mix by its metric name, or any
    reward spec), else the training reward: the only reward of the mix ``rewards`` (a harness
    run's: what the harness returned, ``harness``), or the first of several that is no reward
    model (a classifier's score says nothing of "correct"; all reward models: the first). The
    task's verifier scores only when it is a training reward (its default mix, or named). A
    scorer that is one of the mix's functions keeps that reward's options (e.g. arithmetic with
    extract: last_number) unless ``options`` are given."""
    if name is not None:
        picked = next((s for s in rewards if s.name == name), None)
        why = "train.eval_reward"
        if picked is None:
            with user_input("train.eval_reward"):
                picked = make_reward_spec(name)
    elif rewards:
        from peergrade.rewards.models import RewardModel

        i = next((i for i, s in enumerate(rewards) if not isinstance(s.fn, RewardModel)), 0)
        picked, n = rewards[i], len(rewards)
        why = "the training reward" if n == 1 else f"the first of the {n} training rewards"
        if i > 0:
            why += " that is no reward model"
        if n == 1 and getattr(picked.fn, "__name__", "") == "harness_reward":
            why = "what the harness returns: the training reward"
    else:
        raise InputError(
            f"task {task.name!r} has no reward to score held-out problems with: name one with "
            "--reward (peergrade eval) or train.eval_reward"
        )
    same = next((s for s in rewards if s.fn is picked.fn), None)
    kwargs = dict(options) if options else dict((same or picked).kwargs)
    spec = RewardSpec(name=(same or picked).name, fn=picked.fn, weight=1.0, kwargs=kwargs)
    return spec, why


def check_reward_columns(
    task, specs: list[RewardSpec], scorer: RewardSpec | None = None, provided=()
) -> None:
    """Before the model loads: every column a reward requires (``rewards.required_columns``)
    exists in the task's rows (a dataset file: non-null in every row, named by row).
    ``scorer``, the held-out scorer when it is not one of ``specs``, is named as such;
    ``provided``: columns the trainer passes itself (episodes' ``environments``)."""
    needed: dict[str, list[str]] = {}
    labelled = [(s, s.name) for s in specs]
    if scorer is not None:
        labelled.append((scorer, f"{scorer.name}, the held-out scorer (train.eval_reward)"))
    for spec, label in labelled:
        for column in required_columns(spec):
            if column not in provided:
                needed.setdefault(column, []).append(label)
    if needed:
        with user_input("data"):
            task.check_columns(needed)


def evaluate_config(
    cfg: Config,
    model,
    tokenizer,
    rows: list[dict],
    prompt_ids: list[list[int]],
    acc: RewardSpec,
    *,
    source: AnswerSource | None = None,
    trainer_state: TrainerState | None = None,
    curve: bool = False,
    keep_completions: bool = False,
    train_rewards: tuple[RewardSpec, ...] = (),
) -> dict[str, Any]:
    """``evaluate`` with the run's settings: ``train.eval_samples`` samples per problem drawn
    with the run's own ``SamplerSettings`` (``Config.sampler_settings``: temperature, top-k,
    top-p, stop, length, the episodes' limits) from ``eval_seed(train.seed)``, generated
    ``train.eval_batch_size`` sequences at a time (``Config.eval_generation_batch``: auto = the
    training step's largest generation call, so evaluation never holds more KV cache and
    logits than the step; the draws are keyed, so the numbers do not depend on it);
    ``trainer_state``, ``curve`` and ``keep_completions`` go to ``evaluate``'s
    ``EvalOptions``. With ``source.make_env`` (the run's ``env:``) the answers are episodes and
    ``rows`` episode rows; with ``source.episodes_from`` (an external agent:
    ``training.harness.episode_fn``) its episodes instead of the engine's. ``train_rewards``:
    the training mix to score the same answers with too (``EvalOptions.train_rewards``)."""
    options = EvalOptions(
        k=cfg.train.eval_samples,
        settings=cfg.sampler_settings().replace(batch_size=cfg.eval_generation_batch(dist.world())),
        seed=eval_seed(cfg.train.seed),
        curve=curve,
        keep_completions=keep_completions,
        extra=(answer_format_spec(),) if asks_for_answer_tags(rows) else (),
        trainer_state=trainer_state,
        train_rewards=train_rewards,
    )
    return evaluate(model, tokenizer, rows, prompt_ids, acc, options, source)


#: the training reward's mean on the held-out answers (``held_out_train_rewards``), greedy and
#: sampled, shown beside the scorer's rates
HELD_OUT_TRAIN_KEYS = ("train_reward", "train_reward_sampled")


def held_out_train_rewards(cfg: Config, rewards, scorer: RewardSpec) -> tuple[RewardSpec, ...]:
    """The training rewards a held-out evaluation scores its answers with beside the scorer:
    with ``train.eval_train_reward`` on and ``train.eval_reward`` naming a scorer that is not
    the whole training signal (e.g. a rule beside a judge), the mix's weighted rewards, so
    that the held-out table shows what the training reward (the judge) says of the same
    answers (``train_reward``) and ``reward_vs_eval`` can compare the two; none otherwise (no
    extra reward calls)."""
    if not cfg.train.eval_train_reward or cfg.train.eval_reward is None:
        return ()
    weighted = tuple(s for s in rewards if s.weight != 0)
    if all(s.fn is scorer.fn and s.kwargs == scorer.kwargs for s in weighted):
        return ()  # the held-out score already is the training reward
    return weighted


@dataclass
class HeldOut:
    """The held-out problems (empty for a user dataset without an eval split) and their
    prompt ids; ``evaluate`` scores the current policy on them (zero-shot, always). ``run`` is
    the trainer's (cfg, task, models, accuracy, encode)."""

    run: Any
    rows: list[dict]
    prompt_ids: list[list[int]]

    @classmethod
    def of(cls, run) -> HeldOut:
        n = run.cfg.train.eval_size
        rows = run.task.eval_rows(n) if getattr(run.task, "has_eval", True) else []
        if getattr(run, "make_env", None) is None and getattr(run, "harness", None) is None:
            return cls(run, rows, run.encode(rows))
        from peergrade.training.components import episode_rows

        return cls(run, episode_rows(run.cfg, run.task, rows), [])

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
        # the same evaluator (settings, scorer, seed) as `peergrade eval --model RUN_DIR`
        return evaluate_config(
            cfg,
            policy,
            models.tokenizer,
            self.rows,
            self.prompt_ids,
            self.run.accuracy,
            source=AnswerSource(
                make_env=getattr(self.run, "make_env", None),
                episodes_from=getattr(self.run, "harness_episodes", None),
                engine=getattr(self.run, "engine", None),  # rollout.engine vllm: weights are ours
            ),
            trainer_state=state,
            train_rewards=held_out_train_rewards(cfg, self.run.rewards, self.run.accuracy),
        )

    def evaluate_logged(self, step: int, display) -> dict[str, float]:
        """An evaluation during the run (``train.eval_every``): its ``eval/*`` metrics, shown
        as one line on ``display`` too."""
        result = self.evaluate(step)
        k = result["k"]
        shown = ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS, *TOOL_KEYS)
        shown += HELD_OUT_TRAIN_KEYS
        values = "  ".join(f"{n} {result[n]:.3f}" for n in shown if n in result)
        at = display.count(step) if hasattr(display, "count") else step  # as the progress line
        display.print(f"eval after step {at} ({result['n']} held-out problems): {values}")
        return {f"eval/{key}": v for key, v in result.items()}


def results_table(display, before: dict, after: dict, k: int) -> None:
    """The before/after table of held-out accuracy (``metrics.Display.table``)."""
    names = ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS, *TOOL_KEYS)
    names += HELD_OUT_TRAIN_KEYS
    display.table(
        f"held-out accuracy ({before['n']} problems{', episodes' if TOOL_KEYS[0] in before else ''})",
        ["metric", "before", "after", "change"],
        [
            [n, f"{before[n]:.3f}", f"{after[n]:.3f}", f"{after[n] - before[n]:+.3f}"]
            for n in names
            if n in before and n in after
        ],
    )
