"""The ``peergrade`` command line, end to end.

Smoke runs of ``peergrade train`` in a subprocess on a tiny model (the run directory's files,
parameters that moved, a loadable checkpoint), Ctrl-C -> exit 130 -> ``--resume``, a SIGKILL
inside checkpoint pruning (eval and resume see only complete checkpoints), a user's
TRL-style reward file with a JSONL dataset (issue 5), every bad input giving one ``error:`` line
and exit 2 with the existing run untouched (an unwritable run dir too, before any model loads),
and the ``config`` / ``eval`` / ``--help`` commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cli_helper import cli
from peergrade.cli import main
from peergrade.config import Config, load_config, parse_override_value

TINY = {
    "rollout.prompts_per_step": "2",
    "rollout.group_size": "2",
    "rollout.max_completion_length": "4",
    "train.eval_size": "4",
    "train.eval_samples": "2",
    "train.display": "none",
    "train.threads": "1",
}

REWARDS_PY = '''
def my_fn(prompts, completions, answer=None, **kwargs):
    """TRL-style: prompts, completions and the dataset's other columns as keyword lists."""
    assert len(prompts) == len(completions) == len(answer) == len(kwargs["completion_ids"])
    # chat prompts (the built-in tasks) get [{"role": "assistant", "content": ...}], text ones text
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 + (a in t) for t, a in zip(texts, answer)]
'''


def flags(d: dict[str, str]) -> list[str]:
    return [x for k, v in d.items() for x in (f"--{k}", v)]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def train_rows(run: Path) -> list[dict]:
    return [r for r in metrics(run) if "loss/policy" in r]


@pytest.fixture
def rewards_py(tmp_path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARDS_PY)
    return p


@pytest.fixture
def my_jsonl(tmp_path) -> Path:
    p = tmp_path / "my.jsonl"
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(12)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


# ----------------------------------------------------------------------------- smoke


@pytest.mark.slow
def test_train_smoke_subprocess(tiny_model_dir, rewards_py, tmp_path):
    from transformers import AutoModelForCausalLM

    from peergrade.model.load import load_tokenizer

    opts = {
        **TINY,
        "model.path": str(tiny_model_dir),
        "data.task_options": "{min_digits: 1, max_digits: 1}",
        "algo.beta": "0.04",
        "optim.lr": "0.01",
        "train.steps": "3",
        "train.save_every": "1",
        "train.keep_last": "2",
        "train.log_samples": "1",
    }
    # the arithmetic reward (0 for a random model) plus a dense reward so the weights move
    args = ["train", *flags(opts), "--reward", "arithmetic", "--reward", f"{rewards_py}:my_fn=0.5"]
    proc = cli([*args, "-o", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run = tmp_path / "run"

    # config.yaml is the resolved config, and loads back
    expected = load_config(
        None,
        [(k, parse_override_value(v)) for k, v in opts.items()]
        + [
            (
                "rewards",
                [
                    {"name": "arithmetic", "weight": 1.0},
                    {"name": f"{rewards_py}:my_fn", "weight": 0.5},
                ],
            ),
            ("train.output_dir", "run"),
        ],
    )
    assert load_config(run / "config.yaml") == expected

    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    required = [
        "reward/arithmetic/mean",
        "reward/my_fn/mean",
        "reward/total/mean",
        "reward/accuracy",
        "rollout/frac_zero_std_groups",
        "rollout/len_mean",
        "clip/frac",
        "clip/low_frac",
        "clip/high_frac",
        "kl/mean",
        "loss/policy",
        "entropy/mean",
        "grad/norm",
        "optim/lr",
        "time/generate_s",
        "time/update_s",
        "perf/tokens_per_s",
    ]
    for r in rows:
        missing = [k for k in required if k not in r]
        assert not missing, missing
        assert 0.0 <= r["rollout/frac_zero_std_groups"] <= 1.0
        assert r["optim/lr"] == pytest.approx(0.01)
        assert r["perf/tokens_per_s"] > 0
    assert any(r["grad/norm"] > 0 for r in rows)
    evals = [r for r in metrics(run) if "eval/pass@1_greedy" in r]
    assert [r["step"] for r in evals] == [0, 3]

    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3]
    assert all(len(s["completions"]) == 2 == len(s["rewards"]) for s in samples)

    # keep_last 2 of the saves at 1, 2, 3
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-2", "step-3"]
    last = run / "checkpoints/step-3"
    assert json.loads((last / "trainer_state.json").read_text())["step"] == 3
    state = torch.load(last / "training_state.pt", weights_only=False)
    assert {"optimizer", "scheduler", "rng"} <= set(state)

    # parameters moved, and the checkpoint loads with plain transformers
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    end = load_file(str(last / "model.safetensors"))
    assert start.keys() == end.keys()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    model = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)
    sd = model.state_dict()
    for k, v in end.items():
        assert torch.equal(sd[k], v), k
    tok = load_tokenizer(str(last))
    ids = tok("1+2=", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "1+2="
    assert tok.chat_template


@pytest.mark.slow
def test_user_reward_file_and_jsonl(tiny_model_dir, rewards_py, my_jsonl, tmp_path):
    """Issue 5: `peergrade train --data my.jsonl --reward my_rewards.py:my_fn --model DIR`;
    without a held-out split the trainer skips evaluation."""
    args = [
        "train",
        "--data",
        my_jsonl.name,
        "--reward",
        f"{rewards_py.name}:my_fn",
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        *flags(TINY),
    ]
    proc = cli([*args, "-o", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("eval/") for r in rows for k in r)
    assert all(r["reward/my_fn/mean"] > 0 for r in rows)
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("What is") and s["answer"] is not None for s in samples)

    # with data.task_options.eval_fraction the held-out split exists and is evaluated
    proc = cli([*args, "--data.task_options.eval_fraction", "0.25", "-o", "run2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in metrics(tmp_path / "run2") if "eval/pass@1_greedy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert evals[0]["eval/n"] == 3  # 25% of 12 rows


# ----------------------------------------------------------------------------- interrupt


@pytest.mark.slow
def test_ctrl_c_saves_and_resumes(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    opts = {**TINY, "train.display": "plain"}
    args = ["train", "--model", str(tiny_model_dir), "--steps", "500", *flags(opts)]
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "peergrade.cli", *args, "-o", "run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if (run / "metrics.jsonl").is_file() and train_rows(run):
                break
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert "--resume" in out + err
    done = [r["step"] for r in train_rows(run)]
    assert done == list(range(1, len(done) + 1)) and len(done) < 500
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step-{done[-1]}"]

    # resume to completion (a shorter total, so the test stays quick)
    total = done[-1] + 2
    res = cli(["train", "--resume", "run", "--train.steps", str(total)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in train_rows(run)] == list(range(1, total + 1))
    assert (run / f"checkpoints/step-{total}/trainer_state.json").is_file()


SIGKILL_IN_PRUNE = """
import os, shutil, signal, sys
from pathlib import Path

real_rmtree = shutil.rmtree


def rmtree(path, *a, **kw):
    # the prune's delete: lose one file, then die the way `kill -9` does (no cleanup runs)
    if Path(path).name.startswith(("step-", ".prune-step-")):
        (Path(path) / "model.safetensors").unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rmtree(path, *a, **kw)


shutil.rmtree = rmtree
from peergrade.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkill_inside_prune_then_eval_and_resume(tiny_model_dir, rewards_py, tmp_path, capsys):
    """A real SIGKILL in the middle of deleting an old checkpoint (keep_last 1): `peergrade
    eval` of the run and `--resume` only see the complete checkpoint; resume sweeps the rest."""
    run = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), *flags(TINY), "--steps", "3", "-o", str(run)]
    args += ["--reward", f"{rewards_py}:my_fn", "--train.save_every", "1", "--train.keep_last", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SIGKILL_IN_PRUNE, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".prune-step-1", "step-2"]
    assert not (root / ".prune-step-1/model.safetensors").exists()

    ev = ["eval", "--n", "2", "--k", "1", "--max-new-tokens", "2", "--json"]
    assert main([*ev, "--model", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(root / "step-2")
    assert main([*ev, "--model", str(root / ".prune-step-1")]) == 2
    assert "complete checkpoints of this run: step-2" in capsys.readouterr().err

    assert main(["train", "--resume", str(run)]) == 0
    assert "checkpoints: removed .prune-step-1" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def existing_run(tmp_path) -> Path:
    run = tmp_path / "existing"
    (run / "checkpoints/step-1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints/step-1/trainer_state.json").write_text('{"step": 1}')
    return run


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def bad_inputs(tmp_path: Path, model: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (extra train args, regex the error line must match)."""
    noweights, notok = tmp_path / "noweights", tmp_path / "notok"
    noweights.mkdir()
    notok.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (noweights / f.name).write_bytes(f.read_bytes())
        if not f.name.startswith("tokenizer") and f.suffix != ".jinja":
            (notok / f.name).write_bytes(f.read_bytes())
    (tmp_path / "nocol.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", \n')
    (tmp_path / "r.py").write_text("def my_reward(prompts, completions, **kw):\n    return []\n")
    m = ["--model", str(model)]
    return {
        "unknown task": (
            [*m, "--data.task", "arithmatic"],
            r"unknown task 'arithmatic'.*arithmetic",
        ),
        "no weights": (["--model", str(noweights)], r"noweights.*no weights file"),
        "no tokenizer": (["--model", str(notok)], r"notok.*no tokenizer"),
        "missing column": (
            [*m, "--data", "nocol.jsonl"],
            r"nocol.jsonl: line 1: missing column 'prompt'",
        ),
        "bad json row": ([*m, "--data", "bad.jsonl"], r"bad.jsonl: line 2: invalid JSON"),
        "unknown reward": (
            [*m, "--reward", "arithmetc"],
            r"unknown reward 'arithmetc'.*did you mean 'arithmetic'",
        ),
        "reward fn missing": (
            [*m, "--reward", "r.py:my_rewrd"],
            r"no attribute 'my_rewrd'.*did you mean 'my_reward'",
        ),
        "reward file missing": ([*m, "--reward", "nope.py:f"], r"nope.py.*does not exist"),
        "unknown key": (
            [*m, "--algo.bta", "0.1"],
            r"unknown config key 'algo.bta'; did you mean 'algo.beta'",
        ),
        "bad value": ([*m, "--rollout.group_size", "1"], r"rollout.group_size must be >= 2"),
        "bad type": ([*m, "--algo.beta", "lots"], r"algo.beta: expected a number"),
        "bad choice": ([*m, "--algo.loss_type", "grpoo"], r"algo.loss_type.*did you mean 'grpo'"),
        "missing config": (
            [*m, "--config", "nope.yaml"],
            r"config file 'nope.yaml' does not exist",
        ),
    }


def test_bad_inputs_give_one_error_line_and_leave_run_untouched(
    tiny_model_dir, existing_run, tmp_path, capsys, monkeypatch
):
    import re

    monkeypatch.chdir(tmp_path)
    before = snapshot(existing_run)
    for name, (extra, pattern) in bad_inputs(tmp_path, tiny_model_dir).items():
        # even with --overwrite, a run that fails while loading must not delete the old run
        rc = main(["train", *flags(TINY), *extra, "-o", str(existing_run), "--overwrite"])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert rc == 2, (name, err)
        assert len(lines) == 1, (name, err)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert snapshot(existing_run) == before, name


def test_run_dir_rules(tiny_model_dir, existing_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(existing_run)
    m = ["--model", str(tiny_model_dir), *flags(TINY), "--steps", "1"]

    assert main(["train", *m, "-o", str(existing_run)]) == 2
    assert "already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert snapshot(existing_run) == before

    not_a_run = tmp_path / "notarun"
    not_a_run.mkdir()
    assert main(["train", "--resume", str(not_a_run)]) == 2
    assert "is not a peergrade run" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--resume", str(existing_run), "--config", "x.yaml"]) == 2

    # --overwrite replaces the old run with the new one
    assert main(["train", *m, "-o", str(existing_run), "--overwrite"]) == 0
    assert [r["step"] for r in train_rows(existing_run)] == [1]
    assert sorted(p.name for p in (existing_run / "checkpoints").iterdir()) == ["step-1"]
    assert (
        json.loads((existing_run / "checkpoints/step-1/trainer_state.json").read_text())["step"]
        == 1
    )


def test_unwritable_run_dir_is_one_error_before_the_model_loads(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """As root a chmod'd directory is still writable, so the path lies below a regular file."""
    import peergrade.training.trainer as trainer_mod

    def no_model(cfg):
        raise AssertionError("the model was loaded before the run directory was checked")

    monkeypatch.setattr(trainer_mod, "setup_models", no_model)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    m = ["--model", str(tiny_model_dir), *flags(TINY), "--steps", "1"]
    assert main(["train", *m, "-o", "afile/runs/a"]) == 2
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if x.strip()] == [
        "error: cannot create run directory 'afile/runs/a': "
        f"'{tmp_path / 'afile'}' is a file, not a directory"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _as_unwritable(kind: str, target: Path, argv: list[str]) -> list[str]:
    """A command line that runs ``argv`` where ``target`` cannot be written (or pytest.skip)."""
    import shutil

    if kind == "read-only bind mount":
        if not shutil.which("unshare"):
            pytest.skip("no unshare")
        t = str(target)
        probe = subprocess.run(
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                f"mount --bind {t} {t} && mount -o remount,ro,bind {t} {t}",
            ],
            capture_output=True,
        )
        if probe.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.decode()[-200:]}")
        script = f'mount --bind {t} {t} && mount -o remount,ro,bind {t} {t} && exec "$@"'
        return ["unshare", "-m", "sh", "-c", script, "sh", *argv]
    # an ordinary uid, for which a root-owned 0755 directory is read-only
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*drop, sys.executable, "-c", "import peergrade"]).returncode != 0:
        pytest.skip("uid 65534 cannot run this interpreter / import peergrade")
    return [*drop, *argv]


@pytest.mark.parametrize("kind", ["read-only bind mount", "uid 65534"])
def test_unwritable_run_dir_subprocess(kind):
    """A directory that really cannot be written (new run and --resume): one error line, exit 2,
    no traceback, nothing loaded. Outside pytest's private tmp dir so uid 65534 can reach it."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="peergrade-ro-"))
    try:
        d.chmod(0o755)
        (d / "old").mkdir()
        (d / "old/config.yaml").write_text("train:\n  steps: 1\n")
        for args, what in (
            (["train", "-o", str(d / "run"), "--steps", "1"], str(d)),
            (["train", "--resume", str(d / "old")], str(d / "old")),
        ):
            argv = [sys.executable, "-m", "peergrade.cli", *args]
            proc = subprocess.run(
                _as_unwritable(kind, d, argv),
                capture_output=True,
                text=True,
                timeout=120,
                cwd=d,
                env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(d)},
            )
            lines = [x for x in proc.stderr.splitlines() if x.strip()]
            assert proc.returncode == 2, proc.stderr
            assert len(lines) == 1 and lines[0].startswith("error: run directory"), proc.stderr
            assert f"creating a directory in '{what}' failed" in lines[0]
            assert sorted(p.name for p in d.iterdir()) == ["old"]
    finally:
        shutil.rmtree(d)


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    proc = cli(["train", "--data.task", "nosuch", "-o", "r"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [
        x for x in proc.stderr.splitlines() if x.strip()
    ]
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- config, help, eval


def test_config_prints_yaml_that_loads_back(tmp_path, capsys):
    assert main(["config", "--algo.beta", "0.04", "--rollout.group_size", "4"]) == 0
    text = capsys.readouterr().out
    assert "# KL penalty coefficient" in text  # documented
    p = tmp_path / "c.yaml"
    p.write_text(text)
    cfg = load_config(p)
    assert cfg.algo.beta == 0.04 and cfg.rollout.group_size == 4
    assert cfg == load_config(None, [("algo.beta", 0.04), ("rollout.group_size", 4)])
    assert main(["config", "--no-comments"]) == 0
    plain = yaml.safe_load(capsys.readouterr().out)
    assert load_config(None) == Config() and plain["algo"]["beta"] == Config().algo.beta


def test_config_markdown(capsys):
    assert main(["config", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| key | default | meaning |")
    assert "| `algo.beta` | `0.0` |" in out
    assert "| `rollout.group_size` | `8` |" in out


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("train", "eval", "sft", "config", "memory", "convert", "export"):
        assert cmd in out
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--resume", "--overwrite", "--reward", "--data", "--model", "--config"):
        assert flag in out
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "RUN_OR_CKPT" in out and "--merge-lora" in out and "AutoPeftModelForCausalLM" in out
    assert main([]) == 0  # no command: the help, exit 0
    assert "train" in capsys.readouterr().out


def test_unknown_option_suggests_dotted_key(capsys):
    assert main(["train", "--beta", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --beta; did you mean --algo.beta?" in err


def test_eval_json(tiny_model_dir, capsys):
    args = ["eval", "--model", str(tiny_model_dir), "--n", "4", "--k", "2", "--json"]
    assert main([*args, "--max-new-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 4 and out["k"] == 2 and out["task"] == "arithmetic"
    for key in ("pass@1_greedy", "pass@1_sampled", "pass@2"):
        assert 0.0 <= out[key] <= 1.0
    assert out["pass@2"] >= out["pass@1_sampled"] - 1e-9
    assert "pass@1" not in out  # the curve only with --curve
    # --curve: pass@1 .. pass@k from the same samples, in JSON and in the text table
    assert main([*args, "--max-new-tokens", "4", "--k", "3", "--curve"]) == 0
    curve = json.loads(capsys.readouterr().out)
    assert [curve[f"pass@{j}"] <= curve[f"pass@{j + 1}"] + 1e-12 for j in (1, 2)] == [True] * 2
    assert curve["pass@1"] == pytest.approx(curve["pass@1_sampled"], abs=1e-12)
    text = [a for a in args if a != "--json"]
    assert main([*text, "--max-new-tokens", "4", "--k", "3", "--curve", "--few-shot", "1"]) == 0
    shown = capsys.readouterr().out
    assert "few-shot: 1" in shown and "pass@j curve" in shown
    assert [line.split()[0] for line in shown.splitlines() if line.startswith("  pass@")][-3:] == [
        "pass@1",
        "pass@2",
        "pass@3",
    ]
    # bad arguments are clean errors
    one_digit = ["--task-option", "min_digits=1", "--task-option", "max_digits=1"]
    assert main(["eval", "--model", str(tiny_model_dir), "--n", "0"]) == 2
    assert "--n and --k must be >= 1" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_model_dir), "--n", "500", *one_digit]) == 2
    assert "task: arithmetic: asked for 500 held-out problems" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_model_dir), "--task", "nosuch"]) == 2
    assert "unknown task 'nosuch'" in capsys.readouterr().err


def test_ctrl_c_outside_the_loop_exits_130(monkeypatch, capsys):
    import peergrade.cli as cli_mod

    def interrupted(args, extra):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_mod.config, "run", interrupted)
    assert main(["config"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_override_values_with_a_colon_stay_strings():
    """A prompt template is a sentence and may hold ': ' (found by issue 16's probes: YAML read
    'like this: <answer>0</answer>.' as a one-key mapping); explicit YAML still parses."""
    text = "What is {a} {op} {b}? Answer like this: <answer>0</answer>."
    assert parse_override_value(text) == text
    assert parse_override_value("Q: {a}") == "Q: {a}"
    assert parse_override_value("{min_animals: 1, max_animals: 2}") == {
        "min_animals": 1,
        "max_animals": 2,
    }
    assert parse_override_value("[a, b]") == ["a", "b"]
    assert parse_override_value("a: 1\nb: 2") == {"a": 1, "b": 2}
    assert parse_override_value("0.04") == 0.04 and parse_override_value("null") is None
    cfg = load_config(None, [("data.task_options.template", parse_override_value(text))])
    assert cfg.data.task_options["template"] == text


# ----------------------------------------------------------------------------- shortcuts per command


def _resolved(argv: list[str]):
    """The config a command line resolves to, and its parsed arguments (nothing runs)."""
    from peergrade.cli import build_parser
    from peergrade.cli.common import config_from

    args, extra = build_parser().parse_known_args(argv)
    return config_from(args, extra), args


def test_train_explicit_keys_win_over_its_shortcuts():
    cfg, _ = _resolved(
        [
            "train",
            "--steps",
            "3",
            "--train.steps",
            "5",
            "--seed",
            "1",
            "--train.seed",
            "2",
            "--model",
            "a",
            "--model.path",
            "b",
            "-o",
            "x",
            "--train.output_dir",
            "y",
            "--data",
            "d1.jsonl",
            "--data.path",
            "d2.jsonl",
        ]
    )
    assert (cfg.train.steps, cfg.train.seed, Path(cfg.model.path).name) == (5, 2, "b")
    assert (Path(cfg.train.output_dir).name, Path(cfg.data.path).name) == ("y", "d2.jsonl")
    cfg, _ = _resolved(["train", "--steps", "3", "--seed", "1", "--output-dir", "x"])
    assert (cfg.train.steps, cfg.train.seed, Path(cfg.train.output_dir).name) == (3, 1, "x")


def test_memory_steps_are_measured_steps_not_train_steps():
    """`peergrade memory --train.steps 100` ran with train.steps = 2 (memory's own --steps)."""
    cfg, args = _resolved(["memory", "--train.steps", "100", "--estimate-only"])
    assert cfg.train.steps == 100 and args.steps == 2
    cfg, args = _resolved(["memory", "--steps", "3", "--model", "a", "--model.path", "b"])
    assert cfg.train.steps == Config().train.steps  # memory's --steps sets no config key
    assert args.steps == 3 and Path(cfg.model.path).name == "b"


def test_sweep_explicit_keys_win_over_its_shortcuts():
    cfg, _ = _resolved(["sweep", "--steps", "3", "--train.steps", "9", "--seed", "1"])
    assert (cfg.train.steps, cfg.train.seed) == (9, 1)
    cfg, _ = _resolved(["sweep", "--seed", "1", "--train.seed", "4", "-o", "sw"])
    assert cfg.train.seed == 4 and cfg.train.output_dir is None  # -o is the sweep dir


def test_config_command_takes_overrides_and_no_train_shortcuts(capsys):
    assert main(["config", "--train.steps", "7", "--no-comments"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 7
    assert main(["config", "--steps", "7"]) == 2
    assert "unknown option --steps" in capsys.readouterr().err


def test_output_flag_is_the_commands_output_everywhere():
    """-o/--output is what each command writes; the old long spellings still parse."""
    from peergrade.cli import build_parser

    p = build_parser()
    for argv in (
        ["train", "-o", "R"],
        ["train", "--output-dir", "R"],
        ["train", "--output", "R"],
        ["sweep", "-o", "R"],
        ["sweep", "--output-dir", "R"],
        ["report", "x", "-o", "R"],
        ["memory", "-o", "R"],
        ["sft", "--init", "qwen2", "--out", "R"],
        ["sft", "--init", "qwen2", "-o", "R"],
    ):
        assert p.parse_known_args(argv)[0].output == "R", argv


def test_commands_without_overrides_refuse_extra_arguments(capsys):
    assert main(["export", "a", "b", "--train.steps", "3"]) == 2
    assert "unexpected arguments for export: --train.steps 3" in capsys.readouterr().err
