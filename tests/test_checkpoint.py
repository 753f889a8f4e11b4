"""Checkpoint files: atomic save (temp dir renamed, trainer_state.json last), interrupted saves
ignored, keep-last pruning (rename first, so a kill mid-prune leaves no half-deleted step-N),
completeness against the file list, the resume sweep, run-dir checks (writability included),
JSONL truncation on resume, RNG round trip and per-step seeding."""

from __future__ import annotations

import json
import random

import pytest
import torch

from peergrade.errors import PeergradeError
from peergrade.training import checkpoint as ckpt
from peergrade.training.checkpoint import RunDirError


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
    state = ckpt.read_trainer_state(last)
    files = state.pop("files")
    assert state == {"step": 4, "eval_before": None}
    # trainer_state.json lists every other file: completeness is checked against it
    assert files == sorted(names - {"trainer_state.json"})
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
    np = numpy_or_none()
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(3), np.random.random() if np else None)
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(3), np.random.random() if np else None)
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert ("numpy" in state) == (np is not None)


def numpy_or_none():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def test_seed_step_rngs_seeds_random_and_numpy():
    np = numpy_or_none()

    def draw(seed):
        ckpt.seed_step_rngs(seed)
        return [random.random() for _ in range(3)], (np.random.random(3).tolist() if np else [])

    assert draw(5) == draw(5)
    a, b = draw(5), draw(6)
    assert a[0] != b[0]
    if np:
        assert a[1] != b[1]
    ckpt.seed_step_rngs(2**63 - 2)  # step_seed's range: above numpy's 32-bit seeds


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
    # stopped before its first save: resumable (the trainer starts it from step 0)
    assert ckpt.check_run_dir(run, resume=True, overwrite=False) == []
    assert ckpt.resume_point(run) == (0, False)
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


# ----------------------------------------------------------------------------- kill mid-prune


class Killed(BaseException):
    """Stands in for SIGKILL: nothing of ours catches it."""


def kill_after_first_file(monkeypatch, calls):
    """Make checkpoint's rmtree delete one file of the tree (the weights), then die."""
    real_rmtree = ckpt.shutil.rmtree

    def rmtree(path, *a, **kw):
        calls.append(path.name)
        if (path / "model.safetensors").exists():
            (path / "model.safetensors").unlink()
            raise Killed(path.name)
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)


def test_kill_mid_prune_leaves_no_incomplete_checkpoint(tmp_path, parts, monkeypatch):
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.yaml").write_text("train:\n  steps: 3\n")
    for step in (1, 2):
        save(run, step, parts, keep_last=5)
    calls = []
    kill_after_first_file(monkeypatch, calls)
    with pytest.raises(Killed):
        save(run, 3, parts, keep_last=1)
    monkeypatch.undo()
    # the doomed checkpoints were renamed away before anything was deleted
    assert calls == [".prune-step-1"]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [".prune-step-1", ".prune-step-2", "step-3"]
    assert not (run / "checkpoints/.prune-step-1/model.safetensors").exists()  # half-deleted
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3]
    assert ckpt.resolve_model_dir(str(run)) == str(run / "checkpoints/step-3")
    with pytest.raises(
        RunDirError, match=r"not complete.*complete checkpoints of this run: step-3"
    ):
        ckpt.resolve_model_dir(str(run / "checkpoints/.prune-step-1"))
    # resume sweeps the leftovers
    swept = ckpt.check_run_dir(run, resume=True, overwrite=False)
    assert swept == ["removed .prune-step-1", "removed .prune-step-2"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3"]
    assert ckpt.check_run_dir(run, resume=True, overwrite=False) == []


def test_half_deleted_step_dir_is_never_listed(tmp_path, parts):
    """What a kill inside a plain rmtree of step-N leaves (the defect this guards against):
    trainer_state.json still there, the weights gone. Not listed, not loadable, swept."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  steps: 3\n")
    for step in (1, 2):
        save(run, step, parts, keep_last=5)
    half = run / "checkpoints/step-2"
    (half / "model.safetensors").unlink()
    assert ckpt.checkpoint_problem(half) == "missing model.safetensors"
    assert ckpt.latest_checkpoint(run).name == "step-1"
    assert ckpt.resolve_model_dir(str(run)) == str(run / "checkpoints/step-1")
    with pytest.raises(RunDirError, match="missing model.safetensors.*: step-1"):
        ckpt.resolve_model_dir(str(half))
    # newer than every complete checkpoint: not what a prune leaves, so the sweep keeps it
    assert ckpt.check_run_dir(run, resume=True, overwrite=False) == []
    assert half.is_dir()
    # older than a complete one: a prune's leftover, swept
    save(run, 3, parts, keep_last=5)
    swept = ckpt.check_run_dir(run, resume=True, overwrite=False)
    assert swept == ["removed incomplete step-2 (missing model.safetensors)"]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-1", "step-3"]
    # editing a file by hand keeps a checkpoint complete; deleting one does not
    cfg = run / "checkpoints/step-1/config.json"
    cfg.write_text(cfg.read_text().replace("{", "{\n", 1))
    assert ckpt.checkpoint_problem(cfg.parent) is None
    for step in (1, 3):
        (run / f"checkpoints/step-{step}/training_state.pt").unlink()
    with pytest.raises(
        RunDirError, match=r"no complete checkpoint.*step-1: missing training_state"
    ):
        ckpt.check_run_dir(run, resume=True, overwrite=False)


def test_legacy_checkpoint_without_file_list(tmp_path, parts):
    run = tmp_path / "run"
    old = save(run, 1, parts)
    state = json.loads((old / "trainer_state.json").read_text())
    del state["files"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    assert ckpt.checkpoint_problem(old) is None
    (old / "model.safetensors").unlink()
    assert ckpt.checkpoint_problem(old) == "no weights file"


def test_sweep_restores_an_interrupted_resave(tmp_path, parts):
    """A re-save of step N killed between its two renames leaves .old-step-N (complete) and
    no step-N: the sweep puts it back."""
    run = tmp_path / "run"
    save(run, 2, parts)
    root = run / "checkpoints"
    (root / "step-2").rename(root / ".old-step-2")
    (root / ".tmp-step-2").mkdir()
    assert ckpt.list_checkpoints(run) == []
    assert ckpt.sweep_leftovers(run) == ["restored step-2 from .old-step-2", "removed .tmp-step-2"]
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    # killed while deleting the old copy after the new one is in place: the old one goes
    save(run, 2, parts)
    (root / ".old-step-2").mkdir()
    assert ckpt.sweep_leftovers(run) == ["removed .old-step-2"]
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]


def test_run_dir_that_cannot_be_written(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(RunDirError, match="afile' is a file, not a directory"):
        ckpt.check_run_dir(afile / "sub" / "run", resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        ckpt.check_run_dir(afile, resume=False, overwrite=True)
    with pytest.raises(RunDirError, match="cannot create output dir .*afile' is a file"):
        ckpt.check_writable(afile / "out", "output dir")  # what `peergrade sft --out` checks
    # the probe leaves nothing behind in a writable parent
    ckpt.check_run_dir(tmp_path / "new" / "run", resume=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
