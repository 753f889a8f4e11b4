"""A save the disk refuses (issue 33 item 4): a full disk (an OSError ENOSPC, or torch's own
"unexpected pos" with no room left), a read-only file system. One error naming the path, the
cause and the last good checkpoint, which stays intact; no half-written save is left; resume
after space is freed ends bit-identical to a run never stopped."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.config import load_config
from peergrade.training import checkpoint as ckpt
from peergrade.training.trainer import train

REWARD = """
def char_score(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 for t in texts]
"""


def config(model: Path, reward: Path):
    return load_config(
        None,
        [
            ("model.path", str(model)),
            ("rewards", [{"name": f"{reward}:char_score"}]),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("optim.lr", 1e-2),
            ("train.steps", 3),
            ("train.save_every", 1),
            ("train.eval_size", 2),
            ("train.eval_samples", 2),
            ("train.display", "none"),
            ("train.threads", 1),
        ],
    )


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("storage")
    reward = work / "r.py"
    reward.write_text(REWARD)
    train(config(tiny_model_dir, reward), work / "plain")
    return work, reward, load_file(str(work / "plain/checkpoints/step-3/model.safetensors"))


def full(_):
    raise OSError(errno.ENOSPC, "No space left on device")


def torch_full(_):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4376")


def read_only(_):
    raise OSError(errno.EROFS, "Read-only file system")


@pytest.mark.parametrize(
    "fail, said",
    [
        (full, "the disk is full"),
        (torch_full, "the disk is full"),
        (read_only, "the file system is read-only"),
    ],
)
def test_a_refused_save_names_the_cause_and_keeps_the_last_checkpoint(
    plain, tiny_model_dir, monkeypatch, fail, said
):
    work, reward, expected = plain
    run = work / f"run-{fail.__name__}"
    real_save = torch.save

    def save(obj, path, *a, **kw):  # step 2's optimizer state does not fit
        if ".tmp-step-2" in str(path):
            fail(path)
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", save)
    if fail is torch_full:  # torch says nothing of the disk: only the free space tells
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))
    with pytest.raises(ckpt.StorageError) as got:
        train(config(tiny_model_dir, reward), run)
    msg = str(got.value)
    assert said in msg and str(run / "checkpoints") in msg, msg
    assert "last good checkpoint is step-1" in msg and f"--resume {run}" in msg, msg
    assert "\n" not in msg
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-1"]  # intact, and no half-written save left behind
    assert ckpt.checkpoint_problem(run / "checkpoints/step-1") is None

    monkeypatch.undo()  # space freed
    summary = train(load_config(run / "config.yaml"), run, resume=True)
    assert summary["interrupted"] is False
    got_w = load_file(str(run / "checkpoints/step-3/model.safetensors"))
    for k in expected:
        assert torch.equal(got_w[k], expected[k]), k


def test_a_log_write_the_disk_refuses_is_one_named_error(plain, tiny_model_dir, monkeypatch):
    """metrics.jsonl cannot grow (the disk filled under another process): one error naming the
    file, the cause and the last good checkpoint; resume then ends exact."""
    from peergrade.monitoring import metrics

    work, reward, expected = plain
    run = work / "run-log-full"
    real_write = metrics.JsonlWriter.write

    def write(self, obj):
        if self.path.name == "metrics.jsonl" and obj.get("step") == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, obj)

    monkeypatch.setattr(metrics.JsonlWriter, "write", write)
    with pytest.raises(ckpt.StorageError) as got:
        train(config(tiny_model_dir, reward), run)
    msg = str(got.value)
    assert str(run / "metrics.jsonl") in msg and "the disk is full" in msg, msg
    assert "last good checkpoint is step-1" in msg, msg
    monkeypatch.undo()
    train(load_config(run / "config.yaml"), run, resume=True)
    got_w = load_file(str(run / "checkpoints/step-3/model.safetensors"))
    for k in expected:
        assert torch.equal(got_w[k], expected[k]), k
