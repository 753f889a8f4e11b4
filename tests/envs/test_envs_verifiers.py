"""verifiers environments (``--env verifiers:MODULE``) against the real ``verifiers`` package
(0.4): a local two-tool ``Toolset`` with rewards, a task ending on its own ``@vf.stop``, the
errors for what cannot run here, and training from the command line on the tiny model."""

from __future__ import annotations

import itertools
import json
import re
import textwrap

import pytest
import torch

pytest.importorskip("verifiers.v1")

from peergrade.cli import main  # noqa: E402
from peergrade.config import load_config  # noqa: E402
from peergrade.envs.protocol import run_sync  # noqa: E402
from peergrade.envs.verifiers import load_verifiers, verifiers_reward  # noqa: E402
from peergrade.errors import InputError  # noqa: E402
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model  # noqa: E402
from peergrade.training.components import Given  # noqa: E402

CALC = """
import verifiers.v1 as vf


class CalcData(vf.TaskData):
    answer: int = 0


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        \"\"\"Add two integers.\"\"\"
        return a + b

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        \"\"\"Multiply two integers.\"\"\"
        return a * b


class CalcTask(vf.Task[CalcData]):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.answer) in trace.last_reply)

    @vf.reward(weight=0.5)
    async def used_tools(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.metric
    async def tool_messages(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        for a, b in [(3, 4), (5, 6)]:
            yield CalcTask(CalcData(prompt=f"What is {a} * {b}?", answer=a * b))


__all__ = ["CalcTaskset"]


def load_environment():
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "vf_calc"}, agent={"harness": {"id": "null"}, "max_turns": 4}
    )
    return vf.SingleAgentEnv(config)
"""

# Ends on its own stops: a Trace stop once a tool returned the answer, a Response stop on a
# reply that says "done".
STOPS = """
import verifiers.v1 as vf
from vf_calc import CalcData, CalcTask, CalcTaskset


class StopTask(CalcTask):
    @vf.stop
    async def solved(self, trace: vf.Trace) -> bool:
        return any(m.content == str(self.data.answer) for m in trace.tool_messages)

    @vf.stop
    def said_done(self, response: vf.Response) -> bool:
        return "done" in (response.message.content or "")


class StopTaskset(vf.Taskset[StopTask]):
    def load(self):
        yield StopTask(CalcData(prompt="What is 3 * 4?", answer=12))


def load_environment():
    return StopTaskset(vf.TasksetConfig())
"""

BAD = """
import verifiers.v1 as vf
from vf_calc import CalcData, CalcTask, CalcTools


class Remote(CalcTask):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig(runtime=vf.DockerConfig()))]


class Hosted(CalcTask):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig(url="https://tools.example.com/mcp"))]


class Boxed(CalcTask):
    NEEDS_CONTAINER = True


def taskset(task):
    class One(vf.Taskset[task]):
        def load(self):
            yield task(CalcData(prompt="1+1?", answer=2))

    return One(vf.TasksetConfig())


def remote():
    return taskset(Remote)


def hosted():
    return taskset(Hosted)


def boxed():
    return taskset(Boxed)


def judged():
    cfg = vf.TaskConfig(judges=[{"id": "reference"}])

    class One(vf.Taskset[CalcTask]):
        def load(self):
            yield CalcTask(CalcData(prompt="1+1?", answer=2), cfg)

    return One(vf.TasksetConfig())


def bash():
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset={"id": "vf_calc"}, agent={"harness": {"id": "bash"}}
    ))
"""

TOOL_CALL = '<tool_call>{"name": "calc_multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.fixture
def vf_dir(tmp_path, monkeypatch):
    (tmp_path / "vf_calc.py").write_text(textwrap.dedent(CALC))
    (tmp_path / "vf_stops.py").write_text(textwrap.dedent(STOPS))
    (tmp_path / "vf_bad.py").write_text(textwrap.dedent(BAD))
    (tmp_path / "vf_none.py").write_text("def make_env():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def rows_of(make, n):
    return list(itertools.islice(make.task.train_rows(0), n))


def test_toolset_tools_and_rewards_through_the_native_protocol(vf_dir):
    make = load_verifiers("verifiers:vf_calc")
    rows = rows_of(make, 2)
    assert sorted(r["prompt"] for r in rows) == ["What is 3 * 4?", "What is 5 * 6?"]
    assert make.task.default_rewards == [(verifiers_reward, 1.0)]
    row = next(r for r in rows if "3 * 4" in r["prompt"])

    env = make(row)
    assert run_sync(env.reset(row)) == [{"role": "user", "content": "What is 3 * 4?"}]
    assert sorted(t["function"]["name"] for t in env.tools) == ["calc_add", "calc_multiply"]
    # two calls in one turn: one runs (async), one has bad arguments and becomes an error
    bad = '<tool_call>{"name": "calc_add", "arguments": {"a": "x"}}</tool_call>'
    msg = {"role": "assistant", "content": "Let me see. " + TOOL_CALL + bad}
    step = run_sync(env.step(msg))
    assert not step.done and (step.tool_calls, step.tool_failures) == (2, 1)
    assert step.messages[0] == {"role": "tool", "name": "calc_multiply", "content": "12"}
    assert "error" in step.messages[1]["content"]
    assert msg["content"] == "Let me see." and len(msg["tool_calls"]) == 2
    step = run_sync(env.step({"role": "assistant", "content": "It is 12."}))
    assert step.done and step.finish_reason == "answer"
    # the task's own rewards, weighted as verifiers weights them: 1.0 * correct + 0.5 * used
    assert verifiers_reward(None, [env]) == [1.5]
    assert {k: r.score for k, r in env.trace.rewards.items()} == {"correct": 1.0, "used_tools": 1.0}

    other = make(row)  # a fresh episode: no tool, wrong answer
    run_sync(other.reset(row))
    run_sync(other.step({"role": "assistant", "content": "It is 7."}))
    assert verifiers_reward(None, [other]) == [0.0]


def test_episodes_end_on_the_tasks_own_stop_conditions(vf_dir):
    make = load_verifiers("verifiers:vf_stops")
    row = rows_of(make, 1)[0]
    env = make(row)
    run_sync(env.reset(row))
    step = run_sync(env.step({"role": "assistant", "content": TOOL_CALL}))
    # the Trace stop fires once the tool returned 12: the tool answer is kept, the episode ends
    assert step.done and step.finish_reason == "solved"
    assert step.messages == [{"role": "tool", "name": "calc_multiply", "content": "12"}]
    assert env.trace.stop_condition == "solved"

    env = make(row)
    run_sync(env.reset(row))
    step = run_sync(env.step({"role": "assistant", "content": "done, I think"}))
    assert step.done and step.finish_reason == "said_done"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("verifiers:vf_none", "no load_environment()"),
        ("verifiers:vf_none.py", "defines no load_environment()"),
        ("verifiers:no_such_module", "cannot be imported"),
        ("verifiers:vf_bad.py", "defines no load_environment()"),
    ],
)
def test_a_module_without_load_environment_is_one_error(vf_dir, spec, expected):
    with pytest.raises(InputError, match=expected):
        load_verifiers(spec)


@pytest.mark.parametrize(
    "fn, expected",
    [
        ("remote", "DockerConfig runtime (a remote sandbox or container)"),
        ("hosted", "hosted service (https://tools.example.com/mcp)"),
        ("boxed", "needs a container"),
        ("judged", "judge model served over the network"),
        ("bash", "harness is 'bash'"),
    ],
)
def test_what_needs_a_remote_service_is_refused(vf_dir, fn, expected):
    (vf_dir / f"vf_bad_{fn}.py").write_text(f"from vf_bad import {fn} as load_environment\n")
    with pytest.raises(InputError, match=re.escape(expected)):
        load_verifiers(f"verifiers:vf_bad_{fn}")


SMALL = [
    "--rollout.group_size",
    "2",
    "--rollout.prompts_per_step",
    "2",
    "--rollout.max_completion_length",
    "40",
    "--train.eval_every",
    "0",
    "--train.save_every",
    "0",
    "--train.display",
    "none",
    "--train.audit_rewards",
    "'off'",
]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--env", "verifiers:vf_none"], "no load_environment()"),
        (["--env", "verifiers:vf_bad_hosted"], "hosted service"),
        (["--env", "verifiers:vf_calc", "--data", "x.jsonl"], "taskset's tasks are the data"),
        (["--env", "verifiers:vf_calc", "--tools", "vf_calc.py:x"], "--tools cannot be added"),
    ],
)
def test_bad_verifiers_envs_exit_2_before_the_model_loads(vf_dir, capsys, flags, expected):
    (vf_dir / "vf_bad_hosted.py").write_text("from vf_bad import hosted as load_environment\n")
    rc = main(["train", "--model", "no_such_model", "--steps", "1", *flags, *SMALL])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert expected in err and "no_such_model" not in err, err


class Scripted(torch.nn.Module):
    """The tiny model forced to write ``script`` at the start of its first turn (then eos), and
    eos at once in every later turn: every prompt has ``prompt_len`` tokens."""

    def __init__(self, inner, script_ids, prompt_len, eos_id):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.generation_config = inner.generation_config
        self.script, self.start, self.eos = script_ids + [eos_id], prompt_len, eos_id

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
    ):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
        pos = position_ids[:, -out.logits.shape[1] :] + 1 - self.start  # index of the next token
        for (r, j), k in zip(torch.nonzero(pos >= 0).tolist(), pos[pos >= 0].tolist()):
            out.logits[r, j, self.script[k] if k < len(self.script) else self.eos] += 1e4
        return out


@pytest.mark.parametrize(
    "module, turns, finish", [("vf_calc", 2, "answer"), ("vf_stops", 1, "solved")]
)
def test_collect_runs_the_tools_and_scores_with_the_verifiers_rewards(
    vf_dir, module, turns, finish
):
    """Through the trainer: the scripted tool call runs the Toolset's multiply; vf_calc's
    episode then ends with the (empty) answer, vf_stops' on its own stop, ``solved``."""
    from peergrade.envs.template import render
    from peergrade.training import trainer

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    cfg = load_config(
        None,
        [
            ("env.factory", f"verifiers:{module}"),
            ("rollout.group_size", 2),
            ("rollout.prompts_per_step", 2),
            ("rollout.max_completion_length", 200),
            ("algo.beta", 0.0),
            ("train.audit_rewards", "off"),
        ],
    )
    make = load_verifiers(f"verifiers:{module}")
    row = rows_of(make, 1)[0]
    env = make(row)
    prompt_len = len(
        render(tok, run_sync(env.reset(row)), add_generation_prompt=True, tools=env.tools)
    )
    script = tok.encode(TOOL_CALL, add_special_tokens=False)
    policy = Scripted(inner, script, prompt_len, tok.eos_token_id)
    run = trainer.setup(cfg, Given(policy=policy, tokenizer=tok))
    assert [s.name for s in run.rewards] == ["verifiers_reward"]
    exp = trainer.collect(run, 1, rows_of(make, 2))
    eps = exp.sampled.samples.episodes
    assert len(eps) == 4
    for e in eps:
        assert e.tool_calls == 1 and e.tool_failures == 0 and e.num_turns == turns
        assert e.finish_reason == finish
        assert e.completion_messages[1] == {
            "role": "tool",
            "name": "calc_multiply",
            "content": "12",
        }
        assert e.env.trace.stop_condition == ("agent_completed" if finish == "answer" else finish)
    # used_tools (0.5) for all; correct needs the answer in the last reply, which is empty
    # (vf_calc) or the tool call itself (vf_stops)
    assert exp.sampled.scores.per_fn["verifiers_reward"].tolist() == [0.5] * 4
    exp.seconds["update"] = 0.0
    m = trainer.step_result(run, exp, {}, 1).metrics
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.0
    assert m[f"episode/stop_reason/{finish}"] == 1.0 and m["turns/mean"] == turns
    if module == "vf_calc":  # its @vf.metric, averaged over the episodes
        assert m["verifiers/tool_messages"] == 1.0


@pytest.mark.slow
def test_train_a_verifiers_env_from_the_command_line(vf_dir, capsys):
    out = vf_dir / "tool_model"
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for env in ("verifiers:vf_calc", "verifiers:vf_stops"):
        run_dir = vf_dir / env.split(":")[1]
        rc = main(
            ["train", "--model", str(out), "--env", env, "--steps", "2", "-o", str(run_dir)]
            + [*SMALL, "--env.max_tokens_per_turn", "12"]
        )
        assert rc == 0, capsys.readouterr().err
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in lines if "tools/call_frequency" in m]
        assert [m["step"] for m in steps] == [1, 2]
        known = {"answer", "solved", "said_done", "max_turns", "length", "turn_length"}
        for m in steps:
            assert "reward/verifiers_reward/mean" in m and m["turns/mean"] >= 1
            reasons = {k.rsplit("/", 1)[1] for k in m if k.startswith("episode/stop_reason/")}
            assert reasons and reasons <= known | {"env_over_budget"}, reasons
        samples = (run_dir / "samples.jsonl").read_text().splitlines()
        for s in map(json.loads, samples):
            assert s["prompt"][-1]["content"].startswith("What is")
            assert all(c[0]["role"] == "assistant" for c in s["completions"])
        saved = load_config(run_dir / "config.yaml")
        assert saved.env.factory == env


def test_a_verifiers_file_resolves_like_other_config_paths(vf_dir):
    sub = vf_dir / "sub"
    sub.mkdir()
    (sub / "c.yaml").write_text("env:\n  factory: verifiers:../vf_calc.py\n")
    cfg = load_config(sub / "c.yaml")
    assert cfg.env.factory == "verifiers:" + str(vf_dir / "vf_calc.py")
    assert (
        load_config(None, [("env.factory", "verifiers:vf_calc")]).env.factory == "verifiers:vf_calc"
    )
    make = load_verifiers(cfg.env.factory)  # the file, loaded by its path
    assert len(rows_of(make, 2)) == 2


def test_missing_or_unsupported_verifiers_is_one_error(vf_dir, monkeypatch):
    import sys

    import verifiers

    from peergrade.errors import MissingPackageError

    monkeypatch.setattr(verifiers, "__version__", "0.5.0")
    with pytest.raises(InputError, match=re.escape("supports verifiers>=0.4,<0.5")):
        load_verifiers("verifiers:vf_calc")
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(MissingPackageError, match="peergrade\\[verifiers\\]"):
        load_verifiers("verifiers:vf_calc")


def test_tool_output_cap_and_timeout_apply_to_toolset_calls(vf_dir):
    """env.max_tool_output_chars and env.tool_timeout reach a verifiers Toolset's calls as they
    reach TRL tools' (make_env_from_specs passes them)."""
    from peergrade.envs import make_env_from_specs

    make = make_env_from_specs(env="verifiers:vf_calc", tool_timeout=30.0, max_tool_output_chars=1)
    row = next(r for r in rows_of(make, 2) if "3 * 4" in r["prompt"])
    env = make(row)
    assert (env.timeout, env.max_chars) == (30.0, 1)
    run_sync(env.reset(row))
    step = run_sync(env.step({"role": "assistant", "content": TOOL_CALL}))
    assert step.messages[0]["content"].startswith("1... [truncated 1 characters]")
