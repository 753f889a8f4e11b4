"""Checkpoints and run directories: save, find, load, prune -- atomically.

A run directory holds ``config.yaml`` (resolved), ``metrics.jsonl``, ``samples.jsonl`` and
``checkpoints/step-N/``. Each checkpoint is a Hugging Face ``save_pretrained`` directory (model
+ tokenizer, so ``from_pretrained`` and ``peergrade eval`` load it directly) plus
``training_state.pt`` (optimizer, scheduler, RNG states) and ``trainer_state.json`` (step and
counters, human-readable).

Atomicity: a checkpoint is written into ``checkpoints/.tmp-step-N`` and renamed into place only
when complete, so a kill mid-save never leaves a half-written ``step-N`` and never touches the
previous one. ``trainer_state.json`` lists every file of the checkpoint; a ``step-N`` counts
as complete only when that list is there and every file in it is (``checkpoint_problem``).

Integrity: every file is fsynced, then ``manifest.json`` -- each file's relative path, size
and sha256 -- is written last (``write_manifest``), before the rename into place and an fsync
of ``checkpoints/``. Listing compares sizes (a stat); ``verify_checkpoint`` the sha256s too,
on resume (every file) and for readers of the model (export, eval: all but the ``.pt``
files). A resume goes to the newest checkpoint that verifies and whose ``training_state.pt``
loads (``intact_checkpoint``), naming the newer damaged ones in one line; none intact is one
``RunDirError``; damaged checkpoints are never deleted for the user. A checkpoint without a
manifest (saved before there was one) is accepted unverified, with a note. Pruning renames ``step-N`` to ``.prune-step-N`` (atomic) before
deleting it, so a kill mid-delete leaves a hidden directory, never a half-deleted ``step-N``;
``sweep_leftovers`` (run on resume) removes such leftovers and interrupted temp saves. Text
files that are rewritten (config, truncated metrics on resume) go through ``atomic_write_text``
(temp file + ``os.replace``).

File modes: checkpoints, exports and ``peergrade sft`` outputs get the user's umask
(``peergrade.files``: ``apply_umask`` before the rename into place, ``atomic_write_text``).

RNG: ``seed_step_rngs`` seeds Python's ``random`` and numpy's global generator for each step
from the trainer's per-step seed, so user reward functions that draw from them are
reproducible; ``rng_state`` / ``set_rng_state`` carry those states (and torch's) in the
checkpoint.

``claimed_run_dir`` holds a run directory for the run's life (made -- a new
``runs/<date>-<time>`` when none is named -- locked and checked by rank 0, its name shared with
the other ranks; ``run_lock``), ``RunDir`` is the trainer's view of a run directory (its logs,
``save`` at a step),
``finished_run`` says whether ``--resume`` has anything left to do,
``resume_from_checkpoint`` loads the last checkpoint into a run, ``StopFlag`` turns a
first Ctrl-C or a SIGTERM into "save after this step, then stop" (a second Ctrl-C stops at once,
but never inside a ``critical`` stretch: a step's update and its record, a save's renames), and
``RunDir.save`` turns a save the disk refuses into one ``StorageError`` naming the path, the
cause and the last good checkpoint. ``RunDir`` and the resume take the
trainer's run duck-typed (its models, optimizer state, scheduler and config), so this module never imports
the trainer.

This module does not decide *when* to save (the trainer does) and does not build models.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade.errors import PeergradeError, Stop, Terminated
from peergrade.files import apply_umask, atomic_write_text  # importable from here too
from peergrade.model.load import load_model, resolve_dtype, save_tokenizer
from peergrade.monitoring.metrics import JsonlWriter, MetricLogger, Tee
from peergrade.training.run_lock import LOCK_NAME, RunLock, acquire, check_free, claim_new

STEP_RE = re.compile(r"^step-(\d+)$")
#: written last into every checkpoint: each file's relative path, size and sha256
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TRAINING_STATE = "training_state.pt"
#: hidden names of interrupted saves / prunes (never listed as checkpoints)
TMP_PREFIX, OLD_PREFIX, PRUNE_PREFIX = ".tmp-step-", ".old-step-", ".prune-step-"
#: any of these marks a model directory (full weights, sharded index, or a LoRA adapter)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


class RunDirError(PeergradeError, ValueError):
    """A run directory that is missing, not a run, or would be overwritten."""


def _numpy_random():
    """numpy's legacy global generator module, or None when numpy is not installed."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


def seed_step_rngs(seed: int) -> None:
    """Seed Python's ``random`` and numpy's global generator (when numpy is installed) with
    ``seed``, the trainer's seed for this step and rank: user reward functions that draw from
    them then repeat under the same ``train.seed`` and across a resume."""
    random.seed(seed)
    np_random = _numpy_random()
    if np_random is not None:
        np_random.seed(seed % 2**32)  # numpy's legacy seed is 32-bit


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np_random = _numpy_random()
    if np_random is not None:
        state["numpy"] = np_random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np_random = _numpy_random()
    if "numpy" in state and np_random is not None:  # absent in checkpoints saved without numpy
        np_random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _file_names(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` is not a complete checkpoint (``None`` when it is). Cheap: it reads two
    small JSON files and looks at file sizes; ``verify_checkpoint`` adds the sha256s.

    Complete means: ``trainer_state.json`` is readable and every file it lists exists
    (``_missing``: what a kill while deleting leaves), and, for a checkpoint with a
    ``manifest.json``, every file the manifest lists has the size it records (a truncated
    copy, a file edited by hand). Checkpoints written before the manifest existed are judged
    by the file list alone, and those written before the list by the files every checkpoint
    has (weights, model config, ``training_state.pt``)."""
    return _missing(Path(ckpt)) or _size_problem(Path(ckpt))


def _missing(ckpt: Path) -> str | None:
    """The first file ``ckpt`` should have and lacks, or why that cannot be told; None when
    nothing is missing. This is all ``sweep_leftovers`` removes an older checkpoint for: a
    checkpoint whose bytes are damaged is never deleted for the user."""
    if not ckpt.is_dir():
        return "not a directory"
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError) as exc:
        return f"unreadable trainer_state.json ({exc})"
    files = state.get("files") if isinstance(state, dict) else None
    if isinstance(files, list):  # it lists manifest.json too, when there is one
        for name in files:
            if not (ckpt / str(name)).is_file():
                return f"missing {name}"
        return None
    # no file list: an older checkpoint
    if not any((ckpt / f).is_file() for f in WEIGHT_FILES):
        return "no weights file"
    if not ((ckpt / "config.json").is_file() or (ckpt / "adapter_config.json").is_file()):
        return "missing config.json"
    if not (ckpt / TRAINING_STATE).is_file():
        return f"missing {TRAINING_STATE}"
    return None


def _read_manifest(ckpt: Path) -> dict[str, dict[str, Any]] | None:
    """{relative path: {"size", "sha256"}} from ``ckpt``'s manifest, None when it has none;
    ``ValueError`` (or ``OSError``) when it cannot be read as one."""
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise ValueError('expected {"files": {path: {"size": N, "sha256": HEX}}}')
    for name, entry in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"it names {name!r}, outside the checkpoint")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            raise ValueError(f'its entry for {name!r} is not {{"size": N, "sha256": HEX}}')
    return files


def _size_problem(ckpt: Path) -> str | None:
    """The first file of ``ckpt``'s manifest that is missing or not the size recorded."""
    try:
        files = _read_manifest(ckpt)
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST} ({exc})"
    for name, entry in (files or {}).items():
        try:
            size = (ckpt / name).stat().st_size
        except FileNotFoundError:
            return f"missing {name}"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if size != entry["size"]:
            return f"{name} is {size} bytes, {entry['size']} expected ({MANIFEST})"
    return None


def has_manifest(ckpt: Path) -> bool:
    """Whether ``ckpt`` can be verified: checkpoints saved before peergrade wrote a manifest
    cannot (they are accepted, with a note, by those who verify)."""
    return (Path(ckpt) / MANIFEST).is_file()


def unverified_note(ckpt: Path) -> str:
    return (
        f"checkpoint {str(ckpt)!r} has no {MANIFEST} (saved by an older peergrade): its "
        "files cannot be verified"
    )


def verify_checkpoint(ckpt: Path, *, training: bool = True) -> str | None:
    """Why ``ckpt`` cannot be trusted (``None`` when it can): ``checkpoint_problem`` (files
    missing, sizes) and then every file's sha256 against its manifest, in one line naming the
    file with what was expected and what was found. ``training=False`` leaves out the ``.pt``
    files (optimizer, RNG: only a resume reads them), for readers of the model alone (export,
    eval). A checkpoint without a manifest passes on its files being there (``has_manifest``
    tells the caller to say so). Reads every byte it checks: about a second per 1.5 GB."""
    ckpt = Path(ckpt)
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        return problem
    try:
        files = _read_manifest(ckpt) or {}
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST} ({exc})"
    for name, entry in files.items():
        if not training and name.endswith(".pt"):
            continue
        try:
            _, digest = _hash_file(ckpt / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
        if digest != entry["sha256"]:
            return (
                f"{name} has sha256 {digest[:16]}..., {entry['sha256'][:16]}... expected "
                f"({MANIFEST}): its bytes changed after it was saved"
            )
    return None


_HASH_CHUNK = 8 * 2**20


def _hash_file(path: Path, *, sync: bool = False) -> tuple[int, str]:
    """(size, sha256 hex) of ``path``, read once; ``sync``: fsync it as well, so its bytes
    are on the disk before the manifest that vouches for them."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (files created in it, renames into it) durable. A file system
    that cannot fsync a directory (EINVAL) is let be: there is nothing more to ask of it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> None:
    """fsync every file of ``directory`` while hashing it, then write ``manifest.json`` (each
    file's relative path, size and sha256), fsync it and the directory. The last write of a
    checkpoint: a ``step-N`` with a manifest was whole on disk when the manifest was written."""
    directory = Path(directory)
    files = {}
    for name in _file_names(directory):
        if name != MANIFEST:
            size, digest = _hash_file(directory / name, sync=True)
            files[name] = {"size": size, "sha256": digest}
    doc = {"format": MANIFEST_FORMAT, "files": files}
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for d in sorted(p for p in directory.rglob("*") if p.is_dir()):
        fsync_dir(d)
    fsync_dir(directory)


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Every ``checkpoints/step-N`` of a run, complete or not, oldest first."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := STEP_RE.match(p.name))]
    return sorted(found)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first: hidden dirs of interrupted saves and
    prunes, and any ``step-N`` that is not complete (``checkpoint_problem``), are left out."""
    return [(step, p) for step, p in _step_dirs(run_dir) if checkpoint_problem(p) is None]


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
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically, then delete all but the last ``keep_last``.
    ``extra``: more files of the checkpoint, {file name: object for ``torch.save``} (the
    pipelined rollouts' older weights, ``peergrade.training.pipeline``).

    Every file is fsynced and ``manifest.json`` written last (``write_manifest``); then the
    directory is renamed into place and ``checkpoints/`` fsynced, so after a power loss a
    ``step-N`` is either absent or whole. Under FSDP2 rank 0 writes it all, from the full
    state every rank helped gather (``RunDir.save``)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    new_root = not ckpt_root.is_dir()
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
        tmp / TRAINING_STATE,
    )
    (tmp / "config.yaml").write_text(config_yaml)
    for name, obj in (extra or {}).items():
        torch.save(obj, tmp / name)
    apply_umask(tmp)  # safetensors writes its file 0600
    # trainer_state.json lists every file, the manifest to come included (checkpoint_problem
    # checks against the list); the manifest, last, records each one's size and sha256.
    files = sorted([*_file_names(tmp), MANIFEST])
    state = {"step": step, **trainer_state, "files": files}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    write_manifest(tmp)  # fsyncs every file first
    with critical():  # a second Ctrl-C waits for the renames: never a step-N half in place
        if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a periodic save)
            old = ckpt_root / f"{OLD_PREFIX}{step}"
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
            tmp.rename(final)
            fsync_dir(ckpt_root)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
            fsync_dir(ckpt_root)
        if new_root:
            fsync_dir(ckpt_root.parent)
    prune_checkpoints(run_dir, keep_last)
    return final


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the last ``keep_last`` complete checkpoints (and stale prune leftovers).

    Each ``step-N`` is first renamed to ``.prune-step-N`` (atomic), then deleted: a kill while
    deleting leaves only a hidden directory that no listing sees and the next resume sweeps."""
    ckpt_root = Path(run_dir) / "checkpoints"
    for step, path in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        doomed = ckpt_root / f"{PRUNE_PREFIX}{step}"
        if doomed.exists():  # a stale leftover of the same name: rename cannot replace it
            shutil.rmtree(doomed)
        path.rename(doomed)
    for p in sorted(ckpt_root.glob(f"{PRUNE_PREFIX}*")):
        shutil.rmtree(p)


def sweep_leftovers(run_dir: Path) -> list[str]:
    """Clean ``checkpoints/`` after a kill; returns what was done, one line per directory.

    Removes interrupted saves (``.tmp-step-N``), interrupted prunes (``.prune-step-N``) and
    ``step-N`` directories missing a file, older than the newest complete checkpoint (what a
    prune killed by an older version left; a newer incomplete one is left alone, and unlisted;
    one whose bytes are damaged -- wrong size or sha256 -- is never deleted for the user). A
    ``.old-step-N`` (a re-save of step N killed between its two renames) is put back as
    ``step-N`` when that is missing or incomplete, else removed. Run on resume
    (``check_run_dir``), never by readers such as ``peergrade eval`` (a save may be in
    flight)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    done = []
    for p in sorted(ckpt_root.iterdir()):
        if not p.is_dir():
            continue
        if p.name.startswith(OLD_PREFIX):
            final = ckpt_root / f"step-{p.name[len(OLD_PREFIX) :]}"
            if checkpoint_problem(final) is not None and checkpoint_problem(p) is None:
                if final.exists():
                    shutil.rmtree(final)
                p.rename(final)
                done.append(f"restored {final.name} from {p.name}")
                continue
            shutil.rmtree(p)
            done.append(f"removed {p.name}")
    complete = list_checkpoints(run_dir)
    newest = complete[-1][0] if complete else -1
    for p in sorted(ckpt_root.iterdir()):
        if not p.is_dir():
            continue
        m = STEP_RE.match(p.name)
        if p.name.startswith((TMP_PREFIX, PRUNE_PREFIX)):
            shutil.rmtree(p)
            done.append(f"removed {p.name}")
        elif m and int(m.group(1)) < newest and (problem := _missing(p)) is not None:
            shutil.rmtree(p)
            done.append(f"removed incomplete {p.name} ({problem})")
    return done


def resolve_model_dir(path: str, *, verify: bool = False, say=None) -> str:
    """What a reader (``peergrade eval``) loads for ``path``: a run directory -> its latest
    complete checkpoint; a checkpoint directory that is incomplete, or a hidden one (an
    interrupted save or prune) -> ``RunDirError`` naming the complete ones; a checkpoint whose
    files are not the size its manifest records -> ``RunDirError`` saying which; else ``path``.
    Never sweeps: a training process may be saving into the run right now.

    ``verify`` (``peergrade export``, ``peergrade eval``): the checkpoint's model files are
    checked against their sha256s too (``verify_checkpoint``, its ``.pt`` files left out), and
    a run directory whose newest ``step-N`` is damaged is refused, naming an earlier complete
    one, rather than read from an older checkpoint without a word. ``say``: where the note
    about a checkpoint without a manifest goes (none when not given)."""
    p = Path(path)
    if not p.is_dir():
        return path
    if (p / "config.yaml").is_file() and (p / "checkpoints").is_dir():
        steps = _step_dirs(p)
        if verify and steps and (problem := _damage(steps[-1][1], verify)) is not None:
            newest = steps[-1][1]
            earlier = [c for _, c in list_checkpoints(p) if c != newest]
            raise RunDirError(
                f"the latest checkpoint of run {path!r}, {newest.name}, is damaged ({problem}); "
                + (
                    f"to use the newest complete one before it, name it: {str(earlier[-1])!r}"
                    if earlier
                    else "the run has no complete checkpoint before it"
                )
            )
        last = latest_checkpoint(p)
        if last is None:
            raise RunDirError(
                f"{path!r} is a peergrade run without a complete checkpoint under checkpoints/step-N"
            )
        if verify and say is not None and not has_manifest(last):
            say(unverified_note(last))
        return str(last)
    hidden = p.name.startswith((TMP_PREFIX, OLD_PREFIX, PRUNE_PREFIX))
    in_run = p.parent.name == "checkpoints" and (hidden or STEP_RE.match(p.name))
    if in_run or has_manifest(p):  # a checkpoint of a run, or a copy of one
        problem = "an interrupted save or prune" if hidden else _missing(p)
        damage = None if problem is not None else _damage(p, verify)
        if problem is not None or damage is not None:
            others = list_checkpoints(p.parent.parent) if in_run else []
            complete = [c.name for _, c in others if c.name != p.name]  # unhashed: sizes only
            raise RunDirError(
                f"checkpoint {path!r} is "
                + (f"not complete ({problem})" if problem is not None else f"damaged ({damage})")
                + (
                    f"; complete checkpoints of this run: {', '.join(complete) or 'none'}"
                    if in_run
                    else ""
                )
            )
        if verify and say is not None and not has_manifest(p):
            say(unverified_note(p))
    return path


def _damage(ckpt: Path, verify: bool) -> str | None:
    """What ``resolve_model_dir`` holds against a checkpoint: missing files and sizes, and with
    ``verify`` the sha256 of each file a reader of the model loads."""
    return verify_checkpoint(ckpt, training=False) if verify else checkpoint_problem(ckpt)


def resume_point(run_dir: Path) -> tuple[int, bool]:
    """(the step of the run's latest complete checkpoint, 0 when it has none; whether the run
    finished there: its final evaluation is in metrics.jsonl, or it has no held-out split to
    evaluate). Reads only: ``--resume`` of a finished run changes nothing."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return 0, False
    state = read_trainer_state(last)
    step = int(state["step"])
    if state.get("eval_before", {}) is None:  # no held-out split: no final evaluation to run
        return step, True
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in reversed(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("final") and obj.get("step") == step:
            return step, True
    return step, False


def load_training_state(ckpt: Path) -> dict[str, Any]:
    """``training_state.pt`` of ``ckpt`` (optimizer, scheduler, RNG states); ``RunDirError``
    naming the file when it is missing or cannot be read (truncated, damaged)."""
    state, problem = _load_training_state(Path(ckpt))
    if problem is not None:
        raise RunDirError(f"checkpoint {str(ckpt)!r} cannot be resumed: {problem}")
    return state


def _load_training_state(ckpt: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = ckpt / TRAINING_STATE
    if not path.is_file():
        return None, f"it has no {TRAINING_STATE}"
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # what a truncated or garbled pickle/zip raises varies
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return None, f"{TRAINING_STATE} cannot be read ({type(exc).__name__}: {first})"
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "rng"} <= set(state):
        return None, f"{TRAINING_STATE} is not a peergrade training state"
    return state, None


def intact_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any], list[str]] | None:
    """What a resume starts from: the newest ``checkpoints/step-N`` that verifies
    (``verify_checkpoint``: files, sizes and sha256s against its manifest) and whose
    ``training_state.pt`` loads, that state, and one ``"step-N: problem"`` for each newer
    ``step-N`` passed over. None when the run has no ``step-N`` at all; ``RunDirError``, one
    line naming each checkpoint's problem, when none is intact. Changes nothing on disk."""
    run_dir = Path(run_dir)
    skipped = []
    for _, p in reversed(_step_dirs(run_dir)):
        problem = verify_checkpoint(p)
        if problem is None:
            state, problem = _load_training_state(p)
            if problem is None:
                return p, state, skipped
        skipped.append(f"{p.name}: {problem}")
    if not skipped:
        return None
    raise RunDirError(
        f"cannot resume: {str(run_dir)!r} has no intact checkpoint ({'; '.join(skipped)}); "
        "nothing was changed: put back an intact copy of a checkpoint, or start the run "
        "over with --overwrite"
    )


def _newest_intact(run_dir: Path) -> tuple[Path, dict[str, Any] | None, list[str]] | None:
    """``intact_checkpoint``, worked out by rank 0 alone under torchrun (N ranks hashing the
    same files would read them N times) and shared: every rank gets the same checkpoint, or
    the same error; the training state only where it was loaded (rank 0)."""
    if not dist.parallel():
        return intact_checkpoint(run_dir)
    found = None
    mine: Any = None  # what rank 0 tells the others: (checkpoint, skipped), None or the error
    if dist.is_main():
        try:
            found = intact_checkpoint(run_dir)
            mine = None if found is None else (found[0], found[2])
        except RunDirError as exc:
            mine = exc
    shared = dist.gather_objects(mine)[0]
    if isinstance(shared, RunDirError):
        raise shared
    if shared is None:
        return None
    return shared[0], found[1] if dist.is_main() else None, shared[1]


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


def check_run_dir(
    run_dir: Path, *, resume: bool, overwrite: bool, sweep: bool = True, held: bool = False
) -> list[str]:
    """Refuse to clobber an existing run, to resume something that is not a run, to start a
    run whose directory cannot be written, and to write a directory another process is
    writing (``run_lock.check_free``: its pid; the lock file itself does not make a directory
    non-empty).

    On resume, leftovers of a kill (interrupted saves and prunes) are swept first
    (``sweep_leftovers``; not with ``sweep=False``, the check before the lock is taken); what
    was swept is returned, one line each (else ``[]``). ``held``: the caller holds the lock
    (``claimed_run_dir``'s check under it).

    With ``overwrite`` an existing directory passes the check but is *not* deleted here: the
    trainer removes it only once the config, data, rewards and model have loaded, so a run
    that fails on bad input leaves the old directory untouched. Writability is probed by
    creating (and removing) a hidden directory, so it fails here -- before any model loads --
    exactly when the trainer's writes would: a read-only mount, missing permission, or a path
    below a regular file."""
    run_dir = Path(run_dir)
    try:
        if not held:
            check_free(run_dir)
        return _check_run_dir(run_dir, resume=resume, overwrite=overwrite, sweep=sweep)
    except OSError as exc:  # e.g. a parent we may not even look into (EACCES on stat)
        where = f" ({exc.filename})" if exc.filename else ""
        raise RunDirError(
            f"run directory {str(run_dir)!r} cannot be used: {exc.strerror or exc}{where}"
        ) from None


def _check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, sweep: bool) -> list[str]:
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} exists and is not a directory")
    if resume:
        if not run_dir.is_dir():
            raise RunDirError(f"cannot resume: {str(run_dir)!r} does not exist")
        if not (run_dir / "config.yaml").is_file():
            raise RunDirError(
                f"cannot resume: {str(run_dir)!r} is not a peergrade run (no config.yaml)"
            )
        _check_writable(run_dir, run_dir)
        if (run_dir / "checkpoints").is_dir():
            _check_writable(run_dir, run_dir / "checkpoints")
        swept = sweep_leftovers(run_dir) if sweep else []
        root = run_dir / "checkpoints"
        steps = sorted(p for p in root.glob("step-*") if STEP_RE.match(p.name))
        # none at all: stopped before its first save, so it resumes from step 0 (the trainer)
        if steps and latest_checkpoint(run_dir) is None:
            why = "; ".join(f"{p.name}: {checkpoint_problem(p)}" for p in steps)
            raise RunDirError(
                f"cannot resume: {str(run_dir)!r} has no complete checkpoint under "
                f"checkpoints/step-N ({why}); start it over with --overwrite"
            )
        return swept
    holds = run_dir.is_dir() and any(p.name != LOCK_NAME for p in run_dir.iterdir())
    if holds and not overwrite:
        raise RunDirError(
            f"run directory {str(run_dir)!r} already exists and is not empty; pass --overwrite "
            "to replace it or --resume to continue it"
        )
    check_writable(run_dir)  # --overwrite empties it in place (its lock file stays)
    return []


@contextmanager
def claimed_run_dir(run_dir: Path | str | None, *, resume: bool, overwrite: bool):
    """Hold a run directory for the run's life; yields ``(path, swept)`` (``check_run_dir``).

    Rank 0 makes the directory -- ``runs/<date>-<time>`` (``-2``, ``-3``, ... when taken) when
    ``run_dir`` is None -- takes its lock (``run_lock``: a second writer is refused with the
    holder's pid) and checks it under the lock, so only the holder sweeps a resumed run's
    leftovers. The other ranks of a torchrun launch get its name (or its error) from rank 0:
    every rank writes the one directory, even when they started a second apart. Leaving
    releases the lock; a directory made here and still empty (the run failed while loading)
    is removed."""
    lock, outcome, error = None, None, None
    if dist.is_main():
        try:
            lock, swept = _claim(run_dir, resume=resume, overwrite=overwrite)
            outcome = (str(lock.directory), swept)
        except Exception as exc:
            error, outcome = exc, f"{type(exc).__name__}: {exc}"
    if dist.parallel():
        outcome = dist.gather_objects(outcome)[0]
    if error is not None:
        raise error
    if isinstance(outcome, str):
        raise RunDirError(f"rank 0 could not take the run directory: {outcome}")
    try:
        yield Path(outcome[0]), outcome[1]
    finally:
        if lock is not None:
            lock.release()


def _claim(run_dir: Path | str | None, *, resume: bool, overwrite: bool) -> tuple[RunLock, list]:
    if run_dir is None:
        if resume:
            raise RunDirError("cannot resume: no run directory given")
        lock = claim_new()
    else:
        # every refusal that needs no lock comes first, before anything is made
        check_run_dir(Path(run_dir), resume=resume, overwrite=overwrite, sweep=False)
        lock = acquire(Path(run_dir), create=not resume)
    try:  # again under the lock: what another writer did meanwhile counts
        return lock, check_run_dir(lock.directory, resume=resume, overwrite=overwrite, held=True)
    except BaseException:
        lock.release()
        raise


def check_writable(out_dir: Path, what: str = "run directory") -> None:
    """``RunDirError`` unless ``out_dir`` can be created (or, when it exists, written in):
    probed in the directory itself or its nearest existing ancestor (where mkdir would go)."""
    out_dir = Path(out_dir)
    try:
        existing = out_dir if out_dir.exists() else out_dir.absolute().parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
    except OSError as exc:  # a parent we may not even look into (EACCES on stat)
        raise RunDirError(
            f"{what} {str(out_dir)!r} cannot be used: {exc.strerror or exc} ({exc.filename})"
        ) from None
    if not existing.is_dir():
        raise RunDirError(
            f"cannot create {what} {str(out_dir)!r}: {str(existing)!r} is a file, not a directory"
        )
    _check_writable(out_dir, existing, what)


def _check_writable(out_dir: Path, directory: Path, what: str = "run directory") -> None:
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory, prefix=".peergrade-write-test-"))
    except OSError as exc:
        raise RunDirError(
            f"{what} {str(out_dir)!r} cannot be written: creating a directory in "
            f"{str(directory)!r} failed ({exc.strerror or exc}); choose another "
            "output directory or fix the permissions"
        ) from None


class StorageError(PeergradeError, OSError):
    """A save that the disk refused (full, read-only, not permitted): which path, why, and the
    last good checkpoint."""


#: what torch.save says when the disk fills under it (its writer hides the OSError)
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
_FULL_BELOW = 64 * 2**20  # bytes free under which a failed write is put down to a full disk


def storage_problem(exc: BaseException, where: Path) -> str | None:
    """What about the storage under ``where`` made ``exc`` (a failed write) happen, in words,
    or None when it is not a storage problem."""
    import errno

    code = getattr(exc, "errno", None)
    try:
        free = shutil.disk_usage(where if Path(where).exists() else Path(where).parent).free
    except OSError:
        free = None
    free_note = f" ({free / 2**20:.0f} MiB free)" if free is not None else ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"the disk is full{free_note}" if code == errno.ENOSPC else "the disk quota is used up"
        )
    if code == errno.EROFS:
        return "the file system is read-only"
    if code in (errno.EACCES, errno.EPERM):
        return f"writing there is not permitted ({exc.strerror or exc})"
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _TORCH_WRITE_FAILED):
        if free is not None and free < _FULL_BELOW:
            return f"the disk is full{free_note}"
        return f"the write failed ({str(exc).splitlines()[0][:120]}){free_note}"
    return None


# ----------------------------------------------------------------------------- a run's directory


@dataclass
class RunDir:
    """The run directory: config, logs, checkpoints. ``trainer_state`` is what a checkpoint
    carries besides weights and optimizer (the starting model's evaluation)."""

    path: Path
    config_yaml: str
    trainer_state: dict[str, Any]
    last_saved: int = -1

    def open_logs(self, cfg, *, resume: bool, on_log=None):
        """metrics.jsonl plus the ``train.report_to`` backends (and ``on_log``, a Python caller's
        callback, when given); samples.jsonl (rank 0 alone writes: the other ranks get writers
        that write nothing)."""
        if not dist.is_main():
            return dist.NullWriter(), dist.NullWriter()
        atomic_write_text(self.path / "config.yaml", self.config_yaml)
        metrics = MetricLogger(
            self.path,
            cfg.train.report_to,
            project=cfg.train.project,
            config=asdict(cfg),
            resume=resume,
            start_step=max(self.last_saved, 0),
        )
        if on_log is not None:
            metrics = Tee(metrics, on_log)
        return metrics, JsonlWriter(self.path / "samples.jsonl")

    def save(self, run, step: int, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint ``run`` (the trainer's: models, optimizer_state, scheduler, cfg) at ``step``;
        ``extra``: more files (``save_checkpoint``)."""
        # FSDP2: gathering the full weights and optimizer state is a collective (all ranks)
        model, optimizer = dist.checkpoint_state(run.models.policy, run.optimizer_state)
        if dist.is_main():
            try:
                save_checkpoint(
                    self.path,
                    step,
                    model=model,
                    tokenizer=run.models.tokenizer,
                    optimizer=optimizer,
                    scheduler=run.scheduler,
                    trainer_state={**self.trainer_state, **_algo_state(run)},
                    config_yaml=self.config_yaml,
                    keep_last=run.cfg.train.keep_last,
                    extra=extra,
                )
            except (OSError, RuntimeError) as exc:
                problem = storage_problem(exc, self.path / "checkpoints")
                if problem is None:
                    raise
                # the half-written save goes (it holds the space); the last good one stays
                shutil.rmtree(self.path / "checkpoints" / f"{TMP_PREFIX}{step}", ignore_errors=True)
                last = latest_checkpoint(self.path)
                raise StorageError(
                    f"cannot save checkpoint step-{step} in {str(self.path / 'checkpoints')!r}: "
                    f"{problem}; "
                    + (
                        f"the last good checkpoint is {last.name} (intact): make room, then "
                        f"continue with: peergrade train --resume {self.path}"
                        if last is not None
                        else "no checkpoint was saved before: make room, then start again with: "
                        f"peergrade train --resume {self.path} (from step 0)"
                    )
                ) from None
        dist.barrier()  # the others wait until the checkpoint is complete
        self.last_saved = step


def _algo_state(run) -> dict[str, Any]:
    """``{"algo": ...}``: what the algorithm carries from step to step beyond the weights and
    the optimizer (``update.GRPO.state``: the adaptive entropy bonus's coefficient), so a
    resume continues it instead of starting it over; nothing when it carries nothing."""
    state = getattr(getattr(run, "algo", None), "state", None)
    out = state() if callable(state) else None
    return {"algo": out} if out else {}


def finished_run(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The summary of a run that ``--resume`` finds finished (nothing is loaded, evaluated or
    written), else None; a run past ``steps`` is an error naming how to train further."""
    done, finished = resume_point(run_dir)
    if done > steps:
        raise RunDirError(
            f"cannot resume: {str(run_dir)!r} is at step {done}, past train.steps "
            f"{steps}; to train further pass --train.steps N with N > {done}"
        )
    if done < steps or not finished:
        return None
    if dist.is_main():
        print(
            f"{run_dir} is finished (step {done} of {steps}, final evaluation "
            "done): nothing to do. To train further: peergrade train --resume "
            f"{run_dir} --train.steps N (N > {steps})",
            flush=True,
        )
    return {"interrupted": False, "finished": True, "step": done, "run_dir": str(run_dir)}


def resume_from_checkpoint(run, run_dir: RunDir, say=None) -> Path | None:
    """Load the newest intact checkpoint of ``run_dir`` into ``run`` and return it;
    ``run_dir.last_saved`` is its step. Logs past that step (written after the checkpoint,
    before the stop) are cut. A run stopped before its first checkpoint starts again from step
    0 (None): its logs are cut whole, the starting model's evaluation included.

    Intact: ``intact_checkpoint`` (sizes and sha256s against the manifest, a loadable
    ``training_state.pt``). Newer checkpoints that are not are named, with what is wrong, in one
    line through ``say`` (rank 0; default: stderr) that also says which checkpoint the run
    resumes from; they are left as they are (a save of the same step replaces one, pruning
    removes them in turn). None intact: ``RunDirError``, and nothing is changed. A checkpoint
    without a manifest (an older peergrade's) is resumed from with a note that it cannot be
    verified."""
    if say is None:
        say = _say_stderr
    found = _newest_intact(run_dir.path)
    last = found[0] if found is not None else None
    if last is None:
        if dist.is_main():
            for name in ("metrics.jsonl", "samples.jsonl"):
                truncate_jsonl(run_dir.path / name, -1)
        run_dir.last_saved = 0
        return None
    _, training, skipped = found
    if dist.is_main():
        if skipped:
            they = "it is" if len(skipped) == 1 else "they are"
            say(
                f"skipping damaged checkpoint{'s' if len(skipped) > 1 else ''} of "
                f"{str(run_dir.path)!r} ({'; '.join(skipped)}), left as {they}: resuming "
                f"from {last.name}, the newest intact checkpoint"
            )
        if not has_manifest(last):
            say(unverified_note(last))
    run_dir.trainer_state.update(read_trainer_state(last))
    step = run_dir.trainer_state.pop("step")
    algo_state = run_dir.trainer_state.pop("algo", None)
    if algo_state and callable(getattr(getattr(run, "algo", None), "load_state", None)):
        run.algo.load_state(algo_state)
    device = run.models.device
    loaded = load_model(
        str(last), dtype=resolve_dtype(run.cfg.model.dtype, device), device=str(device)
    )
    dist.load_weights(run.models.policy, loaded.state_dict())
    del loaded
    if training is None:  # under torchrun, ranks other than 0 (which verified it)
        training = load_training_state(last)
    dist.load_optimizer(run.models.policy, run.optimizer_state, training["optimizer"])
    run.scheduler.load_state_dict(training["scheduler"])
    set_rng_state(training["rng"])
    if dist.is_main():
        for name in ("metrics.jsonl", "samples.jsonl"):
            truncate_jsonl(run_dir.path / name, step)
    run_dir.last_saved = step
    return last


def _say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def sigterm_stops():
    """Until a ``StopFlag`` takes over: a SIGTERM raises ``Terminated`` where it lands, as a
    Ctrl-C raises ``KeyboardInterrupt``, so a job preempted while it imports, loads the model or
    opens its run directory ends with its message and exit 143 like a Ctrl-C (130), not killed
    without a word. Nothing is saved then: there is no step yet. Outside the main thread it
    changes nothing."""

    def handler(signum, frame):
        raise Terminated()

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


_ACTIVE: list[StopFlag] = []  # the installed flag (the innermost), for ``critical``


@contextmanager
def critical():
    """A stretch no second Ctrl-C may cut in two: a step's update and the record that it
    happened, the renames of a save. A press inside it is held and raised (as
    ``KeyboardInterrupt``) when the stretch ends; with no flag installed it changes nothing."""
    flag = _ACTIVE[-1] if _ACTIVE else None
    if flag is None:
        yield
        return
    flag.depth += 1
    try:
        yield
    except BaseException:
        flag.depth -= 1
        raise
    flag.depth -= 1
    if flag.depth == 0 and flag.pending is not None:
        pending, flag.pending = flag.pending, None
        raise pending


class StopFlag:
    """First Ctrl-C, or a SIGTERM (what Kubernetes, Slurm preemption and ``docker stop`` send):
    finish the current step, save a checkpoint, exit (the trainer checks ``requested`` after
    each step). Second Ctrl-C: stop at once (``KeyboardInterrupt``), except inside ``critical``,
    which finishes first -- so the trainer always knows whether the update of the step in
    flight happened, and a checkpoint's step is the step whose weights it holds. A repeated
    SIGTERM changes nothing (launchers resend it before they kill).

    ``immediate``: there is nothing a step could add (loading, the evaluations before the first
    and after the last step): the first signal stops at once. ``say``: prints one line (the
    trainer points it at its display of the moment)."""

    def __init__(self, say=print):
        self.requested = False
        self.signal: str | None = None  # the first signal: "SIGINT" or "SIGTERM"
        self.immediate = False
        self.say = say
        self.depth = 0  # inside ``critical`` (nested)
        self.pending: KeyboardInterrupt | None = None  # a stop held until ``critical`` ends

    def _stop(self, signum) -> KeyboardInterrupt:
        return Terminated() if signum == signal.SIGTERM else Stop()

    def handler(self, signum, frame) -> None:
        name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
        if self.requested or self.immediate:
            if self.requested and signum == signal.SIGTERM:
                return  # a launcher's repeat: the stop already asked for goes on
            self.requested, self.signal = True, self.signal or name
            if self.depth:
                if self.pending is None:
                    self.pending = self._stop(signum)
                    self.say("[interrupt] stopping as soon as the update in flight is recorded")
                return
            raise self._stop(signum)
        self.requested, self.signal = True, name
        what = "[interrupt]" if name == "SIGINT" else "[SIGTERM]"
        self.say(
            f"{what} finishing this step, saving a checkpoint, then exiting "
            "(Ctrl-C again to stop at once)"
        )

    @contextmanager
    def installed(self, display=None):
        if display is not None:
            self.say = display.print
        handler = self.handler
        try:
            old_int = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            yield self
            return
        old_term = signal.signal(signal.SIGTERM, handler)
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
