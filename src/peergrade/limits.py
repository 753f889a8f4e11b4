"""The user's code under a time limit: ``call_within(fn, limit_s, name=...)``.

Reward functions, environments' ``reset`` / ``step`` and the like are the user's code: one that
hangs must end as a named failure, not hang the run. ``call_within`` runs ``fn()`` and raises
``TimeLimitExceeded`` once ``limit_s`` seconds have passed; whatever ``fn`` raises (including
``SystemExit`` and ``KeyboardInterrupt``) goes through to the caller, which decides what a failure
of that function means.

How: called from the main thread (where the trainer calls user code), ``fn`` runs right there, as
TRL runs reward functions, because libraries that set signal handlers (math-verify's parse
timeout) need the main thread; a watchdog thread sends SIGUSR1 once the limit has passed, and
peergrade's handler raises inside ``fn`` only while that call is armed, so a late signal is
ignored and a call that returned keeps its result. This interrupts Python code, ``time.sleep``
and blocking reads (the signal ends the system call); a C extension that never returns to Python
cannot be interrupted from inside the process. From any other thread ``fn`` runs on a daemon
thread of its own, stopped past its limit (``stop_thread``).

``in_thread(fn, limit_s, name=...)`` is the awaitable form for an event loop (environments'
sync ``reset`` / ``step``, run concurrently): ``fn`` on a daemon thread of its own, its result
awaited; past the limit ``TimeLimitExceeded``, and the thread is stopped.

``stop_thread(thread)`` stops a thread whose call was given up: an exception is raised inside it
(``PyThreadState_SetAsyncExc``), again every 0.2 s until it ends, so a call that spins in Python
stops using the CPU; one blocked in a system call ends when that call returns, one spinning in C
code that never returns to Python cannot be stopped (its thread is counted: ``running_stopped``).

No limit interrupts an import: a limit that fires while the interrupted code is importing a
module (its stack holds importlib's frames) waits until the import is done and then interrupts
the call, so a module is never left half-imported (a cut sympy import once surfaced as
``Could not import module 'Qwen2ForCausalLM'``), and the error names the call, not a module.

``steps_within(awaitable, limit_s, name=...)`` awaits a coroutine with each of its steps under
``call_within``: an ``async def`` that blocks the event loop (never awaits) is interrupted too.

What it deliberately does not do: nest (an inner limited call disarms the outer one while it
runs).
"""

from __future__ import annotations

import ctypes
import math
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TimeLimitExceeded(Exception):
    """``fn`` was still running after ``limit_s`` seconds."""

    def __init__(self, name: str, limit_s: float):
        super().__init__(f"{name} did not return within {limit_s:g}s")
        self.name, self.limit_s = name, limit_s


class _Overrun(BaseException):
    """Raised in the main thread by the watchdog's signal: the armed call passed its limit."""


_ARMED: list = [None]  # the call the watchdog may interrupt (None: none)
_ARMED_LOCK = threading.Lock()


def importing(frame) -> bool:
    """Whether the code running in ``frame`` is inside an import (importlib's frames on its
    stack): no time limit may interrupt it (a half-imported module stays broken)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _on_overrun(signum, frame) -> None:
    """peergrade's SIGUSR1 handler: interrupts the armed call, ignores anything else; during
    an import it does nothing (the watchdog signals again until the call is interrupted)."""
    if _ARMED[0] is not None and not importing(frame):
        _ARMED[0] = None
        raise _Overrun


def call_within(fn: Callable[[], T], limit_s: float | None, *, name: str) -> T:
    """``fn()``'s result; ``TimeLimitExceeded`` past ``limit_s`` seconds (None or inf: no
    limit, ``fn`` is simply called). See the module docstring for how."""
    if limit_s is None or math.isinf(limit_s):
        return fn()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill"):
        return _in_main_thread(fn, limit_s, name)
    return _in_own_thread(fn, limit_s, name)


def _in_main_thread(fn: Callable[[], T], limit_s: float, name: str) -> T:
    if signal.getsignal(signal.SIGUSR1) is not _on_overrun:
        signal.signal(signal.SIGUSR1, _on_overrun)
    token, box, done = object(), {}, threading.Event()
    main = threading.main_thread().ident

    def watchdog():
        wait = limit_s
        while not done.wait(wait):  # again until interrupted: the handler waits out imports
            with _ARMED_LOCK:
                if _ARMED[0] is not token:
                    return
                signal.pthread_kill(main, signal.SIGUSR1)
            wait = 0.05

    _ARMED[0] = token
    threading.Thread(target=watchdog, name=f"peergrade-watch-{name}", daemon=True).start()
    try:
        try:
            box["out"] = fn()
        finally:
            with _ARMED_LOCK:
                _ARMED[0] = None
            done.set()
    except _Overrun:
        if "out" in box:  # it returned just as the signal came: keep its result
            return box["out"]
        raise TimeLimitExceeded(name, limit_s) from None
    return box["out"]


def _in_own_thread(fn: Callable[[], T], limit_s: float, name: str) -> T:
    box: dict = {}
    torch = sys.modules.get("torch")  # grad mode is thread-local in torch: keep the caller's
    grad = torch.is_grad_enabled() if torch is not None else None

    def target():
        try:
            box["out"] = _stoppable(fn, grad, torch)
        except _Overrun:
            pass  # stopped: nobody waits for it
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"peergrade-{name}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        stop_thread(worker)
        raise TimeLimitExceeded(name, limit_s)
    if "error" in box:
        raise box["error"]
    return box["out"]


async def in_thread(fn: Callable[[], T], limit_s: float | None, *, name: str) -> T:
    """``fn()`` on a daemon thread of its own, awaited from an event loop (which runs other
    calls meanwhile); past ``limit_s`` seconds (None or inf: no limit) ``TimeLimitExceeded``
    and the thread is stopped (``stop_thread``). What ``fn`` raises is raised here."""
    import asyncio

    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    torch = sys.modules.get("torch")  # grad mode is thread-local in torch: keep the caller's
    grad = torch.is_grad_enabled() if torch is not None else None

    def settle(ok: bool, value) -> None:
        if not done.done():  # else: given up
            (done.set_result if ok else done.set_exception)(value)

    def target():
        try:
            try:
                out = True, _stoppable(fn, grad, torch)
            except _Overrun:
                return  # stopped: nobody waits for it
            except BaseException as exc:  # raised in the awaiting task
                out = False, exc
            loop.call_soon_threadsafe(settle, *out)
        except (RuntimeError, _Overrun):  # the loop is closed, or a late stop: given up
            pass

    worker = threading.Thread(target=target, name=f"peergrade-{name}", daemon=True)
    worker.start()
    if limit_s is None or math.isinf(limit_s):
        return await done
    try:
        return await asyncio.wait_for(done, limit_s)  # cancels done: a late result is dropped
    except asyncio.TimeoutError:
        stop_thread(worker)
        raise TimeLimitExceeded(name, limit_s) from None
    except asyncio.CancelledError:
        stop_thread(worker)  # the caller gave up (another call failed, or a stop)
        raise


def _stoppable(fn: Callable[[], T], grad, torch) -> T:
    """``fn()`` with the caller's grad mode, marked as the user's code that ``stop_thread``
    may interrupt (never the thread's own bookkeeping around it)."""
    ident = threading.get_ident()
    _IN_USER_CODE.add(ident)
    try:
        if grad is None:
            return fn()
        with torch.set_grad_enabled(grad):
            return fn()
    finally:
        _IN_USER_CODE.discard(ident)


_IN_USER_CODE: set[int] = set()  # threads running the user's code (_stoppable)


@types.coroutine
def steps_within(awaitable, limit_s: float | None, *, name: str):
    """``await awaitable``, each of its steps (its code between two awaits) under
    ``call_within(limit_s)`` when awaited in the main thread: a coroutine that blocks the event
    loop (never awaits) is interrupted there, where ``asyncio.wait_for`` cannot fire."""
    it = awaitable.__await__()
    main = threading.current_thread() is threading.main_thread()
    value, error = None, None
    while True:
        if error is None:
            step = lambda v=value: it.send(v)  # noqa: E731
        else:
            step = lambda e=error: it.throw(e)  # noqa: E731
        try:
            yielded = call_within(step, limit_s, name=name) if main else step()
        except StopIteration as stop:
            return stop.value
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            it.close()
            raise
        except BaseException as e:  # a cancellation, thrown into the awaitable
            value, error = None, e


_STOPPING: list[threading.Thread] = []  # threads being stopped (stop_thread)
_STOPPING_LOCK = threading.Lock()
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


def stop_thread(thread: threading.Thread) -> None:
    """Raise an interruption inside ``thread`` (again every 0.2 s until it ends; never while
    it imports): a given-up call that spins in Python stops using the CPU."""
    with _STOPPING_LOCK:
        if thread.ident is None or not thread.is_alive() or thread in _STOPPING:
            return
        _STOPPING.append(thread)
        if len(_STOPPING) == 1:
            threading.Thread(target=_stopper, name="peergrade-stopper", daemon=True).start()


def running_stopped() -> int:
    """Threads told to stop that still run (in a system call, or in C code that never returns
    to Python)."""
    with _STOPPING_LOCK:
        return sum(t.is_alive() for t in _STOPPING)


def _stopper() -> None:
    while True:
        with _STOPPING_LOCK:
            _STOPPING[:] = [t for t in _STOPPING if t.is_alive()]
            if not _STOPPING:
                return
            frames = sys._current_frames()
            for t in _STOPPING:
                frame = frames.get(t.ident)
                if t.ident in _IN_USER_CODE and frame is not None and not importing(frame):
                    _set_async_exc(t.ident, _Overrun)
        time.sleep(0.2)
