"""TRL compatibility: reward functions written as public TRL GRPO recipes write them
(tests/trl_recipes), over conversational and plain-text datasets in JSONL, Parquet, CSV and
``save_to_disk`` form, each run for 2 steps through the CLI in a subprocess. Every call's
keyword arguments are recorded and compared with TRL's contract: the argument names, message
completions for conversational prompts and text otherwise, the dataset columns with the values
and types ``datasets`` gives them, ``trainer_state`` progress, and what ``log_extra`` /
``log_metric`` logged landing in samples.jsonl / metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("datasets", reason="datasets is not installed (pip install datasets)")
pytest.importorskip("pandas", reason="pandas is not installed (pip install pandas)")
pytest.importorskip("math_verify", reason="math-verify is not installed")

RECIPES = Path(__file__).resolve().parents[1] / "trl_recipes"
CONTRACT = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
P, G, STEPS, MAX_LEN = 2, 2, 2, 8
OVERLONG = {"max_completion_len": MAX_LEN, "soft_punish_cache": 4}

# (file:function, bound kwargs, display_name) -> the name it is logged under
CONV_REWARDS = [
    ("recipes_a.py:accuracy_reward", {}, None, "accuracy_reward"),
    ("recipes_b.py:accuracy_reward", {}, None, "accuracy_reward_2"),  # the same __name__
    ("recipes_a.py:format_reward", {}, "think_format", "think_format"),
    ("recipes_a.py:tag_count_reward", {}, None, "tag_count_reward"),
    ("recipes_a.py:reasoning_steps_reward", {}, None, "reasoning_steps_reward"),
    ("recipes_a.py:len_reward", {}, None, "len_reward"),
    ("recipes_a.py:repetition_penalty_reward", {}, None, "repetition_penalty_reward"),
    ("recipes_a.py:curriculum_reward", {}, None, "curriculum_reward"),
    ("recipes_a.py:conv_logging_reward", {}, None, "conv_logging_reward"),
    ("recipes_a.py:async_judge_reward", {}, None, "async_judge_reward"),
    ("recipes_a.py:soft_overlong_punishment", OVERLONG, None, "soft_overlong_punishment"),
]
PLAIN_REWARDS = [
    ("recipes_a.py:exact_match", {}, None, "exact_match"),
    ("recipes_b.py:exact_match", {}, None, "exact_match_2"),
    ("recipes_a.py:token_length_reward", {}, None, "token_length_reward"),
    ("recipes_a.py:char_length_reward", {}, "chars", "chars"),
    ("recipes_a.py:ground_truth_reward", {}, None, "ground_truth_reward"),
    ("recipes_a.py:math_task_reward", {}, None, "math_task_reward"),
    ("recipes_a.py:logging_reward", {}, None, "logging_reward"),
    ("recipes_a.py:async_length_reward", {}, None, "async_length_reward"),
    ("recipes_a.py:plain_curriculum_reward", {}, None, "plain_curriculum_reward"),
    ("recipes_a.py:soft_overlong_punishment", OVERLONG, None, "soft_overlong_punishment"),
]


def conv_rows() -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "solution": str(a + b),
            "level": i % 3,
            "source": {"name": "synthetic", "id": i},
        }
        for i, (a, b) in enumerate(
            [(12, 7), (23, 41), (30, 15), (8, 9), (44, 21), (17, 17), (5, 60), (31, 2)]
        )
    ]


def plain_rows() -> list[dict]:
    return [
        {
            "prompt": f"{a}+{b}=",
            "ground_truth": a + b,
            "task": "math" if i % 4 else "other",
            "level": i % 3,
        }
        for i, (a, b) in enumerate(
            [(12, 7), (23, 41), (30, 15), (8, 9), (44, 21), (17, 17), (5, 60), (31, 2)]
        )
    ]


def write_dataset(fmt: str, tmp_path: Path) -> tuple[Path, list[dict], bool]:
    """(path, the rows as datasets.load_dataset / load_from_disk gives them, conversational)."""
    import datasets

    cache = str(tmp_path / "hf-cache")
    if fmt == "jsonl":
        p = tmp_path / "conv.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in conv_rows()))
        theirs = datasets.load_dataset("json", data_files=str(p), split="train", cache_dir=cache)
        return p, theirs.to_list(), True
    if fmt == "disk":
        p = tmp_path / "conv_ds"
        datasets.Dataset.from_list(conv_rows()).save_to_disk(str(p))
        return p, datasets.load_from_disk(str(p)).to_list(), True
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "plain.parquet"
        pq.write_table(pa.Table.from_pylist(plain_rows()), p)
        theirs = datasets.load_dataset("parquet", data_files=str(p), split="train", cache_dir=cache)
        return p, theirs.to_list(), False
    if fmt == "csv":
        p = tmp_path / "plain.csv"
        rows = plain_rows()
        p.write_text(
            ",".join(rows[0])
            + "\n"
            + "".join(",".join(str(v) for v in r.values()) + "\n" for r in rows)
        )
        theirs = datasets.load_dataset("csv", data_files=str(p), split="train", cache_dir=cache)
        return p, theirs.to_list(), False
    raise ValueError(fmt)


def key(prompt) -> str:
    return json.dumps(prompt, sort_keys=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "disk", "parquet", "csv"])
def test_trl_recipes_run_unchanged(fmt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data, theirs, conversational = write_dataset(fmt, tmp_path)
    rewards = CONV_REWARDS if conversational else PLAIN_REWARDS
    cfg = {
        "model": {"path": "bundled"},
        "data": {"path": str(data), "max_prompt_length": 64},
        "rewards": [
            {"name": str(RECIPES / spec), "kwargs": kw, "display_name": display}
            for spec, kw, display, _ in rewards
        ],
        "rollout": {"prompts_per_step": P, "group_size": G, "max_completion_length": MAX_LEN},
        "train": {
            "steps": STEPS,
            "display": "none",
            "threads": 1,
            "log_samples": P,
            "save_every": 0,
            "audit_rewards": "off",  # the start-up audit's calls would be recorded too
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "calls.jsonl"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PEERGRADE_COMPAT_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(RECIPES), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "peergrade.cli", "train", "--config", "run.yaml", "-o", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    # ---- what each function received, against TRL's contract
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    by_prompt = {key(r["prompt"]): r for r in theirs}
    columns = set(theirs[0]) - {"prompt"}
    n_rows = len(theirs)
    fns = {}
    for c in calls:
        fns.setdefault(c["fn"], []).append(c)

    def module_fn(spec: str) -> str:
        file, fn = spec.split(":")
        return f"{file.removesuffix('.py')}.{fn}"

    assert set(fns) == {module_fn(spec) for spec, *_ in rewards}
    for spec, kw, _, _ in rewards:
        fn = module_fn(spec)
        assert len(fns[fn]) == STEPS, fn  # once a step, on the whole batch
        for step, c in enumerate(fns[fn], start=1):
            assert set(c["keys"]) == CONTRACT | columns | set(kw), fn
            assert c["n"] == P * G and c["completion_ids_ok"] and c["log_callables"]
            assert c["completion_text_ok"]
            if conversational:
                assert c["prompt_forms"] == ["messages:user"], fn
                assert c["completion_forms"] == ["messages:assistant"], fn
            else:
                assert c["prompt_forms"] == ["text"] and c["completion_forms"] == ["text"], fn
            assert c["trainer_state"] == {
                "global_step": step - 1,
                "max_steps": STEPS,
                "epoch": (step - 1) * P / n_rows,
                "num_train_epochs": 1,
            }
            assert all(c["columns"][k] == v for k, v in kw.items())  # configured kwargs, bound
            # every dataset column, with the value and type datasets gives it, aligned per row
            for i, prompt in enumerate(c["prompts"]):
                row = by_prompt[key(prompt)]
                for col in columns:
                    assert c["columns"][col][i] == row[col], (fn, col)
                    assert type(c["columns"][col][i]) is type(row[col]), (fn, col)

    # ---- metrics: every function under its (disambiguated / display) name; logged metrics
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss/policy" in m]
    assert [m["step"] for m in steps] == [1, 2]
    names = [name for *_, name in rewards]
    logger = "conv_logging_reward" if conversational else "logging_reward"
    for m in steps:
        for name in names:
            if name == "math_task_reward" and f"reward/{name}/mean" not in m:
                continue  # every sampled row of this step was of the other task: not scored
            assert f"reward/{name}/mean" in m, name
        # log_metric("accuracy", mean of its rewards) is exactly that function's mean
        assert m["accuracy"] == pytest.approx(m[f"reward/{logger}/mean"])
    # ---- samples: log_extra columns per completion, each function's scores
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * P
    gt_col = "solution" if conversational else "ground_truth"
    for s in samples:
        assert set(s["rewards_by_fn"]) == set(names)
        assert s["extra"]["golden_answer"] == [str(by_prompt[key(s["prompt"])][gt_col])] * G
        assert len(s["extra"]["extracted_answer"]) == G
