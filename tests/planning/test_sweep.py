"""`peergrade sweep`: the --set grammar and grid, the baseline-noise figure by hand, choosing the
best variant (also under a time budget), and a real two-variant sweep end to end in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peergrade.errors import InputError
from peergrade.monitoring.report import load_run
from peergrade.planning.sweep import baseline_se, grid, parse_sets, summarize, variant_name


def test_parse_sets_and_grid():
    axes = parse_sets(["rollout.group_size=2,4", "optim.lr=0.001,0.0003", "rollout.stop=[a,b],[]"])
    assert axes[0] == ("rollout.group_size", [2, 4])
    assert axes[1] == ("optim.lr", [0.001, 0.0003])
    assert axes[2] == ("rollout.stop", [["a", "b"], []])  # commas inside [...] stay in the value
    g = grid(axes[:2])
    assert len(g) == 4
    assert g[0] == [("rollout.group_size", 2), ("optim.lr", 0.001)]
    assert g[1] == [("rollout.group_size", 2), ("optim.lr", 0.0003)]  # first axis slowest
    assert variant_name(g[3]) == "group_size=4_lr=0.0003"


@pytest.mark.parametrize(
    "spec,match",
    [
        ("rollout.group_size", "expected KEY=V1,V2"),
        ("rollout.gruop_size=2,4", "not a config key"),
        ("rollout.group_size=2,,4", "empty value"),
    ],
)
def test_parse_sets_errors(spec, match):
    with pytest.raises(InputError, match=match):
        parse_sets([spec])


def test_baseline_se_by_hand():
    # [1, 0]: mean .5, s^2 = (.25 + .25) / 1 = .5, s^2 / G = .25
    # [1, 1, 0, 0]: mean .5, s^2 = 4 * .25 / 3 = 1/3, s^2 / G = 1/12
    # RMS over the two groups: sqrt((.25 + 1/12) / 2) = sqrt(1/6)
    samples = [{"rewards": [1.0, 0.0]}, {"rewards": [1, 1, 0, 0]}, {"rewards": [1.0]}]
    se, n = baseline_se(samples)
    assert n == 2
    assert se == pytest.approx(math.sqrt(1 / 6), abs=1e-12)
    # a group with no spread contributes 0
    se, n = baseline_se([{"rewards": [0.5, 0.5, 0.5]}, {"rewards": [1.0, 0.0]}])
    assert (se, n) == (pytest.approx(math.sqrt(0.25 / 2)), 2)
    assert math.isnan(baseline_se([])[0])


def _fake_run(path: Path, G: int, accs: list[float], step_s: float) -> Path:
    """3 steps of P=1, an eval at steps 0, 2 and 3 (final)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"rollout:\n  group_size: {G}\n  prompts_per_step: 1\n")
    rows = [{"step": 0, "eval/pass@1_sampled": accs[0]}]
    for s in (1, 2, 3):
        m = {"step": s, "time/generate_s": step_s, "time/reward_s": 0.0, "time/ref_s": 0.0}
        m.update({"time/update_s": 0.0, "rollout/frac_zero_std_groups": 1.0 / G, "loss/policy": 0})
        if s == 2:
            m["eval/pass@1_sampled"] = accs[1]
        rows.append(m)
    rows.append({"step": 3, "eval/pass@1_sampled": accs[2], "final": True})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "samples.jsonl").write_text(
        json.dumps({"step": 1, "rewards": [1.0, 0.0] * (G // 2)}) + "\n"
    )
    return path


def test_summarize_names_the_best_and_respects_a_time_budget(tmp_path):
    fast = load_run(_fake_run(tmp_path / "g2", 2, [0.2, 0.5, 0.55], step_s=1.0))
    slow = load_run(_fake_run(tmp_path / "g8", 8, [0.2, 0.4, 0.7], step_s=4.0))
    s = summarize([fast, slow])
    v = {r["name"]: r for r in s["variants"]}
    assert v["g2"]["train_s"] == pytest.approx(3.0) and v["g8"]["train_s"] == pytest.approx(12.0)
    assert v["g2"]["completions"] == 6 and v["g8"]["completions"] == 24
    assert v["g8"]["points"] == [(0, 0.0, 0, 0.2), (2, 8.0, 16, 0.4), (3, 12.0, 24, 0.7)]
    assert v["g2"]["zero_signal_frac"] == pytest.approx(0.5)
    assert s["best"] == "g8"  # 0.7 > 0.55 at the same steps
    # within 8 s of training: g2 finished (0.55 at 3 s), g8 had reached 0.4 at 8 s
    assert summarize([fast, slow], time_budget_s=8.0)["best"] == "g2"
    # equal accuracy: the cheaper one wins
    tie = load_run(_fake_run(tmp_path / "g4", 4, [0.2, 0.5, 0.7], step_s=2.0))
    assert summarize([slow, tie])["best"] == "g4"


@pytest.mark.slow
def test_sweep_end_to_end_subprocess(tiny_model_dir, tmp_path):
    opts = {
        "rollout.prompts_per_step": "2",
        "rollout.max_completion_length": "4",
        "train.eval_size": "4",
        "train.eval_samples": "2",
        "train.eval_every": "2",
        "train.display": "none",
        "train.threads": "1",
        "train.save_every": "0",
    }
    args = [
        "sweep",
        "--model.path",
        str(tiny_model_dir),
        "--set",
        "rollout.group_size=2,4",
        "--steps",
        "3",
        "-o",
        "sw",
        *[x for k, v in opts.items() for x in (f"--{k}", v)],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "peergrade.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    sw = tmp_path / "sw"
    info = json.loads((sw / "sweep.json").read_text())
    assert [v["name"] for v in info["variants"]] == ["group_size=2", "group_size=4"]
    for G in (2, 4):
        run = sw / f"group_size={G}"
        cfg = (run / "config.yaml").read_text()
        assert f"group_size: {G}" in cfg and "seed: 0" in cfg and "steps: 3" in cfg
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps if "loss/policy" in m] == [1, 2, 3]
        assert steps[-1].get("final") is True
        groups = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        assert {len(g["completions"]) for g in groups} == {G}
    out = res.stdout
    assert "group_size=2" in out and "group_size=4" in out
    assert "best pass@1_sampled at the same number of steps: group_size=" in out
    html = (sw / "report.html").read_text()
    assert "Held-out pass@1_sampled vs training time" in html
    assert "Noise of the group-mean baseline vs group size" in html
    # a second sweep into the same dir is refused, nothing touched
    before = (sw / "sweep.json").read_text()
    res2 = subprocess.run(
        [sys.executable, "-m", "peergrade.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert res2.returncode == 2 and "not empty" in res2.stderr
    assert (sw / "sweep.json").read_text() == before


@pytest.mark.parametrize(
    "cmd,flag", [("sweep", "--set"), ("report", "RUN_DIR"), ("memory", "--budget")]
)
def test_help_mentions_the_new_options(cmd, flag, capsys):
    from peergrade.cli import main

    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert flag in capsys.readouterr().out


def test_run_sweep_validates_every_variant_before_training(tmp_path):
    from peergrade.config import ConfigError, load_config
    from peergrade.planning.sweep import run_sweep

    calls = []

    def train(cfg, run_dir, overwrite=False):
        calls.append((cfg.rollout.group_size, cfg.train.seed, cfg.train.steps, Path(run_dir).name))
        return {}

    def load(ov):
        return load_config(None, [("train.steps", 5), *ov])

    axes = parse_sets(["rollout.group_size=2,0"])  # 0 is not a valid group size
    with pytest.raises(ConfigError):
        run_sweep(load=load, axes=axes, out_dir=tmp_path / "a", train=train, log=lambda s: None)
    assert calls == [] and not (tmp_path / "a").exists()

    axes = parse_sets(["rollout.group_size=2,4", "train.seed=0,1"])
    res = run_sweep(load=load, axes=axes, out_dir=tmp_path / "b", train=train, log=lambda s: None)
    assert calls == [
        (2, 0, 5, "group_size=2_seed=0"),
        (2, 1, 5, "group_size=2_seed=1"),
        (4, 0, 5, "group_size=4_seed=0"),
        (4, 1, 5, "group_size=4_seed=1"),
    ]
    info = json.loads((tmp_path / "b" / "sweep.json").read_text())
    assert [v["name"] for v in info["variants"]] == [r["name"] for r in res]
    assert {v["status"] for v in info["variants"]} == {"done"}

    # killed in the second variant: sweep.json already lists it as running
    def dies(cfg, run_dir, overwrite=False):
        if cfg.rollout.group_size == 4:
            raise KeyboardInterrupt
        return {}

    with pytest.raises(KeyboardInterrupt):
        run_sweep(
            load=load,
            axes=parse_sets(["rollout.group_size=2,4,8"]),
            out_dir=tmp_path / "c",
            train=dies,
            log=lambda s: None,
        )
    info = json.loads((tmp_path / "c" / "sweep.json").read_text())
    assert [(v["name"], v["status"]) for v in info["variants"]] == [
        ("group_size=2", "done"),
        ("group_size=4", "running"),
    ]
