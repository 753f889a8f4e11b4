"""A run's life as a new user meets it (issue 23 items 8, 9, 17, 20): Ctrl-C before the first
checkpoint leaves a run that ``--resume`` starts again from step 0 (and says so); ``--resume``
of a finished run says it is finished and changes nothing; checkpoints, exports and the run's
config.yaml get the user's umask; transformers' progress bars follow one policy whether the run
is started by the CLI or by ``trainer.train`` from Python."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from peergrade.cli import main
from peergrade.config import load_config

TINY = {
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_completion_length": 4,
    "train.eval_size": 2,
    "train.eval_samples": 2,
    "train.display": "none",
    "train.threads": 1,
}


def flags(steps: int, model: Path) -> list[str]:
    return ["--model", str(model), "--steps", str(steps)] + [
        x for k, v in TINY.items() for x in (f"--{k}", str(v))
    ]


def steps_logged(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines]


def snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step run trained through the Python entry point (``trainer.train``) under umask 027,
    with transformers' bars switched on as a Python user has them: (run dir, stderr, whether the
    bars were on again afterwards)."""
    import contextlib
    import io

    from transformers.utils import logging as hf_logging

    from peergrade.training.trainer import train

    run = tmp_path_factory.mktemp("finished") / "run"
    overrides = [("model.path", str(tiny_model_dir)), ("train.steps", 2), *TINY.items()]
    old_mask = os.umask(0o027)
    err = io.StringIO()
    try:
        hf_logging.enable_progress_bar()
        with contextlib.redirect_stderr(err):
            summary = train(load_config(None, overrides), run)
        bars_back = hf_logging.is_progress_bar_enabled()
        out = run.parent / "exported"
        assert main(["export", str(run), str(out)]) == 0
    finally:
        os.umask(old_mask)
    assert summary["step"] == 2 and steps_logged(run) == [0, 1, 2, 2]
    return run, err.getvalue(), bars_back


def test_python_entry_point_shows_no_transformers_bars(finished_run):
    """Item 20: the same policy as the CLI's; the caller's setting is back afterwards."""
    _, err, bars_back = finished_run
    assert "Loading weights" not in err and "Writing model shards" not in err, err
    assert bars_back


def test_checkpoint_export_and_config_get_the_umask(finished_run):
    """Item 17: umask 027 -> files 0640, directories 0750 (mkstemp and safetensors give 0600)."""
    run, _, _ = finished_run
    for name in (
        "config.yaml",
        "checkpoints/step-2/model.safetensors",
        "checkpoints/step-2/config.yaml",
        "checkpoints/step-2/trainer_state.json",
    ):
        assert oct((run / name).stat().st_mode & 0o777) == oct(0o640), name
    out = run.parent / "exported"
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o640)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)


def test_resume_of_a_finished_run_changes_nothing(finished_run, capsys, monkeypatch):
    """Item 9: it says the run is finished and how to extend it; nothing is loaded or written."""
    import peergrade.training.trainer as trainer_mod

    def no_model(cfg):
        raise AssertionError("a finished run loaded its model again")

    monkeypatch.setattr(trainer_mod, "setup_models", no_model)
    run = finished_run[0]
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    said = capsys.readouterr().out
    assert "is finished" in said and "--train.steps" in said, said
    assert snapshot(run) == before  # metrics.jsonl byte-identical, nothing rewritten
    # a train.steps below the step the run reached is an error, not a second final evaluation
    assert main(["train", "--resume", str(run), "--train.steps", "1"]) == 2
    assert "past train.steps 1" in capsys.readouterr().err
    assert snapshot(run) == before


def test_ctrl_c_before_the_first_checkpoint_resumes_from_step_0(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """Item 8, and item 6 end to end: the run is started with relative --data and --reward in
    one directory and resumed from another."""
    import peergrade.training.trainer as trainer_mod

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "my_rewards.py").write_text(
        "def exact(completions, answer, **kw):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
    )
    mine = ["--data", "rows.jsonl", "--data.eval_path", "rows.jsonl"]
    mine += ["--reward", "my_rewards.py:exact", "-o", "run"]
    run = work / "run"
    monkeypatch.chdir(work)
    real_step = trainer_mod.train_step

    def interrupted_step(*args, **kwargs):  # a second Ctrl-C inside step 1
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "train_step", interrupted_step)
    assert main(["train", *flags(2, tiny_model_dir), *mine]) == 130
    err = capsys.readouterr().err
    assert "checkpoint saved at step 0" not in err
    assert "nothing saved" in err and "--resume run (from step 0)" in err, err
    assert not (run / "checkpoints").exists()

    # the same command again names --resume, and --resume now works, from step 0
    assert main(["train", *flags(2, tiny_model_dir), *mine]) == 2
    assert "--resume" in capsys.readouterr().err
    monkeypatch.setattr(trainer_mod, "train_step", real_step)
    monkeypatch.chdir(elsewhere)  # relative paths typed in work/ still resolve
    assert main(["train", "--resume", str(run)]) == 0, capsys.readouterr().err
    assert steps_logged(run) == [0, 1, 2, 2]  # one starting evaluation, not two
    saved = (run / "config.yaml").read_text()
    assert f"path: {work / 'rows.jsonl'}  # given as rows.jsonl" in saved


def test_ctrl_c_while_evaluating_the_starting_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import peergrade.training.trainer as trainer_mod

    run = tmp_path / "run"

    def interrupted(self, after_step):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod.HeldOut, "evaluate", interrupted)
    assert main(["train", *flags(1, tiny_model_dir), "-o", str(run)]) == 130
    err = capsys.readouterr().err
    assert f"--resume {run} (starts from step 0)" in err and "--overwrite" in err, err
    assert (run / "config.yaml").is_file()
