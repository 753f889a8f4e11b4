"""Sync tool calls in worker processes forked from the trainer: a call that overruns is killed.

``ToolWorkers(tools)`` runs ``await workers.call(target, args, timeout)`` in a worker process,
one call at a time per worker; a worker is forked from the trainer when no idle one is free
(so at most as many as calls run at once: ``env.tool_concurrency``) and reused for later calls.
A fork carries the trainer's memory, so a tool runs with the same functions, closures, modules
and ``__main__`` it would see on a thread, and nothing is imported or pickled by name.

- ``target`` is the index of one of ``tools``, or ``(instance, method name)`` for a tool method
  of an ``environment_factory`` instance: the instance is pickled to the worker with the call,
  and the attributes the call changed come back and are set on the trainer's instance (so
  ``get_reward()`` and reward functions read them, as in-process). An instance that cannot be
  pickled is ``NotPicklable``: the caller runs that call on a thread instead.
- What comes back: the result (checked by ``tools.check_result`` in the worker); an exception
  the tool raised (a failed call; a ``PeergradeError`` stops the run as in-process); a
  ``sys.exit()`` / ``KeyboardInterrupt`` (``ToolExited``); a worker that died meanwhile
  (``os._exit``, a crash: a failed call naming the exit, where a thread would have ended the
  trainer).
- Past ``timeout`` the worker's process group is killed (SIGKILL): the call stops using the CPU
  whatever it runs (Python, C code, a child process), and the call fails with "timed out".

Each worker leads a process group of its own; what a tool starts (a server, a daemon) stays in
it unless it leaves on purpose (``setsid``). Every such group is killed with its worker at a
timeout, and all of them at the end of the run (``end_user_processes``, also at interpreter
exit); a worker also ends its group when the trainer's end of its pipe closes (the trainer
killed) and, forked from the main thread, when the trainer dies (``PR_SET_PDEATHSIG``).

Cost (measured on 2 busy CPU cores, a process with torch and 200 MB of tensors, the
calculator's ``Calculator.calculate``, 200 calls one after another): 0.13-0.26 ms a call in a
worker against 0.5-0.7 ms on a new thread each (a pickle and a pipe instead of a thread's
start); a worker's fork is paid once, about 35 ms there. Not done here: async tools (they run on the trainer's event
loop, cancelled past their limit) and tools that must share objects with the trainer by
identity (an instance's attributes come back as copies).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import pickle
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Pipe
from typing import Any


class NotPicklable(Exception):
    """An environment instance that cannot be sent to a worker (its call runs on a thread)."""


class WorkerDied(RuntimeError):
    """The worker ended while it ran the call (the tool called ``os._exit``, or crashed)."""


class _Worker:
    def __init__(self, pid: int, conn: Connection):
        self.pid, self.conn = pid, conn


_POOLS: weakref.WeakSet = weakref.WeakSet()
_GROUPS: set[int] = set()  # every worker's process group, ended with the run
_GROUPS_LOCK = threading.Lock()


def end_user_processes() -> None:
    """Kill every tool worker and every process group one led (what the tools started in it):
    the end of the run (and interpreter exit)."""
    for pool in list(_POOLS):
        pool.close()
    with _GROUPS_LOCK:
        groups = list(_GROUPS)
        _GROUPS.clear()
    for group in groups:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)


atexit.register(end_user_processes)


def _end(worker: _Worker) -> None:
    """Kill ``worker`` and its process group; reaped on a thread (its exit takes a while)."""
    with contextlib.suppress(OSError):
        worker.conn.close()
    with contextlib.suppress(OSError):
        os.killpg(worker.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(worker.pid, signal.SIGKILL)
    threading.Thread(target=_reap, args=(worker.pid,), daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


class ToolWorkers:
    """Forked worker processes for sync tool calls (see the module docstring)."""

    def __init__(
        self,
        tools: Sequence[Callable] = (),
        check: Callable[[str, Any], Any] = lambda name, value: value,
        exited: type[Exception] = RuntimeError,
    ):
        """``check(name, value)``: a result's check in the worker (``tools.check_result``);
        ``exited``: the exception a tool's ``sys.exit()`` becomes (``tools.ToolExited``)."""
        self.tools = list(tools)
        self.check, self.exited = check, exited
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()
        self.lock = threading.Lock()
        _POOLS.add(self)

    def index(self, fn: Callable) -> int | None:
        """``fn``'s index among the tools the workers know (by identity), or None."""
        return next((i for i, t in enumerate(self.tools) if t is fn), None)

    async def call(self, target: int | tuple[Any, str], args: dict, timeout: float | None):
        """What the tool returned (see the module docstring for what it raises)."""
        sent, instance = target, None
        if not isinstance(target, int):
            instance, name = target
            try:
                sent = (pickle.dumps(instance), name)
            except Exception as e:
                raise NotPicklable(f"{type(e).__name__}: {e}") from None
        worker = self._take()
        loop = asyncio.get_running_loop()
        reply: asyncio.Future = loop.create_future()
        fd = worker.conn.fileno()

        def readable():
            loop.remove_reader(fd)
            if reply.done():
                return
            try:
                reply.set_result(worker.conn.recv())
            except Exception as e:  # EOF: the worker ended
                reply.set_exception(WorkerDied(_exit_of(worker.pid, e)))

        try:
            worker.conn.send((sent, args))
            loop.add_reader(fd, readable)
            out = await (reply if timeout is None else asyncio.wait_for(reply, timeout))
        except asyncio.TimeoutError:
            self._drop(worker, loop, fd)
            raise TimeoutError(f"timed out after {timeout:g}s") from None
        except OSError as e:  # the worker was gone before the call was sent
            self._drop(worker, loop, fd)
            raise WorkerDied(_exit_of(worker.pid, e)) from None
        except BaseException:  # died, or the call was cancelled (a stop)
            self._drop(worker, loop, fd)
            raise
        with self.lock:
            self.busy.discard(worker)
            self.idle.append(worker)
        kind, value, state = out
        if kind == "ok":
            if state is not None:
                _adopt(instance, state)
            return value
        raise value

    def _take(self) -> _Worker:
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        worker = worker or self._fork()
        with self.lock:
            self.busy.add(worker)
        return worker

    def _drop(self, worker: _Worker, loop, fd: int) -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
        with self.lock:
            self.busy.discard(worker)
        _end(worker)

    def _fork(self) -> _Worker:
        ours, theirs = Pipe()
        others = [w.conn for pool in list(_POOLS) for w in pool.idle + list(pool.busy)]
        from_main = threading.current_thread() is threading.main_thread()
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        # tokenizers prints a warning in a fork after parallel use unless this is set; the
        # worker never tokenises in parallel (its thread pool is not forked)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            pid = os.fork()
            if pid == 0:  # the worker: never returns
                code = 1
                try:
                    os.setpgid(0, 0)
                    ours.close()
                    for conn in others:  # the trainer's ends of the other workers' pipes
                        with contextlib.suppress(OSError):
                            conn.close()
                    code = _serve(theirs, self, from_main)
                finally:
                    os._exit(code)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        theirs.close()
        with contextlib.suppress(OSError):  # also set by the worker: whichever runs first
            os.setpgid(pid, pid)
        with _GROUPS_LOCK:
            _GROUPS.add(pid)
        return _Worker(pid, ours)

    def close(self) -> None:
        """Every worker of this pool killed, with its process group."""
        with self.lock:
            workers = self.idle + list(self.busy)
            self.idle, self.busy = [], set()
        for w in workers:
            _end(w)


def _exit_of(pid: int, error: BaseException) -> str:
    """How a worker ended, in words: ``the tool's process exited with code 3``."""
    try:
        done, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return f"the tool's process ended ({type(error).__name__})"
    if os.WIFSIGNALED(status):
        return f"the tool's process was killed by signal {os.WTERMSIG(status)}"
    return f"the tool's process exited with code {os.waitstatus_to_exitcode(status)}"


def _adopt(instance: Any, state: tuple[str, bytes]) -> None:
    """The attributes a call changed in the worker, set on the trainer's instance."""
    kind, data = state
    if kind == "attrs":
        changed, removed = pickle.loads(data)
        for k, v in changed.items():
            instance.__dict__[k] = v
        for k in removed:
            instance.__dict__.pop(k, None)
    else:  # a class with its own pickling: its whole state
        fresh = pickle.loads(data)
        instance.__dict__.clear()
        instance.__dict__.update(vars(fresh))


def _changed(instance: Any, sent: bytes) -> tuple[str, bytes] | None:
    """What the call changed in ``instance`` (None: nothing), as ``_adopt`` takes it."""
    after = pickle.dumps(instance)
    if after == sent:
        return None
    before = pickle.loads(sent)
    plain = not any(
        hasattr(type(instance), m) and getattr(type(instance), m) is not getattr(object, m, None)
        for m in ("__reduce__", "__reduce_ex__", "__getstate__", "__setstate__")
    )
    if plain and hasattr(instance, "__dict__") and hasattr(before, "__dict__"):
        old, new = vars(before), vars(instance)
        changed = {
            k: v for k, v in new.items() if k not in old or pickle.dumps(v) != pickle.dumps(old[k])
        }
        return "attrs", pickle.dumps((changed, [k for k in old if k not in new]))
    return "whole", after


def _serve(conn: Connection, pool: ToolWorkers, from_main: bool) -> int:
    """The worker's loop: a call in, ``(kind, value, state)`` out, until the trainer's end
    closes. Returns the exit code."""
    import gc

    tools, check_result, exited = pool.tools, pool.check, pool.exited
    gc.freeze()  # the trainer's objects: never traversed here, so their pages stay shared
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops its workers itself
    signal.signal(signal.SIGTERM, _end_group)
    if from_main and sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the trainer died
    while True:
        try:
            (target, args) = conn.recv()
        except (EOFError, OSError):
            _end_group()
        instance, sent = None, None
        try:
            if isinstance(target, int):
                fn = tools[target]
                name = getattr(fn, "__name__", "tool")
            else:
                sent, name = target
                instance = pickle.loads(sent)
                fn = getattr(instance, name)
            value = fn(**args)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            reply = ("ok", check_result(name, value), None)
            if instance is not None:
                reply = ("ok", reply[1], _changed(instance, sent))
        except Exception as e:
            reply = ("error", e, None)
        except BaseException as e:  # sys.exit(), KeyboardInterrupt: this call's failure
            text = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else None
            reply = ("error", exited(text or "raised KeyboardInterrupt"), None)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            conn.send(reply)
        except Exception as e:  # an exception that does not pickle: its text
            if reply[0] == "ok":
                error: Exception = RuntimeError(
                    f"the environment's state cannot be copied back: {e}"
                )
            else:
                error = RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")
            conn.send(("error", error, None))


async def _awaited(value):
    return await value


def _end_group(*_: Any) -> None:
    """End this worker and what its tools started in its process group."""
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGKILL)
    os._exit(0)
