"""The config tree's sections for the learner: ``algo`` (the loss, advantages, off-policy
correction, PPO's critic, distillation), ``optim`` (optimizer and batching) and ``train`` (the
loop, evaluation, checkpoints, and its ``alerts``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peergrade.config.sections import doc


@dataclass
class AlgoConfig:
    name: Literal["grpo", "ppo"] = doc(
        "Algorithm: grpo (group-relative advantages, no critic) or ppo (a learned critic, "
        "token-level GAE advantages; the memory baseline GRPO is measured against).",
        "grpo",
    )
    loss_type: str = doc(
        "Loss aggregation / variant: grpo (per-sequence mean), bnpo (token mean over the "
        "micro-batch), dr_grpo (sum / (B * max_completion_length)), dapo (token mean over the "
        "global batch), cispo (clipped IS-weight policy gradient, token mean over the global batch), "
        "sapo (SAPO: a smooth sigmoid gate of the ratio instead of the clip, per-sequence mean; "
        "sapo_temperature_*), luspo (LUSPO: the clipped surrogate summed over each sequence's "
        "tokens, mean over sequences; use with ratio_level sequence), vespo (VESPO: REINFORCE "
        "weighted by a detached Gamma function of the sequence ratio, token mean over the global "
        "batch; vespo_*); or a name given to peergrade.register_loss in the same process (checked "
        "when the trainer starts). Formulas: docs/algorithms.md.",
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
        "reverse KL on the sampled token (tinker-cookbook's distillation recipe), or with "
        "teacher_divergence top_k a divergence over the teacher's top-k tokens "
        "(docs/algorithms.md). null = off (plain GRPO).",
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
    teacher_divergence: Literal["sampled", "top_k"] = doc(
        "On-policy distillation: the teacher's signal. sampled = the per-token advantage "
        "teacher_coef * (log p_teacher - log p_student) on each sampled token (tinker-cookbook); "
        "top_k = a loss term, teacher_coef x the token mean of the generalized JSD (TRL's "
        "DistillationTrainer: teacher_beta) between the student's and the teacher's next-token "
        "distributions over the teacher's teacher_loss_top_k most likely tokens (plus the tail) "
        "at every sampled position; the advantages are then teacher_verifier_weight x GRPO's. "
        "docs/algorithms.md#on-policy-distillation-algoteacher_path-algoteacher_url.",
        "sampled",
    )
    teacher_beta: float = doc(
        "teacher_divergence top_k: TRL's beta, in [0, 1]: 0 = forward KL(teacher || student), "
        "1 = reverse KL(student || teacher), between = the generalized Jensen-Shannon "
        "divergence (0.5: the JSD).",
        1.0,
    )
    teacher_loss_top_k: int = doc(
        "teacher_divergence top_k: the teacher's most likely tokens per position the divergence "
        "runs over (TRL's loss_top_k, >= 1; the teacher's vocabulary size = the exact "
        "full-vocabulary divergence with the tail).",
        20,
    )
    teacher_loss_add_tail: bool = doc(
        "teacher_divergence top_k: the rest of the vocabulary as one more outcome (TRL's "
        "loss_add_tail); false = both distributions renormalised over the k tokens.",
        True,
    )
    teacher_url: str | None = doc(
        "On-policy distillation with a teacher behind an OpenAI-compatible endpoint (its base "
        "URL, e.g. http://host:8000/v1) instead of teacher_path: the student's token ids are "
        "sent to /v1/completions and scored with vLLM's prompt_logprobs (peergrade serve, "
        "vLLM), at temperature 1. The tokenizers are compared at start-up. null = off.",
        None,
    )
    teacher_model: str | None = doc(
        "teacher_url: the model name sent to the endpoint; null = the one /v1/models lists.",
        None,
    )
    teacher_api_key_env: str | None = doc(
        "teacher_url: the environment variable holding the endpoint's API key (sent as a "
        "Bearer token); null = no key.",
        None,
    )
    teacher_timeout: float = doc(
        "teacher_url: seconds each request may take (> 0); a failed request is tried 3 times "
        "in all before the step stops, naming the URL.",
        120.0,
    )
    turn_credit: Literal["episode", "returns", "step_groups"] = doc(
        "Multi-turn episodes: how the reward is credited to the model's turns. episode = every "
        "sampled token gets the episode's group-relative advantage (GRPO); returns = each "
        "turn's discounted return-to-go of the per-turn rewards (an environment's Step.reward, "
        "a harness's list; the rest of the episode's total on its last turn), normalised over "
        "the group's turns pooled (DeepSeekMath's process supervision); step_groups = GiGPO: "
        "the episode advantage plus turn_step_weight x the return normalised among the group's "
        "turns in the same environment state. docs/environments.md#per-turn-credit.",
        "episode",
    )
    turn_gamma: float = doc(
        "Per-turn credit: the discount of later turns' rewards in a turn's return-to-go, in "
        "[0, 1]; 1 = the plain sum to the end of the episode.",
        1.0,
    )
    turn_step_weight: float = doc(
        "turn_credit step_groups: GiGPO's omega, the weight of the step-level advantage added "
        "to the episode one (>= 0).",
        1.0,
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
    eval_train_reward: bool = doc(
        "With eval_reward naming a scorer that is not the training signal (a rule beside a "
        "judge): also score the held-out answers with the training reward's weighted mix "
        "(eval/train_reward, eval/train_reward_sampled: e.g. the judge's held-out score), so "
        "reward_vs_eval can warn when it rises while the held-out scorer does not. Costs the "
        "training reward's calls on every held-out answer (a judge's count in its failure "
        "accounting too).",
        False,
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
