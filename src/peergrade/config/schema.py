"""The root of the config tree, ``Config``: its sections (``config.sections``,
``config.learner``) and the values derived from several keys (batch sizes, updates per step,
whether a reference is needed, ``off_policy_correction``), computed in this one place."""

from __future__ import annotations

import types
from dataclasses import dataclass

from peergrade.config.learner import AlgoConfig, OptimConfig, TrainConfig
from peergrade.config.sections import (
    DataConfig,
    DistConfig,
    EnvConfig,
    HarnessConfig,
    ModelConfig,
    RewardItem,
    RolloutConfig,
    doc,
)


@dataclass
class Config:
    """The whole run configuration."""

    model: ModelConfig = doc("The policy model.", default_factory=ModelConfig)
    data: DataConfig = doc("Prompts: task or dataset.", default_factory=DataConfig)
    rewards: list[RewardItem] = doc(
        "Reward functions with weights; empty = the task's default rewards.", default_factory=list
    )
    rollout: RolloutConfig = doc("Sampling.", default_factory=RolloutConfig)
    algo: AlgoConfig = doc("Loss and advantages.", default_factory=AlgoConfig)
    optim: OptimConfig = doc("Optimizer and batching.", default_factory=OptimConfig)
    train: TrainConfig = doc("Loop, evaluation, checkpoints.", default_factory=TrainConfig)
    dist: DistConfig = doc(
        "Several processes under torchrun (see docs/scaling.md).", default_factory=DistConfig
    )
    env: EnvConfig = doc(
        "Tools and environments: multi-turn episodes (see docs/environments.md).",
        default_factory=EnvConfig,
    )
    harness: HarnessConfig = doc(
        "An external agent as the episode source (see docs/serving.md).",
        default_factory=HarnessConfig,
    )

    #: not a config key: the relative paths as typed, by key (``data.path``, ``rewards[0].name``),
    #: whose absolute form the fields hold (set by ``load_config``, written as YAML comments)
    given_paths = types.MappingProxyType({})
    #: not a config key: ``model.gradient_checkpointing: auto`` as decided for this run, (on,
    #: why), set by ``planning.memory.resolve_checkpointing`` before the trainer's setup
    checkpointing_auto = None

    # ---- derived values: the one place each is computed (trainer, ppo, memory, validate)

    def sampler_settings(self):
        """The one ``generation.SamplerSettings`` of this config (``rollout`` and, for episodes,
        ``env``): training samples with it, held-out evaluation with its greedy variant and with
        ``n = train.eval_samples``, so no path forwards a setting one by one."""
        from peergrade.generation.record import SamplerSettings  # torch: not for `peergrade config`

        r, e = self.rollout, self.env
        return SamplerSettings(
            n=r.group_size,
            max_new_tokens=r.max_completion_length,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop=tuple(r.stop),
            batch_size=r.generation_batch_size,
            max_turns=e.max_turns,
            max_tokens_per_turn=e.max_tokens_per_turn,
            env_timeout_s=e.timeout_s,
        )

    def generation_rounds(self) -> int:
        """Rounds of ``batch_size`` sequences one generation call of a step samples at most
        (dynamic sampling with ``rollout.rounds_ahead``: max_rounds - 1; else 1)."""
        r = self.rollout
        return max(1, r.max_rounds - 1) if r.dynamic_sampling and r.rounds_ahead else 1

    def step_generation_batch(self, world: int = 1) -> int:
        """Sequences the largest generation call of a training step holds at once, per rank:
        the step's batch (times ``generation_rounds``) cut to ``rollout.generation_batch_size``."""
        rows = self.batch_size // max(1, world) * self.generation_rounds()
        return min(rows, self.rollout.generation_batch_size or rows)

    def eval_generation_batch(self, world: int = 1) -> int:
        """``train.eval_batch_size`` resolved: the int as set, or (auto) the step's largest
        generation call (``step_generation_batch``), never more than the sampled pass holds."""
        t = self.train
        if t.eval_batch_size != "auto":
            return t.eval_batch_size
        return max(1, min(self.step_generation_batch(world), t.eval_size * t.eval_samples))

    @property
    def batch_size(self) -> int:
        """N = rollout.prompts_per_step * rollout.group_size completions per step."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def minibatch_size(self) -> int:
        """Completions per optimizer step: optim.minibatch_size, or the whole batch."""
        mb = self.optim.minibatch_size
        return self.batch_size if mb is None else mb

    @property
    def micro_batch_size(self) -> int:
        """Completions per forward/backward: optim.micro_batch_size, at most a minibatch."""
        return min(self.optim.micro_batch_size, self.minibatch_size)

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per training step: mu passes x minibatches per pass."""
        return self.algo.num_iterations * (self.batch_size // max(1, self.minibatch_size))

    @property
    def uses_reference(self) -> bool:
        """A KL term toward a reference policy (algo.beta > 0) needs reference log-probs."""
        return self.algo.beta > 0

    def gradient_checkpointing_on(self, device_type: str) -> bool:
        """model.gradient_checkpointing resolved: true/false as set; auto as the memory planner
        decided it (``checkpointing_auto``, set by ``planning.memory.resolve_checkpointing``);
        null, and auto not decided, on for GPUs, off for the CPU."""
        gc = self.model.gradient_checkpointing
        if gc == "auto" and self.checkpointing_auto is not None:
            return self.checkpointing_auto[0]
        return device_type == "cuda" if gc in (None, "auto") else gc


def off_policy_correction(cfg: Config) -> str:
    """``algo.off_policy_correction`` as the update applies it: ``auto`` is ``token_tis`` with
    pipelined rollouts (GRPO, ``rollout.async_steps`` >= 1), else ``none``. Stale samples trained
    as if on-policy learn worse (docs/async.md: the demo, seed 1, k = 1: 0.62 held-out greedy
    without a correction, 0.89 with token_tis, 0.89 synchronous)."""
    c = cfg.algo.off_policy_correction
    if c != "auto":
        return c
    return "token_tis" if cfg.rollout.async_steps >= 1 and cfg.algo.name == "grpo" else "none"
