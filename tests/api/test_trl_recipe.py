"""TRL / open-r1 recipe files (``peergrade train --trl-config``): open-r1's reward names give
the same values as open-r1's definitions (re-written below from its formulas) on shared
completions, a recipe YAML runs through the CLI with later --section.key overrides applied,
and what cannot work here (a Hub dataset, a refused field) is one clear error."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from cli_helper import cli
from peergrade.api import OPEN_R1_REWARDS, recipe_overrides
from peergrade.config import ConfigError, load_config
from peergrade.model.load import BUNDLED_MODEL
from peergrade.rewards import resolve_reward

# ----------------------------------------------------------------- open-r1's definitions


def _mv_correct(text: str, sol: str):
    """open-r1: the solution's first parse; the completion's first LaTeX answer, boxed first."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(sol, extraction_mode="first_match", parsing_timeout=None)
    if len(gold) == 0:
        return None
    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False,
            malformed_operators=False,
            basic_latex=True,
            equations=True,
            boxed="all",
            units=True,
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    pred = parse(
        text, extraction_config=[config], extraction_mode="first_match", parsing_timeout=None
    )
    return verify(gold, pred, timeout_seconds=None)


def ref_accuracy(texts, solutions, **_):
    out = []
    for t, s in zip(texts, solutions):
        ok = _mv_correct(t, s)
        out.append(None if ok is None else float(ok))
    return out


def ref_format(texts, **_):
    rx = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
    return [1.0 if re.match(rx, t, re.DOTALL | re.MULTILINE) else 0.0 for t in texts]


def ref_tag_count(texts, **_):
    def count(t):
        return sum(
            0.25
            for tag in ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
            if t.count(tag) == 1
        )

    return [count(t) for t in texts]


def ref_reasoning_steps(texts, **_):
    rx = r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)"
    return [min(1.0, len(re.findall(rx, t)) / 3) for t in texts]


def ref_length(texts, solutions, **_):
    correct = [_mv_correct(t, s) is not False for t, s in zip(texts, solutions)]
    lens = [len(t) for t in texts]
    if max(lens) == min(lens):
        return [0.0] * len(texts)
    lam = [0.5 - (n - min(lens)) / (max(lens) - min(lens)) for n in lens]
    return [v if ok else min(0.0, v) for v, ok in zip(lam, correct)]


def ref_cosine(texts, solutions, *, mvw=-1.0, xvw=-0.5, mvc=0.5, xvc=1.0, max_len=1000, **_):
    out = []
    for t, s in zip(texts, solutions):
        ok = _mv_correct(t, s)
        if ok is None:
            out.append(1.0)
            continue
        lo, hi = (mvc, xvc) if ok else (xvw, mvw)
        out.append(lo + 0.5 * (hi - lo) * (1.0 + math.cos(len(t) / max_len * math.pi)))
    return out


def ref_repetition(texts, *, n=3, max_penalty=-1.0, **_):
    out = []
    for t in texts:
        words = t.lower().split()
        if t == "" or len(words) < n:
            out.append(0.0)
            continue
        grams = list(zip(*[words[i:] for i in range(n)]))
        out.append((1 - len(set(grams)) / len(grams)) * max_penalty)
    return out


def ref_overlong(ids, *, max_len=16384, cache=4096, **_):
    start = max_len - cache
    return [
        0.0 if len(x) <= start else (start - len(x)) / cache if len(x) <= max_len else -1.0
        for x in ids
    ]


TEXTS = [
    "<think>\nadd the tens\n</think>\n<answer>\n\\boxed{19}\n</answer>",
    "<think>\nadd\n</think>\n<answer>\n$20$\n</answer>\ntrailing words",
    "<think>add</think><answer>19</answer>",
    "<think>\n<think>\nx\n</think>\n<answer>\n19\n</answer>",
    "Step 1: add units. Step 2: add tens. Finally, the answer is $\\frac{1}{2}$.",
    "1. first line\n2. second\n- a bullet\n* another",
    "First, the cat sat. Second, the cat sat. Next, The Cat Sat. the cat sat",
    "",
    "19",
    "The answer is \\boxed{0.5} and \\boxed{3}",
]
SOLUTIONS = ["19", "19", "19", "19", "$\\frac{1}{2}$", "7", "7", "7", "19", "$\\frac{1}{2}$"]


@pytest.mark.parametrize(
    "name, ref",
    [
        ("accuracy", ref_accuracy),
        ("format", ref_format),
        ("tag_count", ref_tag_count),
        ("reasoning_steps", ref_reasoning_steps),
        ("length", ref_length),
        ("cosine", ref_cosine),
        ("repetition_penalty", ref_repetition),
    ],
)
def test_open_r1_names_give_open_r1_values(name, ref):
    pytest.importorskip("math_verify")
    builtin, kwargs = OPEN_R1_REWARDS[name]
    fn = resolve_reward(builtin)
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    prompts = [[{"role": "user", "content": "12+7="}]] * len(TEXTS)
    ours = fn(prompts=prompts, completions=completions, solution=SOLUTIONS, **kwargs({}))
    theirs = ref(TEXTS, solutions=SOLUTIONS)
    assert ours == pytest.approx(theirs), (name, ours, theirs)
    assert len(set(theirs)) > 1, "the shared completions must tell values apart"


def test_open_r1_script_arguments_reach_the_rewards():
    script = {
        "cosine_min_value_wrong": -2.0,
        "cosine_max_value_wrong": -0.2,
        "cosine_max_len": 40,
        "repetition_n_grams": 2,
        "repetition_max_penalty": -0.5,
        "max_completion_len": 10,
        "soft_punish_cache": 4,
    }
    pytest.importorskip("math_verify")
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    prompts = [[{"role": "user", "content": "q"}]] * len(TEXTS)
    cos = resolve_reward("openr1_cosine")
    got = cos(prompts, completions, solution=SOLUTIONS, **OPEN_R1_REWARDS["cosine"][1](script))
    assert got == pytest.approx(ref_cosine(TEXTS, SOLUTIONS, mvw=-2.0, xvw=-0.2, max_len=40))
    rep = resolve_reward("repetition_penalty")
    kw = OPEN_R1_REWARDS["repetition_penalty"][1](script)
    assert rep(prompts, completions, **kw) == pytest.approx(
        ref_repetition(TEXTS, n=2, max_penalty=-0.5)
    )
    ids = [[0] * n for n in (3, 6, 7, 9, 10, 11, 40)]
    over = resolve_reward("overlong_penalty")
    kw = OPEN_R1_REWARDS["soft_overlong_punishment"][1](script)
    got = over(["p"] * len(ids), ["c"] * len(ids), completion_ids=ids, **kw)
    assert got == pytest.approx(ref_overlong(ids, max_len=10, cache=4))


# ----------------------------------------------------------------- recipe files


def _dataset(tmp_path: Path) -> Path:
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
        for a, b in [(12, 7), (23, 41), (30, 15), (8, 9), (44, 21), (17, 17)]
    ]
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _recipe(tmp_path: Path, **extra) -> Path:
    """open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml, key for key, with the
    model, the dataset (no Hub here) and the sizes changed for the tiny model, plus the
    reward settings of open-r1's newer recipes."""
    recipe = {
        # Model arguments
        "model_name_or_path": str(BUNDLED_MODEL),
        "model_revision": "main",
        "torch_dtype": "float32",
        "attn_implementation": "sdpa",
        # Data training arguments
        "dataset_name": str(_dataset(tmp_path)),
        "dataset_configs": ["all"],
        "num_processes": 7,
        "system_prompt": "Answer with the number.",
        "reward_funcs": ["accuracy", "format", "tag_count"],
        "reward_weights": [1.0, 0.5, 0.25],
        # GRPO trainer config
        "bf16": False,
        "use_vllm": True,
        "vllm_device": "auto",
        "vllm_gpu_memory_utilization": 0.7,
        "do_eval": True,
        "eval_strategy": "steps",
        "eval_steps": 100,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": False,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "hub_model_id": "Qwen2.5-1.5B-Open-R1-GRPO",
        "hub_strategy": "every_save",
        "learning_rate": 3.0e-04,
        "log_completions": True,
        "log_level": "info",
        "logging_first_step": True,
        "logging_steps": 1,
        "logging_strategy": "steps",
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "max_prompt_length": 64,
        "max_completion_length": 8,
        "max_steps": -1,
        "num_generations": 2,
        "num_train_epochs": 1,
        "output_dir": str(tmp_path / "run"),
        "overwrite_output_dir": True,
        "per_device_eval_batch_size": 32,
        "per_device_train_batch_size": 2,
        "push_to_hub": True,
        "report_to": ["none"],
        "save_strategy": "epoch",
        "save_total_limit": 1,
        "seed": 42,
        "warmup_ratio": 0.1,
    }
    recipe.update(extra)
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(recipe))
    return p


def test_recipe_becomes_the_config_it_describes(tmp_path):
    pytest.importorskip("math_verify")
    with pytest.warns(UserWarning) as got:
        cfg = load_config(None, recipe_overrides(_recipe(tmp_path)))
    text = " ".join(str(w.message) for w in got)
    assert len(got) == 1  # the keys that mean nothing here, reported once
    for name in ("use_vllm", "vllm_device", "hub_model_id", "push_to_hub", "num_processes"):
        assert name in text
    assert cfg.model.path == str(BUNDLED_MODEL) and cfg.model.dtype == "float32"
    assert [r.name for r in cfg.rewards] == ["openr1_accuracy", "openr1_format", "openr1_tag_count"]
    assert [r.weight for r in cfg.rewards] == [1.0, 0.5, 0.25]
    assert [r.display_name for r in cfg.rewards] == ["accuracy", "format", "tag_count"]
    # 2 completions per device x 2 accumulation / groups of 2 = 2 prompts a step
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step) == (2, 2)
    assert (cfg.optim.lr_schedule, cfg.optim.min_lr_ratio) == ("cosine", 0.1)
    # one epoch of 6 rows at 2 prompts a step; a checkpoint each epoch; 10% warmup
    assert cfg.train.steps == 3 and cfg.train.save_every == 3 and cfg.train.keep_last == 1
    assert cfg.optim.warmup_steps == 1 and cfg.train.eval_every == 100
    assert cfg.data.system_prompt == "Answer with the number."
    assert cfg.data.max_prompt_length == 64
    assert cfg.train.eval_batch_size == 32  # per_device_eval_batch_size: sequences at once


def test_recipe_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="Hugging Face Hub"):
        recipe_overrides(_recipe(tmp_path, dataset_name="AI-MO/NuminaMath-TIR"))
    with pytest.raises(ConfigError, match=r"'optim'.*AdamW"):
        recipe_overrides(_recipe(tmp_path, optim="adafactor"))
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\] 'code'.*code_tests"):
        recipe_overrides(
            _recipe(tmp_path, reward_funcs=["accuracy", "code"], reward_weights=[1.0, 1.0])
        )
    with pytest.raises(ConfigError, match="unknown key 'num_generatons'.*'num_generations'"):
        recipe_overrides(_recipe(tmp_path, num_generatons=4))
    with pytest.raises(ConfigError, match="chat_template.*tokenizer"):
        recipe_overrides(_recipe(tmp_path, chat_template="{{ messages }}"))
    with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs"):
        recipe_overrides(_recipe(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": True}))


def test_cli_hub_dataset_is_one_error_line(tmp_path):
    r = cli(
        ["train", "--trl-config", str(_recipe(tmp_path, dataset_name="org/hub-only"))], cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: dataset_name 'org/hub-only'")


@pytest.mark.slow
def test_open_r1_recipe_runs_with_trl_config(tmp_path):
    pytest.importorskip("math_verify")
    recipe = _recipe(tmp_path)
    r = cli(["train", "--trl-config", str(recipe), "--train.steps", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("peergrade ignores") == 1  # the meaningless keys, reported once
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if not m.get("final")]
    assert [m["step"] for m in steps] == [1, 2]  # --train.steps after the recipe wins
    for name in ("accuracy", "format", "tag_count"):
        assert f"reward/{name}/mean" in steps[0]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["rollout"]["group_size"] == 2 and saved["rollout"]["prompts_per_step"] == 2
