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
    # a file edited by hand no longer matches the manifest: named, and (unlike a missing
    # file, which is what a killed prune leaves) never swept away for the user
    cfg = run / "checkpoints/step-1/config.json"
    cfg.write_text(cfg.read_text().replace("{", "{\n", 1))
    size = cfg.stat().st_size
    assert ckpt.checkpoint_problem(cfg.parent) == (
        f"config.json is {size} bytes, {size - 1} expected (manifest.json)"
    )
    assert ckpt.check_run_dir(run, resume=True, overwrite=False) == []
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-1", "step-3"]
    for step in (1, 3):
        (run / f"checkpoints/step-{step}/training_state.pt").unlink()
    with pytest.raises(
        RunDirError, match=r"no complete checkpoint.*step-1: missing training_state"
    ):
        ckpt.check_run_dir(run, resume=True, overwrite=False)


def test_legacy_checkpoint_without_file_list(tmp_path, parts):
    run = tmp_path / "run"
    old = save(run, 1, parts)
    as_legacy(old)
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


# ----------------------------------------------------------------------------- the manifest


def flip_byte(path):
    """One byte of ``path`` changed in place: the size stays, the sha256 does not."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def as_legacy(ckpt_dir):
    """What a peergrade from before the manifest saved: no manifest.json, and trainer_state.json
    listing the other files."""
    (ckpt_dir / "manifest.json").unlink()
    state = json.loads((ckpt_dir / "trainer_state.json").read_text())
    state["files"] = [f for f in state["files"] if f != "manifest.json"]
    (ckpt_dir / "trainer_state.json").write_text(json.dumps(state, indent=2))


def snapshot(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_manifest_lists_every_file_and_is_written_last_after_fsyncs(tmp_path, parts, monkeypatch):
    """manifest.json: each file's relative path, size and sha256; nothing is written after it;
    every file and directory is fsynced, checkpoints/ last (after the rename into place)."""
    import hashlib
    import os

    run = tmp_path / "run"
    present, synced = [], []
    real_write_manifest, real_fsync = ckpt.write_manifest, os.fsync

    def write_manifest(directory):
        present.append(sorted(p.name for p in directory.iterdir()))
        real_write_manifest(directory)

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(ckpt, "write_manifest", write_manifest)
    monkeypatch.setattr(os, "fsync", fsync)
    step1 = save(run, 1, parts)
    monkeypatch.undo()

    names = sorted(p.name for p in step1.iterdir())
    assert "manifest.json" in names
    # when the manifest was written, every other file was there already, and none came after
    assert present == [[n for n in names if n != "manifest.json"]]
    manifest = json.loads((step1 / "manifest.json").read_text())
    assert sorted(manifest["files"]) == present[0]
    for name, entry in manifest["files"].items():
        data = (step1 / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    # trainer_state.json lists every other file, manifest.json included
    assert ckpt.read_trainer_state(step1)["files"] == [
        n for n in names if n != "trainer_state.json"
    ]

    def key(p):
        return (p.stat().st_dev, p.stat().st_ino)

    for p in [*step1.iterdir(), step1, run / "checkpoints"]:
        assert key(p) in synced, p.name
    after = synced.index(key(run / "checkpoints"))
    assert all(synced.index(key(p)) < after for p in [*step1.iterdir(), step1])


class KilledMidSave(BaseException):
    """Stands in for SIGKILL while the save hashes its files."""


def test_save_interrupted_before_its_manifest_leaves_no_checkpoint(tmp_path, parts, monkeypatch):
    run = tmp_path / "run"
    save(run, 1, parts)
    before = snapshot(run / "checkpoints/step-1")
    calls = []
    real_hash = ckpt._hash_file

    def hash_file(path, **kw):
        calls.append(path.name)
        if len(calls) == 3:
            raise KilledMidSave()
        return real_hash(path, **kw)

    monkeypatch.setattr(ckpt, "_hash_file", hash_file)
    with pytest.raises(KilledMidSave):
        save(run, 2, parts)
    monkeypatch.undo()
    tmp = run / "checkpoints/.tmp-step-2"
    assert (tmp / "training_state.pt").is_file() and not (tmp / "manifest.json").exists()
    assert not (run / "checkpoints/step-2").exists()
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1]
    assert snapshot(run / "checkpoints/step-1") == before
    # in place without its manifest (copied by hand, say), it is incomplete and never resumed
    tmp.rename(run / "checkpoints/step-2")
    assert ckpt.checkpoint_problem(run / "checkpoints/step-2") == "missing manifest.json"
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1]
    found, _, skipped = ckpt.intact_checkpoint(run)
    assert found.name == "step-1" and skipped == ["step-2: missing manifest.json"]
    (run / "checkpoints/step-2").rename(tmp)
    assert ckpt.sweep_leftovers(run) == ["removed .tmp-step-2"]


def test_a_flipped_byte_is_named_and_resume_takes_the_newest_intact(tmp_path, parts):
    run = tmp_path / "run"
    save(run, 1, parts)
    step2 = save(run, 2, parts)
    (run / "config.yaml").write_text("train:\n  steps: 3\n")  # a run directory
    expected = json.loads((step2 / "manifest.json").read_text())["files"]["model.safetensors"]
    flip_byte(step2 / "model.safetensors")
    import hashlib

    found = hashlib.sha256((step2 / "model.safetensors").read_bytes()).hexdigest()
    # the size is right: listing (stat only) cannot tell; verifying (sha256) can
    assert ckpt.checkpoint_problem(step2) is None
    problem = ckpt.verify_checkpoint(step2)
    assert problem == (
        f"model.safetensors has sha256 {found[:16]}..., {expected['sha256'][:16]}... expected "
        "(manifest.json): its bytes changed after it was saved"
    )
    last, state, skipped = ckpt.intact_checkpoint(run)
    assert last.name == "step-1" and set(state) == {"optimizer", "scheduler", "rng"}
    assert skipped == [f"step-2: {problem}"]
    # readers that verify (export, eval) refuse the run's damaged latest and name the earlier one
    with pytest.raises(RunDirError) as err:
        ckpt.resolve_model_dir(str(run), verify=True)
    msg = str(err.value)
    assert "step-2, is damaged (model.safetensors has sha256" in msg and "\n" not in msg
    assert f"name it: {str(run / 'checkpoints/step-1')!r}" in msg
    with pytest.raises(RunDirError, match=r"step-2' is damaged \(model.safetensors has sha256"):
        ckpt.resolve_model_dir(str(step2), verify=True)
    assert ckpt.resolve_model_dir(str(run)) == str(step2)  # without verify: sizes only
    # the optimizer state is read by a resume alone: export and eval leave its hash out
    flip_byte(run / "checkpoints/step-1/training_state.pt")
    assert ckpt.verify_checkpoint(run / "checkpoints/step-1", training=False) is None
    assert ckpt.verify_checkpoint(run / "checkpoints/step-1").startswith(
        "training_state.pt has sha256"
    )


def test_a_truncated_training_state_is_named_never_a_traceback(tmp_path, parts):
    run = tmp_path / "run"
    save(run, 1, parts)
    step2 = save(run, 2, parts)
    size = (step2 / "training_state.pt").stat().st_size
    truncate(step2 / "training_state.pt")
    assert ckpt.checkpoint_problem(step2) == (
        f"training_state.pt is {size // 2} bytes, {size} expected (manifest.json)"
    )
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1]
    last, _, skipped = ckpt.intact_checkpoint(run)
    assert last.name == "step-1" and skipped == [f"step-2: {ckpt.checkpoint_problem(step2)}"]
    with pytest.raises(
        RunDirError, match=r"step-2' cannot be resumed: training_state.pt cannot be read"
    ):
        ckpt.load_training_state(step2)
    # an older checkpoint (no manifest): the load itself finds the damage
    as_legacy(step2)
    assert ckpt.checkpoint_problem(step2) is None and ckpt.verify_checkpoint(step2) is None
    last, _, skipped = ckpt.intact_checkpoint(run)
    assert last.name == "step-1" and len(skipped) == 1
    # torch's own words for a cut-short file (one line of them, which vary with the cut)
    assert skipped[0].startswith("step-2: training_state.pt cannot be read (")
    assert "\n" not in skipped[0]


def test_no_intact_checkpoint_is_one_error_and_changes_nothing(tmp_path, parts):
    run = tmp_path / "run"
    for step in (1, 2):
        flip_byte(save(run, step, parts, keep_last=5) / "model.safetensors")
    before = snapshot(run)
    with pytest.raises(RunDirError) as err:
        ckpt.intact_checkpoint(run)
    msg = str(err.value)
    assert msg.startswith(f"cannot resume: {str(run)!r} has no intact checkpoint (step-2: model")
    assert "; step-1: model.safetensors has sha256" in msg and "\n" not in msg
    assert snapshot(run) == before
    assert ckpt.intact_checkpoint(tmp_path / "fresh") is None  # no checkpoint at all: step 0


def test_a_checkpoint_without_manifest_is_accepted_unverified(tmp_path, parts):
    """Saved by a peergrade from before the manifest: resumed and exported as it is, with a
    note that it cannot be verified."""
    run = tmp_path / "run"
    old = save(run, 1, parts)
    (run / "config.yaml").write_text("train:\n  steps: 3\n")  # a run directory
    as_legacy(old)
    assert not ckpt.has_manifest(old)
    assert ckpt.checkpoint_problem(old) is None and ckpt.verify_checkpoint(old) is None
    last, _, skipped = ckpt.intact_checkpoint(run)
    assert last == old and skipped == []
    notes = []
    assert ckpt.resolve_model_dir(str(run), verify=True, say=notes.append) == str(old)
    assert notes == [
        f"checkpoint {str(old)!r} has no manifest.json (saved by an older peergrade): its files "
        "cannot be verified"
    ]
    flip_byte(old / "model.safetensors")  # what the manifest would have caught
    assert ckpt.verify_checkpoint(old) is None


def test_ranks_share_rank_0s_verdict(tmp_path, parts, monkeypatch):
    """Under torchrun rank 0 alone hashes; every rank resumes from its choice or raises its
    error (a rank raising alone would leave the others waiting in a collective)."""
    run = tmp_path / "run"
    save(run, 1, parts)
    flip_byte(save(run, 2, parts) / "model.safetensors")
    main_result = ckpt.intact_checkpoint(run)
    monkeypatch.setattr(ckpt.dist, "parallel", lambda: True)
    monkeypatch.setattr(ckpt.dist, "is_main", lambda: False)
    sent = []

    def gather_from_rank_0(obj):
        sent.append(obj)
        return [(main_result[0], main_result[2]), obj]

    monkeypatch.setattr(ckpt.dist, "gather_objects", gather_from_rank_0)
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda *a, **k: pytest.fail("rank 1 hashed"))
    assert ckpt._newest_intact(run) == (main_result[0], None, main_result[2])
    assert sent == [None]
    error = RunDirError("cannot resume: no intact checkpoint")
    monkeypatch.setattr(ckpt.dist, "gather_objects", lambda obj: [error, obj])
    with pytest.raises(RunDirError, match="no intact checkpoint"):
        ckpt._newest_intact(run)


# ----------------------------------------------------------------------------- end to end

TINY_RUN = {
    "--steps": "2",
    "--rollout.prompts_per_step": "2",
    "--rollout.group_size": "2",
    "--rollout.max_completion_length": "4",
    "--train.eval_size": "2",
    "--train.eval_samples": "1",
    "--train.display": "none",
    "--train.threads": "1",
    "--train.save_every": "1",
    "--train.keep_last": "5",
}


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """A finished 2-step run with checkpoints step-1 and step-2; each test damages a copy."""
    from peergrade.cli import main

    run = tmp_path_factory.mktemp("trained") / "run"
    args = [x for kv in TINY_RUN.items() for x in kv]
    assert main(["train", "--model", str(tiny_model_dir), *args, "-o", str(run)]) == 0
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path):
    import shutil

    return shutil.copytree(trained_run, tmp_path / "run")


def trained_steps(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss/policy" in r]


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint_and_export_refuses_it(run_copy, tmp_path, capsys):
    from peergrade.cli import main

    run = run_copy
    weights = run / "checkpoints/step-2/model.safetensors"
    original = weights.read_bytes()
    flip_byte(weights)
    out = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the latest checkpoint of run") and err.count("\n") == 1, err
    assert "step-2, is damaged (model.safetensors has sha256" in err, err
    assert f"name it: {str(run / 'checkpoints/step-1')!r}" in err, err
    assert main(["export", str(run / "checkpoints/step-2"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "step-2' is damaged (model.safetensors has sha256" in err and err.count("\n") == 1
    assert not out.exists()

    assert main(["train", "--resume", str(run), "--train.steps", "3"]) == 0
    said = capsys.readouterr()
    assert "Traceback" not in said.err
    damaged = [line for line in (said.out + said.err).splitlines() if "damaged" in line]
    assert len(damaged) == 1, said
    assert damaged[0].startswith(
        f"skipping damaged checkpoint of {str(run)!r} (step-2: model.safetensors has sha256 "
    )
    assert damaged[0].endswith(
        "expected (manifest.json): its bytes changed after it was saved), left as it is: "
        "resuming from step-1, the newest intact checkpoint"
    )
    assert trained_steps(run) == [1, 2, 3]  # step 2's line was cut, and step 2 trained again
    # ... from step-1, exactly: the step-2 it saved again is the one before the damage
    assert weights.read_bytes() == original
    assert ckpt.verify_checkpoint(run / "checkpoints/step-2") is None


@pytest.mark.slow
def test_resume_past_a_truncated_training_state_and_stop_when_none_is_intact(run_copy, capsys):
    from peergrade.cli import main

    run = run_copy
    state = run / "checkpoints/step-2/training_state.pt"
    size = state.stat().st_size
    truncate(state)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "3"]) == 0
    said = capsys.readouterr()
    assert "Traceback" not in said.err
    assert (
        f"(step-2: training_state.pt is {size // 2} bytes, {size} expected (manifest.json)), "
        "left as it is: resuming from step-1, the newest intact checkpoint"
    ) in said.out + said.err
    assert trained_steps(run) == [1, 2, 3]

    # every checkpoint damaged: one error line, status 2, nothing written
    for step in (1, 2, 3):
        flip_byte(run / f"checkpoints/step-{step}/model.safetensors")
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--train.steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(
        f"error: cannot resume: {str(run)!r} has no intact checkpoint (step-3: model.safetensors"
    )
    assert "; step-2: model.safetensors" in errors[0] and "; step-1: model.safetensors" in errors[0]
    assert snapshot(run) == before


@pytest.mark.slow
def test_checkpoints_without_manifest_resume_and_export_unverified(run_copy, tmp_path, capsys):
    """Saved by a peergrade from before the manifest: accepted with a note; a truncated
    training_state.pt is still caught (by loading it)."""
    from peergrade.cli import main

    run = run_copy
    for step in (1, 2):
        as_legacy(run / f"checkpoints/step-{step}")
    truncate(run / "checkpoints/step-2/training_state.pt")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "3"]) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "Traceback" not in said.err
    assert "(step-2: training_state.pt cannot be read (" in text, text
    assert "left as it is: resuming from step-1, the newest intact checkpoint" in text
    assert ckpt.unverified_note(run / "checkpoints/step-1") in text
    assert trained_steps(run) == [1, 2, 3]
    assert ckpt.has_manifest(run / "checkpoints/step-2")  # saved again, with its manifest
    out = tmp_path / "exported"
    assert main(["export", str(run / "checkpoints/step-1"), str(out)]) == 0
    assert ckpt.unverified_note(run / "checkpoints/step-1") in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()
