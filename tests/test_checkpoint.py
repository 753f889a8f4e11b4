"""Checkpoint files: atomic save (temp dir renamed, trainer_state.json last), interrupted saves
ignored, keep-last pruning, run-dir checks, JSONL truncation on resume, RNG round trip."""

from __future__ import annotations

import json
import random

import pytest
import torch

from peergrade import checkpoint as ckpt
from peergrade.checkpoint import RunDirError
from peergrade.errors import PeergradeError


@pytest.fixture
def parts(tiny_qwen2):
    model, tok = tiny_qwen2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    return dict(model=model, tokenizer=tok, optimizer=opt, scheduler=sched)


def save(run, step, parts, keep_last=3):
    return ckpt.save_checkpoint(
        run,
        step,
        **parts,
        trainer_state={"eval_before": None},
        config_yaml="train:\n  steps: 3\n",
        keep_last=keep_last,
    )


def test_save_layout_and_keep_last(tmp_path, parts):
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        save(run, step, parts, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3", "step-4"]
    last = ckpt.latest_checkpoint(run)
    assert last.name == "step-4"
    names = {p.name for p in last.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "training_state.pt"} <= names
    assert {"trainer_state.json", "config.yaml"} <= names
    assert ckpt.read_trainer_state(last) == {"step": 4, "eval_before": None}
    state = ckpt.load_training_state(last)
    assert set(state) == {"optimizer", "scheduler", "rng"}


def test_interrupted_save_is_ignored(tmp_path, parts):
    run = tmp_path / "run"
    save(run, 2, parts)
    # a kill mid-save leaves a temp dir, and a step dir without trainer_state.json is incomplete
    (run / "checkpoints/.tmp-step-3").mkdir()
    (run / "checkpoints/.tmp-step-3/model.safetensors").write_bytes(b"partial")
    (run / "checkpoints/step-5").mkdir()
    (run / "checkpoints/step-5/config.json").write_text("{}")
    assert ckpt.latest_checkpoint(run).name == "step-2"
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    # the next save of step 3 replaces the stale temp dir
    save(run, 3, parts)
    assert ckpt.latest_checkpoint(run).name == "step-3"
    assert not (run / "checkpoints/.tmp-step-3").exists()


def test_trainer_state_is_written_last(tmp_path, parts, monkeypatch):
    """If the save dies while writing trainer_state.json, no step-N appears and the previous
    checkpoint is untouched."""
    run = tmp_path / "run"
    save(run, 1, parts)
    before = (run / "checkpoints/step-1/model.safetensors").read_bytes()
    written = []
    real_write_text = type(run).write_text

    def write_text(self, text, *a, **kw):
        written.append(self.name)
        if self.name == "trainer_state.json":
            raise OSError("disk full")
        return real_write_text(self, text, *a, **kw)

    monkeypatch.setattr(type(run), "write_text", write_text)
    with pytest.raises(OSError, match="disk full"):
        save(run, 2, parts)
    monkeypatch.undo()
    assert written[-1] == "trainer_state.json"
    assert (run / "checkpoints/.tmp-step-2/training_state.pt").is_file()  # everything else done
    assert not (run / "checkpoints/step-2").exists()
    assert ckpt.latest_checkpoint(run).name == "step-1"
    assert (run / "checkpoints/step-1/model.safetensors").read_bytes() == before


def test_resaving_same_step_replaces_it(tmp_path, parts):
    run = tmp_path / "run"
    save(run, 2, parts)
    save(run, 2, parts)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]


def test_rng_round_trip():
    random.seed(1)
    torch.manual_seed(1)
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_truncate_jsonl(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/x": 1}, {"step": 1}, {"step": 2}, {"step": 3}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tor')
    ckpt.truncate_jsonl(p, 2)
    assert [json.loads(x) for x in p.read_text().splitlines()] == rows[:3]
    ckpt.truncate_jsonl(tmp_path / "missing.jsonl", 2)  # absent file: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_check_run_dir(tmp_path, parts):
    run = tmp_path / "run"
    ckpt.check_run_dir(run, resume=False, overwrite=False)  # absent: fine
    run.mkdir()
    ckpt.check_run_dir(run, resume=False, overwrite=False)  # empty: fine
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="already exists.*--overwrite"):
        ckpt.check_run_dir(run, resume=False, overwrite=False)
    ckpt.check_run_dir(run, resume=False, overwrite=True)
    assert (run / "metrics.jsonl").exists()  # the check never deletes; the trainer does, later

    with pytest.raises(RunDirError, match="does not exist"):
        ckpt.check_run_dir(tmp_path / "nope", resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="not a peergrade run"):
        ckpt.check_run_dir(run, resume=True, overwrite=False)
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        ckpt.check_run_dir(run, resume=True, overwrite=False)
    save(run, 1, parts)
    ckpt.check_run_dir(run, resume=True, overwrite=False)
    assert issubclass(RunDirError, PeergradeError)


def test_load_training_state_missing(tmp_path):
    with pytest.raises(RunDirError, match="training_state.pt"):
        ckpt.load_training_state(tmp_path)


def test_atomic_write_text_leaves_no_temp(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("old")
    ckpt.atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert [x.name for x in tmp_path.iterdir()] == ["config.yaml"]
