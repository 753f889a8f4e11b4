"""Paths in configs (issue 23 items 6, 7, 16): a relative path in a YAML file is relative to
that file (as ``base:`` is), on the command line to the working directory; the loaded config
holds them absolute and remembers how they were typed, so a run's saved config.yaml works from
any directory. A reward may be given as a plain string in a YAML list."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from peergrade.config import ConfigError, load_config, load_run_config, to_yaml


@pytest.fixture
def project(tmp_path):
    """project/configs/my.yaml naming project/configs/data/rows.jsonl and a reward file."""
    conf = tmp_path / "configs"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (conf / "my_rewards.py").write_text("def exact(completions, **kw):\n    return [0.0]\n")
    (conf / "base.yaml").write_text("data:\n  eval_path: data/rows.jsonl\n")
    (conf / "my.yaml").write_text(
        "base: base.yaml\n"
        "data:\n  path: data/rows.jsonl\n"
        "rewards:\n  - my_rewards.py:exact\n  - {name: format, weight: 0.5}\n"
    )
    return tmp_path


def test_paths_in_a_config_file_resolve_against_the_file(project, monkeypatch):
    elsewhere = project / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the config's folder
    cfg = load_config(project / "configs" / "my.yaml")
    conf = project / "configs"
    assert cfg.data.path == str(conf / "data" / "rows.jsonl")
    assert cfg.data.eval_path == str(conf / "data" / "rows.jsonl")  # from the base file
    assert cfg.rewards[0].name == f"{conf / 'my_rewards.py'}:exact"
    assert (cfg.rewards[0].weight, cfg.rewards[1].name) == (1.0, "format")
    assert cfg.given_paths["data.path"] == "data/rows.jsonl"
    assert cfg.given_paths["rewards[0].name"] == "my_rewards.py:exact"


def test_a_missing_relative_path_is_shown_resolved(project, monkeypatch, capsys):
    from peergrade.cli import main

    monkeypatch.chdir(project)
    (project / "rows.jsonl").write_text("{}\n")  # where the old rule (working directory) looked
    bad = project / "configs" / "bad.yaml"
    bad.write_text("data:\n  path: rows.jsonl\n")
    assert load_config(bad).data.path == str(project / "configs" / "rows.jsonl")
    assert main(["train", "--config", str(bad), "-o", str(project / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(project / "configs" / "rows.jsonl") in err, err


def test_command_line_paths_resolve_against_the_working_directory(project, monkeypatch):
    monkeypatch.chdir(project / "configs")
    cfg = load_config(
        None, [("data.path", "data/rows.jsonl"), ("rewards", ["my_rewards.py:exact=2"])]
    )
    assert cfg.data.path == str(project / "configs" / "data" / "rows.jsonl")
    assert cfg.rewards[0].name == f"{project / 'configs' / 'my_rewards.py'}:exact"
    assert cfg.rewards[0].weight == 2.0
    # names that are not paths stay as they are
    cfg = load_config(None, [("rewards", ["format", "peergrade.rewards:format_reward"])])
    assert [r.name for r in cfg.rewards] == ["format", "peergrade.rewards:format_reward"]
    assert cfg.model.path == "bundled" and not cfg.given_paths


def test_saved_config_works_from_another_directory(project, monkeypatch):
    """What ``--resume`` reads: the run's config.yaml, loaded from anywhere."""
    monkeypatch.chdir(project / "configs")
    cfg = load_config(None, [("data.path", "data/rows.jsonl")])
    saved = project / "run" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(to_yaml(cfg))
    assert "# given as data/rows.jsonl" in saved.read_text()
    monkeypatch.chdir(project)
    again = load_run_config(saved)
    assert again.data.path == cfg.data.path and Path(again.data.path).is_file()
    assert dict(again.given_paths) == {"data.path": "data/rows.jsonl"}
    assert to_yaml(again) == saved.read_text()  # a resumed run rewrites the same file


def test_old_run_config_with_relative_paths_reads_them_from_the_working_directory(project):
    run = project / "old-run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  path: configs/data/rows.jsonl\n")
    cwd = os.getcwd()
    try:
        os.chdir(project)
        cfg = load_run_config(run / "config.yaml")
    finally:
        os.chdir(cwd)
    assert cfg.data.path == str(project / "configs" / "data" / "rows.jsonl")


def test_reward_short_form_and_its_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rewards: [format=0.25]\n")
    assert [(r.name, r.weight) for r in load_config(f).rewards] == [("format", 0.25)]
    f.write_text("rewards: [3]\n")
    with pytest.raises(ConfigError, match=r"rewards\[0\]: .*\{name: my_rewards.py:my_reward"):
        load_config(f)
    f.write_text("rewards: 3\n")
    with pytest.raises(ConfigError, match=r"rewards: .*\[\{name: my_rewards.py:my_reward"):
        load_config(f)
