"""TRL's reward contract in score_rewards: completion forms, trainer_state, log_extra/log_metric,
async functions, names; and the bad inputs (wrong length, raising, async raising, bad names)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from peergrade.rewards import (
    RewardError,
    RewardSpec,
    TrainerState,
    make_reward_specs,
    score_rewards,
)

CHAT = [{"role": "user", "content": "1+1?"}]


def test_conversational_rows_get_message_completions_plain_rows_get_text():
    seen = {}

    def spy(prompts, completions, **kw):
        seen["completions"] = completions
        return [0.0] * len(completions)

    score_rewards([RewardSpec("spy", spy)], [CHAT, CHAT, "2+2=", "3+3="], ["a", "b", "c", "d"])
    assert seen["completions"] == [
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
        "c",
        "d",
    ]


def test_open_r1_style_function_reads_completion_content():
    def format_reward(completions, **kwargs):
        return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]

    s = score_rewards([RewardSpec("format_reward", format_reward)], [CHAT] * 2, ["<think>x", "y"])
    assert s.per_fn["format_reward"].tolist() == [1.0, 0.0]


def test_trainer_state_fields_and_progress():
    st = TrainerState.at_step(3, max_steps=10, batch_size=8, prompts_per_step=4, num_rows=16)
    # two steps done, 4 rows a step over 16 rows: half an epoch; 10 steps need 3 epochs
    assert (st.global_step, st.max_steps, st.epoch, st.num_train_epochs) == (2, 10, 0.5, 3)
    assert st.train_batch_size == 8 and st.is_world_process_zero and st.is_local_process_zero
    endless = TrainerState.at_step(1, max_steps=4, batch_size=8, prompts_per_step=4)
    assert (endless.global_step, endless.epoch, endless.num_train_epochs) == (0, 0.0, 1)
    with pytest.raises(AttributeError, match="no attribute 'log_history'.*global_step"):
        _ = st.log_history
    with pytest.raises(AttributeError):  # frozen: a reward cannot change the trainer's progress
        st.global_step = 5

    def curriculum(completions, trainer_state, **kw):
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    s = score_rewards([RewardSpec("c", curriculum)], ["p"], ["c"], trainer_state=st)
    assert s.per_fn["c"].tolist() == [pytest.approx(0.2)]


def test_log_extra_and_log_metric_land_in_scores():
    def logger(completions, log_extra, log_metric, **kw):
        log_extra("length", [len(c) for c in completions])
        log_metric("frac_long", sum(len(c) > 1 for c in completions) / len(completions))
        log_metric("frac_long", 0.0)  # called twice: TRL averages the calls
        return [1.0] * len(completions)

    def other(completions, log_metric, **kw):
        log_metric("other/value", 3)
        return [None] * len(completions)

    s = score_rewards(
        [RewardSpec("a", logger), RewardSpec("b", other)], ["p"] * 3, ["x", "yy", "zz"]
    )
    assert s.extra == {"length": [1, 2, 2]}
    assert s.logged == {"frac_long": pytest.approx(1 / 3), "other/value": 3.0}
    m = s.metrics()
    assert m["frac_long"] == pytest.approx(1 / 3) and m["other/value"] == 3.0
    rec = s.sample_fields(slice(1, 3))
    assert rec == {
        "rewards_by_fn": {"a": [1.0, 1.0], "b": [None, None]},
        "extra": {"length": [2, 2]},
    }


@pytest.mark.parametrize(
    "body, pattern",
    [
        ("log_extra('x', [1])", r"log_extra\('x', \.\.\.\): expected a list of 2 values"),
        ("log_extra('x', [object(), 1])", "JSON-serialisable"),
        ("log_extra('', [1, 2])", "non-empty string"),
        ("log_metric('loss/policy', 1.0)", "'loss/policy' is reserved"),
        ("log_metric('m', 'high')", r"log_metric\('m', \.\.\.\): value must be a real number"),
        ("log_metric('m', float('nan'))", "must be finite"),
    ],
)
def test_bad_logging_is_a_reward_error_naming_the_function(body, pattern):
    def fn(completions, log_extra, log_metric, **kw):
        eval(body)  # noqa: S307 - the test's own literal
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=rf"reward 'logs'.*{pattern}"):
        score_rewards([RewardSpec("logs", fn)], ["p", "q"], ["a", "b"])
    s = score_rewards([RewardSpec("logs", fn)], ["p", "q"], ["a", "b"], on_error="zero")
    assert s.num_errors == 2 and s.extra == {} and s.logged == {}


def test_same_log_extra_column_from_two_functions_is_refused():
    def a(completions, log_extra, **kw):
        log_extra("col", list(completions))
        return [1.0] * len(completions)

    def b(completions, log_extra, **kw):
        log_extra("col", list(completions))
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="column 'col' was already logged.*by reward 'a'"):
        score_rewards([RewardSpec("a", a), RewardSpec("b", b)], ["p"], ["c"])


def test_async_functions_run_concurrently_on_one_loop():
    events: dict[str, asyncio.Event] = {}
    loops = set()

    async def ping(completions, **kw):
        # waits for pong: sequential awaiting would never get here (bounded, so a bug fails)
        loops.add(asyncio.get_running_loop())
        events.setdefault("ping", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("pong", asyncio.Event()).wait(), 20)
        return [1.0] * len(completions)

    async def pong(completions, **kw):
        loops.add(asyncio.get_running_loop())
        events.setdefault("pong", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("ping", asyncio.Event()).wait(), 20)
        return [2.0] * len(completions)

    def sync(completions, **kw):
        return [0.5] * len(completions)

    specs = [RewardSpec("ping", ping), RewardSpec("sync", sync), RewardSpec("pong", pong)]
    s = score_rewards(specs, ["p", "q"], ["a", "b"])
    assert s.total.tolist() == [3.5, 3.5]
    events.clear()
    score_rewards(specs, ["p"], ["a"])  # a second batch: the same loop (clients bound to it live)
    assert len(loops) == 1


def test_async_raising_and_wrong_length_are_reported_others_kept():
    async def boom(completions, **kw):
        await asyncio.sleep(0)
        raise RuntimeError("judge unreachable")

    async def short(completions, **kw):
        return [1.0]

    async def fine(completions, **kw):
        return [0.25] * len(completions)

    specs = [RewardSpec("boom", boom), RewardSpec("short", short), RewardSpec("fine", fine)]
    with pytest.raises(
        RewardError, match="reward 'boom' raised on the batch of 3.*judge unreachable"
    ):
        score_rewards(specs, ["p"] * 3, ["a", "b", "c"])
    s = score_rewards(specs, ["p"] * 3, ["a", "b", "c"], on_error="zero")
    assert s.num_errors == 6
    assert any("'short' returned 1 scores for 3" in e for e in s.errors)
    assert s.per_fn["fine"].tolist() == [0.25] * 3
    # a sync function that returns a coroutine is awaited too
    s = score_rewards(
        [RewardSpec("lazy", lambda completions, **kw: fine(completions))], ["p"], ["a"]
    )
    assert s.per_fn["lazy"].tolist() == [0.25]


def test_wrong_length_and_raising_sync_functions():
    with pytest.raises(RewardError, match="returned 1 scores for 2 completions"):
        score_rewards([RewardSpec("f", lambda completions, **kw: [1.0])], ["p", "q"], ["a", "b"])

    def bad(completions, **kw):
        return [c[0]["content"] for c in completions]  # a conversational recipe on plain text

    with pytest.raises(RewardError, match=r"first failing sample index 0: TypeError"):
        score_rewards([RewardSpec("bad", bad)], ["p", "q"], ["a", "b"])


def test_duplicate_names_are_made_unique_and_display_names_are_checked(tmp_path):
    def from_file():  # a distinct function with the same __name__, as from a second file
        def accuracy_reward(completions, **kw):
            return [1.0] * len(completions)

        return accuracy_reward

    accuracy_reward, other = from_file(), from_file()

    def total(completions, **kw):
        return [0.0] * len(completions)

    specs = make_reward_specs(
        [
            (accuracy_reward, 1.0, {}, None),
            (other, 1.0, {}, None),
            (accuracy_reward, 0.5, {}, "accuracy_reward_2"),  # an explicit name is never taken
            (total, 1.0, {}, None),
            ("arithmetic", 1.0, {}, None),
        ]
    )
    assert [s.name for s in specs] == [
        "accuracy_reward",
        "accuracy_reward_3",
        "accuracy_reward_2",
        "total_2",
        "arithmetic",
    ]
    s = score_rewards(specs, ["p"], ["12"], {"answer": ["12"]})
    assert set(s.per_fn) == {s.name for s in specs}
    for bad in ("a/b", "total", "", "x" * 65, 3):
        with pytest.raises(ValueError, match=r"rewards\[0\]\.display_name .* is not valid"):
            make_reward_specs([("arithmetic", 1.0, {}, bad)])
    with pytest.raises(
        ValueError, match=r"rewards\[1\]\.display_name 'acc' is used by two rewards"
    ):
        make_reward_specs([("arithmetic", 1.0, {}, "acc"), ("format", 1.0, {}, "acc")])
    with pytest.raises(ValueError, match=r"kwargs \['trainer_state'\] are reserved"):
        make_reward_specs([("arithmetic", 1.0, {"trainer_state": 1}, None)])


def test_total_std_excludes_unscored_rows_ddof_1():
    fn = lambda completions, **kw: [1.0, None, 3.0, None]  # noqa: E731
    m = score_rewards([RewardSpec("f", fn)], ["p"] * 4, list("abcd")).metrics()
    assert m["reward/total/std"] == pytest.approx(math.sqrt(2.0))  # std of [1, 3], ddof 1
    assert m["reward/f/std"] == pytest.approx(math.sqrt(2.0))
    one = score_rewards([RewardSpec("f", lambda completions, **kw: [1.0])], ["p"], ["a"])
    assert "reward/f/std" not in one.metrics() and torch.isfinite(one.total).all()
