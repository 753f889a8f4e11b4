"""Small ones of issue 33 item 6: config conflicts with the launch refused before any model loads
or run directory is made, a far-ahead pipeline warned of, the audit honest about its rows and
about a reward that scores nothing, and a non-UTF-8 recipe as one line."""

from __future__ import annotations

import json

import pytest

from peergrade.cli import main
from peergrade.config import ConfigError, load_config


def test_dynamic_with_pipelined_under_torchrun_is_refused_before_anything(
    tmp_path, monkeypatch, tiny_model_dir
):
    import peergrade.training.trainer as tr

    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tr, "setup_models", lambda *a: pytest.fail("the model loaded"))
    cfg = load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            ("rollout.dynamic_sampling", True),
            ("rollout.async_steps", 1),
        ],
    )
    with pytest.raises(ConfigError, match="under torchrun \\(2 processes\\)"):
        tr.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_pipeline_far_ahead_warns(capsys):
    from peergrade.training.trainer import check_run_conflicts

    check_run_conflicts(load_config(None, [("rollout.async_steps", 2)]))
    assert "warning" not in capsys.readouterr().err
    check_run_conflicts(load_config(None, [("rollout.async_steps", 8)]))
    assert "warning: rollout.async_steps 8" in capsys.readouterr().err


BAD = """
def boom(completions, **kw):
    raise ValueError("nope")

def nothing(completions, **kw):
    return [None] * len(completions)

def exact(completions, answer, **kw):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == a) for t, a in zip(texts, answer)]
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.mark.parametrize(
    "fn, said", [("boom", "it raised on every completion"), ("nothing", "returned None")]
)
def test_audit_of_a_reward_that_scores_nothing_says_so(files, capsys, fn, said):
    code = main(["audit", "--reward", f"{files / 'bad.py'}:{fn}", "--data", str(files / "d.jsonl")])
    out = capsys.readouterr().out
    assert code == 1
    assert said in out and f"FAILED: {fn} scored no completion at all" in out, out
    assert "earns credit" not in out and "clean" not in out.split("verdict")[-1]


def test_audit_rows_are_capped_at_the_data(files, capsys):
    args = ["audit", "--reward", f"{files / 'bad.py'}:exact", "--data", str(files / "d.jsonl")]
    assert main([*args, "--rows", "1e20", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["rows"] == 3
    assert "--rows 100000000000000000000 is more than the data's 3 training rows" in got.err


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "recipe.yaml"
    bad.write_bytes(b"\xff\xfe model_name_or_path: x\n")
    assert main(["train", "--trl-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --trl-config") and "not UTF-8" in err and err.count("\n") == 1


@pytest.mark.slow
def test_samples_log_under_torchrun_has_the_groups_one_process_logs(tiny_model_dir, tmp_path):
    """train.log_samples 4 of P = 4 prompts on 2 ranks (2 groups each): samples.jsonl holds all
    4 groups a step, the same lines as one process writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reward = tmp_path / "r.py"
    reward.write_text(
        "def score(completions, **kw):\n"
        "    t = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [(sum(map(ord, x)) % 97) / 97.0 for x in t]\n"
    )
    over = [
        ["model.path", str(tiny_model_dir)],
        ["rewards", [{"name": f"{reward}:score"}]],
        ["rollout.prompts_per_step", 4],
        ["rollout.group_size", 2],
        ["rollout.max_completion_length", 4],
        ["train.steps", 2],
        ["train.log_samples", 4],
        ["train.save_every", 0],
        ["train.eval_size", 2],
        ["train.eval_samples", 2],
        ["train.display", "none"],
        ["train.threads", 1],
        ["train.audit_rewards", "off"],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, launcher in [
        ("one", [sys.executable]),
        (
            "two",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--monitor-interval=0.5",
            ],
        ),
    ]:
        spec = tmp_path / f"{name}.json"
        runs = [{"dir": str(tmp_path / name), "overrides": over}]
        spec.write_text(json.dumps({"fixed_rollouts": True, "runs": runs}))
        out = subprocess.run(
            [*launcher, str(root / "tests/dist_worker.py"), str(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-4000:]
    one = (tmp_path / "one/samples.jsonl").read_text()
    assert [json.loads(x)["step"] for x in one.splitlines()] == [1] * 4 + [2] * 4
    assert (tmp_path / "two/samples.jsonl").read_text() == one
