"""Tools and environments that hang, exit, flood or fail (issue 33 items 2, 3 and 5): tool calls
run concurrently across episodes (bounded), a tool's sys.exit() is its failed call, an over-long
result is cut and counted, and an environment whose reset raises or exits is one error naming
the user's class, the row and the line."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from peergrade.envs.tools import tool_environment_factory
from peergrade.errors import UserCodeError
from peergrade.generation.episodes import _call_all


def slow(x: int) -> int:
    """Takes a second.

    Args:
        x: anything
    """
    time.sleep(1.0)
    return x


def leaves(x: int) -> int:
    """Calls sys.exit.

    Args:
        x: anything
    """
    sys.exit(3)


async def leaves_async(x: int) -> int:
    """Calls sys.exit.

    Args:
        x: anything
    """
    sys.exit(4)


def flood(n: int) -> str:
    """A long result.

    Args:
        n: its length
    """
    return "z" * n


def call(name: str, args: str) -> dict:
    return {
        "role": "assistant",
        "content": f'<tool_call>{{"name": "{name}", "arguments": {{{args}}}}}</tool_call>',
    }


def steps_of(make, n: int, message: dict):
    envs = [make({"prompt": "p"}) for _ in range(n)]

    async def go():
        return await asyncio.gather(*(e.step(dict(message)) for e in envs))

    return asyncio.run(go())


@pytest.mark.parametrize("concurrency, bound", [(8, (0, 3.5)), (1, (4.0, 60))])
def test_tools_run_concurrently_across_episodes_up_to_the_bound(concurrency, bound):
    make = tool_environment_factory([slow], tool_concurrency=concurrency)
    t0 = time.monotonic()
    steps = steps_of(make, 4, call("slow", '"x": 7'))
    took = time.monotonic() - t0
    assert [s.messages[0]["content"] for s in steps] == ["7"] * 4
    assert bound[0] <= took < bound[1], took  # 4 one-second calls: ~1 s together, 4 s in turn


def test_a_tool_that_exits_is_a_failed_call_not_the_end():
    make = tool_environment_factory([leaves, leaves_async])
    content = call("leaves", '"x": 1')["content"] + call("leaves_async", '"x": 1')["content"]
    (st,) = steps_of(make, 1, {"role": "assistant", "content": content})
    assert (st.tool_calls, st.tool_failures) == (2, 2)
    assert "called sys.exit(3)" in st.messages[0]["content"]
    assert "called sys.exit(4)" in st.messages[1]["content"]


def test_an_over_long_result_is_cut_marked_and_counted():
    make = tool_environment_factory([flood], max_tool_output_chars=100)
    (st,) = steps_of(make, 1, call("flood", '"n": 1000000'))
    assert st.messages[0]["content"] == "z" * 100 + "... [truncated 999900 characters]"
    assert st.tool_truncated == 1 and st.tool_failures == 0


class BrokenReset:
    def reset(self, **row):
        raise ValueError("no such table")

    def look(self, x: int) -> int:
        """Looks.

        Args:
            x: anything
        """
        return x


class ExitingReset(BrokenReset):
    def reset(self, **row):
        sys.exit(5)


@pytest.mark.parametrize(
    "cls, said",
    [
        (BrokenReset, "raised ValueError: no such table (at test_tools_guard.py:"),
        (ExitingReset, "called sys.exit(5) (at test_tools_guard.py:"),
    ],
)
def test_an_environment_whose_reset_fails_is_one_named_error(cls, said):
    make = tool_environment_factory(environment_factory=cls)
    env = make({"prompt": "p"})
    with pytest.raises(UserCodeError) as got:
        _call_all([(env, "reset", {"prompt": "p"}, 3)])
    msg = str(got.value)
    assert msg.startswith(f"environment {cls.__name__}.reset (rows[3]) "), msg
    assert said in msg and "\n" not in msg, msg


# ---------------------------------------------------------------- time limits on reset / step


class HangingReset:
    """A native environment whose reset never returns (a sleep, or a busy loop)."""

    def __init__(self, how: str = "sleep"):
        self.how = how

    def reset(self, row):
        if self.how == "sleep":
            time.sleep(600)
        while True:
            pass

    def step(self, message):
        return [], True


class HangingAsyncStep:
    async def reset(self, row):
        return "hi"

    async def step(self, message):
        await asyncio.sleep(600)


class SlowTRLReset(BrokenReset):
    def reset(self, **row):
        time.sleep(600)


@pytest.mark.parametrize(
    "env, method, name",
    [
        (HangingReset("sleep"), "reset", "HangingReset"),
        (HangingReset("busy"), "reset", "HangingReset"),
        (HangingAsyncStep(), "step", "HangingAsyncStep"),
        (
            tool_environment_factory(environment_factory=SlowTRLReset)({"prompt": "p"}),
            "reset",
            "SlowTRLReset",
        ),
    ],
    ids=["sync-sleep", "sync-busy-loop", "async", "trl-class-reset"],
)
def test_a_hanging_reset_or_step_is_one_named_error_within_its_limit(env, method, name):
    arg = {"prompt": "p"} if method == "reset" else {"role": "assistant", "content": "x"}
    start = time.monotonic()
    with pytest.raises(UserCodeError) as got:
        _call_all([(env, method, arg, 2)], 0.5)
    took = time.monotonic() - start
    msg = str(got.value)
    assert msg == (
        f"environment {name}.{method} (rows[2]) did not return within 0.5s "
        "(env.timeout_s; null = no limit)"
    ), msg
    assert took < 30, took  # 600 s without the limit


def test_calls_within_their_limit_keep_their_results_and_the_tool_step_is_not_limited_whole():
    class Quick:
        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, message):
            await asyncio.sleep(0.01)
            return [], True

    envs = [Quick(), Quick()]
    opened = _call_all([(e, "reset", {"prompt": f"p{i}"}, i) for i, e in enumerate(envs)], 5.0)
    assert opened == [[{"role": "user", "content": "p0"}], [{"role": "user", "content": "p1"}]]
    done = _call_all([(e, "step", {"role": "assistant", "content": "x"}, 0) for e in envs], 5.0)
    assert [s[1] for s in done] == [True, True]
    # the tool wrapper's step: its tool call (1 s) has its own limit (none here), so a step
    # longer than the environment limit is not stopped
    make = tool_environment_factory([slow])
    env = make({"prompt": "p"})
    (st,) = _call_all([(env, "step", call("slow", '"x": 7'), 0)], 0.3)
    assert st.messages[0]["content"] == "7" and st.tool_failures == 0


def test_a_limited_call_leaves_no_armed_watchdog_behind():
    """After a call returns under its limit, a late watchdog signal interrupts nothing."""
    from peergrade.limits import call_within

    assert call_within(lambda: 41 + 1, 0.2, name="quick") == 42
    time.sleep(0.5)  # the watchdog's limit passes with nothing armed
    assert call_within(lambda: "still fine", None, name="unlimited") == "still fine"
