"""The harness's worker processes (``envs.harness_pool``) and a Ctrl-C: a worker starts with
SIGINT held off (blocked or ignored) from its first instruction, so a Ctrl-C that reaches the
process group while it imports prints no traceback of its own."""

from __future__ import annotations

import multiprocessing
import sys
import threading
from pathlib import Path

import pytest

from peergrade.envs.harness_pool import _Worker

SLOW = "import time\ntime.sleep(20)\n\n\ndef agent(row, base_url, model):\n    return 0.0\n"


def _sigint_held_off(pid: int) -> bool:
    """SIGINT (signal 2, bit 1) blocked or ignored in process ``pid``, from /proc."""
    fields = dict(
        line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return any(int(fields[k], 16) & 0b10 for k in ("SigBlk", "SigIgn"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("where", ["main thread", "another thread"])
def test_a_worker_starts_with_sigint_held_off(tmp_path, where):
    (tmp_path / "slow.py").write_text(SLOW)
    ctx = multiprocessing.get_context("spawn")
    seen: list[bool] = []

    def start() -> None:
        w = _Worker(ctx, f"{tmp_path / 'slow.py'}:agent", 0)
        try:  # the child is still in its interpreter's start-up: far from _worker_main
            seen.append(_sigint_held_off(w.proc.pid))
        finally:
            w.kill()

    if where == "main thread":
        start()
    else:
        t = threading.Thread(target=start)
        t.start()
        t.join()
    assert seen == [True]
