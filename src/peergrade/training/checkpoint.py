"""Checkpoints and run directories: save, find, load, prune -- atomically.

A run directory holds ``config.yaml`` (resolved), ``metrics.jsonl``, ``samples.jsonl`` and
``checkpoints/step-N/``. Each checkpoint is a Hugging Face ``save_pretrained`` directory (model
+ tokenizer, so ``from_pretrained`` and ``peergrade eval`` load it directly) plus
``training_state.pt`` (optimizer, scheduler, RNG states) and ``trainer_state.json`` (step and
counters, human-readable).

Atomicity: a checkpoint is written into ``checkpoints/.tmp-step-N`` and renamed into place only
when complete, so a kill mid-save never leaves a half-written ``step-N`` and never touches the
previous one. ``trainer_state.json`` is written last and lists every file of the checkpoint; a
``step-N`` counts as complete only when that list is there and every file in it is
(``checkpoint_problem``). Pruning renames ``step-N`` to ``.prune-step-N`` (atomic) before
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

``RunDir`` is the trainer's view of a run directory (its logs, ``save`` at a step),
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

import json
import os
import random
import re
import shutil
import signal
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

STEP_RE = re.compile(r"^step-(\d+)$")
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
    """Why ``ckpt`` is not a complete checkpoint (``None`` when it is).

    Complete means: ``trainer_state.json`` (written last) is readable and every file it lists
    exists (a kill deletes or leaves whole files; sizes are not compared, so editing e.g. a
    checkpoint's ``config.json`` by hand keeps it complete). Checkpoints written before the
    list existed are judged by the files every checkpoint has (weights, model config,
    ``training_state.pt``)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return "not a directory"
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError) as exc:
        return f"unreadable trainer_state.json ({exc})"
    files = state.get("files") if isinstance(state, dict) else None
    if isinstance(files, list):
        for name in files:
            if not (ckpt / str(name)).is_file():
                return f"missing {name}"
        return None
    # no file list: an older checkpoint
    if not any((ckpt / f).is_file() for f in WEIGHT_FILES):
        return "no weights file"
    if not ((ckpt / "config.json").is_file() or (ckpt / "adapter_config.json").is_file()):
        return "missing config.json"
    if not (ckpt / "training_state.pt").is_file():
        return "missing training_state.pt"
    return None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first: hidden dirs of interrupted saves and
    prunes, and any ``step-N`` that is not complete (``checkpoint_problem``), are left out."""
    ckpt_root = Path(run_dir) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_RE.match(p.name)
        if m and checkpoint_problem(p) is None:
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
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically, then delete all but the last ``keep_last``.
    ``extra``: more files of the checkpoint, {file name: object for ``torch.save``} (the
    pipelined rollouts' older weights, ``peergrade.training.pipeline``)."""
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
    for name, obj in (extra or {}).items():
        torch.save(obj, tmp / name)
    apply_umask(tmp)  # safetensors writes its file 0600
    # trainer_state.json last, listing every file: checkpoint_problem checks against the list.
    state = {"step": step, **trainer_state, "files": _file_names(tmp)}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    with critical():  # a second Ctrl-C waits for the renames: never a step-N half in place
        if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a periodic save)
            old = ckpt_root / f"{OLD_PREFIX}{step}"
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
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
    incomplete ``step-N`` directories older than the newest complete checkpoint (what a prune
    killed by an older version left; a newer incomplete one is left alone, and unlisted). A
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
        elif m and int(m.group(1)) < newest and (problem := checkpoint_problem(p)) is not None:
            shutil.rmtree(p)
            done.append(f"removed incomplete {p.name} ({problem})")
    return done


def resolve_model_dir(path: str) -> str:
    """What a reader (``peergrade eval``) loads for ``path``: a run directory -> its latest
    complete checkpoint; a checkpoint directory that is incomplete, or a hidden one (an
    interrupted save or prune) -> ``RunDirError`` naming the complete ones; else ``path``.
    Never sweeps: a training process may be saving into the run right now."""
    p = Path(path)
    if not p.is_dir():
        return path
    if (p / "config.yaml").is_file() and (p / "checkpoints").is_dir():
        last = latest_checkpoint(p)
        if last is None:
            raise RunDirError(
                f"{path!r} is a peergrade run without a complete checkpoint under checkpoints/step-N"
            )
        return str(last)
    hidden = p.name.startswith((TMP_PREFIX, OLD_PREFIX, PRUNE_PREFIX))
    if p.parent.name == "checkpoints" and (hidden or STEP_RE.match(p.name)):
        problem = "an interrupted save or prune" if hidden else checkpoint_problem(p)
        if problem is not None:
            complete = [c.name for _, c in list_checkpoints(p.parent.parent)]
            raise RunDirError(
                f"checkpoint {path!r} is not complete ({problem}); complete checkpoints of "
                f"this run: {', '.join(complete) or 'none'}"
            )
    return path


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


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse to clobber an existing run, to resume something that is not a run, and to start
    a run whose directory cannot be written.

    On resume, leftovers of a kill (interrupted saves and prunes) are swept first
    (``sweep_leftovers``); what was swept is returned, one line each (else ``[]``).

    With ``overwrite`` an existing directory passes the check but is *not* deleted here: the
    trainer removes it only once the config, data, rewards and model have loaded, so a run
    that fails on bad input leaves the old directory untouched. Writability is probed by
    creating (and removing) a hidden directory, so it fails here -- before any model loads --
    exactly when the trainer's writes would: a read-only mount, missing permission, or a path
    below a regular file."""
    run_dir = Path(run_dir)
    try:
        return _check_run_dir(run_dir, resume=resume, overwrite=overwrite)
    except OSError as exc:  # e.g. a parent we may not even look into (EACCES on stat)
        where = f" ({exc.filename})" if exc.filename else ""
        raise RunDirError(
            f"run directory {str(run_dir)!r} cannot be used: {exc.strerror or exc}{where}"
        ) from None


def _check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> list[str]:
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
        swept = sweep_leftovers(run_dir)
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
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        raise RunDirError(
            f"run directory {str(run_dir)!r} already exists and is not empty; pass --overwrite "
            "to replace it or --resume to continue it"
        )
    check_writable(run_dir)
    if overwrite and run_dir.is_dir() and any(run_dir.iterdir()):
        _check_writable(run_dir, run_dir.absolute().parent)  # --overwrite deletes and recreates it
    return []


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


def resume_from_checkpoint(run, run_dir: RunDir) -> Path | None:
    """Load the last checkpoint of ``run_dir`` into ``run`` and return it; ``run_dir.last_saved``
    is its step. Logs past that step (written after the checkpoint, before the stop) are cut.
    A run stopped before its first checkpoint starts again from step 0 (None): its logs are
    cut whole, the starting model's evaluation included."""
    last = latest_checkpoint(run_dir.path)
    if last is None:
        if dist.is_main():
            for name in ("metrics.jsonl", "samples.jsonl"):
                truncate_jsonl(run_dir.path / name, -1)
        run_dir.last_saved = 0
        return None
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
    training = load_training_state(last)
    dist.load_optimizer(run.models.policy, run.optimizer_state, training["optimizer"])
    run.scheduler.load_state_dict(training["scheduler"])
    set_rng_state(training["rng"])
    if dist.is_main():
        for name in ("metrics.jsonl", "samples.jsonl"):
            truncate_jsonl(run_dir.path / name, step)
    run_dir.last_saved = step
    return last


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
