"""The Python-code tool (``envs.python_tool.run_python``): model-written programs run in the
code sandbox, a failing program is a failed call the model reads, and a sandbox that cannot
contain code stops the run before the model loads (fail closed), never becoming a tool error."""

from __future__ import annotations

import asyncio
import os

import pytest

from peergrade.envs import python_tool
from peergrade.envs.load import reference_of
from peergrade.envs.tools import _call_tools, tool_environment_factory, tool_schema
from peergrade.rewards.sandbox import SandboxUnavailable, require_sandbox


def _sandbox_or_skip() -> None:
    try:
        require_sandbox("auto")
    except SandboxUnavailable as e:  # the fail-closed tests below still run
        pytest.skip(f"no code sandbox on this machine: {e}")


def _call(code: str, tool=python_tool.run_python):
    call = {"function": {"name": "run_python", "arguments": {"code": code}}}
    ((name, result, failed),) = asyncio.run(_call_tools([call], {"run_python": tool}))
    return result, failed


def test_it_is_a_tool_with_a_schema_recorded_by_name():
    schema = tool_schema(python_tool.run_python)
    assert schema["function"]["name"] == "run_python"
    assert list(schema["function"]["parameters"]["properties"]) == ["code"]
    # a run given it from Python can be resumed from the command line
    assert reference_of(python_tool.run_python) == "peergrade.envs.python_tool:run_python"
    assert reference_of(python_tool.make_python_tool()).startswith("python-object:")


def test_a_program_runs_in_the_sandbox_and_its_output_is_the_result():
    _sandbox_or_skip()
    result, failed = _call("print(6 * 7)")
    assert (result, failed) == ("42\n", False)
    if os.geteuid() == 0:  # the root mechanism drops to an unprivileged uid of its own
        result, failed = _call("import os; print(os.getuid())")
        assert not failed and int(result) != 0


def test_a_failing_program_is_a_failed_call_the_model_reads():
    _sandbox_or_skip()
    result, failed = _call("raise ValueError('boom')")
    assert failed and "ValueError: boom" in result["error"], result
    short = python_tool.make_python_tool(timeout_s=1)
    short.__name__ = "run_python"
    result, failed = _call("import time; time.sleep(30)", tool=short)
    assert failed and result["error"].startswith("timeout"), result


def test_a_sandbox_that_cannot_contain_code_stops_at_start_up(monkeypatch):
    def broken(mechanism="auto", *a, **kw):
        raise SandboxUnavailable("the code sandbox failed its self-test: canary escaped")

    monkeypatch.setattr(python_tool, "require_sandbox", broken)
    # loading the tool (before any model) runs the self-test: fail closed
    with pytest.raises(SandboxUnavailable, match="canary escaped"):
        tool_environment_factory(tools=[python_tool.run_python])
    # and a call never turns it into a tool error the run would carry on after
    with pytest.raises(SandboxUnavailable):
        _call("print(1)")
