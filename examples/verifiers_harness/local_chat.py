"""A verifiers 0.4 harness plugin (``harness.id = "local_chat"``): verifiers' own chat loop,
the program its ``null`` harness runs, started with this Python instead of a ``uv`` script.

The ``null`` harness prepares that program with ``uv sync --script`` (verifiers
``runtimes/base.py``, ``Runtime.prepare_uv_script``): it installs ``uv`` when missing
(``pip install --user uv``, else the astral.sh installer) and resolves the program's
dependencies (openai, mcp, httpx, httpx2, tenacity, certifi) from PyPI into a fresh
environment, so it needs network on first use. They are all verifiers' own dependencies, so
the interpreter verifiers runs in can run the program as it is; this harness does only that.
Everything else (prompt, tools over MCP, arguments, the interception endpoint) is the null
harness's.
"""

from __future__ import annotations

import hashlib
import sys

from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program


class _ThisPython:
    """The rollout's runtime, except that a script runs with this interpreter, unprepared."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate=True):
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)  # in the runtime's work dir, its cwd
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    async def setup(self, runtime) -> None:
        pass  # nothing to prepare

    async def launch(
        self,
        ctx,
        trace,
        runtime,
        endpoint,
        secret,
        mcp_urls,
        data,
        tool_interception_url=None,
    ):
        system_prompt, prompt = self.resolve_prompt(data)
        extra = (
            [f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else ()
        )
        return await launch_chat_program(
            CHAT_PROGRAM_SOURCE,
            self.config,
            ctx,
            trace,
            _ThisPython(runtime),
            endpoint,
            secret,
            mcp_urls,
            system_prompt,
            prompt,
            extra_args=extra,
        )


__all__ = ["LocalChatHarness"]
