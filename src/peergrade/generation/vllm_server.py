"""vLLM as the rollout engine in another process: a vLLM OpenAI server, started by the trainer
or given by URL (``rollout.vllm_mode server``; docs/engines.md).

``VllmServerEngine`` is a ``VllmEngine`` whose engine is a server: the same ``sample`` and
episode turn sampler, the same keyed seeds and the same ends and log-probs
(``vllm_engine._samples_of`` and ``_TurnSampler`` read the ``EngineRow`` s this module makes
from the server's JSON), only the transport differs:

- **Sampling.** Each (prompt, sample) is one ``/v1/completions`` request with token-id
  prompts, ``n=1`` and its own ``seed`` (``kernel.row_states``, as colocated), ``logprobs=0``
  and ``return_token_ids`` (the sampled ids and vLLM's processed log-probs, never re-encoded
  text), the kernel's EOS ids as ``stop_token_ids`` with ``ignore_eos``, stop strings kept in
  the output. Requests are sent concurrently, so the server batches them.
- **Weights.** After every optimizer step ``push`` sends the policy's tensors through vLLM's
  weight-transfer routes (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``), then resets the server's prefix cache
  (``/reset_prefix_cache``). On one machine the backend is ``peergrade_shm``
  (``vllm_plugin``: a safetensors file in ``/dev/shm``, loaded by vLLM's layerwise reload); a
  CUDA policy with a server on another GPU or host uses vLLM's own NCCL trainer engine
  (``NCCLTrainerWeightTransferEngine``; wired, not run: no GPU here).
- **Started by the trainer** (no URL): the policy's weights are saved once to a temporary
  directory, ``python -m vllm.entrypoints.openai.api_server`` starts on a free loopback port
  with the flags the colocated engine passes to ``LLM`` (processed log-probs; on a CPU eager,
  whole-prompt prefill and an explicit KV cache) plus the weight-transfer backend, the trainer
  waits for ``/health``, and ``close`` (the run's end, an error, Ctrl-C) stops it; the server
  also gets SIGTERM if the trainer dies.
- **Given by URL**: the server must run ``VLLM_SERVER_DEV_MODE=1`` (vLLM's weight-transfer
  and cache routes) with ``--logprobs-mode processed_logprobs`` and the weight-transfer
  backend above; its weights are replaced by the policy's at the first call.

The trainer's side needs no vLLM for a server given by URL on the same machine (plain HTTP
and a safetensors file).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any

import torch

from peergrade.errors import ConfigError
from peergrade.generation.record import SamplerSettings
from peergrade.generation.vllm_engine import (
    EngineRow,
    VllmEngine,
    _base_model,
    _dtype_name,
    hf_weights,
)
from peergrade.generation.vllm_plugin import BACKEND, PROTOCOL

__all__ = ["VllmServerEngine", "check_server", "row_of_choice", "server_flags"]

#: the model name the trainer's own server serves under
SERVED_NAME = "peergrade-policy"
#: concurrent HTTP requests per call (the server batches what arrives together)
MAX_IN_FLIGHT = 64


class VllmServerEngine(VllmEngine):
    """A vLLM server as the rollout engine (see the module docstring). ``url``: the server
    (None: start one, and stop it at ``close``); ``timeout``: seconds to wait for the server's
    start and for each request; the other arguments are ``VllmEngine``'s, passed to a server
    the trainer starts."""

    def __init__(self, *, url: str | None = None, timeout: float = 240.0, **kw):
        super().__init__(**kw)
        self.url = url.rstrip("/") if url else None
        self.timeout = float(timeout)
        self.backend: str | None = None  # the weight-transfer backend in use
        self.start_s: float | None = None  # seconds the trainer's server took to answer
        self.push_s: list[float] = []  # seconds of each push
        self._proc: subprocess.Popen | None = None
        self._pusher: Any = None

    # ------------------------------------------------------------------ start and stop

    def _start(self, model, tokenizer) -> None:
        if self.llm is not None:
            return
        device = next(_base_model(model).parameters()).device
        if self.url is None:
            t0 = time.perf_counter()
            self._launch(model, tokenizer, device)
            self.start_s = time.perf_counter() - t0
        else:  # another machine's server takes a CUDA policy's weights by NCCL
            check_server(self.url, min(self.timeout, 30.0))
            nccl = device.type == "cuda" and not _loopback(self.url)
            self.backend = "nccl" if nccl else BACKEND
        client = _Client(self.url, self.timeout)
        self._pusher = (_NcclPusher if self.backend == "nccl" else _ShmPusher)(client)
        self.llm = client  # started: VllmEngine's push and _hold load weights through _load
        if self._proc is None:
            self._load(model)  # a server given by URL holds other weights
        else:  # the trainer's server was started from the policy's weights as they are now
            self._holds = (weakref.ref(model), self._tags.get(model))
            self.version = self._tags.get(model)

    def _launch(self, model, tokenizer, device) -> None:
        """Save the policy once, start a vLLM server on it, wait for ``/health``."""
        self._dir = tempfile.TemporaryDirectory(prefix="peergrade-vllm-server-")
        d = self._dir.name
        base = _base_model(model)
        base.config.save_pretrained(d)
        tokenizer.save_pretrained(d)
        _save_weights(model, os.path.join(d, "model.safetensors"))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.backend = BACKEND
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if device.type == "cuda" and torch.cuda.device_count() > 1:  # another GPU: NCCL
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            last = str(torch.cuda.device_count() - 1)
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[-1] if visible else last
            self.backend = "nccl"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", d]
        cmd += server_flags(base, device, port, self.backend, self)
        main = threading.main_thread()
        log = open(os.path.join(d, "server.log"), "wb")  # noqa: SIM115 (the process's)
        self._proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the trainer, which stops it (close)
            # SIGTERM when this thread ends: the main thread's end is the trainer's
            preexec_fn=_die_with_parent if threading.current_thread() is main else None,
        )
        log.close()
        atexit.register(self._stop)  # an exit that skips close
        try:
            _wait_healthy(self.url, self._proc, self.timeout, os.path.join(d, "server.log"))
        except BaseException:
            self._stop()
            raise

    def close(self) -> None:
        """Stop the trainer's server (a server given by URL is left running) and forget the
        weights it holds; a later ``sample`` starts again."""
        with self._lock:
            if self._pusher is not None:
                with contextlib.suppress(Exception):
                    self._pusher.close()
            self._pusher, self.llm, self.version, self._holds = None, None, None, None
            self._stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.url = None  # the next start picks a new port
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # vLLM shuts its engine down on SIGTERM
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: only its processes
                proc.wait(10)

    # ------------------------------------------------------------------ weights and samples

    def _load(self, model) -> None:
        with self._lock, torch.no_grad():
            t0 = time.perf_counter()
            version = self._tags.get(model)
            self._pusher.push(model, None if version is None else str(version))
            self._reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.push_s.append(time.perf_counter() - t0)
            self.pushes += 1
            self.version = version
            self._holds = (weakref.ref(model), version)

    def _reset_prefix_cache(self) -> None:
        """vLLM's prefix cache emptied (it refuses while blocks are held: retried briefly)."""
        for _ in range(50):
            if (self.llm.post("reset_prefix_cache") or {}).get("success", True):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"vLLM server {self.url}: /reset_prefix_cache kept failing after a weight push "
            "(requests still running on it?)"
        )

    def _sample_rows(self, model, prompts, limits, states, settings, eos) -> list[EngineRow]:
        with self._lock:
            self._hold(model)
            bodies = [
                _request(settings, list(p), k, state, eos)
                for p, k, state in zip(prompts, limits, states)
            ]
            return self.llm.complete(bodies)


def server_flags(base, device, port: int, backend: str, engine: VllmEngine) -> list[str]:
    """The ``vllm serve`` flags of the trainer's server: as the colocated engine builds its
    ``LLM`` (``VllmEngine._start``), plus the weight-transfer backend."""
    flags = [
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        _dtype_name(base),
        "--seed",
        "0",  # every request brings its own seed
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",  # sampling settings come from the request only
        "--enable-prefix-caching",
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
    ]
    if engine.max_model_len is not None:
        flags += ["--max-model-len", str(engine.max_model_len)]
    if device.type == "cpu":  # see VllmEngine._start: whole prompts, as the CPU needs
        longest = engine.max_model_len or getattr(base.config, "max_position_embeddings", 0)
        flags += [
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(int((engine.kv_cache_gb or 1.0) * (1 << 30))),
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(int(longest or 0), 8192)),
        ]
    else:
        flags += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
        if engine.kv_cache_gb is not None:
            flags += ["--kv-cache-memory-bytes", str(int(engine.kv_cache_gb * (1 << 30)))]
    return flags


def check_server(url: str, timeout: float) -> None:
    """``url`` answers ``/health`` (a ``ConfigError`` naming it otherwise)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:
            if r.status == 200:
                return
            why = f"HTTP {r.status}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = str(getattr(e, "reason", e))
    raise ConfigError(
        f"rollout.vllm_server_url {url}: no vLLM server answers there ({why}); start one "
        "(docs/engines.md, 'A vLLM server') or leave the key null to let the trainer start it"
    )


# ----------------------------------------------------------------------------- HTTP


class _Client:
    """JSON over HTTP to one vLLM server (stdlib only)."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.model = self._model_name()

    def _model_name(self) -> str:
        data = self.get("v1/models")["data"]
        if not data:
            raise ConfigError(f"vLLM server {self.url}: /v1/models lists no model")
        return data[0]["id"]

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(f"{self.url}/{path}"))

    def post(self, path: str, body: Any = None) -> Any:
        data = b"" if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}/{path}", data=data, headers={"Content-Type": "application/json"}
        )
        return self._call(req)

    def _call(self, req: urllib.request.Request) -> Any:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            hint = _HINTS.get(e.code, "")
            raise RuntimeError(
                f"vLLM server {self.url}: {req.get_method()} {req.full_url} -> HTTP {e.code}: "
                f"{detail}{hint}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(
                f"vLLM server {self.url}: {req.get_method()} {req.full_url} failed: "
                f"{getattr(e, 'reason', e)} (the server stopped or is unreachable)"
            ) from None
        return json.loads(raw) if raw else None

    def complete(self, bodies: list[dict]) -> list[EngineRow]:
        """One ``/v1/completions`` call per body, concurrently; rows in body order."""
        if not bodies:
            return []
        workers = min(len(bodies), MAX_IN_FLIGHT)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            outs = list(pool.map(self._complete_one, bodies))
        return outs

    def _complete_one(self, body: dict) -> EngineRow:
        return row_of_choice(self.post("v1/completions", {"model": self.model, **body}))


_HINTS = {
    404: " (vLLM's weight-transfer and cache routes need VLLM_SERVER_DEV_MODE=1 on the server)",
}


def _request(settings: SamplerSettings, prompt: list[int], max_tokens: int, state: int, eos):
    """The ``/v1/completions`` body of one sequence, as ``vllm_engine._params`` sets
    ``SamplingParams`` for the colocated engine."""
    stop = list(settings.stop)
    return {
        "prompt": prompt,
        "n": 1,
        "max_tokens": int(max_tokens),
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k if settings.top_k > 0 else -1,
        "seed": int(state) & (2**63 - 1),
        "logprobs": 0,
        "return_token_ids": True,
        "stop": stop or None,
        "include_stop_str_in_output": True,
        "stop_token_ids": list(eos) or None,
        "ignore_eos": True,  # EOS is the kernel's set (stop_token_ids), or none
        "skip_special_tokens": True,
    }


def row_of_choice(response: dict) -> EngineRow:
    """A ``/v1/completions`` response of one sequence as an ``EngineRow``."""
    c = response["choices"][0]
    toks = [int(t) for t in c.get("token_ids") or []]
    lps = (c.get("logprobs") or {}).get("token_logprobs") or []
    if len(lps) != len(toks):
        raise RuntimeError(
            f"vLLM server: a completion returned {len(toks)} token ids and {len(lps)} "
            "log-probs (the request asks logprobs=0 and return_token_ids)"
        )
    return EngineRow(toks, [float(x) for x in lps], c.get("finish_reason"), c.get("stop_reason"))


# ----------------------------------------------------------------------------- weights


class _ShmPusher:
    """``peergrade_shm``: the policy's tensors to a safetensors file in shared memory, its path
    through vLLM's weight-transfer routes (``vllm_plugin``)."""

    def __init__(self, client: _Client):
        self.client = client
        root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._dir = tempfile.TemporaryDirectory(prefix="peergrade-push-", dir=root)
        self._n = 0
        try:
            client.post("init_weight_transfer_engine", {"init_info": {"protocol": PROTOCOL}})
        except RuntimeError as e:
            raise RuntimeError(
                f"{e}\nThe server must run with --weight-transfer-config "
                f'\'{{"backend": "{BACKEND}"}}\' and peergrade installed beside vLLM (its '
                "plugin; docs/engines.md)"
            ) from None

    def push(self, model, version: str | None) -> None:
        self._n += 1
        path = os.path.join(self._dir.name, f"weights-{self._n}.safetensors")
        _save_weights(model, path)
        try:
            self.client.post("start_weight_update")
            self.client.post("update_weights", {"update_info": {"path": path}})
            self.client.post("finish_weight_update", {"weight_version": version})
        finally:
            os.unlink(path)

    def close(self) -> None:
        self._dir.cleanup()


class _NcclPusher:
    """vLLM's NCCL trainer engine (``NCCLTrainerWeightTransferEngine`` through
    ``HTTPVLLMWeightSyncClient``): the trainer is rank 0 of a group with the server's workers
    and broadcasts the policy's tensors on its GPU. Wired from vLLM's code; not run here (no
    GPU)."""

    def __init__(self, client: _Client):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.client = client
        self.sync = HTTPVLLMWeightSyncClient(client.url, timeout=client.timeout)
        self.engine = None
        self.source = None

    def push(self, model, version: str | None) -> None:
        if self.engine is None:
            self._init(model)
        self.source.model = model
        self.engine.send_weights()  # start, update (with the broadcast), finish
        if version is not None:
            self.client.post("update_weight_version", {"new_version": version})

    def _init(self, model) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        workers = int(self.client.get("get_world_size")["world_size"])
        host = urllib.parse.urlparse(self.client.url).hostname or "127.0.0.1"
        address = "127.0.0.1" if _loopback(self.client.url) else _own_address(host)
        info = NCCLTrainerInitInfo(
            master_address=address, master_port=_free_port(), world_size=workers + 1, rank=0
        )
        self.source = _hf_source(model)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.sync, source=self.source
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def _hf_source(model):
    """vLLM's ``WeightSource`` over ``hf_weights(model)`` (the names vLLM loads)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _Source(WeightSource):
        def __init__(self, m):
            self.model = m

        def metadata(self):
            return [ParamMeta(k, t.dtype, tuple(t.shape)) for k, t in hf_weights(self.model)]

        def __iter__(self):
            return iter(_named_tensors(self.model))

    return _Source(model)


def _named_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """``hf_weights(model)``, every name (a tied ``lm_head.weight`` too: on vLLM's CPU backend
    the LM head packs its own copy of the tied embedding, which is packed again only when that
    name arrives), contiguous."""
    return [(k, t.contiguous()) for k, t in hf_weights(model)]


def _save_weights(model, path: str) -> None:
    """``model``'s weights (``_named_tensors``) to one safetensors file; a tensor under a
    second name (tied) is written twice (safetensors stores no shared tensors)."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for k, t in _named_tensors(model):
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        out[k] = t.cpu().clone() if t.numel() and key in seen else t.cpu()
        seen.add(key)
    save_file(out, path)


# ----------------------------------------------------------------------------- processes


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    """Until ``url/health`` answers 200; an error with the server's log if it exits or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the vLLM server the trainer started ({url}) exited with code "
                f"{proc.returncode} before it answered:\n{_tail(log)}"
            )
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"the vLLM server the trainer started ({url}) did not answer /health within "
        f"{timeout:g} s (rollout.vllm_server_timeout):\n{_tail(log)}"
    )


def _tail(path: str, lines: int = 25) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return "(no log)"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback(url: str | None) -> bool:
    host = urllib.parse.urlparse(url or "").hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _own_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (the NCCL rendezvous the server's
    workers join)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the trainer dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
