"""Checkpoints and run directories: save, find, load, prune -- atomically.

A run directory holds ``config.yaml`` (resolved), ``metrics.jsonl``, ``samples.jsonl`` and
``checkpoints/step-N/``. Each checkpoint is a Hugging Face ``save_pretrained`` directory (model
+ tokenizer, so ``from_pretrained`` and ``peergrade eval`` load it directly) plus
``training_state.pt`` (optimizer, scheduler, RNG states) and ``trainer_state.json`` (step and
counters, human-readable).

Atomicity: a checkpoint is written into ``checkpoints/.tmp-step-N`` and renamed into place only
when complete, so a kill mid-save never leaves a half-written ``step-N`` and never touches the
previous one. Text files that are rewritten (config, truncated metrics on resume) go through
``atomic_write_text`` (temp file + ``os.replace``).

This module does not decide *when* to save (the trainer does) and does not build models.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from peergrade.errors import PeergradeError
from peergrade.models import save_tokenizer

STEP_RE = re.compile(r"^step-(\d+)$")


class RunDirError(PeergradeError, ValueError):
    """A run directory that is missing, not a run, or would be overwritten."""


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first (temp dirs of interrupted saves are ignored)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep_last: int,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically, then delete all but the last ``keep_last``."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step}"
    tmp = ckpt_root / f".tmp-step-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)  # in the form plain AutoTokenizer reads back exactly
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        },
        tmp / "training_state.pt",
    )
    (tmp / "config.yaml").write_text(config_yaml)
    # trainer_state.json last: its presence marks a complete checkpoint.
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=2))
    if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a periodic save)
        old = ckpt_root / f".old-step-{step}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def load_training_state(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / "training_state.pt"
    if not path.is_file():
        raise RunDirError(
            f"checkpoint {str(ckpt)!r} has no training_state.pt: it cannot be resumed"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / "trainer_state.json").read_text())


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop lines logged after ``max_step`` (written after the checkpoint we resume from)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            continue  # a torn last line from a kill mid-write
        if step <= max_step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an existing run, and refuse to resume something that is not a run.

    With ``overwrite`` an existing directory passes the check but is *not* deleted here: the
    trainer removes it only once the config, data, rewards and model have loaded, so a run
    that fails on bad input leaves the old directory untouched."""
    run_dir = Path(run_dir)
    if resume:
        if not run_dir.is_dir():
            raise RunDirError(f"cannot resume: {str(run_dir)!r} does not exist")
        if not (run_dir / "config.yaml").is_file():
            raise RunDirError(
                f"cannot resume: {str(run_dir)!r} is not a peergrade run (no config.yaml)"
            )
        if latest_checkpoint(run_dir) is None:
            raise RunDirError(
                f"cannot resume: {str(run_dir)!r} has no complete checkpoint under checkpoints/step-N"
            )
        return
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        raise RunDirError(
            f"run directory {str(run_dir)!r} already exists and is not empty; pass --overwrite "
            "to replace it or --resume to continue it"
        )
