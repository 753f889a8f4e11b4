"""Model FLOPs of a training step's phases, and the CPU's peak FLOP/s to hold them against.

What it does
------------
``Shape.of(config)`` reads the sizes a decoder-only transformer's FLOPs depend on from a Hugging
Face config (hidden size d, layers n, heads h, key/value heads k, head dim e, MLP width f,
vocabulary V). Counting one multiply-add as 2 FLOPs, a forward pass costs

    per token fed:            2 n (d h e + 2 d k e + h e d + m d f)     the layers' linear maps
                                                                        (m = 3 gated MLP, 2 plain)
    per (token, key) pair:    4 n h e                                   q.k and the weighted sum of v
    per logits row:           2 d V                                     the lm_head

and nothing else: embeddings are lookups, and norms, rotary embeddings, softmax, activations,
sampling and the optimizer are not counted (they are part of where the time goes, not of the
model's work). Attention is causal: a token at position t (1-based) attends to t keys, so a
sequence of L tokens run from scratch has L (L + 1) / 2 pairs and n tokens appended to a cache
of s have n s + n (n + 1) / 2. Forward + backward is 3x the forward (the backward computes the
gradients of the activations and of the weights, each one forward's worth).

What a phase counts is the work its *result* needs, each distinct piece once, whatever the
implementation recomputes or pads (that is the gap this module helps to measure):

* generation (``generation``): each distinct prompt of a group prefilled once (1 logits row),
  then every sampled token but the last fed back with a KV cache, attending to its prompt and
  the tokens before it (1 logits row each). An episode's environment tokens count as fed
  tokens like sampled ones (each is prefilled once; their logits rows are counted too, an
  overestimate of at most the environment's share of the lm_head work);
* a log-prob pass (``logprob_pass``: the reference pass, the update's old-policy pass): each
  distinct prompt once, every completion token fed against it, one logits row per counted
  completion token (the chunked lm_head runs only on those);
* the update: forward + backward over the completions whose gradient is not exactly zero
  (``update.grpo_update_work``).

``cpu_peak(dtype, cores)`` derives the CPU's peak from its clock and the widest unit its flags
(``/proc/cpuinfo``) name for the dtype; ``Peak.how`` says how. It is an estimate: the clock is
the maximum (turbo) frequency the kernel reports, or the one in /proc/cpuinfo, and two FMA units
per core are assumed (Intel Xeon Gold/Platinum since Skylake-SP; a part with one AVX-512 FMA
unit, or AMD Zen 4 with its 256-bit datapaths, reaches half: ``fma_units=1``); both are
arguments.

What it deliberately does not do: no timing (the trainer measures the phases), no model code
or config objects of peergrade (plain sizes and tensors in, ints out), no GPU peaks, no
mixture-of-experts or sliding-window attention (every layer counted as dense full attention),
no LoRA discount (a frozen weight's backward needs no weight gradient, so a LoRA update does
about 2/3 of the counted work: its achieved rate reads high by up to 1.5x).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["Shape", "Work", "split_lengths", "generation", "logprob_pass", "Peak", "cpu_peak"]


@dataclass(frozen=True)
class Shape:
    """The sizes a decoder-only transformer's FLOPs depend on."""

    hidden: int  # d
    layers: int  # n
    heads: int  # h (query heads)
    kv_heads: int  # k
    head_dim: int  # e
    intermediate: int  # f
    vocab: int  # V
    gated_mlp: bool = True  # SwiGLU (gate, up, down: Llama, Qwen, Mistral) or up + down

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From a Hugging Face config (object or dict) of the Llama/Qwen family; raises
        ``ValueError`` naming the missing key."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "vocab_size",
            )
            if get(k) is None
        ]
        if missing:
            raise ValueError(
                f"model config: no {', '.join(missing)}: FLOPs are counted for decoder-only "
                "transformers with a Llama/Qwen-style config"
            )
        d, h = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            hidden=d,
            layers=int(get("num_hidden_layers")),
            heads=h,
            kv_heads=int(get("num_key_value_heads") or h),
            head_dim=int(get("head_dim") or d // h),
            intermediate=int(get("intermediate_size")),
            vocab=int(get("vocab_size")),
            gated_mlp=get("model_type") not in ("gpt2", "gpt_neox", "opt", "phi"),
        )

    @property
    def per_token(self) -> int:
        """Forward FLOPs of the layers' linear maps for one token."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * d * self.intermediate
        return 2 * self.layers * (d * q + 2 * d * kv + q * d + mlp)

    @property
    def per_pair(self) -> int:
        """Forward FLOPs of attention for one (token, key) pair, over every layer."""
        return 4 * self.layers * self.heads * self.head_dim

    @property
    def per_logit_row(self) -> int:
        """Forward FLOPs of the lm_head for one position."""
        return 2 * self.hidden * self.vocab

    def forward(self, tokens: int, pairs: int, logit_rows: int) -> int:
        """Forward FLOPs of ``tokens`` fed, ``pairs`` attended (token, key) pairs and
        ``logit_rows`` positions projected to the vocabulary."""
        return tokens * self.per_token + pairs * self.per_pair + logit_rows * self.per_logit_row


class Work(NamedTuple):
    """What a phase fed the model: tokens, attended (token, key) pairs, logits rows; and the
    forward FLOPs of that (``Shape.forward``; a training pass multiplies by 3)."""

    tokens: int
    pairs: int
    logit_rows: int
    flops: int

    def __add__(self, other: Work) -> Work:  # type: ignore[override]
        return Work(*(a + b for a, b in zip(self, other)))

    def times(self, k: int) -> Work:
        return Work(*(k * x for x in self))


def _appended_pairs(n: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(token, key) pairs of n tokens appended to a cache of s: n s + n (n + 1) / 2."""
    return n * s + n * (n + 1) // 2


def split_lengths(attention_mask: torch.Tensor, completion_columns: int):
    """``([N], [N])`` int64 prompt and completion lengths of a training batch laid out as
    [left-padded prompt | right-padded completion], the completion being the last
    ``completion_columns`` columns of ``attention_mask`` (``[N, L]``, 1 = a token)."""
    am = attention_mask.detach().to("cpu", torch.int64)  # [N, L]
    P = am.shape[1] - completion_columns
    return am[:, :P].sum(dim=1), am[:, P:].sum(dim=1)  # [N], [N]


def _prompts_once(prompt_lens: torch.Tensor, group_size: int, rows: torch.Tensor) -> torch.Tensor:
    """``[groups]`` the prompt length of each group with a row in ``rows`` (once per group)."""
    first = torch.zeros(len(prompt_lens), dtype=torch.bool)
    groups = torch.arange(len(prompt_lens)) // group_size
    seen = torch.unique(groups[rows])
    first[seen * group_size] = True  # the group's first row stands for its prompt
    return prompt_lens[first]


def _work(shape: Shape, tokens, pairs, logits) -> Work:
    t, p, g = int(tokens), int(pairs), int(logits)
    return Work(t, p, g, shape.forward(t, p, g))


def generation(
    shape: Shape, prompt_lens: torch.Tensor, completion_lens: torch.Tensor, group_size: int
) -> Work:
    """The forward work of sampling ``completion_lens`` (``[N]``) tokens for every row, the G
    rows of a group (adjacent) answering one prompt of ``prompt_lens[i]`` tokens (``[N]``):
    the prompt prefilled once per group, then each sampled token but the last fed back."""
    p, c = prompt_lens.to("cpu", torch.int64), completion_lens.to("cpu", torch.int64)
    q = _prompts_once(p, group_size, torch.arange(len(p)))  # [groups]
    fed = (c - 1).clamp(min=0)  # [N]: the last sampled token is never fed back
    pairs = _appended_pairs(q, torch.zeros_like(q)).sum() + _appended_pairs(fed, p).sum()
    return _work(shape, q.sum() + fed.sum(), pairs, len(q) + fed.sum())


def logprob_pass(
    shape: Shape,
    prompt_lens: torch.Tensor,
    completion_lens: torch.Tensor,
    counted: torch.Tensor,
    group_size: int,
    rows: torch.Tensor | None = None,
) -> Work:
    """The forward work of one teacher-forced log-prob pass over ``rows`` (``[N]`` bool; all
    when None): each of their groups' prompts once, every completion token fed, a logits row
    per counted token (``counted``: ``[N]`` counted tokens per row, the loss mask's sums)."""
    p, c = prompt_lens.to("cpu", torch.int64), completion_lens.to("cpu", torch.int64)
    n = counted.detach().to("cpu", torch.int64)
    rows = torch.ones(len(p), dtype=torch.bool) if rows is None else rows.to("cpu", torch.bool)
    q = _prompts_once(p, group_size, rows)  # [groups with a row in the pass]
    pairs = _appended_pairs(q, torch.zeros_like(q)).sum() + _appended_pairs(c, p)[rows].sum()
    return _work(shape, q.sum() + c[rows].sum(), pairs, n[rows].sum())


# ----------------------------------------------------------------------------- the CPU's peak


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s estimate: ``flops_per_s`` for ``dtype`` on ``cores`` cores, and how."""

    dtype: str
    cores: int
    ghz: float
    per_cycle: int  # FLOPs per cycle per core
    unit: str  # the instructions the rate is quoted for
    how: str  # one sentence: cores x clock x per-cycle rate, and where each came from

    @property
    def flops_per_s(self) -> float:
        return self.cores * self.ghz * 1e9 * self.per_cycle


# FLOPs per cycle per core: lanes x 2 (a multiply-add) x FMA_UNITS, or AMX's tile rate. AMX:
# one TDPBF16PS / TDPFP16PS (16 x 32 x 16 multiply-adds, 16384 FLOPs) per 16 cycles per core.
FMA_UNITS = 2
AMX_PER_CYCLE = 1024


def _flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def _ghz(cpuinfo: str, read_sysfs: bool) -> tuple[float, str] | None:
    if read_sysfs:  # the kernel's maximum (turbo) frequency, when the machine exposes it
        try:
            with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
                return int(f.read()) / 1e6, "cpufreq's cpuinfo_max_freq"
        except (OSError, ValueError):
            pass
    m = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", cpuinfo, re.M)
    if m:
        return float(m.group(1)) / 1e3, "/proc/cpuinfo's cpu MHz"
    m = re.search(r"@\s*([0-9.]+)\s*GHz", cpuinfo)
    if m:
        return float(m.group(1)), "the model name"
    return None


def _per_cycle(dtype: str, flags: set[str], fma_units: int) -> tuple[int, str]:
    """The widest unit the flags name for ``dtype``: (FLOPs per cycle per core, its name)."""
    if dtype in ("bfloat16", "float16"):
        short = "bf16" if dtype == "bfloat16" else "fp16"
        amx, avx = f"amx_{short}", f"avx512_{short}"
        if amx in flags and "amx_tile" in flags:
            return AMX_PER_CYCLE, f"AMX tiles ({amx}: {AMX_PER_CYCLE} FLOPs/cycle/core)"
        if avx in flags:  # 32 16-bit products per 512-bit multiply-add, per FMA unit
            return fma_units * 32 * 2, f"AVX-512 {short} (32 products per op) x {fma_units} units"
        # no 16-bit arithmetic: the kernels convert to float32 and run at its rate
        per, unit = _per_cycle("float32", flags, fma_units)
        return per, f"{unit} (no {dtype} units: converted to float32)"
    if dtype != "float32":
        raise ValueError(f"cpu_peak: dtype {dtype!r}: expected float32, bfloat16 or float16")
    if "avx512f" in flags:
        return fma_units * 16 * 2, f"AVX-512 FMA (16 float32 lanes) x {fma_units} units"
    if "avx2" in flags and "fma" in flags:
        return fma_units * 8 * 2, f"AVX2 FMA (8 float32 lanes) x {fma_units} units"
    if "avx" in flags:
        return 16, "AVX (8 lanes, a multiply and an add per cycle)"
    return 8, "SSE (4 lanes, a multiply and an add per cycle)"


def cpu_peak(
    dtype: str = "float32",
    cores: int = 1,
    *,
    cpuinfo: str | None = None,
    ghz: float | None = None,
    fma_units: int = FMA_UNITS,
) -> Peak:
    """The peak FLOP/s of ``cores`` cores for ``dtype`` (float32, bfloat16, float16): cores x
    clock x the FLOPs per cycle of the widest unit /proc/cpuinfo's flags name (``cpuinfo``:
    that file's text, read from the machine when None; then the clock comes from cpufreq when
    available). ``ghz`` and ``fma_units`` override the clock and the assumed FMA units per core.
    Raises ``ValueError`` when no clock can be found and none is given."""
    read = cpuinfo is None
    if read:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    per, unit = _per_cycle(dtype, _flags(cpuinfo), fma_units)
    if ghz is not None:
        clock, src = float(ghz), "given"
    else:
        found = _ghz(cpuinfo, read and os.path.exists("/sys/devices/system/cpu"))
        if found is None:
            raise ValueError("cpu_peak: no clock frequency in /proc/cpuinfo: pass ghz=")
        clock, src = found
    how = (
        f"{cores} core(s) x {clock:.2f} GHz ({src}) x {per} {dtype} FLOPs/cycle: {unit}; "
        "an estimate (the clock under load and the units per core vary by part)"
    )
    return Peak(dtype, cores, clock, per, unit, how)
