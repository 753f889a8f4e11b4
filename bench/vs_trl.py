"""peergrade vs TRL's GRPOTrainer, side by side on the CPU: seconds per step, generation
throughput and peak memory on the same random-init Qwen2 models, prompts and reward.

The workload (issue 17): P = 4 prompts x G = 8 completions, 32 new tokens, loss ``dapo``,
lr 1e-5, temperature 1, one optimizer step per batch, prompts of ``--prompt-len`` characters
(one token each: a character tokenizer padded to the model's vocabulary). Each measurement is a
fresh child process per framework (so each side's imports and peak memory are its own), run
alternately A B, B A, ... (``--passes``); each child runs ``--steps`` steps and times all but
the first (warm-up). The table gives medians over passes.

The reward is a deterministic hash of the completion text, in [0, 1), the same function for
both frameworks (TRL's reward-function contract, which peergrade accepts unchanged):

    --signal all    every group has reward signal (so peergrade's zero-advantage elision cannot
                    flatter it: no completion has advantage exactly 0)
    --signal mix    half the prompts are "alike" (every completion scores 0: zero advantages,
                    as when a group is all right or all wrong), the other half hashed

Two comparisons (``--compare``), so a reader can tell an algorithmic lead from a precision one:

    equal     the same precision and the same gradient checkpointing on both sides: float32
              (peergrade ``model.autocast: off``, TRL ``bf16=False``), checkpointing as the
              setting says (off for kl and nokl, on for kl-ckpt) on both
    default   each tool as it comes: peergrade ``model.autocast: auto`` and
              ``model.gradient_checkpointing: auto`` (decided as ``peergrade train`` decides
              them), TRL's GRPOConfig defaults (``bf16=True``, ``gradient_checkpointing=True``);
              the setting's checkpointing is not applied

Printed per row: seconds per step, wall and CPU (each child's own CPU time, which another
process's load does not stretch: on a shared machine the steadier measure), generated tokens
per second of generation time (peergrade: its rollout; TRL: the time inside
``model.generate``), peak RSS of the child during the steps, each ratio peergrade / TRL (< 1 is
better for seconds and memory, > 1 for tokens/s), what precision and checkpointing each side
ran, the CPU's bf16 units and the load average when the row ended. ``--write-results`` stores
the table with the commit in bench/RESULTS.md.

    pip install "torch==2.13.0" -e ".[bench]"   # TRL (needs no torch of its own: the pin holds)
    OMP_NUM_THREADS=1 python bench/vs_trl.py --sizes 34m --rows kl:mix,nokl:all  # issue 59's
    python bench/vs_trl.py --sizes 1m --settings kl --passes 1 --steps 2   # a quick look

``--profile`` runs one peergrade child under cProfile instead and prints where its step time
goes (generate / reference / update and the top functions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = {
    "1m": dict(vocab=2000, hidden=128, layers=4, heads=4, kv_heads=2, inter=512),
    "34m": dict(vocab=32000, hidden=512, layers=6, heads=8, kv_heads=2, inter=1408),
}
# name -> (beta, gradient checkpointing)
SETTINGS = {"kl": (0.04, False), "nokl": (0.0, False), "kl-ckpt": (0.04, True)}

REWARD_SRC = '''
import zlib


def hashed(prompts, completions, **kwargs):
    """A deterministic score in [0, 1) per completion; 0 for every completion of an "alike"
    prompt (those starting with "=")."""
    out = []
    for p, c in zip(prompts, completions):
        p = p if isinstance(p, str) else p[-1]["content"]
        c = c if isinstance(c, str) else c[-1]["content"]
        out.append(0.0 if p.startswith("=") else (zlib.crc32(c.encode()) % 1000) / 1000)
    return out
'''


def make_prompts(n: int, length: int, signal: str) -> list[str]:
    """``n`` prompts of ``length`` characters; with ``signal == "mix"`` every other one is
    "alike" (starts with "="), so half the groups score alike."""
    words = "what is the sum of the numbers below when each is doubled and then halved again "
    out = []
    for i in range(n):
        body = (f"{i}: " + words * (length // len(words) + 1))[: length - 1]
        out.append(("=" if signal == "mix" and i % 2 == 0 else "Q") + body)
    return out


# ----------------------------------------------------------------------------- children


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def child_peergrade(a) -> dict:
    import torch

    from peergrade.config import load_config
    from peergrade.planning.memory import resolve_checkpointing
    from peergrade.training.trainer import setup, train_step
    from peergrade.training.update import use_bf16_autocast

    _threads(a.threads)
    beta, ckpt = SETTINGS[a.setting]
    over = [
        ("model.path", a.model),
        ("model.device", "cpu"),
        ("data.path", a.data),
        ("data.use_chat_template", False),
        ("rollout.prompts_per_step", a.prompts),
        ("rollout.group_size", a.group),
        ("rollout.max_completion_length", a.new_tokens),
        ("algo.loss_type", "dapo"),
        ("algo.beta", beta),
        ("optim.lr", 1e-5),
        ("train.seed", 0),
        ("train.threads", a.threads),
    ]
    if a.compare == "equal":  # float32 and the setting's checkpointing, as TRL's side
        over += [("model.autocast", "off"), ("model.gradient_checkpointing", ckpt)]
    over += [(k, json.loads(v)) for k, v in (kv.split("=", 1) for kv in a.peergrade_set)]
    over.append(("rewards", [{"name": f"{a.reward}:hashed", "weight": 1.0}]))
    cfg = load_config(None, over)
    resolve_checkpointing(cfg)  # gradient_checkpointing auto, as peergrade train decides it
    run = setup(cfg)
    policy = run.models.policy
    bf16 = use_bf16_autocast(cfg.model.autocast, run.models.device, policy)
    rows = run.task.train_rows(0)
    times, cpus, gen_tok, gen_s = [], [], 0, 0.0
    phases = {"generate": 0.0, "ref": 0.0, "update": 0.0}
    _common.peak_rss_reset()
    for step in range(1, a.steps + 1):
        batch = [next(rows) for _ in range(a.prompts)]
        t0, c0 = time.perf_counter(), time.process_time()
        m = train_step(run, step, batch).metrics
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step > 1:
            times.append(dt)
            cpus.append(dc)
            gen_tok += m["perf/tokens_per_s"] * m["time/generate_s"]
            gen_s += m["time/generate_s"]
            phases["generate"] += m["time/generate_s"]
            phases["ref"] += m["time/ref_s"]
            phases["update"] += m["time/update_s"]
    del torch
    n = max(len(times), 1)
    return {
        "step_s": sum(times) / n,
        "cpu_s": sum(cpus) / n,
        "gen_tok_s": gen_tok / max(gen_s, 1e-9),
        "peak_rss": _common.peak_rss(),
        "phases": {k: v / n for k, v in phases.items()},
        "ran": f"{'bf16' if bf16 else 'fp32'}, ckpt {_on(cfg.gradient_checkpointing_on('cpu'))}",
    }


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def child_trl(a) -> dict:
    import importlib.util

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _threads(a.threads)
    if a.trl_compact:  # the fused head scores the completion positions only, as on a GPU
        import trl.trainer.utils as trl_utils

        trl_utils._use_triton = lambda device: True  # read there only to choose compact
    beta, ckpt = SETTINGS[a.setting]
    spec = importlib.util.spec_from_file_location("bench_reward", a.reward)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(a.data) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    ds = Dataset.from_list([{"prompt": p} for p in prompts])
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32")
    gen = {"s": 0.0, "tok": 0}
    orig = model.generate

    def timed_generate(*args, **kw):  # generation time, as TRL's transformers path runs it
        t0 = time.perf_counter()
        out = orig(*args, **kw)
        gen["s"] += time.perf_counter() - t0
        ids = kw.get("input_ids", args[0] if args else None)
        new = out[:, ids.shape[1] :] if ids is not None else out
        gen["tok"] += int((new != tok.pad_token_id).sum())
        return out

    model.generate = timed_generate
    times: list[float] = []
    cpus: list[float] = []
    marks = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
            marks["gen0"] = (gen["s"], gen["tok"])

        def on_step_end(self, args, state, control, **kw):
            if state.global_step > 1:  # the first step is the warm-up
                times.append(time.perf_counter() - marks["t0"])
                cpus.append(time.process_time() - marks["c0"])
                marks.setdefault("gen", [0.0, 0])
                marks["gen"][0] += gen["s"] - marks["gen0"][0]
                marks["gen"][1] += gen["tok"] - marks["gen0"][1]

    # equal: float32 and the setting's checkpointing, as peergrade's side; default: TRL's own
    # (GRPOConfig: bf16=True, gradient_checkpointing=True)
    precision = {"bf16": False, "gradient_checkpointing": ckpt} if a.compare == "equal" else {}
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=a.prompts * a.group,
            gradient_accumulation_steps=1,
            num_generations=a.group,
            max_completion_length=a.new_tokens,
            learning_rate=1e-5,
            beta=beta,
            loss_type="dapo",
            temperature=1.0,
            max_steps=a.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
            **precision,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[mod.hashed],
            args=cfg,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Timer()],
        )
        _common.peak_rss_reset()
        trainer.train()
    n = max(len(times), 1)
    g = marks.get("gen", [0.0, 0])
    return {
        "step_s": sum(times) / n,
        "cpu_s": sum(cpus) / n,
        "gen_tok_s": g[1] / g[0] if g[0] > 0 else float("nan"),
        "peak_rss": _common.peak_rss(),
        "ran": f"{'bf16' if cfg.bf16 else 'fp32'}, ckpt {_on(cfg.gradient_checkpointing)}",
    }


# ----------------------------------------------------------------------------- parent


def _child_argv(framework: str, a, model: str, setting: str, compare: str = "equal") -> list[str]:
    argv = [
        os.path.abspath(__file__),
        "--child",
        framework,
        "--model",
        model,
        "--data",
        a.data,
        "--reward",
        a.reward,
        "--setting",
        setting,
        "--steps",
        str(a.steps),
        "--prompts",
        str(a.prompts),
        "--group",
        str(a.group),
        "--new-tokens",
        str(a.new_tokens),
        "--threads",
        str(a.threads),
        "--compare",
        compare,
    ]
    for kv in a.peergrade_set:
        argv += ["--peergrade-set", kv]
    return argv + (["--trl-compact"] if a.trl_compact else [])


def _commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def profile(a, model: str, setting: str) -> None:
    """One peergrade child under cProfile: the phases and the top functions by own time."""
    argv = _child_argv("peergrade", a, model, setting)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    prof = os.path.join(a.tmp, "peergrade.prof")
    subprocess.run([sys.executable, "-m", "cProfile", "-o", prof, *argv], check=True, env=env)
    import pstats

    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=["peergrade", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--reward", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="kl", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="1m,34m", help=f"comma-separated of {', '.join(SIZES)}")
    ap.add_argument(
        "--settings",
        default="kl,nokl",
        help=f"comma-separated of {', '.join(SETTINGS)} (kl: beta 0.04; nokl: beta 0; "
        "-ckpt: gradient checkpointing on)",
    )
    ap.add_argument("--signal", default="mix,all", help="comma-separated of mix, all")
    ap.add_argument(
        "--compare",
        default="equal,default",
        help="comma-separated of equal (float32 and the setting's checkpointing on both "
        "sides), default (each tool's own defaults)",
    )
    ap.add_argument(
        "--rows",
        help="only these setting:signal pairs, comma-separated (e.g. kl:mix,nokl:all); "
        "default: every setting x every signal",
    )
    ap.add_argument("--passes", type=int, default=3, help="alternating passes (medians)")
    ap.add_argument("--steps", type=int, default=3, help="steps per child (first = warm-up)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=32, help="max new tokens")
    ap.add_argument("--prompt-len", type=int, default=100, help="prompt length in tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child")
    ap.add_argument(
        "--peergrade-set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra peergrade config override, e.g. algo.skip_zero_advantage=false",
    )
    ap.add_argument(
        "--baseline",
        metavar="SRC",
        help="also time another peergrade checkout's src/ (e.g. main's) as a third side",
    )
    ap.add_argument("--baseline-label", default="", help="how RESULTS.md names the baseline")
    ap.add_argument(
        "--trl-compact",
        action="store_true",
        help="a diagnostic, not TRL as shipped: TRL's fused lm_head scores only the completion "
        "positions on the CPU too (TRL 1.16 does so only where Triton runs, on GPUs; on a CPU "
        "it scores every position, prompt included)",
    )
    ap.add_argument("--profile", action="store_true", help="profile one peergrade child")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    a = ap.parse_args()

    if a.child:
        fn = child_peergrade if a.child == "peergrade" else child_trl
        _common.emit(fn(a))
        return

    rows, t_start = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        a.tmp = tmp
        a.reward = os.path.join(tmp, "reward.py")
        Path(a.reward).write_text(REWARD_SRC)
        env = {"OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
        for size in a.sizes.split(","):
            model = os.path.join(tmp, size)
            n_params = _common.build_random_qwen2(model, SIZES[size])
            for signal in a.signal.split(","):
                a.data = os.path.join(tmp, f"prompts-{signal}.jsonl")
                n = a.prompts * (a.steps + 1)
                with open(a.data, "w") as f:
                    for p in make_prompts(n, a.prompt_len, signal):
                        f.write(json.dumps({"prompt": p}) + "\n")
                for setting in a.settings.split(","):
                    if a.rows and f"{setting}:{signal}" not in a.rows.split(","):
                        continue
                    if a.profile:
                        profile(a, model, setting)
                        return
                    for compare in a.compare.split(","):
                        row = measure_row(a, env, model, setting, compare)
                        row[:0] = [f"{size} ({n_params / 1e6:.1f}M)", compare, setting, signal]
                        rows.append(row)
                        print(" | ".join(row), flush=True)
    headers = [
        "model",
        "compare",
        "setting",
        "signal",
        "peergrade s/step",
        "TRL s/step",
        "ratio",
        "CPU s/step (pg / TRL)",
        "CPU ratio",
        "ran (pg / TRL)",
        "gen tok/s ratio",
        "peak RSS MiB (pg / TRL)",
        "RSS ratio",
        "pg gen/ref/update s",
        "CPU bf16 units",
        "load (1 min)",
    ]
    if a.baseline:
        headers += ["baseline s/step", "baseline ratio"]
    load = _common.load_note()
    print()
    print(_common.format_table(headers, rows))
    print(load)
    if a.write_results:
        write_results(headers, rows, load, a, time.time() - t_start)


def measure_row(a, env: dict, model: str, setting: str, compare: str) -> list[str]:
    """One row's cells after its labels: both sides (and the baseline) alternated, medians."""
    from peergrade.training.update import cpu_bf16_kind

    def side(fw, extra_env=None):
        return lambda: _common.run_child(
            _child_argv(fw, a, model, setting, compare),
            env={**env, **(extra_env or {})},
            timeout=3600,
        )

    sides = {"peergrade": side("peergrade"), "trl": side("trl")}
    if a.baseline:
        sides["baseline"] = side("peergrade", {"PYTHONPATH": os.path.abspath(a.baseline)})
    res = _common.alternate(sides, a.passes)
    keys = ("step_s", "cpu_s", "gen_tok_s", "peak_rss")
    med = {fw: {k: _common.median([r[k] for r in rs]) for k in keys} for fw, rs in res.items()}
    pg, trl = med["peergrade"], med["trl"]
    ph = {
        k: _common.median([r["phases"][k] for r in res["peergrade"]])
        for k in ("generate", "ref", "update")
    }
    row = [
        f"{pg['step_s']:.2f}",
        f"{trl['step_s']:.2f}",
        f"{pg['step_s'] / trl['step_s']:.2f}",
        f"{pg['cpu_s']:.2f} / {trl['cpu_s']:.2f}",
        f"**{pg['cpu_s'] / trl['cpu_s']:.2f}**",
        f"{res['peergrade'][0]['ran']} / {res['trl'][0]['ran']}",
        f"{pg['gen_tok_s'] / trl['gen_tok_s']:.2f}x",
        f"{pg['peak_rss'] / 2**20:.0f} / {trl['peak_rss'] / 2**20:.0f}",
        f"{pg['peak_rss'] / trl['peak_rss']:.2f}",
        f"{ph['generate']:.2f}/{ph['ref']:.2f}/{ph['update']:.2f}",
        cpu_bf16_kind() or "none",
        f"{os.getloadavg()[0]:.1f}",
    ]
    if base := med.get("baseline"):
        row += [f"{base['step_s']:.2f}", f"{base['step_s'] / trl['step_s']:.2f}"]
    return row


def write_results(headers, rows, load, a, wall) -> None:
    import torch

    path = Path(__file__).resolve().parent / "RESULTS.md"
    md = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    try:
        import trl

        trl_v = trl.__version__
    except ImportError:  # pragma: no cover
        trl_v = "?"
    text = (
        "# bench/vs_trl.py: latest results\n\n"
        f"Commit {_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"torch {torch.__version__}, TRL {trl_v}; {a.threads} thread(s) per child, "
        f"{a.passes} alternating passes x {a.steps} steps (first = warm-up), medians; "
        f"P = {a.prompts}, G = {a.group}, {a.new_tokens} new tokens, "
        f"{a.prompt_len}-token prompts, loss dapo, lr 1e-5. Wall {wall / 60:.0f} min."
        + (f" Baseline: {a.baseline} ({a.baseline_label})." if a.baseline else "")
        + "\n\n"
        f"Machine: {load}.\n\n" + "\n".join(md) + "\n\n"
        "ratio = peergrade / TRL wall seconds per step (< 1: peergrade faster); CPU ratio = "
        "the same in each child's CPU seconds (the steadier figure on a shared machine); ran = "
        "the precision and gradient checkpointing each side ran; gen tok/s ratio = "
        "peergrade / TRL generated tokens per second of generation; RSS = peak resident memory "
        "of each child during its steps; load = the 1-minute load average when the row ended. "
        "Reproduce: `python bench/vs_trl.py --write-results`.\n"
    )
    # the other benchmarks' sections (each a "# bench/NAME" heading) are kept as they are
    old = path.read_text() if path.exists() else ""
    rest = old.find("\n# bench/", 1)
    path.write_text(text + (old[rest:] if rest != -1 else ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
