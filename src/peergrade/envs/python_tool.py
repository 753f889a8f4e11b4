"""A Python-code tool for episodes: the model's program runs in peergrade's code sandbox.

``run_python(code)`` is a TRL-style tool (type hints, Google-style docstring):
``--tools peergrade.envs.python_tool:run_python``, ``env.tools: [peergrade.envs.python_tool:run_python]``
or ``GRPOTrainer(tools=[run_python])``. The program runs as the ``code_tests`` reward's
candidates do (``rewards.sandbox.run_program``: its own uid, namespaces, rlimits, a tmpfs work
directory, no network, the process group killed at the end) and its standard output is the
tool's result. A program that fails (an exception, a timeout, a limit) is a failed call: the
model reads the status, the reason and the tail of stderr, and ``tools/failure_frequency``
counts it.

Fail closed, with the same privilege handling as the code reward: the sandbox's self-test
(``require_sandbox``) runs when the tool is loaded, before the model (``startup_check``, which
``envs.tools`` calls for every tool that has one), and a sandbox that cannot contain its canary
stops the run with one error instead of running model-written code unconfined. ``make_python_tool``
builds the same tool with other limits or an explicit ``mechanism`` (``"none"`` runs
unsandboxed, with the code reward's warning).

This module does not parse calls or run episodes (``envs.tools``, ``envs.runner``).
"""

from __future__ import annotations

from collections.abc import Callable

from peergrade.rewards.sandbox import SandboxLimits, require_sandbox, run_program

__all__ = ["make_python_tool", "run_python"]

MAX_RESULT_CHARS = 2000  # of stdout (its end) in a result; the runner may cut further


def make_python_tool(
    *, mechanism: str = "auto", timeout_s: float = 5.0, memory_mb: int = 512
) -> Callable[[str], str]:
    """``run_python`` with these sandbox settings (``rewards.sandbox.run_program``'s
    ``mechanism`` and ``SandboxLimits``' names; bad limits raise ValueError here)."""
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb)

    def run_python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: the complete program; print the values you need, its standard output is the result
        """
        used = require_sandbox(mechanism)  # cached; raises SandboxUnavailable (a PeergradeError)
        r = run_program(code, limits=limits, mechanism=used)
        if r.ok:
            return r.stdout[-MAX_RESULT_CHARS:]
        raise RuntimeError(f"{r.status}: {r.reason or r.stderr.strip()[-300:]}")

    run_python.__qualname__ = "run_python"  # the module's instance is recorded by this name
    run_python.startup_check = lambda: require_sandbox(mechanism)  # fail closed before the model
    return run_python


run_python = make_python_tool()
