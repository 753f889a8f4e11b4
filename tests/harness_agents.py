"""Harnesses the worker-process tests load by name (tests/harness_agents.py:NAME): a worker
imports this file, not the test module (no torch, no pytest)."""

from __future__ import annotations

import os
import sys
import time

from openai import OpenAI


def _ask(base_url, model, messages, **kw):
    c = OpenAI(base_url=base_url, api_key="-", max_retries=0)
    return c.chat.completions.create(model=model, messages=messages, **kw)


def chat(row, base_url, model):
    """Two turns, echoing the reply back; the reward depends on what the model said."""
    messages = [{"role": "user", "content": row["q"]}]
    text = ""
    for _ in range(2):
        r = _ask(base_url, model, messages, temperature=0.3, max_tokens=7)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "go on"})
        text += r.choices[0].message.content or ""
    return {"reward": len(text) % 5 / 4, "chars": len(text)}


def one_turn(row, base_url, model):
    _ask(base_url, model, [{"role": "user", "content": "q"}])
    return 1.0


def by_case(row, base_url, model):
    """What ``row['case']`` names."""
    case = row["case"]
    if case == "good":
        return one_turn(row, base_url, model)
    if case == "raises":
        one_turn(row, base_url, model)
        raise ValueError("boom")
    if case == "returns_text":
        one_turn(row, base_url, model)
        return "1.0"
    if case == "never_calls":
        return 1.0
    if case == "hangs":
        time.sleep(30)
    if case == "spins":  # hangs holding a core
        while True:
            pass
    if case == "dies":
        one_turn(row, base_url, model)
        time.sleep(0.5)  # the others' requests are in flight when the process goes
        os._exit(7)
    if case == "exits":
        sys.exit(3)
    raise AssertionError(case)


async def async_chat(row, base_url, model):  # an async def harness: runs in the trainer
    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    r = await c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": row["q"]}], max_tokens=5
    )
    return float(len(r.choices[0].message.content or "") % 2)
