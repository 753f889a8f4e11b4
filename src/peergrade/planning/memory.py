"""Peak training memory: measured for one configuration, and estimated from the model config.

What this module does
---------------------
``measure_memory(cfg)`` runs training steps of ``cfg`` -- the trainer's own ``setup`` and
``train_step``, with a meter that brackets its generate / rewards / reference / update phases -- in a
*fresh child process*, so the numbers are that configuration's alone (every data and algo key
the trainer follows, few-shot prompts included), and reports the peak per phase:

* CPU: the process's resident set (``VmHWM`` from /proc/self/status, reset with
  ``/proc/self/clear_refs`` before each phase). torch's CPU allocations are invisible to
  Python's tracemalloc; the kernel's high-water mark is the honest measure. Every figure is
  reported **above the baseline**: the RSS of the child after imports and a warm-up step on a
  toy copy of the model, before the measured model is loaded (that baseline, typically
  0.4-0.6 GB, is reported separately as ``baseline_bytes``; add it for the whole process).
  ``allocator="returning"`` (the default) runs the child with glibc's
  ``MALLOC_MMAP_THRESHOLD_=131072``: blocks of 128 KiB and more are mmapped and given back to
  the OS when freed, so RSS follows the live tensors (the quantity the estimate models and
  CUDA's max-allocated reports). ``allocator="default"`` keeps glibc's dynamic threshold,
  under which freed activations stay in the heap; its peaks ran 5-35% higher (GRPO vs PPO
  30M-150M, see bench/memory.py) and vary from run to run with fragmentation. Either way the
  number is a real peak RSS of a real training step.
* CUDA: ``torch.cuda.max_memory_allocated`` per phase (``reset_peak_memory_stats`` before each);
  the baseline is ``memory_allocated`` before loading (the CUDA context is not included).

Two steps are run and the peak is over both: AdamW allocates its state lazily at the first
``step()``, so the first step alone understates the steady state by 2x the trainable weights.
The measured steps are the worst case a budget must hold: every completion runs to
``max_completion_length`` (EOS and stop strings ignored) and a probe reward
(``PROBE_SPACING``) gives every completion a non-zero advantage, so the update trains every
row even where the model earns nothing (with ``algo.beta`` 0 such a step would otherwise skip
its update and measure only the generation); ``update_ran`` in the report says whether it ran.

``estimate_memory(model_config, shape, options, placement)`` predicts the same peak from the
architecture alone (parameter count, vocabulary, hidden/intermediate sizes, heads, layers), the
step's shape (``StepShape``: batch, lengths, micro-batch, group, generation and evaluation
batches), its options (``MemoryOptions``: dtype, bf16 autocast, LoRA, algorithm, reference,
...) and where it runs (``Placement``: device, ranks, strategy), as a breakdown in bytes
(b = bytes per element of the weights):

    weights      P * b                          (tied embeddings counted once)
    grads        P_train * b                    (P_train = P, or the LoRA parameters)
    optimizer    2 * P_train * b                (AdamW exp_avg + exp_avg_sq, in the param dtype)
    reference    P * b when beta > 0 and no LoRA (a frozen copy); 0 with LoRA (adapter off).
                 With ``model.ref_offload`` on CUDA it is resident only in its own pass
    critic       P_critic * b * 4               (PPO: weights + grads + AdamW state of the value
                                                 model = the backbone without an untied lm_head)
    reward_models  P_rm * b per reward model    (resident all run; its no-grad scoring forward
                                                 is phase "rewards": see reward_model_memory)
    teacher      P_teacher * b                  (on-policy distillation's local teacher: frozen,
                                                 resident all run; its no-grad log-prob pass,
                                                 and the student's, are phase "reference")
    activations  what one micro-batch's forward leaves for the backward, per decoder layer:
                 tokens x ``_token_bytes`` (measured with saved-tensor hooks: e.g. float32
                 6H + 4 q_dim + 4I + L elements per token; under bf16 autocast the linear
                 outputs in bf16 and the residual stream in float32, plus each layer's weights
                 cast to bf16). With ``model.shared_prompt_forward`` (the default) a
                 micro-batch's ~micro/G distinct prompts run once and its completions run
                 against the cache repeated to every row: tokens = prompts x Lp + micro x C,
                 plus micro x Lp x 2 q_dim for the repeated keys and values. With gradient
                 checkpointing: each layer's input plus one layer. Then the chunked log-probs'
                 two [c, V] float32 buffers (c = min(chunk_size, micro * completion_len)).
                 PPO's critic: a plain forward (every row in full, no autocast).
    transient    when lm_head is trained, the chunked log-prob backward holds a float32
                 V x H gradient accumulator, plus one V x H product in the weight dtype when
                 that is not float32, on top of the activations. AdamW is the fused kernel
                 (``update.build_optimizer``), which has no temporaries.

    peak = weights + reference + critic + optimizer
           + max(policy activations + max(critic activations,          # backward begins
                                          critic grads + head backward), # policy head's turn
                 grads,                                                  # optimizer step
                 generation: KV cache + [N, V] logits (+ bf16 casts))    # rollout
           (+ grads while micro-batches accumulate)

and, for the whole run, the held-out evaluation (phase "evaluate", with ``estimate_for_config``):

    evaluate = weights + reference + critic + optimizer
               + KV cache + [N, V] logits of one evaluation call (the generation formula above,
                 N = train.eval_batch_size: auto = the step's largest generation call)

``peak`` is the run's (every phase), ``step_peak`` the training step's, ``peak_phase`` names
the phase that sets ``peak``.

The estimate assumes every completion runs to ``completion_len`` (an upper bound for a model
that stops early) and the longest prompt for all rows; the measurement runs that same step
(full-length completions, every row trained). Measured accuracy: docs/memory.md.
It counts live tensors (compare with ``allocator="returning"`` measurements, or CUDA's); with
glibc's default allocator policy the process RSS is higher by what the heap keeps.

``format_table`` renders measured vs estimated rows with the error in percent.

What it deliberately does not do
--------------------------------
No model download, no quantisation (4-bit/8-bit weights), no DeepSpeed/FSDP sharding math, no
vLLM; the estimator does not know allocator fragmentation (CUDA's caching allocator reserves
more than it allocates: ``max_memory_reserved`` can be 10-20% higher than what is reported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "param_counts",
    "estimate_memory",
    "StepShape",
    "MemoryOptions",
    "Placement",
    "estimate_for_config",
    "measure_memory",
    "format_table",
    "format_estimates",
    "DTYPE_BYTES",
    "checkpointing_decision",
    "resolve_checkpointing",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1024**3


def _get(cfg, *names, default=None):
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _arch(model_config) -> dict[str, Any]:
    """The sizes the estimate needs, from a transformers config object or a config.json dict."""
    if isinstance(model_config, (str, Path)):
        model_config = json.loads((Path(model_config) / "config.json").read_text())
    H = _get(model_config, "hidden_size", "n_embd")
    n_layers = _get(model_config, "num_hidden_layers", "n_layer")
    n_heads = _get(model_config, "num_attention_heads", "n_head")
    V = _get(model_config, "vocab_size")
    if None in (H, n_layers, n_heads, V):
        raise ValueError(
            "model config needs hidden_size, num_hidden_layers, num_attention_heads and "
            f"vocab_size; got {H=}, {n_layers=}, {n_heads=}, {V=}"
        )
    n_kv = _get(model_config, "num_key_value_heads", default=n_heads)
    head_dim = _get(model_config, "head_dim", default=H // n_heads)
    inter = _get(model_config, "intermediate_size", default=4 * H)
    tied = bool(_get(model_config, "tie_word_embeddings", default=True))
    mtype = _get(model_config, "model_type", default="")
    qkv_bias = bool(_get(model_config, "attention_bias", default=mtype == "qwen2"))
    types = _get(model_config, "layer_types")
    if types is not None:  # as logprobs._full_attention_only decides
        full_attention = all(t == "full_attention" for t in types)
    else:
        full_attention = not _get(model_config, "use_sliding_window", default=False)
    return dict(
        full_attention=full_attention,
        H=H,
        layers=n_layers,
        heads=n_heads,
        kv_heads=n_kv,
        head_dim=head_dim,
        I=inter,
        V=V,
        tied=tied,
        qkv_bias=qkv_bias,
    )


def param_counts(model_config, lora: dict | None = None) -> dict[str, int]:
    """Parameter counts of a Llama/Qwen2-style decoder: ``total``, ``embedding``, ``lm_head``
    (0 when tied), ``per_layer``, ``largest`` (the biggest single tensor) and ``lora`` (the
    adapter's parameters for ``lora = {"r": .., "target_modules": [..]}``)."""
    a = _arch(model_config)
    H, inter, V = a["H"], a["I"], a["V"]
    q_dim, kv_dim = a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"]
    shapes = {  # (in, out) of each linear in a decoder layer
        "q_proj": (H, q_dim),
        "k_proj": (H, kv_dim),
        "v_proj": (H, kv_dim),
        "o_proj": (q_dim, H),
        "gate_proj": (H, inter),
        "up_proj": (H, inter),
        "down_proj": (inter, H),
    }
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * H  # + two RMSNorm weights
    if a["qkv_bias"]:
        per_layer += q_dim + 2 * kv_dim
    emb = V * H
    head = 0 if a["tied"] else V * H
    total = emb + head + a["layers"] * per_layer + H  # + final norm
    n_lora = 0
    per_target: dict[str, int] = {}
    if lora:
        targets = lora.get("target_modules", list(shapes))
        if targets == "all-linear":
            targets = list(shapes)
        r = int(lora["r"])
        per_target = {k: r * (i + o) for k, (i, o) in shapes.items() if k in targets}
        n_lora = a["layers"] * sum(per_target.values())
    largest = max(emb, max(i * o for i, o in shapes.values()))
    return dict(
        total=total,
        embedding=emb,
        lm_head=head,
        per_layer=per_layer,
        largest=largest,
        lora=n_lora,
        lora_per_target=per_target,
    )


def _token_bytes(a: dict, L: int, *, act: str, r_sum: int, lora: bool) -> int:
    """Bytes one token leaves saved for the backward in one decoder layer (measured with
    ``torch.autograd.graph.saved_tensors_hooks`` on Llama/Qwen2 layers; bench/memory.py).

    act "float32": 6H + 4 q_dim + 4I + L float32 elements: the two RMSNorms' input, normalised
    and scaled copies, q and k, v repeated to all heads, the attention output, four MLP
    intermediates and a row of the additive mask. act "autocast" (float32 weights under bf16
    autocast): the linear layers' outputs in bf16, the residual stream and the norms in
    float32. act "half" (bf16/fp16 weights): everything in 2 bytes but the norms' float32
    upcast. LoRA: the frozen norm weights need not their input, the adapters add r values per
    adapted linear (r_sum), under autocast one more q-sized bf16 cast, and on half-precision
    weights the float32 copies peft makes of the adapted layers' inputs. Fitted on two shapes
    (H = q_dim = 576, I = 1536; H = 256, q_dim = 512, I = 704), exact to a few bytes.
    """
    H, inter = a["H"], a["I"]
    q = a["heads"] * a["head_dim"]
    if act == "autocast":
        n = 26 * H + 8 * q + 8 * inter + 2 * L
        return n + (-8 * H + 2 * q + 2 * r_sum if lora else 0)
    if act == "float32":
        n = 24 * H + 16 * q + 16 * inter + 4 * L
        return n + (-8 * H + 4 * r_sum if lora else 0)
    n = 16 * H + 8 * q + 8 * inter + 2 * L
    # peft's float32 adapters on half-precision weights: float32 copies of the adapted inputs
    return n + (12 * H + 4 * q + 2 * inter + 4 * r_sum if lora else 0)


_F32 = 4  # bytes of a float32 element


@dataclass(frozen=True)
class StepShape:
    """The training step's shape, as ``estimate_memory`` counts it (per run, before ``world``
    divides it between ranks).

    batch: sequences per step (P * G); seq_len: prompt + completion tokens; completion_len:
    completion tokens (0 < completion_len < seq_len); micro_batch: sequences per
    forward/backward (None: batch); minibatch: sequences per optimizer step (None: batch;
    smaller micro-batches accumulate grads while the next one's activations are built);
    group_size: G (the completions of one prompt); generation_batch:
    ``rollout.generation_batch_size`` (None: all); generation_rounds: the most rounds of
    ``batch`` sequences one generation call samples (``rollout.rounds_ahead``: max_rounds - 1);
    eval_rows, eval_batch: the held-out evaluation's largest pass (``train.eval_size *
    train.eval_samples``; 0: no evaluation) and the sequences it generates at once (None: all).
    """

    batch: int
    seq_len: int
    completion_len: int
    micro_batch: int | None = None
    minibatch: int | None = None
    group_size: int = 1
    generation_batch: int | None = None
    generation_rounds: int = 1
    eval_rows: int = 0
    eval_batch: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.completion_len < self.seq_len:
            raise ValueError(
                f"need 0 < completion_len ({self.completion_len}) < seq_len ({self.seq_len})"
            )


@dataclass(frozen=True)
class MemoryOptions:
    """How the step trains, as far as memory goes (``estimate_memory``).

    dtype: the weights' "float32" | "bfloat16" | "float16"; lora: None or {"r": int,
    "target_modules": [...]}; algo: "grpo" | "ppo"; beta: KL coefficient (> 0 loads a reference
    unless LoRA); optimizer: "adamw" (the only one the trainer builds); chunk_size: the chunked
    log-prob's rows per chunk; gradient_checkpointing; autocast: bf16 autocast on float32
    weights (``update.use_bf16_autocast``); shared_prompt: ``model.shared_prompt_forward``
    (each distinct prompt of a micro-batch runs once); ref_offload: the reference copy lives in
    host memory outside its own pass (counted on "cuda" only); reward_models:
    ``reward_model_memory`` dicts (``weights``, ``activations``) of the reward models among the
    rewards; async_steps: ``rollout.async_steps`` k (k >= 1 adds the producer); distill:
    on-policy distillation (``algo.teacher_path`` or ``algo.teacher_url``): the student's own
    no-grad log-prob pass in phase "reference"; teacher: the local teacher's model config (a
    model directory, config.json dict or transformers config; None: no local teacher, e.g. one
    behind an endpoint), frozen in the weights' dtype and resident all run, its no-grad
    log-prob pass in phase "reference" too (``training.teacher``).
    """

    dtype: str = "float32"
    lora: dict | None = None
    algo: str = "grpo"
    beta: float = 0.0
    optimizer: str = "adamw"
    chunk_size: int = 1024
    gradient_checkpointing: bool = False
    autocast: bool = False
    shared_prompt: bool = True
    ref_offload: bool = False
    reward_models: tuple[dict, ...] = ()
    async_steps: int = 0
    distill: bool = False
    teacher: Any = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
        if self.algo not in ("grpo", "ppo"):
            raise ValueError(f"algo={self.algo!r}: expected 'grpo' or 'ppo'")
        if self.optimizer != "adamw":
            raise ValueError(f"optimizer={self.optimizer!r}: only 'adamw' is supported")
        object.__setattr__(self, "reward_models", tuple(self.reward_models or ()))


@dataclass(frozen=True)
class Placement:
    """Where the step runs: device "cpu" | "cuda"; world: ranks under torchrun; strategy:
    ``dist.strategy`` ("ddp" | "fsdp"). With world > 1 the figures are per rank."""

    device: str = "cpu"
    world: int = 1
    strategy: str = "ddp"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: expected 'cpu' or 'cuda'")


class _Model(NamedTuple):
    """The sizes the formulas read: ``_arch``'s dict, ``param_counts`` and bytes per weight."""

    a: dict
    pc: dict
    b: int


class _Resident(NamedTuple):
    """The tensors that live through the whole step, in bytes (one whole copy, unsharded)."""

    params: int  # parameter count
    trainable_params: int
    weights: int
    grads: int
    optimizer: int  # AdamW's exp_avg and exp_avg_sq, in the trainable weights' dtype
    reference: int  # the frozen copy for the KL term (none with LoRA: the adapter is turned off)


def _resident(pc: dict, b: int, *, lora, beta: float) -> _Resident:
    """The policy's weights, grads and AdamW state, and the reference, from the counts ``pc``."""
    P, P_train = pc["total"], (pc["lora"] if lora else pc["total"])
    # LoRA adapters are created in float32 by peft regardless of the base dtype
    tb = _F32 if lora else b
    weights = P * b + (pc["lora"] * _F32 if lora else 0)
    reference = P * b if (beta > 0 and not lora) else 0
    return _Resident(P, P_train, weights, P_train * tb, 2 * P_train * tb, reference)


class _PolicyPass(NamedTuple):
    """Bytes of the policy's forward and backward over one micro-batch (``_policy_pass``)."""

    layer_act: int  # one decoder layer's activations
    acts: int  # what the decoder layers keep for the backward
    chunk_bufs: int  # the chunked log-prob's two [c, V] float32 buffers
    hidden: int  # the final norm's output and the completion rows' hidden states
    grad_transient: int  # the chunked log-prob backward's lm_head gradient buffers
    head_backward: int  # what the policy's backward adds at its start (the head)


def _policy_pass(m: _Model, micro: int, shape: StepShape, opts: MemoryOptions) -> _PolicyPass:
    """What the policy's forward of ``micro`` sequences keeps for the backward, and what its
    backward holds on top (see ``_PolicyPass``). ``opts.autocast`` is the effective one."""
    a, pc, b = m
    L, C, lora, autocast = shape.seq_len, shape.completion_len, opts.lora, opts.autocast
    checkpointing = opts.gradient_checkpointing
    H, V, nl = a["H"], a["V"], a["layers"]
    q_dim = a["heads"] * a["head_dim"]
    Lp = L - C
    act = "autocast" if autocast else ("float32" if b == _F32 else "half")
    act_b = _F32 if act == "float32" else 2
    r_sum = int(lora["r"]) * len(pc["lora_per_target"]) if lora else 0
    per_tok = _token_bytes(a, L, act=act, r_sum=r_sum, lora=bool(lora))
    G = max(1, int(shape.group_size))
    # rows of one micro-batch that share a prompt: completions of equal length keep their
    # groups together in the length-sorted plan, so a micro-batch spans about micro / G prompts
    prompts_in_micro = min(micro, -(-micro // G) + (1 if micro % G else 0))
    shared = (
        opts.shared_prompt
        and not checkpointing
        and a["full_attention"]
        and prompts_in_micro < micro
    )
    if shared:  # prompts once, completions against the cache expanded to every row
        layer_act = (prompts_in_micro * Lp + micro * C) * per_tok + micro * Lp * 2 * q_dim * act_b
    else:
        layer_act = micro * L * per_tok
    # bf16 copies of each layer's float32 weights, cast once per forward by autocast (once in
    # all when the weights are trained: autocast caches casts of parameters that need grads)
    weight_copies = 0
    if autocast:
        forwards = 2 if (shared and lora) else 1
        weight_copies = 2 * (pc["per_layer"] + pc["lora"] // nl) * forwards
    if checkpointing:  # only each layer's input is kept; layers are recomputed later
        resid_b = _F32 if autocast else b
        acts = micro * L * H * resid_b * nl
    else:
        acts = (layer_act + weight_copies) * nl
    c = min(opts.chunk_size, micro * C)
    chunk_bufs = 2 * c * V * _F32  # the chunked log-prob's [c, V] float32 logits and softmax
    hidden = micro * L * H * (_F32 if autocast else b) + micro * C * H * _F32  # final norm, rows
    # the chunked log-prob backward: a float32 [V, H] grad accumulator (updated in place with
    # addmm for float32 weights; a half-precision weight adds one [V, H] product per chunk)
    grad_transient = (V * H * _F32 + (V * H * b if b != _F32 else 0)) if not lora else 0
    # fused AdamW (update.build_optimizer) steps each tensor in one kernel: no temporaries
    head_backward = chunk_bufs + grad_transient + layer_act
    if checkpointing:  # the head's buffers are gone before the first layer is
        # recomputed; then one layer's activations and their gradients at a time
        head_backward = max(chunk_bufs + grad_transient, 2 * layer_act + weight_copies)
    return _PolicyPass(layer_act, acts, chunk_bufs, hidden, grad_transient, head_backward)


def _critic_activations(a: dict, b: int, micro: int, L: int, checkpointing: bool) -> int:
    """What PPO's critic keeps for the joint backward: a plain forward (no autocast)."""
    H, nl = a["H"], a["layers"]
    critic_tok = _token_bytes(a, L, act="float32" if b == _F32 else "half", r_sum=0, lora=False)
    critic_layer = micro * L * critic_tok
    if checkpointing:  # the critic is built with it too (ppo.build_value_model)
        return micro * L * H * b * (nl + 1) + 2 * critic_layer
    return critic_layer * nl + micro * L * H * b


def __getattr__(name: str):
    """``SAMPLER_VOCAB_BUFFERS``, importable from here as before: the sampler's own constant
    (``generation.kernel``), read only when asked for (this module does not import torch)."""
    if name == "SAMPLER_VOCAB_BUFFERS":
        from peergrade.generation.kernel import SAMPLER_VOCAB_BUFFERS

        return SAMPLER_VOCAB_BUFFERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _generation_bytes(a: dict, b: int, *, rows: int, generation_batch, seq_len: int):
    """(KV cache, one step's [N, V] float32 logits and sampling buffers) of the largest
    generation call: ``rows`` sequences, cut to ``generation_batch``. The sampler's formulas
    (``generation.kernel``: ``kv_bytes_per_token``, ``SAMPLER_VOCAB_BUFFERS``), which the
    endpoint's admission control counts with too; imported here, not at the top, so that this
    module loads without torch."""
    from peergrade.generation.kernel import SAMPLER_VOCAB_BUFFERS, kv_bytes_per_token

    gen_rows = min(rows, generation_batch or rows)
    per_token = kv_bytes_per_token(a["layers"], a["kv_heads"], a["head_dim"], b)
    kv_cache = per_token * gen_rows * seq_len
    gen_logits = SAMPLER_VOCAB_BUFFERS * gen_rows * a["V"] * _F32
    return kv_cache, gen_logits


def _phases(
    static: int,
    fwd: _PolicyPass,
    *,
    critic_acts: int,
    critic_grads: int,
    grads: int,
    accumulate: bool,
    generation: int,
    casts: int,
    reference_pass: bool,
    reward_models,
) -> dict[str, int]:
    """Each phase's peak on one process (bytes): the resident ``static`` plus what the phase
    adds. generate and update always; reference and rewards when they run."""
    # grads (policy's and critic's) are allocated as the backward frees activations. The
    # policy's own backward begins with the chunked head's buffers on top of its activations;
    # PPO's critic, built last, is differentiated first: by the time the policy's head runs,
    # the critic's activations have become its grads.
    policy_acts = fwd.acts + fwd.hidden
    backward = policy_acts + max(critic_acts, critic_grads + fwd.head_backward)
    if accumulate:  # the earlier micro-batches' grads
        backward += grads + critic_grads
    step = grads + critic_grads
    phases = {"generate": static + generation + casts, "update": static + max(backward, step)}
    if reference_pass:  # a no-grad pass: one layer's forward at a time
        phases["reference"] = static + casts + fwd.layer_act + fwd.chunk_bufs + fwd.hidden
    if reward_models:  # scoring: one reward model's micro-batch forward at a time
        phases["rewards"] = static + max(m["activations"] for m in reward_models)
    return phases


def _per_rank(
    phases: dict,
    res: _Resident,
    *,
    static: int,
    offloaded: bool,
    m: _Model,
    where: Placement,
    lora,
) -> tuple[dict, _Resident]:
    """The phases and resident tensors of one of ``where.world`` ranks under its strategy:
    sharding and communication buffers (``peergrade.distributed.rank_memory``)."""
    from peergrade.distributed import rank_memory

    a, pc, b = m

    resident_ref = 0 if offloaded else res.reference
    parts = dict(
        weights=res.weights, grads=res.grads, optimizer=res.optimizer, reference=resident_ref
    )
    phases, parts = rank_memory(
        phases,
        parts,
        static=static,
        world=where.world,
        strategy=where.strategy,
        lora=bool(lora),
        layer_fraction=a["layers"] * pc["per_layer"] / res.params,
        layer_bytes=pc["per_layer"] * b,
    )
    res = res._replace(
        weights=parts["weights"],
        grads=parts["grads"],
        optimizer=parts["optimizer"],
        reference=parts["reference"] if not offloaded else res.reference,
    )
    return phases, res


def estimate_memory(
    model_config,
    shape: StepShape,
    options: MemoryOptions | None = None,
    placement: Placement | None = None,
) -> dict[str, Any]:
    """Peak-memory breakdown in bytes for one training step (see the module docstring).

    model_config: a transformers config, a config.json dict, or a model directory; shape: the
    step's batch and lengths (``StepShape``); options: dtype, LoRA, algorithm, reference,
    checkpointing and the rest (``MemoryOptions``; None: its defaults, float32 GRPO without a
    reference); placement: device, ranks and ``dist.strategy`` (``Placement``; None: one CPU
    process). How each is counted: ``_beyond_the_step``. What it leaves out: allocator slack
    per thread or process, which is what a measurement adds on top. For example::

        estimate_memory(
            "Qwen/Qwen2.5-0.5B",
            StepShape(batch=64, seq_len=768, completion_len=512, micro_batch=8),
            MemoryOptions(dtype="bfloat16", beta=0.04),
            Placement(device="cuda"),
        )

    Returns a dict of components plus ``phases`` (generate/update peaks, "reference" when a
    reference pass runs, "rewards" with a reward model, "pipelined" with k >= 1, "evaluate"
    with eval_rows, "checkpoint"), ``peak`` (the run's: every phase), ``peak_phase`` (the phase
    that sets it), ``step_peak`` (the training step's phases: not the evaluation nor the
    checkpoint) and ``eval_generation`` (the evaluation's KV cache and logits).
    """
    opts = options if options is not None else MemoryOptions()
    where = placement if placement is not None else Placement()
    b = DTYPE_BYTES[opts.dtype]
    m = _Model(_arch(model_config), param_counts(model_config, opts.lora), b)
    pc, L = m.pc, shape.seq_len
    batch = shape.batch // max(1, where.world)  # this rank's sequences
    micro = min(shape.micro_batch or batch, batch)
    # autocast only ever casts float32 weights down
    opts = replace(opts, autocast=opts.autocast and b == _F32)
    res = _resident(pc, b, lora=opts.lora, beta=opts.beta)
    ppo = opts.algo == "ppo"
    critic_w = (res.params - pc["lm_head"]) * b if ppo else 0  # PPO's value model
    fwd = _policy_pass(m, micro, shape, opts)
    # the critic: a plain forward (no autocast) in the joint backward
    checkpointing = opts.gradient_checkpointing
    critic_acts = _critic_activations(m.a, b, micro, L, checkpointing) if ppo else 0
    rows = batch * max(1, int(shape.generation_rounds))
    kv_cache, gen_logits = _generation_bytes(
        m.a, b, rows=rows, generation_batch=shape.generation_batch, seq_len=L
    )
    # the reference is resident in its own pass only
    offloaded = opts.ref_offload and where.device == "cuda" and res.reference > 0
    rm_weights = sum(r["weights"] for r in opts.reward_models)  # frozen, resident all run
    # the critic's weights and optimizer state are static; its grads exist during the update
    static = res.weights + (0 if offloaded else res.reference) + critic_w * 3 + res.optimizer
    teacher_w, teacher_pass = _teacher(m.b, micro, shape, opts)
    static += rm_weights + teacher_w
    phases = _phases(
        static,
        fwd,
        critic_acts=critic_acts,
        critic_grads=critic_w,
        grads=res.grads,
        accumulate=micro < min(shape.minibatch or batch, batch),
        generation=kv_cache + gen_logits,
        casts=2 * res.params if opts.autocast else 0,
        reward_models=opts.reward_models,
        reference_pass=res.reference > 0 or (opts.lora and opts.beta > 0),
    )
    if opts.distill or opts.teacher is not None:  # the student's pass, then the teacher's
        student_pass = fwd.layer_act + fwd.chunk_bufs + fwd.hidden
        distill = static + (2 * res.params if opts.autocast else 0)
        distill += max(student_pass, teacher_pass)
        phases["reference"] = max(phases.get("reference", 0), distill)
    phases, res, eval_generation, producer = _beyond_the_step(
        phases,
        res,
        static=static,
        fwd=fwd,
        m=m,
        shape=shape,
        opts=opts,
        where=where,
        offloaded=offloaded,
    )
    return {
        **res._asdict(),
        "critic": 4 * critic_w,  # weights, grads and AdamW's two states
        "reward_models": rm_weights,
        "teacher": teacher_w,
        "activations": fwd.acts + fwd.chunk_bufs + fwd.hidden + critic_acts,
        "transient": fwd.grad_transient + fwd.layer_act,
        **_peaks(phases, kv_cache, producer, eval_generation, shape.eval_rows, shape.eval_batch),
    }


def _teacher(b: int, micro: int, shape: StepShape, opts: MemoryOptions) -> tuple[int, int]:
    """(weights, one no-grad log-prob pass) of on-policy distillation's local teacher, in bytes:
    its parameters in the policy's dtype (``training.teacher.load_teacher``), and one
    micro-batch's pass by the reference's formula on the teacher's own sizes (one layer's
    activations, the chunked log-prob's [c, V] buffers, the hidden states). (0, 0) without a
    local teacher."""
    if opts.teacher is None:
        return 0, 0
    t = _Model(_arch(opts.teacher), param_counts(opts.teacher), b)
    fwd = _policy_pass(t, micro, shape, replace(opts, lora=None))
    return t.pc["total"] * b, fwd.layer_act + fwd.chunk_bufs + fwd.hidden


def _peaks(phases: dict, kv_cache, producer, eval_generation, eval_rows, eval_batch) -> dict:
    """The generation's, the producer's and the evaluation's figures; the run's peak, the phase
    that sets it, and the training step's own peak."""
    return {
        "kv_cache": kv_cache,
        "producer": producer,
        "eval_generation": eval_generation,
        "eval_batch": min(int(eval_rows), eval_batch or int(eval_rows)),
        "phases": phases,
        "peak": max(phases.values()),
        "peak_phase": max(phases, key=phases.get),
        "step_peak": max(v for k, v in phases.items() if k not in _OUTSIDE_THE_STEP),
    }


#: the phases of a run that are not its training step's
_OUTSIDE_THE_STEP = ("evaluate", "checkpoint")


def _beyond_the_step(
    phases: dict,
    res: _Resident,
    *,
    static: int,
    fwd: _PolicyPass,
    m: _Model,
    shape: StepShape,
    opts: MemoryOptions,
    where: Placement,
    offloaded: bool,
) -> tuple[dict, _Resident, int, int]:
    """``estimate_memory``'s phases past one process's step. Returns (phases, this rank's
    resident figures, the evaluation's generation bytes, the producer's bytes).

    eval_rows (the sampled pass: ``train.eval_size * train.eval_samples`` sequences) > 0 adds
    "evaluate": the resident tensors of a periodic or final evaluation (weights, the reference
    when beta > 0, the optimizer state) plus the KV cache and logits of ``eval_batch``
    sequences (``Config.eval_generation_batch``), by the step's generation formula (every rank
    evaluates every row). world > 1: ``distributed.rank_memory`` (batch / world sequences
    each; under fsdp the decoder layers' weights, grads, optimizer state and reference are
    sharded 1/world, two layers are gathered at a time in the update, and all of them for the
    rollout). "checkpoint": ``_checkpoint_phase``. async_steps k >= 1: the producer
    (``peergrade.training.pipeline``), its copy of the trainable weights and the k + 1
    versions it may sample with, and a "pipelined" phase where its largest phase's transients
    (generation, the reference pass, a reward model) sit on top of the update's."""
    eval_rows, eval_batch, async_steps = shape.eval_rows, shape.eval_batch, opts.async_steps
    world, lora = where.world, opts.lora
    eval_generation = 0
    if eval_rows:  # the held-out passes: the step's generation formula at the eval batch
        eval_generation = sum(
            _generation_bytes(
                m.a, m.b, rows=int(eval_rows), generation_batch=eval_batch, seq_len=shape.seq_len
            )
        )
        phases["evaluate"] = static + eval_generation + (2 * res.params if opts.autocast else 0)
    # the producer (async_steps k >= 1): its copy of the trainable weights and k + 1 versions
    producer = (async_steps + 2) * res.grads if async_steps else 0
    whole = res  # the unsharded figures: what a checkpoint gathers under fsdp
    if world > 1:  # per-rank sharding and communication buffers
        phases, res = _per_rank(
            phases, res, static=static, offloaded=offloaded, m=m, where=where, lora=lora
        )
    if offloaded:  # its own pass brings it back: no grads, one layer's activations
        back = static + res.reference + fwd.layer_act + fwd.chunk_bufs + fwd.hidden
        phases["reference"] = max(phases.get("reference", 0), back)  # or a teacher's pass
    sharded = world > 1 and where.strategy == "fsdp" and not lora
    phases["checkpoint"] = _checkpoint_phase(
        static, whole, res, offloaded=offloaded, sharded=sharded, device=where.device
    )
    if async_steps:  # the producer runs its phases while the trainer updates
        outside = ("update", *_OUTSIDE_THE_STEP)
        beside = max(v - static for k, v in phases.items() if k not in outside)
        phases["pipelined"] = phases["update"] + producer + beside
    return phases, res, eval_generation, producer


def _checkpoint_phase(static: int, whole, res, *, offloaded: bool, sharded: bool, device) -> int:
    """A checkpoint save: what stays resident through the step (``static``, less what sharding
    took off this rank) and nothing more -- safetensors and ``torch.save`` stream the tensors
    to the file (measured on SmolLM2-135M: 0.4 MiB above the resident set). Under fsdp rank 0
    first gathers the full weights and optimizer state to its CPU
    (``distributed.checkpoint_state``): on the CPU that adds them whole (on an accelerator it
    is host memory, which these per-device figures do not count)."""
    parts = ("weights", "optimizer") + (() if offloaded else ("reference",))
    static -= sum(getattr(whole, k) - getattr(res, k) for k in parts)
    return static + (whole.weights + whole.optimizer if sharded and device == "cpu" else 0)


def prompt_length(cfg, n: int = 64) -> int:
    """Longest prompt (tokens) among the first ``n`` training prompts of ``cfg``'s task, as the
    trainer builds them at step 1 (few-shot examples included)."""
    import itertools

    from peergrade.model.load import load_tokenizer, resolve_model_path
    from peergrade.training.components import build_few_shot, build_task, encode_rows

    task = build_task(cfg)
    tok = load_tokenizer(resolve_model_path(cfg.model.path), cfg.model.chat_template)
    rows = list(itertools.islice(task.train_rows(cfg.train.seed), n))
    rows, _ = build_few_shot(cfg, task).apply(rows, step=1)
    return max(len(x) for x in encode_rows(cfg, task, tok, rows))


def _reward_models(cfg, *, dtype: str, device: str, prompt_len: int) -> list[dict]:
    """``reward_model_memory`` of the config's reward models and local judges (weights resident
    all run, one scoring forward at a time)."""
    r = cfg.rollout
    from peergrade.rewards.models import (
        DEFAULT_BATCH_SIZE,
        is_reward_model_name,
        reward_model_memory,
    )

    reward_models = [
        reward_model_memory(
            i.name.strip(),
            dtype=dtype,
            seq_len=prompt_len + r.max_completion_length,
            batch_size=int((i.kwargs or {}).get("batch_size") or DEFAULT_BATCH_SIZE),
            device=device,
        )
        for i in cfg.rewards
        if is_reward_model_name(i.name)
    ]
    from peergrade.training.judge_local import judge_model_memory  # a judge reward's local model

    judges = [
        judge_model_memory(
            i.kwargs,
            dtype=dtype,
            device=device,
            prompt_len=prompt_len,
            completion_len=r.max_completion_length,
            group=r.group_size,
        )
        for i in cfg.rewards
        if isinstance(i.name, str)
        and i.name.strip() == "judge"
        and (i.kwargs or {}).get("judge_model")
    ]
    reward_models += [j for j in judges if j is not None]
    return reward_models


def estimate_for_config(
    cfg, *, prompt_len: int | None = None, device: str | None = None, world: int = 1
) -> dict:
    """``estimate_memory`` with the sizes of a peergrade ``Config`` (model dir's config.json)."""
    import torch

    from peergrade.model.load import resolve_device, resolve_dtype, resolve_model_path

    path = resolve_model_path(cfg.model.path)
    if device is None:
        device = resolve_device(cfg.model.device).type
    dtype = resolve_dtype(cfg.model.dtype, torch.device(device))
    if prompt_len is None:
        prompt_len = prompt_length(cfg)
    r = cfg.rollout
    lora = None
    if cfg.model.lora.enabled:
        lora = {"r": cfg.model.lora.r, "target_modules": cfg.model.lora.target_modules}
    reward_models = _reward_models(cfg, dtype=dtype, device=device, prompt_len=prompt_len)
    from peergrade.training.update import auto_bf16

    autocast = cfg.model.autocast == "bf16"
    if cfg.model.autocast == "auto":  # the trainer's decision, from the config alone
        autocast = auto_bf16(device, dtype, param_counts(path)["total"])[0]
    shape = StepShape(
        batch=cfg.batch_size,
        seq_len=prompt_len + r.max_completion_length,
        completion_len=r.max_completion_length,
        micro_batch=cfg.micro_batch_size,
        minibatch=cfg.minibatch_size,
        group_size=r.group_size,
        generation_batch=r.generation_batch_size,
        generation_rounds=cfg.generation_rounds(),
        eval_rows=cfg.train.eval_size * cfg.train.eval_samples,
        eval_batch=cfg.eval_generation_batch(world),
    )
    options = MemoryOptions(
        dtype=dtype,
        lora=lora,
        algo=cfg.algo.name,
        beta=cfg.algo.beta,
        chunk_size=cfg.model.logprob_chunk_size,
        gradient_checkpointing=cfg.gradient_checkpointing_on(device),
        autocast=autocast,
        shared_prompt=cfg.model.shared_prompt_forward,
        ref_offload=cfg.model.ref_offload,
        reward_models=tuple(reward_models),
        async_steps=cfg.rollout.async_steps,
        distill=cfg.algo.teacher_path is not None or cfg.algo.teacher_url is not None,
        teacher=(
            resolve_model_path(cfg.algo.teacher_path) if cfg.algo.teacher_path is not None else None
        ),
    )
    where = Placement(device=device, world=world, strategy=cfg.dist.strategy)
    return estimate_memory(path, shape, options, where)


# ----------------------------------------------------------------------------- checkpointing auto

#: the share of the memory a run may use that ``model.gradient_checkpointing: auto`` lets the
#: estimated step peak without checkpointing fill (the rest: the estimate's error, the
#: process's baseline of imports and allocator slack, docs/memory.md)
CHECKPOINTING_SHARE = 0.9


def checkpointing_decision(peak_without: int, memory: int, where: str) -> tuple[bool, str]:
    """``model.gradient_checkpointing: auto`` from the estimated step peak without
    checkpointing and the ``memory`` (bytes; ``where`` says what it is) the run may use: off
    when the peak fits in ``CHECKPOINTING_SHARE`` of it (no recompute), on otherwise. Returns
    (on, why)."""
    limit = int(memory * CHECKPOINTING_SHARE)
    share = f"{_gib(limit)} ({CHECKPOINTING_SHARE:.0%} of {where}, {_gib(memory)})"
    if peak_without <= limit:
        return False, f"the step's estimated peak without it, {_gib(peak_without)}, fits in {share}"
    return True, (
        f"the step's estimated peak without it, {_gib(peak_without)}, does not fit in {share}"
    )


def _gib(x: int) -> str:
    return f"{x / GB:.2f} GiB"


def run_memory(device: str) -> tuple[int, str]:
    """The memory a run on ``device`` may use, in bytes, and what it is: the GPU's free
    memory; on the CPU the machine's available memory (``MemAvailable``), or the cgroup's
    limit less its usage where that is lower."""
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0]), "the GPU's free memory"
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    free, where = int(info["MemAvailable"].split()[0]) * 1024, "the available memory"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free, where
    if limit != "max" and int(limit) - used < free:
        return int(limit) - used, "the cgroup's memory limit less its usage"
    return free, where


def resolve_checkpointing(cfg, *, world: int | None = None) -> tuple[bool, str] | None:
    """Decide ``model.gradient_checkpointing: auto`` for ``cfg`` before the trainer's setup:
    ``estimate_for_config`` of the config with checkpointing off against ``run_memory``
    (``checkpointing_decision``). The decision is stored in ``cfg.checkpointing_auto``, which
    ``Config.gradient_checkpointing_on`` and the trainer's start-up line read, and returned;
    None when the setting is not auto. Where no estimate can be made (a model or data the
    planner cannot read, no /proc/meminfo) auto keeps the default of null: on for GPU, off for
    the CPU, and says so."""
    if cfg.model.gradient_checkpointing != "auto":
        return None
    import copy

    from peergrade.model.load import resolve_device

    device = resolve_device(cfg.model.device).type
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    probe = copy.deepcopy(cfg)
    probe.model.gradient_checkpointing = False
    try:
        peak = estimate_for_config(probe, device=device, world=world)["step_peak"]
        memory, where = run_memory(device)
    except Exception as e:  # noqa: BLE001 - any failure to estimate: the old default, said
        on = device == "cuda"
        why = f"no memory estimate ({type(e).__name__}: {e}); {'on for a GPU' if on else 'off on the CPU'}"
        cfg.checkpointing_auto = (on, why)
        return cfg.checkpointing_auto
    cfg.checkpointing_auto = checkpointing_decision(peak, memory, where)
    return cfg.checkpointing_auto


# ----------------------------------------------------------------------------- measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")  # pragma: no cover


class _Meter:
    """Per-phase peaks: CUDA max allocated, or the process's peak RSS (VmHWM, reset per phase)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.phases: dict[str, int] = {}
        self.base = self.now()

    def now(self) -> int:
        if self.cuda:
            return self.torch.cuda.memory_allocated()
        return _status_kib("VmRSS") * 1024

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated()
        return _status_kib("VmHWM") * 1024

    def record(self, name: str) -> None:
        self.phases[name] = max(self.phases.get(name, 0), self.peak() - self.base)


def _shrunk_copy(path: str, out: Path) -> Path:
    """The model in ``path`` at a toy size (1 layer, 8-dim heads), same class and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from peergrade.model.load import load_tokenizer

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    heads = cfg.num_attention_heads
    cfg.num_hidden_layers = 1
    cfg.hidden_size = 8 * heads
    cfg.intermediate_size = 32
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = 8
    for attr in ("layer_types", "max_window_layers"):
        if isinstance(getattr(cfg, attr, None), list):
            setattr(cfg, attr, getattr(cfg, attr)[:1])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out


def _child(cfg_path: str, steps: int) -> dict:
    """Warm up on a toy copy of the model (imports, kernels, code paths), take the baseline,
    then run ``steps`` measured steps; return per-phase peaks above the baseline."""
    import gc
    import tempfile

    import torch

    from peergrade.config import load_config
    from peergrade.model.load import resolve_device, resolve_model_path
    from peergrade.training.trainer import NO_METER

    cfg = load_config(cfg_path)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.model.device)
    with tempfile.TemporaryDirectory(prefix="peergrade-warmup-") as tmp:
        warm = load_config(cfg_path)
        warm.model.path = str(_shrunk_copy(resolve_model_path(cfg.model.path), Path(tmp)))
        if warm.algo.critic_path is not None:
            warm.algo.critic_path = warm.model.path
        if warm.algo.teacher_path is not None:  # the toy copy: not the real teacher twice
            warm.algo.teacher_path = warm.model.path
        _run_steps(warm, 1, NO_METER)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    meter = _Meter(device)
    meter.reset()
    out = _run_steps(cfg, steps, meter)
    return {
        "device": device.type,
        "baseline_bytes": meter.base,
        "phases": meter.phases,
        "peak": max(meter.phases.values()),
        **out,
    }


PROBE_SPACING = 1e4
"""The measurement's probe reward: completion ``j`` of each group scores ``PROBE_SPACING * (j +
[j == G - 1])`` (0, 1, ..., G - 2, G), on top of the configured rewards. No two completions of a
group tie and none sits at the group's mean, so every advantage is non-zero and the update
computes every row: the step the estimate describes, whatever the model earns."""


def _probe_reward(G: int):
    def memory_probe(completions, **_) -> list[float]:
        return [PROBE_SPACING * (i % G + (i % G == G - 1)) for i in range(len(completions))]

    return memory_probe


def _run_steps(cfg, steps: int, meter) -> dict:
    """``steps`` steps of the trainer's own ``train_step`` on ``cfg``, phases metered, in the
    worst case the estimate describes: full-length completions (no EOS, no stop strings) and a
    probe reward (``PROBE_SPACING``) that gives every completion a non-zero advantage, so the
    update really runs on every row. ``update_ran`` says whether it did on some step (a step
    whose every minibatch was skipped for zero signal measures only the generation)."""
    import time

    from peergrade.rewards.registry import RewardSpec
    from peergrade.training.trainer import setup, train_step

    cfg.rollout.stop = []
    run = setup(cfg)
    run.rewards = [*run.rewards, RewardSpec("memory_probe", _probe_reward(cfg.rollout.group_size))]
    meter.record("load")
    P = cfg.rollout.prompts_per_step
    rows = iter(run.task.train_rows(cfg.train.seed))
    shapes, skipped, t0 = [], [], time.perf_counter()
    # every completion runs to max_completion_length: the worst case the estimate assumes
    run.sampler = run.sampler.replace(ignore_eos=True)
    for step in range(1, steps + 1):
        res = train_step(run, step, [next(rows) for _ in range(P)], meter)
        shapes.append(res.shapes)
        skipped.append(res.metrics.get("update/zero_signal_frac", 0.0))
    _save_metered(run, steps, meter)
    policy = run.models.policy
    return {
        **{k: max(s[k] for s in shapes) for k in ("seq_len", "completion_len", "prompt_len")},
        "update_ran": any(frac < 1.0 for frac in skipped),
        "params": sum(p.numel() for p in policy.parameters()),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "critic_params": (
            sum(p.numel() for p in run.critic.model.parameters()) if run.critic is not None else 0
        ),
        "seconds": time.perf_counter() - t0,
    }


def _save_metered(run, step: int, meter) -> None:
    """The trainer's own checkpoint save of ``run`` (into a scratch directory), metered as the
    phase "checkpoint"."""
    from peergrade.config import to_yaml
    from peergrade.training.checkpoint import RunDir

    with tempfile.TemporaryDirectory(prefix="peergrade-memory-save-") as tmp:
        meter.reset()
        RunDir(Path(tmp), to_yaml(run.cfg), {}).save(run, step)
        meter.record("checkpoint")


def measure_memory(
    cfg,
    *,
    steps: int = 2,
    allocator: str = "returning",
    timeout: float | None = None,
    env: dict | None = None,
):
    """Run ``steps`` steps of ``cfg`` (a Config) in a fresh child process; return its report:
    ``phases`` (load / generate / rewards / reference / update / checkpoint peaks above the
    baseline, bytes), ``peak``,
    ``baseline_bytes``, the sequence lengths it saw, parameter counts, ``seconds``.

    allocator (CPU, glibc): "returning" (freed blocks >= 128 KiB go back to the OS, so RSS
    follows live memory) or "default" (glibc's own policy); see the module docstring.
    """
    from peergrade.config import to_yaml

    if steps < 1:
        raise ValueError(f"steps={steps}: expected >= 1")
    full_env = dict(os.environ)
    if allocator == "returning":
        full_env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    elif allocator == "default":
        full_env.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        raise ValueError(f"allocator={allocator!r}: expected 'returning' or 'default'")
    full_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="peergrade-memory-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(to_yaml(cfg, comments=False))
        proc = subprocess.run(
            [sys.executable, "-m", "peergrade.planning.memory", "--child", str(path), str(steps)],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
        )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"memory measurement child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return {**json.loads(lines[-1]), "allocator": allocator}


# ----------------------------------------------------------------------------- report


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def format_table(rows: list[tuple[str, dict, dict]]) -> str:
    """``rows`` = [(label, measured report, estimate)] -> a plain-text table in MiB: the
    estimate's breakdown, estimated and measured peaks, the error, and the measured per-phase
    peaks (generate / reference / update / checkpoint); a "teacher" column (on-policy
    distillation's local teacher) when some estimate has one."""
    teacher = any(est.get("teacher") for _, _, est in rows)
    headers = [
        "config",
        "weights",
        "grads",
        "optim",
        "ref",
        "critic",
        *(["teacher"] if teacher else []),
        "act+logits",
        "est peak",
        "meas peak",
        "error %",
        "meas gen",
        "meas ref",
        "meas upd",
        "meas ckpt",
    ]
    cells = [headers]
    for label, meas, est in rows:
        ph = meas["phases"]
        err = 100.0 * (est["step_peak"] - meas["peak"]) / meas["peak"]
        cells.append(
            [
                label,
                _mib(est["weights"]),
                _mib(est["grads"]),
                _mib(est["optimizer"]),
                _mib(est["reference"]),
                _mib(est["critic"]),
                *([_mib(est.get("teacher", 0))] if teacher else []),
                _mib(est["activations"]),
                _mib(est["step_peak"]),
                _mib(meas["peak"]),
                f"{err:+.1f}",
                _mib(ph.get("generate", 0)),
                _mib(ph.get("reference", 0)),
                _mib(ph.get("update", 0)),
                _mib(ph.get("checkpoint", 0)),
            ]
        )
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        out.append(
            "  ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_estimates(rows: list[tuple[str, dict]]) -> str:
    """``rows`` = [(label, estimate)] -> a plain-text table of the estimated breakdown (MiB),
    the training step's peak, the run's peak and the phase that sets it."""
    keys = ["weights", "grads", "optimizer", "reference", "critic", "reward_models"]
    if any(est.get("teacher") for _, est in rows):  # on-policy distillation's local teacher
        keys.append("teacher")
    keys += ["activations", "kv_cache"]
    if any(est.get("producer") for _, est in rows):  # rollout.async_steps >= 1
        keys.append("producer")
    evals = any(est.get("eval_generation") for _, est in rows)
    if evals:  # the held-out evaluation's KV cache and logits, at its batch
        keys.append("eval_generation")
    cells = [["config", *keys, *(["step peak"] if evals else []), "peak", "set by"]]
    for label, est in rows:
        step = [_mib(est["step_peak"])] if evals else []
        phase = est.get("peak_phase", max(est["phases"], key=est["phases"].get))
        cells.append([label, *(_mib(est[k]) for k in keys), *step, _mib(est["peak"]), phase])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "--child":
        result = _child(argv[1], int(argv[2]))
        print(json.dumps(result), flush=True)
        return
    raise SystemExit("usage: python -m peergrade.planning.memory --child CONFIG.yaml STEPS")


if __name__ == "__main__":
    _main(sys.argv[1:])
