"""Batched sampling from a Hugging Face causal LM with a KV cache -> ``Rollout``.

``generate(model, tokenizer, prompts, n=G, max_new_tokens=T, ...)`` answers every prompt ``n``
times (the ``n`` samples of one prompt are adjacent: sequence ``i`` answers prompt ``i // n``) and
returns the completion token ids, a mask of the tokens that count (and a separate loss mask), the
log-probability of every sampled token (over the full tempered distribution, and under the
sampler's own truncated one), why each sequence ended and the decoded text. It is the GRPO
rollout step; it knows nothing of rewards, configs or training.

How it is fast (compared with ``model.generate``):

- **Prefill once per prompt.** The ``n`` samples of a prompt share one prefill forward pass; the
  KV cache rows are then copied ``n`` times (prefix sharing, as vLLM's prefix cache does).
- **A preallocated KV cache.** Keys/values are written in place into a buffer of length
  ``P + max_new_tokens`` (``P`` = longest prompt of the micro-batch) instead of being
  concatenated every step, so a decode step reads the cache once and copies nothing.
- **Finished rows leave the batch.** When a sequence ends (EOS, stop string or length), its row is
  index-selected out of the running batch and the cache, so it stops costing compute. On CUDA the
  host checks for finished rows only every ``check_every`` steps (default 8) to avoid a device
  sync per token; on CPU it checks every step (a sync is free there). A prompt may have a
  token budget of its own below ``max_new_tokens`` (``budgets``: an endpoint batching requests
  of different ``max_tokens``), and ``Hooks.on_done`` hands each row over at the check after
  its end.
- **No per-step mask building.** Left padding is handled by a 4-D additive attention mask kept as
  one ``[B, P + max_new_tokens]`` row bias and sliced each step, plus explicit ``position_ids``
  (``cumsum(attention_mask) - 1``, as ``model.generate`` computes them). Models whose layers are
  not all full attention (sliding windows, ...) or whose attention implementation is not
  ``sdpa``/``eager`` take a generic path: ``DynamicCache`` and a 2-D mask that the model expands.

Sampling (one uniform number per sequence per step, inverse-CDF):

- ``temperature > 0``: ``p = softmax(logits / temperature)``; with ``top_k > 0`` only the ``top_k``
  most probable tokens are kept; with ``top_p < 1`` only the smallest set of most-probable tokens
  whose (renormalised, after top-k) mass reaches ``top_p`` is kept (the token that crosses the
  threshold is included), as in Holtzman et al. 2019 and HF's ``TopPLogitsWarper``. The token is
  drawn from the renormalised kept set by inverse CDF with a uniform ``u[i, t]``.
- ``temperature == 0``: greedy, ``argmax(logits)`` (first index on ties, as ``torch.argmax`` and
  ``model.generate(do_sample=False)``).
- The uniform ``u[i, t]`` of sequence ``i`` at decoding position ``t`` is a counter-based hash
  (splitmix64, in int64 tensor ops) of ``(seed, row_keys[i // n], i % n, t)``: the seed, the
  prompt's key (its id, e.g. its global index in the training step), the sample index within the
  prompt's group and the position. Nothing else enters: a completion draws the same uniforms
  whatever ``batch_size``, whichever other prompts share the call, in whatever order, on
  whichever process, and whenever finished rows leave the batch. Its tokens are then the same
  up to rounding differences of the forward pass at other batch shapes: a token flips when they
  move a CDF boundary across ``u``. In float32 that was never seen in the measurements; under
  bf16 autocast on the CPU, where logits differ by bf16 ulps between batch shapes, it is common
  for high-entropy distributions (docs/sampling.md has the measured rates).

**Reported log-probs** are ``log softmax(logits / temperature)[token]`` over the *full* tempered
vocabulary distribution, i.e. before top-k/top-p truncation (what vLLM and TRL report, and what a
teacher-forced forward pass at the same temperature recomputes). With ``temperature == 0`` they
are ``log softmax(logits)[token]`` of the untempered distribution. They are computed in float32
even when the model runs in bf16/fp16.

``completion_mask == 1`` marks the generated tokens that count: everything up to and including the
EOS token, or the token in which a stop string completes; 0 after. Stop strings are searched for
in the decoded text (special tokens skipped) of the last few tokens of every running sequence each
step; the completion text is cut right after the first occurrence of a stop string (text that the
same token decodes to beyond the stop string is dropped from the text but the token is kept).

What this module deliberately does not do: apply chat templates (prompts arrive as token ids or
already-templated strings, which are encoded with ``add_special_tokens=False``), beam search,
repetition penalties, speculative decoding, or multi-GPU sharding.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# One rule for positions under left padding, shared with teacher-forced log-probs (models).
from peergrade.generation.record import SamplerSettings, Samples
from peergrade.model.load import position_ids_from_mask

__all__ = [
    "SAMPLER_VOCAB_BUFFERS",
    "GenerationCancelled",
    "Hooks",
    "Rollout",
    "generate",
    "kv_bytes_per_token",
    "model_kv_bytes_per_token",
    "position_ids_from_mask",
]

#: the kernel's result is the package's one record (``record.Samples``); the old name stays
Rollout = Samples


class GenerationCancelled(RuntimeError):
    """A sampling call stopped at a step because its ``cancel`` event was set (the trainer's
    endpoint on Ctrl-C: no sampling thread outlives the run)."""

    def __init__(self) -> None:
        super().__init__("sampling was cancelled (the run is stopping)")


def check_cancel(cancel) -> None:
    """Raise ``GenerationCancelled`` if ``cancel`` (a ``threading.Event`` or None) is set."""
    if cancel is not None and cancel.is_set():
        raise GenerationCancelled()


# --------------------------------------------------------------------------------------------
# KV cache: preallocated, written in place
# --------------------------------------------------------------------------------------------


def slab_cache(num_layers: int, capacity: int, grow: bool = False):
    """A transformers ``Cache`` whose layers preallocate ``capacity`` positions and write in place.

    ``update`` returns views ``[B, H, length, D]`` of the buffers, so attention reads only the
    filled part and no step concatenates. ``batch_select_indices`` keeps chosen rows (used both to
    copy a prompt's prefill to its ``n`` samples and to drop finished rows). With ``grow`` an
    update past the capacity doubles the buffers (multi-turn episodes, whose length depends on
    what the environment answers, cannot size them up front); without it, it is an error.
    """
    from transformers.cache_utils import Cache, DynamicLayer

    class _SlabLayer(DynamicLayer):
        def __init__(self):
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states, value_states):
            b, h, _, d = key_states.shape
            self.device = key_states.device
            shape_k = (b, h, self.capacity, d)
            shape_v = (b, value_states.shape[1], self.capacity, value_states.shape[-1])
            self.keys = key_states.new_empty(shape_k)  # [B, Hkv, cap, D]
            self.values = value_states.new_empty(shape_v)  # [B, Hkv, cap, Dv]
            self.length = 0
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            q = key_states.shape[-2]
            end = self.length + q
            if end > self.capacity:
                if not grow:
                    raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
                self._grow(max(end, 2 * self.capacity))
            self.keys[:, :, self.length : end].copy_(key_states)
            self.values[:, :, self.length : end].copy_(value_states)
            self.length = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def _grow(self, capacity: int) -> None:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:])
                new[:, :, : self.length].copy_(old[:, :, : self.length])
                setattr(self, name, new)
            self.capacity = capacity

        def get_seq_length(self) -> int:
            return self.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_max_length(self) -> int:
            return self.capacity

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if not self.is_initialized:
                return
            # Copy only the filled part into fresh full-capacity buffers.
            end = self.length
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty((indices.numel(),) + tuple(old.shape[1:]))
                new[:, :, :end].copy_(old[:, :, :end].index_select(0, indices))
                setattr(self, name, new)

    return Cache(layers=[_SlabLayer() for _ in range(num_layers)])


def slab_cache_of(rows: list, capacity: int, grow: bool = False):
    """A ``slab_cache`` holding given rows' keys/values, right-aligned; returns ``(cache, width)``.

    ``rows[r]`` is row ``r``'s per-layer ``(keys [Hkv, n_r, D], values [Hkv, n_r, Dv])`` (one
    length ``n_r`` in every layer), or None for an empty row (``n_r = 0``); at least one row
    holds tokens. The cache's filled length is ``width = max n_r``: row ``r`` is in its last
    ``n_r`` columns, and the ``width - n_r`` columns before them are zeros (hole columns the
    caller hides with its attention mask; zeros, not uninitialised memory, since a NaN times a
    zero attention weight is still NaN). It does not build masks or positions.
    """
    full = [r for r in rows if r is not None]
    if not full:
        raise ValueError("slab_cache_of: every row is empty")
    width = max(r[0][0].shape[-2] for r in full)
    cache = slab_cache(len(full[0]), max(capacity, width), grow=grow)
    for i, layer in enumerate(cache.layers):
        k0, v0 = full[0][i]
        layer.device = k0.device
        layer.capacity = max(capacity, width)
        for name, t in (("keys", k0), ("values", v0)):
            buf = t.new_empty((len(rows), t.shape[0], layer.capacity, t.shape[-1]))
            buf[:, :, :width].zero_()
            setattr(layer, name, buf)
        for r, row in enumerate(rows):
            if row is not None:
                k, v = row[i]
                layer.keys[r, :, width - k.shape[-2] : width].copy_(k)
                layer.values[r, :, width - v.shape[-2] : width].copy_(v)
        layer.length = width
        layer.is_initialized = True
    return cache, width


def slab_rows(cache, real: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each row's keys/values at its real columns, hole columns dropped (``slab_cache_of``'s
    inverse): ``real`` is ``[B, length]`` bool (the filled length of the cache); returns per row
    the per-layer ``(keys [Hkv, n_r, D], values [Hkv, n_r, Dv])``, copies of the buffers."""
    counts = real.sum(1).tolist()  # one host sync for all rows, not one per row
    cols = real.nonzero()[:, 1].split(counts)
    return [
        [
            (layer.keys[r].index_select(1, at), layer.values[r].index_select(1, at))
            for layer in cache.layers
        ]
        for r, at in enumerate(cols)
    ]


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def _signed64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed64(0x9E3779B97F4A7C15)  # splitmix64's increment, 2^64 / golden ratio
_MUL1 = _signed64(0xBF58476D1CE4E5B9)
_MUL2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: it copies the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; products wrap mod 2^64 as the uint64 original's.
    Works in place on ``z`` (every caller passes a fresh tensor): int64 products are not
    vectorised on most CPUs, so sparing the temporaries counts at [N, T] sizes."""
    z ^= _shr(z, 30)
    z *= _MUL1
    z ^= _shr(z, 27)
    z *= _MUL2
    z ^= _shr(z, 31)
    return z


def _draw(state: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Output number ``counter`` (>= 0) of the splitmix64 stream whose state is ``state``."""
    return _mix64(state + (counter + 1) * _GOLDEN)


def row_states(seed: int, row_keys: torch.Tensor, n: int) -> torch.Tensor:
    """The stream state of every sequence: prompt ``row_keys[i // n]``, sample ``i % n``.

    seed: any int (its low 64 bits count); row_keys: [R] int64 >= 0. Returns [R * n] int64.
    Each level (seed -> prompt -> sample) is one draw of its parent's stream, so two sequences
    share a state only if their (seed, key, sample) do (up to 64-bit hash collisions).
    """
    dev = row_keys.device
    root = _mix64(torch.tensor(_signed64(seed & (2**64 - 1)), dtype=torch.long, device=dev))
    prompt = _draw(root, row_keys)  # [R]
    sample = torch.arange(n, dtype=torch.long, device=dev)  # [n]
    return _draw(prompt[:, None], sample[None, :]).reshape(-1)  # [R * n]


def uniforms(states: torch.Tensor, steps: int) -> torch.Tensor:
    """u[i, t] in [0, 1) for sequence state ``states[i]`` and position ``t < steps``: the top 24
    bits of draw ``t`` (every float32 multiple of 2^-24, as ``torch.rand`` gives). [B] -> [B, T]."""
    t = torch.arange(steps, dtype=torch.long, device=states.device)
    bits = _shr(_draw(states[:, None], t[None, :]), 40)  # [B, T] in [0, 2^24)
    return bits.to(torch.float32).mul_(1.0 / (1 << 24))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j with cdf[j-1] <= u * total < cdf[j] per row; never a zero-probability entry.

    probs: [B, K] non-negative (unnormalised is fine); u: [B] in [0, 1). Returns [B] long.
    """
    cdf = probs.cumsum(-1)  # [B, K]
    total = cdf[:, -1:]  # [B, 1]
    x = torch.minimum(u.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, x, right=True)  # [B, 1]
    return idx.squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def draw_tokens(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: [B, V] float32, u: [B]. Returns (tokens [B], logprobs [B]
    over the full tempered distribution, sampler log-probs [B] under the distribution drawn
    from: tempered, truncated by top-k/top-p and renormalised; 0 when greedy)."""
    if temperature == 0.0:
        tokens = logits.argmax(-1)  # [B]
        logp_all = torch.log_softmax(logits, -1)  # [B, V]
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, logp, torch.zeros_like(logp)  # greedy picks its token with probability 1
    scaled = logits if temperature == 1.0 else logits / temperature  # [B, V]
    vocab = scaled.shape[-1]
    k = vocab if top_k <= 0 else min(top_k, vocab)
    if k == vocab and top_p >= 1.0:
        # Plain sampling: one exp pass serves both the draw and the log-prob.
        # log p(tok) = scaled[tok] - max - log(sum exp(scaled - max)).
        mx = scaled.amax(-1, keepdim=True)  # [B, 1]
        e = (scaled - mx).exp_()  # [B, V]
        tokens = _inverse_cdf(e, u)
        log_z = mx.squeeze(-1) + e.sum(-1).log()  # [B]
        logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_z
        return tokens, logp, logp  # nothing truncated: the sampler's distribution is the full one
    logp_all = torch.log_softmax(scaled, -1)  # [B, V]
    if k < vocab:
        cand_logp, cand_idx = torch.topk(logp_all, k, dim=-1)  # [B, k], sorted descending
    else:
        cand_logp, cand_idx = torch.sort(logp_all, dim=-1, descending=True)  # [B, V]
    cand_p = cand_logp.exp()  # [B, k]
    if top_p < 1.0:
        cum = cand_p.cumsum(-1)  # [B, k]
        mass = cum[:, -1:]  # [B, 1] (renormalise after top-k)
        # Keep token j if the mass strictly before it is below top_p: the smallest prefix
        # reaching top_p, including the token that crosses it. Token 0 is always kept.
        keep = (cum - cand_p) < top_p * mass
        cand_p = cand_p * keep
    pick = _inverse_cdf(cand_p, u).unsqueeze(-1)  # [B, 1]
    tokens = cand_idx.gather(-1, pick).squeeze(-1)
    # the kept set renormalised: log p_kept(tok) = log p(tok) - log(mass kept)
    sampler_logp = cand_logp.gather(-1, pick).squeeze(-1) - cand_p.sum(-1).log()
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), sampler_logp


# --------------------------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------------------------


def check_sampling(caller: str, temperature, top_p, top_k) -> int:
    """The sampling settings every sampler takes (``generate``, ``envs.run_episodes``): a finite
    temperature >= 0, top_p in (0, 1], top_k an int >= 0 (returned)."""
    top_k = check_int("top_k", top_k, 0, caller)
    if (
        not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(
            f"{caller}(): temperature must be a finite number >= 0, got {temperature!r}"
        )
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"{caller}(): top_p must be in (0, 1], got {top_p!r}")
    return top_k


def check_int(name: str, value, minimum: int, caller: str = "generate") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{caller}(): {name} must be an int >= {minimum}, got {value!r}")
    return value


def _encode_prompts(tokenizer, prompts, vocab_size: int | None) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(
            "generate(): prompts must be a list of strings or of token-id lists, "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("generate(): prompts is empty; expected at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = list(tokenizer(p, add_special_tokens=False)["input_ids"])
        elif isinstance(p, torch.Tensor) and p.dim() == 1:
            ids = [int(t) for t in p.tolist()]
        elif isinstance(p, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        ):
            ids = list(p)
        else:
            raise ValueError(
                f"generate(): prompts[{i}] must be a string or a list of int token ids, "
                f"got {type(p).__name__}"
            )
        if len(ids) == 0:
            raise ValueError(f"generate(): prompts[{i}] is empty (0 tokens); expected >= 1 token")
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(
                f"generate(): prompts[{i}] has token id {bad[0]} outside [0, {vocab_size})"
            )
        out.append(ids)
    return out


def check_row_keys(row_keys, num_prompts: int) -> torch.Tensor:
    """``row_keys`` as a [num_prompts] int64 tensor (default 0..num_prompts-1), checked."""
    if row_keys is None:
        return torch.arange(num_prompts, dtype=torch.long)
    if isinstance(row_keys, torch.Tensor):
        if row_keys.dim() != 1 or row_keys.dtype.is_floating_point or row_keys.is_complex():
            raise ValueError(
                "generate(): row_keys must be a 1-D integer tensor or a list of ints, "
                f"got a {row_keys.dtype} tensor of shape {tuple(row_keys.shape)}"
            )
        keys = [int(k) for k in row_keys.tolist()]
    else:
        keys = list(row_keys)
        if any(isinstance(k, bool) or not isinstance(k, int) for k in keys):
            raise ValueError(f"generate(): row_keys must be ints, got {row_keys!r}")
    if len(keys) != num_prompts:
        raise ValueError(
            f"generate(): row_keys has {len(keys)} keys for {num_prompts} prompts; "
            "expected one key per prompt"
        )
    bad = [k for k in keys if not 0 <= k < 2**63]
    if bad:
        raise ValueError(f"generate(): row_keys must be in [0, 2**63), got {bad[0]}")
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(
            f"generate(): row_keys must be distinct (key {dup} repeats): prompts with one key "
            "would draw the same random numbers"
        )
    return torch.tensor(keys, dtype=torch.long)


def model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("generate(): model has no .config; expected a Hugging Face causal LM")
    return cfg


def slab_cache_ok(cfg) -> bool:
    """Whether the in-place slab cache with explicit 4-D masks fits the model: every layer is
    full attention and the attention implementation is ``sdpa`` or ``eager``."""
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    attn_impl = getattr(cfg, "_attn_implementation", None) or "eager"
    return all(t == "full_attention" for t in layer_types) and attn_impl in ("sdpa", "eager")


def default_eos_ids(model, tokenizer) -> list[int]:
    """The tokens that end a reply: the tokenizer's eos plus the model's
    ``generation_config.eos_token_id`` (an int or a list), sorted."""
    eos = {int(tokenizer.eos_token_id)}
    gen_cfg = getattr(model, "generation_config", None)
    gen_eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(gen_eos, int):
        eos.add(gen_eos)
    elif gen_eos is not None:
        eos.update(int(t) for t in gen_eos)
    return sorted(eos)


def eos_ids(model, tokenizer, given: Sequence[int] | None) -> list[int]:
    """The tokens that end a sequence: ``given`` (sorted, distinct), else the tokenizer's eos
    plus the model's ``generation_config.eos_token_id``."""
    if given is not None:
        return sorted({int(t) for t in given})
    return default_eos_ids(model, tokenizer)


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode without gradients for the block, then back as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


#: [N, vocab] float32 buffers a sampling step holds at once: the logits, the tempered copy,
#: its exp (or log-softmax) and the cumulative sum (or sort) the draw searches. Counted as two
#: until 2026-12-02, the SmolLM2 evaluation's growth from 128 to 1,600 rows was 16% above the
#: formula (4,060 MiB measured, 3,398 estimated; docs/memory.md); with four, 3,950: -2.7%.
#: The memory planner (``planning.memory``) and the endpoint's admission control
#: (``serving.server.row_overhead_tokens``) both count with it.
SAMPLER_VOCAB_BUFFERS = 4


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of KV cache one token of one sequence takes: keys and values of every layer,
    ``2 * layers * kv_heads * head_dim`` elements of ``element_size`` bytes (the model's
    dtype). The memory planner's and the endpoint's one formula."""
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * int(element_size)


def model_kv_bytes_per_token(model) -> int:
    """``kv_bytes_per_token`` of a loaded model: its config's layers, key/value heads and head
    size (``hidden_size / heads`` when the config has none), in its first float dtype."""
    cfg = model.config
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    return kv_bytes_per_token(cfg.num_hidden_layers, kv_heads, head_dim, size)


def forward_signature(model) -> set[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hooks:
    """What a caller serving requests follows a ``generate`` call by (the endpoint's engine):

    - ``on_tokens``: ``fn(sequences, tokens)`` after each step: the sequences (prompt ``i``'s
      sample ``j``: ``i * n + j``) that drew a counted token, and those tokens;
    - ``on_done``: ``fn(sequence, row)`` once per sequence, at the host check after its end
      (the last ones as the call ends): ``row`` holds its ``tokens``, ``logprobs``,
      ``sampler_logprobs`` (lists), ``finish`` and ``text``, as the ``Samples`` has them;
    - ``cancel``: a ``threading.Event``: once set, the call raises ``GenerationCancelled``.
      An object with ``is_set()`` and ``dropped()`` (the sequences to end at the next host
      check, their clients gone) is read the same way."""

    on_tokens: Callable[[list[int], list[int]], None] | None = None
    on_done: Callable[[int, dict], None] | None = None
    cancel: Any = None


def generate(
    model,
    tokenizer,
    prompts,
    settings: SamplerSettings | None = None,
    *,
    seed: int | None = None,
    row_keys: Sequence[int] | torch.Tensor | None = None,
    eos_token_ids: Sequence[int] | None = None,
    check_every: int | None = None,
    budgets: Sequence[int] | None = None,
    hooks: Hooks | None = None,
    **fields,
) -> Samples:
    """Sample ``settings.n`` completions for each prompt; see the module docstring for the
    exact rules.

    Args:
        model: a Hugging Face causal LM (or a peft ``PeftModel`` around one), any device/dtype.
            It is switched to eval mode and back; no gradients are recorded.
        tokenizer: its tokenizer; must define ``pad_token_id`` and ``eos_token_id``.
        prompts: strings (encoded with ``add_special_tokens=False``) or token-id lists.
        settings: how to sample (``SamplerSettings``), or its fields as keywords (``fields``):
            ``n`` samples per prompt (the GRPO group size), >= 1; ``max_new_tokens``: length
            limit, >= 1; ``temperature`` >= 0 (0 = greedy); ``top_p`` in (0, 1] (1 = off);
            ``top_k`` >= 0 (0 = off); ``stop`` strings (a single string is one stop string;
            the completion ends at the first occurrence, stop string included);
            ``batch_size``: sequences generated at once (bounds memory; None = all N at once);
            ``ignore_eos``: EOS is an ordinary token (a fixed number of tokens). The episode
            fields (``max_turns`` ...) are not read here.
        seed: the seed of every draw (a training step folds its step number into it); None
            draws one from torch's global RNG.
        row_keys: one distinct int >= 0 per prompt naming it within the seed's scope (the
            trainer passes the prompt's global index in its step, so a rank passes its shard's
            global offsets); a completion's draws depend only on (seed, its prompt's key, its
            sample index, position). Default ``range(len(prompts))``.
        eos_token_ids: tokens that end a sequence; default: the tokenizer's eos plus the model's
            ``generation_config.eos_token_id``.
        check_every: steps between host checks for finished rows; default 1 on CPU, 8 otherwise.
            With stop strings the check runs every step (the text must be decoded anyway).
        budgets: per prompt, a token limit in [1, max_new_tokens] (finish ``length`` there).
        hooks: the streaming, end-of-row and cancellation callbacks (``Hooks``).
    """
    settings = SamplerSettings.given(settings, fields, "generate")
    hooks = hooks or Hooks()
    cfg = model_config(model)
    settings = _check_settings(tokenizer, settings, eos_token_ids)
    check_every = None if check_every is None else check_int("check_every", check_every, 1)
    prompt_ids = _encode_prompts(tokenizer, prompts, getattr(cfg, "vocab_size", None))
    max_new_tokens = settings.max_new_tokens
    _check_context(prompt_ids, max_new_tokens, getattr(cfg, "max_position_embeddings", None))
    eos_token_ids = eos_ids(model, tokenizer, eos_token_ids)
    device = next(model.parameters()).device
    num_seq = len(prompt_ids) * settings.n
    budgets = _check_budgets(budgets, len(prompt_ids), max_new_tokens)
    keys = check_row_keys(row_keys, len(prompt_ids))
    states = row_states(seed_of(seed), keys.to(device), settings.n)  # [N]
    runner = _Runner.of(
        model,
        tokenizer,
        cfg,
        settings=settings,
        eos_token_ids=torch.tensor(eos_token_ids, dtype=torch.long, device=device),
        check_every=check_every,
        on_tokens=hooks.on_tokens,
        budgets=budgets,
        on_done=hooks.on_done,
        cancel=hooks.cancel,
    )
    step = settings.batch_size or num_seq
    starts = range(0, num_seq, step)
    with eval_mode(model):
        parts = [runner.run(prompt_ids, states, i, min(i + step, num_seq)) for i in starts]
    return _assemble(parts, prompt_ids, settings.n, tokenizer.pad_token_id, device)


def _check_settings(tokenizer, settings: SamplerSettings, eos_token_ids) -> SamplerSettings:
    """``generate``'s sampling settings checked, with ``top_k`` an int and ``temperature`` /
    ``top_p`` floats."""
    n = check_int("n", settings.n, 1)
    max_new_tokens = check_int("max_new_tokens", settings.max_new_tokens, 1)
    if settings.batch_size is not None:
        check_int("batch_size", settings.batch_size, 1)
    top_k = check_sampling("generate", settings.temperature, settings.top_p, settings.top_k)
    if any(not isinstance(s, str) or s == "" for s in settings.stop):
        raise ValueError(f"generate(): stop must be non-empty strings, got {settings.stop!r}")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "generate(): tokenizer has no pad token (tokenizer.pad_token_id is None); "
            "set tokenizer.pad_token first (e.g. to the eos token)"
        )
    if tokenizer.eos_token_id is None and eos_token_ids is None:
        raise ValueError(
            "generate(): tokenizer has no eos token (tokenizer.eos_token_id is None); "
            "set tokenizer.eos_token or pass eos_token_ids"
        )
    return settings.replace(
        n=n,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        temperature=float(settings.temperature),
        top_p=float(settings.top_p),
    )


def _check_budgets(budgets, num_prompts: int, max_new_tokens: int) -> list[int] | None:
    if budgets is None:
        return None
    budgets = list(budgets)
    if len(budgets) != num_prompts or any(
        isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 1 <= b <= max_new_tokens
        for b in budgets
    ):
        raise ValueError(
            f"generate(): budgets must be {num_prompts} ints in [1, max_new_tokens="
            f"{max_new_tokens}], one per prompt, got {budgets!r}"
        )
    return [int(b) for b in budgets]


def _check_context(prompt_ids: list[list[int]], max_new_tokens: int, max_pos: int | None) -> None:
    """Every prompt plus ``max_new_tokens`` fits the model's context."""
    if max_pos is None:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > max_pos:
            raise ValueError(
                f"generate(): prompts[{i}] has {len(ids)} tokens; with max_new_tokens="
                f"{max_new_tokens} that exceeds the model's context "
                f"(max_position_embeddings={max_pos})"
            )


def cut_after_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the end of the first stop string in it (kept, as ``generate`` keeps it);
    the whole text when none is in it."""
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def seed_of(seed) -> int:
    """The draws' seed: ``seed``, or one from torch's global RNG when None."""
    if seed is None:
        return int(torch.randint(0, 2**62, ()).item())
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"generate(): seed must be an int or None, got {seed!r}")
    return int(seed)


def _assemble(parts: list[dict], prompt_ids, n: int, pad_id: int, device) -> Samples:
    """The micro-batches' results as one ``Samples``, every part padded to the longest
    completion."""
    c = max(p["tokens"].shape[1] for p in parts)
    num_seq = len(prompt_ids) * n

    def cat(key, fill, dt):
        rows = []
        for p in parts:
            t = p[key]
            if t.shape[1] < c:
                t = torch.cat([t, t.new_full((t.shape[0], c - t.shape[1]), fill)], 1)
            rows.append(t.to(dt))
        return torch.cat(rows, 0)

    return Samples(
        prompt_ids=[list(prompt_ids[i // n]) for i in range(num_seq)],
        completion_ids=cat("tokens", pad_id, torch.long),
        completion_mask=cat("mask", 0.0, torch.float32),
        logprobs=cat("logprobs", 0.0, torch.float32),
        sampler_logprobs=cat("sampler_logprobs", 0.0, torch.float32),
        finish_reason=[r for p in parts for r in p["finish"]],
        completion_text=[t for p in parts for t in p["text"]],
        prompt_index=torch.arange(num_seq, device=device) // n,
    )


@dataclass
class _Runner:
    """Generates one micro-batch of sequences [start, end) (global indices) with the sampling
    settings of one ``generate`` call."""

    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    settings: SamplerSettings  # checked (``_check_settings``)
    eos_token_ids: torch.Tensor  # [E] long
    check_every: int  # host-side stop checks every this many tokens
    on_tokens: Callable[[list[int], list[int]], None] | None  # generate's streaming hook
    budgets: list[int] | None  # per prompt: its sequences' token limit (None: max_new_tokens)
    on_done: Callable[[int, dict], None] | None  # each sequence's result, as it ends
    cancel: Any  # a threading.Event: set, the call stops at its next step
    fast: bool  # every layer full attention with sdpa/eager: the in-place slab cache
    cache_kw: str  # the forward's name for the KV cache argument
    bool_mask: bool  # sdpa takes a boolean attention mask
    logits_to_keep: bool  # the forward accepts logits_to_keep
    num_layers: int

    @property
    def n(self) -> int:  # samples per prompt
        return self.settings.n

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    @property
    def stop(self) -> tuple[str, ...]:
        return self.settings.stop

    @property
    def ignore_eos(self) -> bool:
        return self.settings.ignore_eos

    @property
    def sampling(self) -> tuple[float, float, int]:  # temperature (0 = greedy), top-p, top-k
        s = self.settings
        return s.temperature, s.top_p, s.top_k

    @classmethod
    def of(cls, model, tokenizer, cfg, *, check_every: int | None, **settings) -> _Runner:
        """The runner for ``model``: its device and float dtype, the cache and mask its forward
        takes, and how often finished rows are checked (every step with stop strings: the text
        must be decoded anyway; else 1 on the CPU, 8 elsewhere)."""
        device = next(model.parameters()).device
        float_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        dtype = next(
            (p.dtype for p in model.parameters() if p.dtype in float_dtypes), torch.float32
        )
        if check_every is None:
            check_every = 1 if device.type == "cpu" else 8
        if settings["settings"].stop:
            check_every = 1
        sig = forward_signature(model)
        return cls(
            model=model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            check_every=check_every,
            fast=slab_cache_ok(cfg),
            cache_kw="cache" if "cache" in sig else "past_key_values",
            bool_mask=(getattr(cfg, "_attn_implementation", None) or "eager") == "sdpa",
            logits_to_keep="logits_to_keep" in sig,
            num_layers=cfg.num_hidden_layers,
            **settings,
        )

    def _forward(self, input_ids, mask, position_ids, cache, last_only: bool):
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            self.cache_kw: cache,
            "use_cache": True,
        }
        if last_only and self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float()  # [B, V]

    def _prefill(self, prompt_ids, start: int, end: int):
        """Each unique prompt of sequences [start, end) run once, its cache rows copied to the
        sequences that answer it. Returns ``(logits [b, V], next positions [b], cache,
        visible [b, cap], prompt length)``: ``visible`` says which cache slots each row may
        attend to (a bool or additive mask with the slab cache, a 0/1 mask otherwise)."""
        dev, n, T = self.device, self.n, self.max_new_tokens
        b = end - start
        # Unique prompts of this micro-batch and how many of its sequences answer each.
        pidx = [i // n for i in range(start, end)]
        uniq = sorted(set(pidx))
        counts = torch.tensor([pidx.count(u) for u in uniq], device=dev)
        lens = [len(prompt_ids[u]) for u in uniq]
        p_len = max(lens)
        cap = p_len + T

        ids = torch.full((len(uniq), p_len), self.tokenizer.pad_token_id, dtype=torch.long)
        real = torch.zeros((len(uniq), p_len), dtype=torch.bool)
        for r, u in enumerate(uniq):
            ids[r, p_len - lens[r] :] = torch.tensor(prompt_ids[u], dtype=torch.long)
            real[r, p_len - lens[r] :] = True
        ids, real = ids.to(dev), real.to(dev)  # [U, P]
        pos = position_ids_from_mask(real)  # [U, P]
        expand = torch.repeat_interleave(torch.arange(len(uniq), device=dev), counts)  # [b]

        # ---- prefill (once per unique prompt) ----
        neg = torch.finfo(self.dtype).min
        if self.fast:
            cache = slab_cache(self.num_layers, cap)
            causal = torch.ones(p_len, p_len, dtype=torch.bool, device=dev).tril_()
            allowed = causal & (real[:, None, :] | torch.eye(p_len, dtype=torch.bool, device=dev))
            # Key-visibility per row over the whole capacity (pads hidden): a bool mask for sdpa
            # (True = attend; faster than an additive one on CPU), additive 0 / min for eager.
            key_ok = torch.ones((len(uniq), cap), dtype=torch.bool, device=dev)
            key_ok[:, :p_len] = real
            key_ok = key_ok.index_select(0, expand)  # [b, cap]
            if self.bool_mask:
                mask4, visible = allowed, key_ok
            else:
                mask4 = torch.zeros(allowed.shape, dtype=self.dtype, device=dev)
                mask4.masked_fill_(~allowed, neg)  # [U, P, P]
                visible = torch.zeros((b, cap), dtype=self.dtype, device=dev)
                visible.masked_fill_(~key_ok, neg)  # [b, cap]
            logits = self._forward(ids, mask4[:, None], pos, cache, last_only=True)
            cache.batch_select_indices(expand)
        else:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            logits = self._forward(ids, real.long(), pos, cache, last_only=True)
            cache.batch_select_indices(expand)
            visible = torch.ones((b, cap), dtype=torch.long, device=dev)
            visible[:, :p_len] = real.long().index_select(0, expand)
        logits = logits.index_select(0, expand)  # [b, V]
        next_pos = pos[:, -1].index_select(0, expand) + 1  # [b]

        return logits, next_pos, cache, visible, p_len

    def run(self, prompt_ids, states, start: int, end: int) -> dict:
        dev, T, b = self.device, self.max_new_tokens, end - start
        logits, next_pos, cache, visible, p_len = self._prefill(prompt_ids, start, end)

        tokens_out = torch.full((b, T), self.tokenizer.pad_token_id, dtype=torch.long, device=dev)
        logp_out = torch.zeros((b, T), dtype=torch.float32, device=dev)
        sampler_out = torch.zeros((b, T), dtype=torch.float32, device=dev)
        finished_at = torch.full((b,), T, dtype=torch.long, device=dev)  # T = not finished
        ends = _Ends(self, start, b, finished_at)
        rows = torch.arange(b, device=dev)  # local index of each running row
        u_local = uniforms(states[start:end], T)  # [b, T]
        out = (tokens_out, logp_out, sampler_out, finished_at)

        cur = p_len  # cache length before this step's token
        for t in range(T):
            check_cancel(self.cancel)
            tok, logp, sampler_logp = draw_tokens(logits, u_local[rows, t], *self.sampling)
            tokens_out[rows, t] = tok
            logp_out[rows, t] = logp
            sampler_out[rows, t] = sampler_logp
            if self.on_tokens is not None:  # rows not finished before this step: counted
                counted = finished_at[rows] == T
                self.on_tokens((rows[counted] + start).tolist(), tok[counted].tolist())
            ends.mark(t, tok, rows)
            if t == T - 1:
                break
            if (t + 1) % self.check_every == 0:
                self._drop_left(rows, start, t, finished_at)
                alive = finished_at[rows] == T  # [B]
                n_alive = int(alive.sum().item())
                if n_alive < rows.numel():
                    ends.report(rows[~alive].tolist(), out)
                if n_alive == 0:
                    break
                if n_alive < rows.numel():
                    keep = alive.nonzero().squeeze(-1)
                    rows, tok = rows[keep], tok[keep]
                    next_pos = next_pos[keep]
                    cache.batch_select_indices(keep)
                    visible = visible.index_select(0, keep)
            if self.fast:
                step_mask = visible[:, None, None, : cur + 1]  # [B, 1, 1, cur+1]
            else:
                step_mask = visible[:, : cur + 1]
            logits = self._forward(tok[:, None], step_mask, next_pos[:, None], cache, False)
            next_pos = next_pos + 1
            cur += 1

        ends.report(range(b), out)  # the rows still running at the end
        return self._finish(tokens_out, logp_out, sampler_out, finished_at, ends.finishes())

    def _drop_left(self, rows: torch.Tensor, start: int, t: int, finished_at) -> None:
        """Rows nobody waits for any more end at step ``t``: ``cancel.dropped()``, when the
        cancel object has it (the endpoint's: its clients that disconnected), names their
        sequences (global indices); the call goes on with the others."""
        dropped = getattr(self.cancel, "dropped", None)
        gone = dropped() if dropped is not None else None
        if not gone:
            return
        T = self.max_new_tokens
        for i in rows.tolist():
            if start + i in gone and int(finished_at[i]) == T:
                finished_at[i] = t

    def _finish(self, tokens_out, logp_out, sampler_out, finished_at, reason) -> dict:
        """The micro-batch's result: masks up to each row's end (its first EOS, the token
        where a stop string completed, or its budget), ``reason`` (``_Ends.finishes``), texts
        cut after their stop string."""
        T, b = self.max_new_tokens, tokens_out.shape[0]
        dev = tokens_out.device
        length = torch.where(finished_at < T, finished_at + 1, T)  # [b]
        col = torch.arange(T, device=dev)
        mask = (col[None, :] < length[:, None]).float()  # [b, T]
        c = int(length.max().item())
        tokens_out = tokens_out.masked_fill(mask == 0, self.tokenizer.pad_token_id)[:, :c]
        logp_out = (logp_out * mask)[:, :c]
        sampler_out = (sampler_out * mask)[:, :c]
        mask = mask[:, :c]
        len_l = length.tolist()
        tok_lists = tokens_out.tolist()
        texts = self.tokenizer.batch_decode(
            [tok_lists[r][: len_l[r]] for r in range(b)], skip_special_tokens=True
        )
        for r in range(b):
            if reason[r] == "stop":
                texts[r] = cut_after_stop(texts[r], self.stop)
        return {
            "tokens": tokens_out,
            "mask": mask,
            "logprobs": logp_out,
            "sampler_logprobs": sampler_out,
            "finish": reason,
            "text": texts,
        }


class _Ends:
    """How and where the rows of one micro-batch end: EOS, a stop string, a budget (``mark``,
    every step), and ``on_done`` called once per row (``report``)."""

    def __init__(self, runner: _Runner, start: int, b: int, finished_at: torch.Tensor):
        self.r, self.start, self.finished_at = runner, start, finished_at
        self.T = runner.max_new_tokens
        self.reason = ["length"] * b  # "stop" where a stop string ended the row
        self.hist = [[] for _ in range(b)] if runner.stop else None
        self.window = (max(len(s) for s in runner.stop) + 8) if runner.stop else 0
        self.cut = self.budget = None  # rows ended by their budget; each row's budget
        if runner.budgets is not None:
            per_row = [runner.budgets[(start + i) // runner.n] for i in range(b)]
            self.budget = torch.tensor(per_row, dtype=torch.long, device=finished_at.device)
            self.cut = torch.zeros(b, dtype=torch.bool, device=finished_at.device)
        self.reported: set[int] = set()

    def mark(self, t: int, tok: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows whose token ``t`` ends them: the first EOS, then a stop string, then the
        budget (a row's first end counts; between host checks a finished row keeps running)."""
        r, T, finished_at = self.r, self.T, self.finished_at
        if not r.ignore_eos:
            fin = finished_at[rows]  # [B]
            finished_at[rows] = torch.where(torch.isin(tok, r.eos_token_ids) & (fin == T), t, fin)
        if r.stop:
            rows_l = rows.tolist()
            for i, tk in zip(rows_l, tok.tolist()):
                self.hist[i].append(tk)
            fin_l = finished_at[rows].tolist()
            tails = r.tokenizer.batch_decode(
                [self.hist[i][-self.window :] for i in rows_l], skip_special_tokens=True
            )
            for i, f, tail in zip(rows_l, fin_l, tails):
                if f == T and any(s in tail for s in r.stop):
                    finished_at[i] = t
                    self.reason[i] = "stop"
        if self.budget is not None:
            fin = finished_at[rows]
            hit = (self.budget[rows] == t + 1) & (fin == T)
            finished_at[rows] = torch.where(hit, t, fin)
            self.cut[rows] |= hit

    def finishes(self) -> list[str]:
        """Each row's finish reason: ``stop``, ``eos`` (ended before ``T``, not by its
        budget) or ``length``."""
        fin = self.finished_at.tolist()
        cut = self.cut.tolist() if self.cut is not None else [False] * len(fin)
        return [
            "stop" if why == "stop" else "eos" if f < self.T and not c else "length"
            for why, f, c in zip(self.reason, fin, cut)
        ]

    def report(self, rows, out) -> None:
        """``on_done`` for each of ``rows`` (local indices) not reported yet."""
        if self.r.on_done is None:
            return
        tokens_out, logp_out, sampler_out, _ = out
        new = [i for i in rows if i not in self.reported]
        if not new:
            return
        self.reported.update(new)
        finishes, fin = self.finishes(), self.finished_at.tolist()
        for i in new:
            n = fin[i] + 1 if fin[i] < self.T else self.T
            ids = tokens_out[i, :n].tolist()
            text = self.r.tokenizer.decode(ids, skip_special_tokens=True)
            if finishes[i] == "stop":
                text = cut_after_stop(text, self.r.stop)
            row = {
                "tokens": ids,
                "logprobs": logp_out[i, :n].tolist(),
                "sampler_logprobs": sampler_out[i, :n].tolist(),
                "finish": finishes[i],
                "text": text,
            }
            self.r.on_done(self.start + i, row)
