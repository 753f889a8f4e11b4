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
thread of its own, abandoned past its limit.

What it deliberately does not do: nest (an inner limited call disarms the outer one while it
runs), or limit coroutines (the async callers use ``asyncio.wait_for``).
"""

from __future__ import annotations

import math
import signal
import sys
import threading
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


def _on_overrun(signum, frame) -> None:
    """peergrade's SIGUSR1 handler: interrupts the armed call, ignores anything else."""
    if _ARMED[0] is not None:
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
        if not done.wait(limit_s):
            with _ARMED_LOCK:
                if _ARMED[0] is token:
                    signal.pthread_kill(main, signal.SIGUSR1)

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
            if grad is None:
                box["out"] = fn()
            else:
                with torch.set_grad_enabled(grad):
                    box["out"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"peergrade-{name}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise TimeLimitExceeded(name, limit_s)
    if "error" in box:
        raise box["error"]
    return box["out"]
