"""User code that hangs, spins, imports slowly or leaves processes behind (issue 53, part 1):
environments' calls run at once and a hanging one ends the batch after about one limit; a
timed-out tool call stops using the CPU and is reported; no time limit cuts an import; a
tool's daemon ends with the run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from peergrade.errors import UserCodeError
from peergrade.generation.episodes import _call_all

# ---------------------------------------------------------------- (a) environments' reset/step


class HangingReset:
    def __init__(self, how: str):
        self.how = how

    def reset(self, row):
        if self.how == "sleep":
            time.sleep(600)
        while True:  # busy
            pass

    def step(self, message):
        return [], True


class QuickReset:
    def reset(self, row):
        return "hi"

    def step(self, message):
        return [], True


def _cpu_over(window_s: float) -> float:
    """CPU seconds this process used over ``window_s`` seconds of wall time."""
    before = time.process_time()
    time.sleep(window_s)
    return time.process_time() - before


@pytest.mark.parametrize("how", ["sleep", "busy"])
def test_hanging_resets_of_a_batch_end_within_about_one_limit_not_one_each(how):
    """8 episodes x 1 s: one call after another took >= 8 s; at once, well under 4 s. The
    busy ones stop spinning afterwards (their threads are stopped)."""
    envs = [HangingReset(how) for _ in range(8)] + [QuickReset()]
    start = time.monotonic()
    with pytest.raises(UserCodeError) as got:
        _call_all([(e, "reset", {"prompt": "p"}, i) for i, e in enumerate(envs)], 1.0)
    took = time.monotonic() - start
    assert took < 4.0, took
    msg = str(got.value)
    assert msg == (
        "environment HangingReset.reset (rows[0]) did not return within 1s "
        "(env.timeout_s; null = no limit); 7 more of the batch's 9 calls too"
    ), msg
    if how == "busy":  # 8 spinning threads would use both cores: < 0.5 s of CPU in 1 s
        time.sleep(0.5)
        assert _cpu_over(1.0) < 0.5


class BlockingAsyncReset:
    """An ``async def reset`` that never awaits: it holds the event loop."""

    async def reset(self, row):
        time.sleep(8)
        return "late"

    async def step(self, message):
        return [], True


def test_an_async_reset_that_blocks_the_loop_is_bounded_and_named():
    envs = [QuickReset(), BlockingAsyncReset()]
    start = time.monotonic()
    with pytest.raises(UserCodeError) as got:
        _call_all([(e, "reset", {"prompt": "p"}, i) for i, e in enumerate(envs)], 0.5)
    took = time.monotonic() - start
    assert took < 4.0, took  # 8 s before: nothing could fire while the loop was held
    msg = str(got.value)
    assert msg == (
        "environment BlockingAsyncReset.reset (rows[1]) did not return within 0.5s "
        "(env.timeout_s; null = no limit)"
    ), msg


def test_environment_calls_run_at_once_and_keep_their_order():
    class Slow:
        def reset(self, row):
            time.sleep(0.5)
            return row["prompt"]

        def step(self, message):
            return [], True

    start = time.monotonic()
    out = _call_all([(Slow(), "reset", {"prompt": f"p{i}"}, i) for i in range(8)], 5.0)
    assert out == [f"p{i}" for i in range(8)]
    assert time.monotonic() - start < 3.0  # 4 s one after another


def test_an_unlimited_batch_is_not_limited():
    class Slowish:
        async def reset(self, row):
            await asyncio.sleep(0.2)
            return "ok"

        def step(self, message):
            return [], True

    assert _call_all([(Slowish(), "reset", {}, 0)], None) == ["ok"]


# ---------------------------------------------------------------- (c) no limit cuts an import


def test_a_limit_never_cuts_an_import_and_names_the_call(tmp_path, monkeypatch):
    """A reward whose first call imports a slow module (1.5 s) under a 0.3 s limit: the import
    completes (the module is whole in sys.modules), then the limit names the reward."""
    from peergrade.limits import TimeLimitExceeded, call_within

    (tmp_path / "slow_import_mod.py").write_text(
        "import time\nfor _ in range(15):\n    time.sleep(0.1)\nCOMPLETE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("slow_import_mod", None)

    def reward():
        import slow_import_mod  # noqa: F401

        while True:  # then spins: the limit must still fire
            time.sleep(0.01)

    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded) as got:
        call_within(reward, 0.3, name="my_reward")
    assert str(got.value) == "my_reward did not return within 0.3s"
    assert getattr(sys.modules.get("slow_import_mod"), "COMPLETE", False)
    assert time.monotonic() - start < 10
    sys.modules.pop("slow_import_mod", None)


def test_the_math_reward_imports_its_checkers_before_its_alarm():
    """math-verify's import slowed to 1.5 s, a 0.5 s check: the check still scores 1 and
    sympy is whole afterwards (an alarm in the import once scored 0 and broke the process)."""
    script = textwrap.dedent(
        """
        import importlib.machinery, sys, time
        class Slow:
            def find_spec(self, name, path, target=None):
                if name != "math_verify":
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                run = spec.loader.exec_module
                def slow(module):
                    for _ in range(15):
                        time.sleep(0.1)
                    run(module)
                spec.loader.exec_module = slow
                return spec
        sys.meta_path.insert(0, Slow())
        from peergrade.rewards.math import math_accuracy
        print(math_accuracy([None], ["0.5"], answer=["\\\\frac{1}{2}"], timeout_s=0.5))
        import sympy, math_verify
        print(sympy.Rational(1, 2) == sympy.Rational("0.5"), callable(math_verify.parse))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["[1.0]", "True True"], r.stdout + r.stderr[-2000:]


# ---------------------------------------------------------------- (b) tools that spin


def spin(x: int) -> int:
    """Never returns, using a core.

    Args:
        x: anything
    """
    while True:
        x += 1


def crash(code: int) -> int:
    """Ends its process.

    Args:
        code: the exit code
    """
    os._exit(code)


def fails(x: int) -> int:
    """Raises.

    Args:
        x: anything
    """
    raise ValueError(f"bad x {x}")


def double(x: int) -> int:
    """Twice x.

    Args:
        x: a number
    """
    return 2 * x


def call(name: str, args: str) -> dict:
    return {
        "role": "assistant",
        "content": f'<tool_call>{{"name": "{name}", "arguments": {{{args}}}}}</tool_call>',
    }


def steps_of(make, n: int, message: dict):
    envs = [make({"prompt": "p", "a": i}) for i in range(n)]
    out = _call_all([(e, "step", dict(message), i) for i, e in enumerate(envs)], None)
    return envs, out


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_timed_out_tool_call_stops_using_the_cpu_and_is_one_warning_line(capsys):
    """4 episodes call a tool that spins past its 0.5 s limit: each is a failed 'timed out'
    call, no CPU is used afterwards (on threads, 4 spinning calls kept both cores busy), and
    the batch's end prints one line naming the tool and the count."""
    from peergrade.envs.tools import tool_environment_factory

    make = tool_environment_factory([spin, double], tool_timeout=0.5, tool_concurrency=8)
    start = time.monotonic()
    _, steps = steps_of(make, 4, call("spin", '"x": 1'))
    assert time.monotonic() - start < 10
    for st in steps:
        assert st.tool_failures == 1
        assert st.messages[0]["content"] == str({"error": "timed out after 0.5s"})
    import threading

    assert not [t for t in threading.enumerate() if t.name == "peergrade-tool"]  # none spins
    time.sleep(0.5)
    assert _cpu_over(1.0) < 0.5  # this process (a spinning thread would count here)
    workers = make.end_batch.__self__.workers
    assert not workers.busy and not workers.idle
    capsys.readouterr()
    lines = make.end_batch()
    assert lines == [
        "warning: tool spin: 4 calls timed out in this batch (env.tool_timeout 0.5 s) and were "
        "stopped; each is a failed call the model reads as 'timed out'"
    ]
    assert capsys.readouterr().err.strip() == lines[0]
    assert make.end_batch() == []  # counted once
    # the next calls get fresh workers and their results
    _, steps = steps_of(make, 2, call("double", '"x": 21'))
    assert [st.messages[0]["content"] for st in steps] == ["42", "42"]


def test_a_spinning_tool_worker_is_killed_with_its_process_group():
    from peergrade.envs.tools import tool_environment_factory

    make = tool_environment_factory([spin], tool_timeout=0.3)
    env = make({"prompt": "p"})
    workers = env.limiter.workers
    forked = []
    real_fork = workers._fork

    def recording_fork():
        w = real_fork()
        forked.append(w.pid)
        return w

    workers._fork = recording_fork
    _call_all([(env, "step", call("spin", '"x": 1'), 0)], None)
    assert len(forked) == 1 and _gone(forked[0])


def test_tool_results_errors_and_exits_are_what_they_were():
    from peergrade.envs.tools import tool_environment_factory

    make = tool_environment_factory([double, fails, crash], tool_timeout=5)
    env = make({"prompt": "p"})
    msg = {
        "role": "assistant",
        "content": '<tool_call>{"name": "double", "arguments": {"x": 4}}</tool_call>'
        '<tool_call>{"name": "fails", "arguments": {"x": 3}}</tool_call>'
        '<tool_call>{"name": "crash", "arguments": {"code": 7}}</tool_call>'
        '<tool_call>{"name": "double", "arguments": {"x": 5}}</tool_call>',
    }
    (st,) = _call_all([(env, "step", msg, 0)], None)
    assert [m["content"] for m in st.messages] == [
        "8",
        str({"error": "bad x 3"}),
        str({"error": "the tool's process exited with code 7"}),
        "10",
    ]
    assert st.tool_calls == 4 and st.tool_failures == 2


class Counter:
    """A TRL environment class whose tool changes its state."""

    def reset(self, **row):
        self.count, self.seen = 0, []

    def bump(self, by: int) -> int:
        """Adds to the count.

        Args:
            by: how much
        """
        self.count += by
        self.seen.append(by)
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class LockedCounter(Counter):
    """Holds something that cannot be pickled: its tools run on threads."""

    def reset(self, **row):
        super().reset(**row)
        import threading

        self.lock = threading.Lock()


@pytest.mark.parametrize("cls", [Counter, LockedCounter])
def test_an_environment_instance_keeps_the_state_its_tools_change(cls, capsys):
    from peergrade.envs.tools import tool_environment_factory

    make = tool_environment_factory(environment_factory=cls, tool_timeout=5)
    env = make({"prompt": "p"})
    _call_all([(env, "reset", {"prompt": "p"}, 0)], None)
    keep = env.instance.__dict__.get("lock")
    for by in (2, 3):
        (st,) = _call_all([(env, "step", call("bump", f'"by": {by}'), 0)], None)
    assert st.messages[0]["content"] == "5"
    assert env.instance.count == 5 and env.instance.seen == [2, 3]
    assert env.instance.get_reward() == 5.0
    assert env.instance.__dict__.get("lock") is keep
    err = capsys.readouterr().err
    assert ("run on the trainer's threads" in err) == (cls is LockedCounter), err


def test_tool_call_overhead_is_small(capsys):
    """The calculator's tool, 200 calls: in a worker process vs on a thread (printed)."""
    from peergrade.envs.calculator import Calculator
    from peergrade.envs.tools import ToolLimiter, _in_thread, _run_sync

    inst = Calculator()
    inst.reset(a=1234, b=5678)
    limiter = ToolLimiter(8)

    async def run(way):
        t0 = time.perf_counter()
        for _ in range(200):
            if way == "thread":
                out = await _in_thread(inst.calculate, {"expression": "a*b"}, 5.0)
            else:
                out = await _run_sync(inst.calculate, {"expression": "a*b"}, 5.0, limiter, inst)
            assert out == str(1234 * 5678)
        return (time.perf_counter() - t0) / 200 * 1000

    asyncio.run(run("worker"))  # the fork, once
    thread_ms, worker_ms = asyncio.run(run("thread")), asyncio.run(run("worker"))
    with capsys.disabled():
        print(f"\ncalculator tool call: thread {thread_ms:.3f} ms, worker {worker_ms:.3f} ms")
    assert worker_ms < 50


# ---------------------------------------------------------------- (d) daemons end with the run


def test_a_daemon_a_tool_starts_ends_with_the_run(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    script = textwrap.dedent(
        f"""
        import subprocess
        from peergrade.envs.tools import tool_environment_factory
        from peergrade.generation.episodes import _call_all

        def start_server(port: int) -> str:
            '''Starts a server that outlives the call.

            Args:
                port: ignored
            '''
            p = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            open({str(pidfile)!r}, "w").write(str(p.pid))
            return "started"

        env = tool_environment_factory([start_server], tool_timeout=10)({{"prompt": "p"}})
        msg = {{"role": "assistant", "content":
               '<tool_call>{{"name": "start_server", "arguments": {{"port": 1}}}}</tool_call>'}}
        (st,) = _call_all([(env, "step", msg, 0)], None)
        print(st.messages[0]["content"])
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "started", r.stdout + r.stderr[-2000:]
    pid = int(pidfile.read_text())
    try:
        assert _gone(pid), f"the tool's daemon {pid} outlived the run"
    finally:
        if not _gone(pid, 0.1):
            os.kill(pid, 9)
