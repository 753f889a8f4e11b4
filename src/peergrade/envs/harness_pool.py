"""Sync harness calls in worker processes (``harness.processes``), off the trainer's GIL.

``HarnessPool(spec, processes)`` starts ``processes`` worker processes (multiprocessing's spawn
context) the first time it is used; each loads the harness from ``spec`` ('path/to/file.py:fn'
or 'module:fn', with the trainer's own loader, ``envs.load.load_object``) and runs every call
it is given on a thread of its own, so a worker holds many episodes at once and every open
episode still has its request in flight (the server's per-turn batching gathers them all).
``pool.submit(row, base_url, model)``, from inside the trainer's event loop, is a future of
what the call returned, in ``HarnessRunner``'s terms:

- a number, a list of per-turn numbers, or ``{"reward": r, **numbers}`` (the return value
  already checked by ``reward_of`` in the worker, so only numbers cross the pipe);
- ``EpisodeFailure(text, kind)`` for a harness that raised (``kind`` 'exception', the text
  ``"ValueError: boom"`` as in-process), returned something else ('bad_return'), or whose
  worker died while it ran ('exception', naming the process and its exit code);
- ``SystemExit(code)`` for a harness that called ``sys.exit``: raised in the trainer's loop,
  where ``HarnessRunner`` makes it that episode's failure, as for a sync harness on one of the
  trainer's threads.

A call that overruns its timeout is abandoned in the worker (its thread cannot be stopped, as
in-process); its late result is dropped. A dead worker is replaced at the next ``ensure()``
(each ``HarnessRunner.run``), and so is a worker whose only calls left are abandoned ones (a
harness that hangs, or spins, would otherwise hold a thread and a core for the whole run). Workers ignore Ctrl-C (the trainer stops them: ``close()``, also
at interpreter exit) and exit on their own when the trainer's end of their pipe closes (the
trainer killed), so none outlives it.

``reward_of(value)``: the (reward, metrics) of what a harness returned, both sides' check;
``turn_rewards_of(value)``: its per-turn rewards when it returned a list.
It imports neither torch nor the generation code (a worker loads only the harness). It does
not record, score or time episodes (``serving.harness``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import math
import numbers
import os
import signal
import sys
import threading
import types
import weakref
from typing import Any

#: seconds a worker may take to start and load the harness
START_TIMEOUT_S = 300.0
_START_LOCK = threading.Lock()


class EpisodeFailure(Exception):
    """One episode's harness failed in a worker: ``text`` is its error as in-process."""

    def __init__(self, text: str, kind: str = "exception"):
        super().__init__(text)
        self.text, self.kind = text, kind


class WorkerStartError(RuntimeError):
    """A worker could not start or load the harness."""


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def turn_rewards_of(value: Any) -> list[float] | None:
    """The per-turn rewards of what a harness returned: a list (or tuple) of numbers, one per
    model turn of its episode (``algo.turn_credit`` reads them), alone or as a dict's
    ``reward``; None for a single number (the episode's reward only)."""
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, (list, tuple)) and value and all(_number(v) for v in value):
        return [float(v) for v in value]
    return None


def reward_of(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) of what a harness returned: a number, a non-empty list of
    numbers (per-turn rewards: the episode's reward is their sum), or a dict whose ``reward``
    is either, its other numbers the extra metrics; TypeError for anything else."""
    reward = value.get("reward") if isinstance(value, dict) else value
    turns = turn_rewards_of(reward)
    if turns is not None:
        r = float(sum(turns))
    elif _number(reward):
        r = float(reward)
    else:
        raise TypeError(
            "a harness must return a number, a list of per-turn numbers or a dict with a "
            f"numeric 'reward', got {type(value).__name__}: {str(value)[:200]}"
        )
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        extra = {str(k): float(v) for k, v in value.items() if k != "reward" and _number(v)}
    if not math.isfinite(r):
        raise TypeError(f"a harness returned a non-finite reward: {r}")
    return r, extra


# ------------------------------------------------------------------------------- the worker


def _tell(conn, msg) -> None:  # pragma: no cover - runs in the child process
    """Send ``msg`` to the trainer; a trainer that has stopped (its end closed) ends the worker
    quietly, as a closed pipe does later."""
    try:
        conn.send(msg)
    except (OSError, ValueError, EOFError):
        os._exit(0)


def _worker_main(conn, spec: str) -> None:  # pragma: no cover - runs in the child process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops its workers itself
    # started with SIGINT blocked (``_Worker``): a Ctrl-C while the child imported is dropped
    # here, now that it is ignored, instead of printing the child's traceback
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from peergrade.envs.load import load_object

    try:
        fn = load_object(spec, "harness.fn")
        if not callable(fn):
            raise TypeError(f"harness.fn {spec!r} is not callable")
    except BaseException as e:
        _tell(conn, ("load_error", f"{type(e).__name__}: {e}"))
        return
    _tell(conn, ("ready", os.getpid()))
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            try:
                conn.send(msg)
            except (OSError, ValueError, EOFError):  # the trainer is gone
                os._exit(0)

    def one(tid: int, row, base_url: str, model: str) -> None:
        try:
            value = fn(row, base_url, model)
        except SystemExit as e:
            code = e.code if e.code is None or isinstance(e.code, (int, str)) else str(e.code)
            return send(("done", tid, "exit", code))
        except BaseException as e:
            return send(("done", tid, "exception", f"{type(e).__name__}: {e}"))
        try:
            r, extra = reward_of(value)
        except TypeError as e:
            return send(("done", tid, "bad_return", str(e)))
        turns = turn_rewards_of(value)  # per-turn rewards cross the pipe as they are
        reward = r if turns is None else turns
        send(
            ("done", tid, "ok", {"reward": reward, **extra} if isinstance(value, dict) else reward)
        )

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer closed its end (or died)
            os._exit(0)
        if msg is None:
            os._exit(0)
        threading.Thread(target=one, args=msg, name="peergrade-harness", daemon=True).start()


# ------------------------------------------------------------------------------ the trainer


@contextlib.contextmanager
def _sigint_kept_from_children():
    """A Ctrl-C reaches the whole process group, workers too, and one that lands while a
    worker imports (before it can ignore SIGINT) prints its traceback. Children started in this
    block begin with SIGINT held off: blocked, which a child started from another thread
    inherits through exec; from the main thread (where spawn's fork_exec does not keep the
    mask) also ignored, which every child inherits and Python then leaves ignored. The worker
    ignores SIGINT itself and unblocks it (``_worker_main``). A Ctrl-C to the trainer in these
    milliseconds is lost (from the main thread) or held until the block ends."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:  # None: a handler not set from Python, which cannot be put back as it was
            signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Worker:
    def __init__(self, ctx, spec: str, index: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, spec), name=f"peergrade-harness-{index}"
        )
        with _START_LOCK:
            # spawn re-runs the trainer's __main__ in the child (a user's script, unguarded by
            # `if __name__ == "__main__"`, would train again there); the worker needs nothing
            # of it (the harness is loaded by name), so the child is started without it
            main = sys.modules["__main__"]
            sys.modules["__main__"] = types.ModuleType("__main__")
            try:
                with _sigint_kept_from_children():
                    self.proc.start()
            finally:
                sys.modules["__main__"] = main
        child.close()
        self.lock = threading.Lock()
        self.pending: dict[int, Any] = {}  # task id -> callback(status, payload)
        self.dead: str | None = None
        self.reader: threading.Thread | None = None

    def wait_ready(self, spec: str, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise WorkerStartError(
                f"harness.processes: a worker did not load harness.fn {spec!r} within {timeout:g}s"
            )
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise WorkerStartError(
                f"harness.processes: a worker process exited (code {self.proc.exitcode}) while "
                f"loading harness.fn {spec!r}"
            ) from None
        if msg[0] != "ready":
            self.proc.join(5)
            raise WorkerStartError(
                f"harness.processes: a worker process could not load harness.fn {spec!r}: {msg[1]}"
            )
        self.reader = threading.Thread(
            target=self._read, name="peergrade-harness-reader", daemon=True
        )
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            _, tid, status, payload = msg
            with self.lock:
                settle = self.pending.pop(tid, None)
            if settle is not None:
                settle(status, payload)
        self.proc.join(5)
        text = (
            f"the harness's worker process (pid {self.proc.pid}) died with exit code "
            f"{self.proc.exitcode} while this episode ran"
        )
        with self.lock:
            self.dead = text
            pending, self.pending = self.pending, {}
        for settle in pending.values():
            settle("died", text)

    def send(self, tid: int, msg, settle) -> None:
        with self.lock:
            if self.dead is not None:
                return settle("died", self.dead)
            self.pending[tid] = settle
            try:
                self.conn.send(msg)
            except Exception as e:  # a row that cannot be pickled; a pipe already broken
                self.pending.pop(tid, None)
                text = f"{type(e).__name__}: {e}"
                return settle("exception", f"cannot hand the episode to a worker process: {text}")

    @property
    def load(self) -> int:
        return len(self.pending)

    def alive(self) -> bool:
        return self.dead is None and self.proc.is_alive()

    def _join(self, timeout: float) -> None:
        """Wait for the process to end. The reader thread joins it when the pipe closes, so it
        is waited for instead: two threads reaping one child race (the loser's ``waitpid``
        fails and its ``is_alive()`` says True for a process that is gone)."""
        reader = self.reader
        if reader is not None and reader.is_alive() and reader is not threading.current_thread():
            reader.join(timeout)
        else:
            self.proc.join(timeout)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self._join(2)
        if self.proc.is_alive():
            self.proc.terminate()
            self._join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self._join(2)
        with contextlib.suppress(Exception):
            self.conn.close()


_POOLS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK: list[bool] = []


def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _hook_exit() -> None:
    """``_close_all`` at interpreter exit, registered after multiprocessing's own handler (which
    joins the children) so that it runs first (atexit runs last-registered first)."""
    import multiprocessing.util  # noqa: F401  (registers its handler now if not yet)

    if not _EXIT_HOOK:
        atexit.register(_close_all)
        _EXIT_HOOK.append(True)


class HarnessPool:
    """``processes`` worker processes running the harness named by ``spec`` (see the module
    docstring). Started by ``ensure()`` (or the first ``submit``), stopped by ``close()``."""

    def __init__(self, spec: str, processes: int):
        if processes < 1:
            raise ValueError(f"HarnessPool needs processes >= 1, got {processes}")
        self.spec, self.processes = spec, processes
        self.workers: list[_Worker] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._futs: dict[int, asyncio.Future] = {}  # task id -> its caller's future
        _POOLS.add(self)

    def _stuck(self, w: _Worker) -> bool:
        """Every call ``w`` still runs was abandoned (its caller gave up: a timeout), so only
        stopping the process stops them."""
        with w.lock:
            futs = [self._futs.get(t) for t in w.pending]
        return bool(futs) and all(f is not None and f.done() for f in futs)

    def ensure(self) -> None:
        """Every worker started and ready (a dead one replaced, and one that runs nothing but
        abandoned calls)."""
        import multiprocessing

        _hook_exit()
        with self._lock:
            ctx = multiprocessing.get_context("spawn")
            keep = [w for w in self.workers if w.alive() and not self._stuck(w)]
            for w in self.workers:
                if w not in keep:
                    w.kill()
            fresh = [
                _Worker(ctx, self.spec, len(keep) + i) for i in range(self.processes - len(keep))
            ]
            try:
                for w in fresh:
                    w.wait_ready(self.spec, START_TIMEOUT_S)
            except BaseException:
                for w in fresh:
                    w.kill()
                raise
            self.workers = keep + fresh
            self._futs = {t: f for t, f in self._futs.items() if not f.done()}

    def submit(self, row, base_url: str, model: str) -> asyncio.Future:
        """A future (of the running loop) of one harness call in the least busy worker."""
        if not self.workers:
            self.ensure()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def resolve(status: str, payload) -> None:
            self._futs.pop(tid, None)
            if fut.done():  # timed out: abandoned
                return
            if status == "ok":
                fut.set_result(payload)
            elif status == "exit":
                fut.set_exception(SystemExit(payload))
            elif status == "bad_return":
                fut.set_exception(EpisodeFailure(payload, "bad_return"))
            else:  # exception, died
                fut.set_exception(EpisodeFailure(payload, "exception"))

        def settle(status: str, payload) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(resolve, status, payload)

        live = [w for w in self.workers if w.dead is None] or self.workers
        worker = min(live, key=lambda w: w.load)
        tid = next(self._ids)
        self._futs[tid] = fut
        worker.send(tid, (tid, row, base_url, model), settle)
        return fut

    def close(self) -> None:
        """Stop every worker (abandoned calls with them)."""
        with self._lock:
            workers, self.workers = self.workers, []
        for w in workers:
            w.kill()
