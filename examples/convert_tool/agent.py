"""The new user's own agent (issue 55): the plain ``openai`` client, one ``convert`` tool and its
own reward. Nothing here imports peergrade.

peergrade trains it through ``--harness`` (docs/environments.md, 'Your tools on your model'):

    peergrade train --config examples/convert_tool/harness.yaml

calling ``agent(row, base_url, model)`` once per (prompt, sample) with a ``base_url`` private to
that episode (docs/harness.md). Pointed at any OpenAI-compatible server (``peergrade serve``,
vLLM), the same function runs as an ordinary agent.
"""

from __future__ import annotations

import json
import re

from convert_tool import convert  # the tool itself: the user's own function, called for real
from openai import DefaultHttpxClient, OpenAI

# The tool's schema as the agent offers it. It is the schema `peergrade sft --tools
# convert_tool.py:convert` renders in the warm-up (``transformers.utils.get_json_schema`` of
# ``convert``, "return" included), so the model is trained on the same system turn it sees here;
# tests/test_convert_tool_example.py checks that the two agree.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert a length from one unit to another.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "description": "the length to convert"},
                    "from_unit": {
                        "type": "string",
                        "description": "its unit: km, m, cm, mm, mi, ft or in",
                    },
                    "to_unit": {
                        "type": "string",
                        "description": "the unit wanted: km, m, cm, mm, mi, ft or in",
                    },
                },
                "required": ["value", "from_unit", "to_unit"],
            },
            "return": {"type": "string"},
        },
    }
]
MAX_TURNS = 3  # a call, its result, the answer; one more call allowed
# One HTTP connection pool for every episode (a new client per episode would build an SSL
# context each time).
HTTP = DefaultHttpxClient()


def run_tool(name: str, arguments: str) -> str:
    """A call's result, or the error the model reads instead (an unknown tool, bad JSON, a unit
    the tool does not know)."""
    try:
        if name != "convert":
            raise ValueError(f"unknown tool {name!r}")
        return convert(**json.loads(arguments))
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def states(text: str, answer: str) -> bool:
    """Whether ``text`` states the number ``answer`` (commas ignored)."""
    return answer in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))


def agent(row: dict, base_url: str, model: str) -> dict:
    """Answer ``row`` (its ``prompt`` messages and ``answer``) with the ``convert`` tool; reward 1
    when the final answer states the converted value."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    messages = list(row["prompt"])
    calls, answer = 0, ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=96
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            calls += 1
            result = run_tool(call.function.name, call.function.arguments)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.function.name,
                    "content": result,
                }
            )
    return {"reward": float(states(answer, str(row["answer"]))), "tool_calls": calls}


if __name__ == "__main__":  # one episode against a running server: peergrade serve --port 8000
    import sys

    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    row = {"prompt": [{"role": "user", "content": "How many cm is 2.5 m?"}], "answer": "250"}
    model = OpenAI(base_url=url, api_key="-").models.list().data[0].id
    print(agent(row, url, model))
