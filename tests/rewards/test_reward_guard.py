"""User reward code that hangs, exits or raises KeyboardInterrupt (issue 33 items 2 and 3): each
is a named failure of that function that goes through on_reward_error, never a hang and never
the end of the run."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from peergrade.rewards import RewardSpec
from peergrade.rewards.registry import RewardError, TrainerState, score_rewards

RELEASE = threading.Event()  # lets the abandoned threads of the hanging functions finish


def hangs(completions, **kw):
    RELEASE.wait(60)
    return [1.0] * len(completions)


async def hangs_async(completions, **kw):
    await asyncio.sleep(60)
    return [1.0] * len(completions)


def exits(completions, **kw):
    sys.exit(3)


def interrupts(completions, **kw):
    raise KeyboardInterrupt


def ok(completions, **kw):
    return [0.5] * len(completions)


def spec(fn, limit=1.0):
    return RewardSpec(fn.__name__, fn, timeout_s=limit)


def run(*specs, on_error="zero"):
    state = TrainerState(global_step=4, max_steps=10)
    return score_rewards(
        list(specs), ["p", "q"], ["a", "b"], on_error=on_error, trainer_state=state
    )


@pytest.mark.parametrize("fn", [hangs, hangs_async])
def test_a_hanging_reward_times_out_and_is_counted(fn):
    t0 = time.monotonic()
    got = run(spec(fn, 0.5), spec(ok))
    assert time.monotonic() - t0 < 20  # one limit, not one per sample
    assert got.per_fn[fn.__name__].tolist() == [0.0, 0.0]
    assert got.per_fn["ok"].tolist() == [0.5, 0.5]
    assert got.counts[f"reward/{fn.__name__}/timeouts"] == 1
    assert got.num_errors == 2
    assert any("did not return within 0.5 s" in e and "step 5" in e for e in got.errors), got.errors


def test_a_timeout_under_fail_names_the_function_the_step_and_the_limit():
    with pytest.raises(RewardError, match=r"'hangs' did not return within 0.5 s .* in step 5") as e:
        run(spec(hangs, 0.5), on_error="fail")
    assert "\n" not in str(e.value) and "first prompt: 'p'" in str(e.value)


@pytest.mark.parametrize(
    "fn, said", [(exits, "called sys.exit(3)"), (interrupts, "raised KeyboardInterrupt")]
)
def test_exit_or_keyboard_interrupt_inside_a_reward_is_its_failure(fn, said):
    got = run(spec(fn), spec(ok))
    assert got.per_fn[fn.__name__].tolist() == [0.0, 0.0]
    assert any(f"reward {fn.__name__!r} {said}" in e for e in got.errors), got.errors
    with pytest.raises(RewardError, match=f"reward '{fn.__name__}'"):
        run(spec(fn), on_error="fail")


def test_no_limit_still_guards_exit():
    got = run(spec(exits, float("inf")))
    assert got.num_errors == 2


def teardown_module():
    RELEASE.set()


@pytest.mark.parametrize(
    "source, said",
    [
        ("def f(completions, **kw)\n    return []\n", "failed at line 1: SyntaxError"),
        ("import os\n\nX = 1 / 0\n", "failed at line 3: ZeroDivisionError: division by zero"),
        ("import sys\nsys.exit(2)\n", "failed at line 2: called sys.exit(2)"),
    ],
)
def test_a_file_that_fails_to_import_is_one_line_with_file_and_line(tmp_path, source, said):
    from peergrade.errors import PeergradeError
    from peergrade.rewards.registry import resolve_reward

    path = tmp_path / "mine.py"
    path.write_text(source)
    with pytest.raises(PeergradeError) as got:
        resolve_reward(f"{path}:f")
    msg = str(got.value)
    assert str(path) in msg and said in msg and "\n" not in msg, msg


def test_the_audit_of_a_hanging_reward_waits_once_and_says_it_is_broken():
    from peergrade.rewards.audit import audit_rewards

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(3)]
    t0 = time.monotonic()
    report = audit_rewards([spec(hangs, 0.5)], rows)
    assert time.monotonic() - t0 < 20  # one limit, not one per exploit (40 of them)
    (unit,) = [u for u in report.units if u.name == "hangs"]
    assert unit.verdict == "broken" and "did not return within 0.5 s" in unit.note


def uses_signals(completions, **kw):
    """As math-verify's parse does (TRL's accuracy_reward): a signal handler and an alarm, which
    only the main thread may set."""
    import signal

    old = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.alarm(5)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
    return [0.25] * len(completions)


def test_a_guarded_reward_runs_in_the_main_thread_so_signal_users_work():
    got = run(spec(uses_signals, 5.0), spec(ok))
    assert got.num_errors == 0, got.errors
    assert got.per_fn["uses_signals"].tolist() == [0.25, 0.25]


def test_math_verify_rewards_run_under_a_timeout():
    pytest.importorskip("math_verify")
    from math_verify import parse

    def mv(completions, **kw):
        return [float(len(parse(c)) > 0) for c in completions]

    state = TrainerState(global_step=1, max_steps=1)
    got = score_rewards(
        [RewardSpec("mv", mv, timeout_s=30.0)], ["p", "q"], ["$2$", "$3$"], trainer_state=state
    )
    assert got.num_errors == 0, got.errors
    assert got.per_fn["mv"].tolist() == [1.0, 1.0]
