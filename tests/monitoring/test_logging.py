"""Logging backends (train.report_to) and what a run logs: each backend writes something that
reads back with its own reader (TensorBoard's EventAccumulator, trackio's store, the W&B
offline run file), under the same metric names as metrics.jsonl; a missing package is named
before the model loads; samples.jsonl carries each reward function's values; a step whose loss
is NaN is skipped with the parameters untouched, counted and reported.

Backend tests skip when the package is absent (CI installs them through the ``test`` extra).
trackio and W&B run in a subprocess: both read their storage location from the environment
when imported, and a test must not write into the user's home.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.config import ConfigError, load_config
from peergrade.errors import InputError
from peergrade.files import read_jsonl
from peergrade.monitoring.metrics import MetricLogger, check_backends
from peergrade.training import checkpoint as ckpt

LINES = [
    {"step": 0, "eval/pass@1_greedy": 0.25, "eval/n": 200},
    {"step": 1, "reward/total/mean": 0.5, "loss/policy": -0.01, "alerts": {"x": "y"}},
    {"step": 2, "reward/total/mean": 0.75, "loss/policy": 0.02, "alert/kl_blowup": 1.0},
]


def tiny_overrides(model_dir: Path, reward_path: Path, **extra) -> list[tuple[str, object]]:
    base = {
        "model.path": str(model_dir),
        "rewards": [
            {"name": f"{reward_path}:char_score", "weight": 1.0},
            {"name": f"{reward_path}:length_score", "weight": 0.5},
        ],
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_completion_length": 4,
        "optim.lr": 1e-2,
        "train.eval_size": 2,
        "train.eval_samples": 2,
        "train.display": "none",
        "train.log_samples": 1,
        "train.threads": 1,
        "train.steps": 2,
    }
    base.update(extra)
    return list(base.items())


REWARD_FILE = """
def _text(c):  # chat completions (the built-in tasks' prompts are messages) or plain text
    return c[0]["content"] if isinstance(c, list) else c

def char_score(prompts, completions, **kwargs):
    return [(sum(ord(ch) for ch in _text(c)) % 97) / 97.0 for c in completions]

def length_score(prompts, completions, **kwargs):
    return [float(len(_text(c))) for c in completions]
"""


@pytest.fixture
def reward_file(tmp_path) -> Path:
    p = tmp_path / "two_rewards.py"
    p.write_text(REWARD_FILE)
    return p


# ----------------------------------------------------------------------------- selection


def test_unknown_backend_is_a_config_error_with_a_suggestion():
    with pytest.raises(ConfigError, match="train.report_to.*'tensorboard'"):
        load_config(None, [("train.report_to", ["tensorbord"])])
    assert load_config(None, [("train.report_to", ["wandb", "trackio"])]).train.report_to == [
        "wandb",
        "trackio",
    ]


def test_missing_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(InputError, match=r"pip install wandb"):
        check_backends(["tensorboard", "wandb"] if real("tensorboard") else ["wandb"])
    check_backends([])  # nothing selected, nothing needed


def test_missing_package_fails_before_the_model_loads(monkeypatch, tmp_path):
    import importlib.util

    import peergrade.training.trainer as trainer_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a)
    )

    def no_load(cfg):
        raise AssertionError("the model was loaded before the missing package was reported")

    monkeypatch.setattr(trainer_mod, "setup_models", no_load)
    cfg = load_config(None, [("train.report_to", ["trackio"]), ("train.display", "none")])
    with pytest.raises(InputError, match="pip install trackio"):
        trainer_mod.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_no_backend_writes_only_jsonl_and_imports_none(tmp_path):
    """metrics.jsonl alone: nothing else in the run dir, and no backend module imported."""
    code = textwrap.dedent(
        f"""
        import sys
        from peergrade.monitoring.metrics import MetricLogger
        with MetricLogger({str(tmp_path)!r}, []) as log:
            log.write({{"step": 1, "reward/total/mean": 0.5}})
        print([m for m in ("tensorboard", "torch.utils.tensorboard", "wandb", "trackio")
               if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- backends


def test_tensorboard_event_file_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricLogger(tmp_path, ["tensorboard"]) as log:
        for line in LINES:
            log.write(line)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/total/mean", "loss/policy", "eval/pass@1_greedy", "alert/kl_blowup"} <= tags
    assert "step" not in tags and "alerts" not in tags
    got = [(e.step, e.value) for e in acc.Scalars("reward/total/mean")]
    assert got == [(1, 0.5), (2, 0.75)]
    # and metrics.jsonl holds the same lines, alerts included
    assert read_jsonl(tmp_path / "metrics.jsonl") == LINES


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    """A run resumed from step 1 rewrites step 2: TensorBoard keeps the new value only."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricLogger(tmp_path, ["tensorboard"]) as log:
        for line in LINES:
            log.write(line)
    with MetricLogger(tmp_path, ["tensorboard"], resume=True, start_step=1) as log:
        log.write({"step": 2, "reward/total/mean": 0.25})
        log.write({"step": 3, "reward/total/mean": 1.0})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("reward/total/mean")]
    assert got == [(1, 0.5), (2, 0.25), (3, 1.0)]


def _subprocess_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(
        TRACKIO_DIR=str(tmp_path / "trackio"),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path / "wandb-home"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-home"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-home"),
        HF_HOME=str(tmp_path / "hf-home"),
    )
    return env


@pytest.mark.slow
def test_trackio_store_reads_back(tmp_path):
    pytest.importorskip("trackio")
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    code = textwrap.dedent(
        f"""
        import json
        from peergrade.monitoring.metrics import MetricLogger
        with MetricLogger({str(run_dir)!r}, ["trackio"], project="pgtest", config={{"a": 1}}) as log:
            for line in {LINES!r}:
                log.write(line)
        from trackio.sqlite_storage import SQLiteStorage
        print("LOGS", json.dumps(SQLiteStorage.get_logs("pgtest", "myrun")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_subprocess_env(tmp_path),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "trackio" / "pgtest.db").is_file()
    (logs,) = [json.loads(x[5:]) for x in out.stdout.splitlines() if x.startswith("LOGS ")]
    rewards = [(r["step"], r["reward/total/mean"]) for r in logs if "reward/total/mean" in r]
    assert rewards == [(1, 0.5), (2, 0.75)]
    assert any(r.get("eval/pass@1_greedy") == 0.25 for r in logs)


@pytest.mark.slow
def test_wandb_offline_run_file_written(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "myrun"
    run_dir.mkdir()
    code = textwrap.dedent(
        f"""
        from peergrade.monitoring.metrics import MetricLogger
        with MetricLogger({str(run_dir)!r}, ["wandb"], project="pgtest", config={{"a": 1}}) as log:
            for line in {LINES!r}:
                log.write(line)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_subprocess_env(tmp_path),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    # the history records carry the metric names as written to metrics.jsonl
    assert b"reward/total/mean" in data and b"eval/pass@1_greedy" in data
    run_id = (run_dir / "wandb" / "peergrade-run-id").read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"


# ----------------------------------------------------------------------------- the trainer


def test_train_feeds_tensorboard_and_logs_rewards_per_function(
    tiny_model_dir, reward_file, tmp_path
):
    tb = pytest.importorskip("tensorboard")
    del tb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(
        None, tiny_overrides(tiny_model_dir, reward_file, **{"train.report_to": ["tensorboard"]})
    )
    from peergrade.training.trainer import train

    run = tmp_path / "run"
    train(cfg, run)
    lines = read_jsonl(run / "metrics.jsonl")
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # same names everywhere: every numeric key of every line is a TensorBoard tag
    numeric = {
        k
        for m in lines
        for k, v in m.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    assert numeric and numeric <= tags
    assert "rollout/repetition" in tags and "update/nonfinite_frac" in tags
    final = [e.step for e in acc.Scalars("eval/pass@1_greedy")]
    assert final == [0, 2]  # before training and the final evaluation

    samples = read_jsonl(run / "samples.jsonl")
    assert len(samples) == 2
    for s in samples:
        by_fn = s["rewards_by_fn"]
        assert set(by_fn) == {"char_score", "length_score"}
        assert by_fn["length_score"] == [float(len(c)) for c in s["completions"]]
        weighted = [a + 0.5 * b for a, b in zip(by_fn["char_score"], by_fn["length_score"])]
        assert s["rewards"] == pytest.approx(weighted, rel=1e-6)


@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_nonfinite_loss_skips_the_step_and_is_reported(
    tiny_model_dir, reward_file, tmp_path, monkeypatch, capsys, algo
):
    """A NaN loss gives NaN gradients: every optimizer step is skipped (weights bit-identical
    to the start, AdamW state untouched), counted, and the nonfinite alert is logged."""
    import peergrade.training.ppo as ppo_mod
    import peergrade.training.trainer as trainer_mod
    import peergrade.training.update as update_mod

    mod = update_mod if algo == "grpo" else ppo_mod
    real = mod.policy_loss

    def nan_loss(*a, **k):
        loss, m = real(*a, **k)
        return loss * float("nan"), m

    monkeypatch.setattr(mod, "policy_loss", nan_loss)
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_dir,
            reward_file,
            **{
                "algo.name": algo,
                "train.steps": 2,
                "optim.minibatch_size": 2,
                "optim.weight_decay": 0.1,
            },
        ),
    )
    run = tmp_path / "run"
    trainer_mod.train(cfg, run)
    steps = [m for m in read_metrics_steps(run)]
    assert [m["update/nonfinite_frac"] for m in steps] == [1.0, 1.0]
    assert [m["update/skipped_total"] for m in steps] == [2, 4]  # two minibatches a step
    assert all(m["alert/nonfinite"] == 1.0 for m in steps)
    assert "skipped with the parameters untouched" in steps[0]["alerts"]["nonfinite"]
    # shown once, when it starts, even with train.display none
    assert capsys.readouterr().err.count("[alert] step 1: non-finite loss") == 1
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), weights(run)
    assert all(torch.equal(before[k], after[k]) for k in before)
    if algo == "grpo":
        state = ckpt.load_training_state(ckpt.latest_checkpoint(run))["optimizer"]["state"]
        assert state == {}  # AdamW never stepped: no moments were created


def read_metrics_steps(run: Path) -> list[dict]:
    return [m for m in read_jsonl(run / "metrics.jsonl") if "rollout/len_mean" in m]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.latest_checkpoint(run) / "model.safetensors"))
