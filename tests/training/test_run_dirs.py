"""Run directories (issue 50): no two runs share one, no two processes write one.

Two runs started in the same second get two directories (``runs/<stamp>`` and
``runs/<stamp>-2``); a second writer -- ``peergrade train -o`` of a run being written, with or
without ``--overwrite``, a second ``--resume``, ``peergrade.train`` -- gets one ``error:`` line
naming the holder's pid, exit status 2, and changes nothing in the directory; the trainer holds
the lock while it trains (``GRPOTrainer`` too) and gives it up when it ends, and a holder killed
with SIGKILL leaves a stale ``.lock`` that blocks nothing. A second process holds the lock from a
small helper (``HOLD``) where a whole training run is not needed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helper import ROOT, cli
from peergrade.cli import main
from peergrade.config import load_config
from peergrade.training import checkpoint as ckpt
from peergrade.training.run_lock import LOCK_NAME, RunLockError, acquire

TINY = {
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 2,
    "rollout.max_completion_length": 4,
    "train.eval_size": 2,
    "train.eval_samples": 2,
    "train.display": "none",
    "train.threads": 1,
}

#: holds the lock of argv[1] until its stdin closes (or it is killed)
HOLD = (
    "import sys\n"
    "from peergrade.training.run_lock import acquire\n"
    "lock = acquire(sys.argv[1], create=True)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)

#: ``peergrade ARGS`` with the clock stopped at one second, as for two runs started together
SAME_SECOND = (
    "import sys, time\n"
    "real = time.strftime\n"
    "time.strftime = lambda fmt, *a: real(fmt, time.gmtime(1767225600)) if fmt.startswith("
    "'runs/') else real(fmt, *a)\n"
    "from peergrade.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
STAMP = time.strftime("%Y%m%d-%H%M%S", time.gmtime(1767225600))


def flags(steps: int, model: Path) -> list[str]:
    return ["--model", str(model), "--steps", str(steps)] + [
        x for k, v in TINY.items() for x in (f"--{k}", str(v))
    ]


def env() -> dict[str, str]:
    """This checkout's ``src`` first, one torch thread."""
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def steps_logged(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def hold(directory: Path) -> subprocess.Popen:
    """A second process holding ``directory``'s lock (``close(holder)`` lets go)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def close(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0


def in_use(directory: Path, pid: int) -> str:
    return (
        f"error: run directory {str(directory)!r} is in use by process {pid} (its pid is in "
        f"{str(directory / LOCK_NAME)!r}): one process writes a run directory at a time; wait "
        "for that run to end, or write to another directory"
    )


def error_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def test_two_runs_started_in_the_same_second_get_two_directories(tiny_model_dir, tmp_path):
    """Two ``peergrade train`` without -o at once, on one clock second: each trains into its
    own directory, made atomically (before: both wrote runs/<stamp>/, interleaved)."""
    argv = [sys.executable, "-c", SAME_SECOND, "train", *flags(1, tiny_model_dir)]
    procs = [
        subprocess.Popen(
            argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [STAMP, f"{STAMP}-2"]
    for run in runs.iterdir():
        assert steps_logged(run) == [0, 1, 1]  # one run's lines, not two interleaved
        assert (run / "checkpoints" / "step-1").is_dir() and (run / "config.yaml").is_file()
        assert not (run / LOCK_NAME).exists()  # released, and removed, at the end


def test_a_second_writer_gets_one_line_naming_the_holder_and_changes_nothing(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """While another process holds the run: -o (with and without --overwrite), --resume and
    peergrade.train are refused with the holder's pid; nothing in the run changes (an
    interrupted save stays unswept). Once it lets go, --resume works and sweeps it."""
    import peergrade

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", *flags(1, tiny_model_dir), "-o", str(run)]) == 0
    leftover = run / "checkpoints" / ".tmp-step-7"  # what a kill mid-save leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()

    holder = hold(run)
    try:
        before = snapshot(run)
        assert (run / LOCK_NAME).read_text().split()[0] == str(holder.pid)
        for argv in (
            ["train", *flags(1, tiny_model_dir), "-o", str(run)],
            ["train", *flags(1, tiny_model_dir), "-o", str(run), "--overwrite"],
            ["train", "--resume", str(run), "--train.steps", "2"],
        ):
            assert main(argv) == 2, argv
            assert error_lines(capsys.readouterr().err) == [in_use(run, holder.pid)], argv
            assert snapshot(run) == before, argv
        cfg = load_config(
            None,
            [("model.path", str(tiny_model_dir)), *TINY.items(), ("train.output_dir", str(run))],
        )
        for resume in (False, True):
            with pytest.raises(RunLockError, match=f"in use by process {holder.pid} "):
                peergrade.train(cfg, resume=resume)
        assert snapshot(run) == before
        # as a user meets it: one line, the user-error status, no traceback
        proc = cli(["train", "--resume", str(run)], tmp_path, timeout=120)
        assert proc.returncode == 2
        assert error_lines(proc.stderr) == [in_use(run, holder.pid)], proc.stderr
        assert snapshot(run) == before
    finally:
        close(holder)

    assert main(["train", "--resume", str(run), "--train.steps", "2"]) == 0
    assert "removed .tmp-step-7 (left by an interrupted run)" in capsys.readouterr().err
    assert not leftover.exists() and steps_logged(run) == [0, 1, 1, 2, 2]
    assert not (run / LOCK_NAME).exists()


def test_the_python_api_holds_the_run_while_it_trains_and_lets_go_after(tmp_path):
    """GRPOTrainer.train: during a step another process (and another writer in this process)
    is refused with this pid; afterwards the lock file is gone and the directory is free."""
    from peergrade import GRPOConfig, GRPOTrainer
    from peergrade.model.load import BUNDLED_MODEL
    from peergrade.training.run_lock import check_free

    out = tmp_path / "run"
    probe = [
        sys.executable,
        "-c",
        "import sys; from peergrade.training.run_lock import check_free; check_free(sys.argv[1])",
        str(out),
    ]
    seen = {}

    class Probe:
        def on_step_end(self, args, state, control, **kw):
            seen["other"] = subprocess.run(probe, capture_output=True, text=True, env=env())
            try:
                check_free(out)
            except RunLockError as e:
                seen["same"] = str(e)

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        save_strategy="no",
    )
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}]} for a in (3, 4)]
    trainer = GRPOTrainer(
        str(BUNDLED_MODEL),
        lambda completions, **kw: [0.0] * len(completions),
        args,
        rows,
        callbacks=[Probe()],
    )
    trainer.train()
    other = seen["other"]
    assert other.returncode == 1
    assert f"is in use by process {os.getpid()} (its pid" in other.stderr, other.stderr
    assert f"is in use by this process (pid {os.getpid()})" in seen["same"]
    assert not (out / LOCK_NAME).exists()
    check_free(out)  # free again
    assert subprocess.run(probe, env=env()).returncode == 0


def test_a_killed_run_leaves_a_lock_that_blocks_nothing(tiny_model_dir, tmp_path, capsys):
    """A training process holds the run (a second --resume is refused with its pid); killed
    with SIGKILL, its .lock stays behind, stale: --resume takes the run over and finishes."""
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "peergrade.cli",
        "train",
        *flags(1000, tiny_model_dir),
        "--train.save_every",
        "0",
        "-o",
        str(run),
    ]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "config.yaml").is_file():  # written once the model has loaded
            assert proc.poll() is None, "the run ended early"
            assert time.monotonic() < deadline, "the run never wrote its config"
            time.sleep(0.1)
        assert (run / LOCK_NAME).read_text().split()[0] == str(proc.pid)
        refused = cli(["train", "--resume", str(run)], tmp_path, timeout=120)
        assert refused.returncode == 2
        assert error_lines(refused.stderr) == [in_use(run, proc.pid)], refused.stderr
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert (run / LOCK_NAME).read_text().split()[0] == str(proc.pid)  # stale, left behind
    assert main(["train", "--resume", str(run), "--train.steps", "1"]) == 0, capsys.readouterr()
    assert steps_logged(run)[-1] == 1 and not (run / LOCK_NAME).exists()


def test_a_stale_lock_file_is_not_content(tmp_path):
    """A directory holding only a stale .lock (its run was killed while loading) is empty to
    -o; a held one is refused; a directory made for a lock is removed when left empty."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text("12345 elsewhere\n")
    assert ckpt.check_run_dir(run, resume=False, overwrite=False) == []
    with acquire(run) as lock:
        assert (run / LOCK_NAME).read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunLockError, match=r"this process \(pid \d+\)"):
            ckpt.check_run_dir(run, resume=False, overwrite=False)
        assert lock.directory == run
    assert sorted(run.iterdir()) == []
    with acquire(tmp_path / "new" / "deeper", create=True):
        assert (tmp_path / "new" / "deeper" / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()
