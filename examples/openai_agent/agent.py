"""A calculator agent written only against the official ``openai`` client: its own tool loop,
its own ``calculate`` tool and its own reward. Nothing here imports peergrade.

peergrade trains it with

    peergrade train --config examples/openai_agent/config.yaml

calling ``agent(row, base_url, model)`` once per (prompt, sample) with a ``base_url`` private to
that episode; whatever this function sends there is recorded in tokens and trained on. Point
``base_url`` at any OpenAI-compatible server (``peergrade serve``, vLLM, OpenAI) and the same
function runs as an ordinary agent.
"""

from __future__ import annotations

import ast
import json

from openai import DefaultHttpxClient, OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an integer arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'integers, the operands a and b, +, - and *, e.g. "a*b"',
                    }
                },
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 3
# One HTTP connection pool for every episode: building an OpenAI client without one creates an
# SSL context each time (about 60 ms of CPU), which dominates when hundreds of episodes run.
HTTP = DefaultHttpxClient()


def calculate(expression: str, names: dict[str, int]) -> str:
    """The tool: +, -, * over integers and the problem's operands ``a`` and ``b`` (no eval)."""
    ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported expression")

    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("expression must be a short string")
    return str(value(ast.parse(expression.strip(), mode="eval").body))


def run_tool(arguments: str, names: dict[str, int]) -> str:
    """A call's result, or the error the model reads instead."""
    try:
        return calculate(json.loads(arguments)["expression"], names)
    except Exception as e:
        return f"error: {e}"


def agent(row: dict, base_url: str, model: str) -> dict:
    """Solve ``row`` (its ``prompt`` messages; ``a``, ``b`` and ``answer``) with tool calls;
    reward 1 for the exact answer."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    messages = list(row["prompt"])
    names = {"a": int(row["a"]), "b": int(row["b"])}
    calls = 0
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=128
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = (message.content or "").strip()
            break
        for call in message.tool_calls:
            calls += 1
            result = run_tool(call.function.arguments, names)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": "calculate", "content": result}
            )
    return {"reward": float(answer == str(row["answer"])), "tool_calls": calls}


def responses_agent(row: dict, base_url: str, model: str) -> dict:
    """``agent`` written against the Responses API (``client.responses.create``): each next
    request sends only the tool results and continues the last reply by
    ``previous_response_id``."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses form
    names = {"a": int(row["a"]), "b": int(row["b"])}
    new, previous, calls, answer = list(row["prompt"]), None, 0, ""
    for _ in range(MAX_TURNS):
        reply = client.responses.create(
            model=model,
            input=new,
            previous_response_id=previous,
            tools=tools,
            max_output_tokens=128,
        )
        previous = reply.id
        called = [item for item in reply.output if item.type == "function_call"]
        if not called:
            answer = reply.output_text.strip()
            break
        calls += len(called)
        new = [
            {
                "type": "function_call_output",
                "call_id": c.call_id,
                "output": run_tool(c.arguments, names),
            }
            for c in called
        ]
    return {"reward": float(answer == str(row["answer"])), "tool_calls": calls}


if __name__ == "__main__":  # one episode against a running server: peergrade serve --port 8000
    import sys

    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    row = {
        "prompt": [{"role": "user", "content": "270*324="}],
        "a": 270,
        "b": 324,
        "answer": "87480",
    }
    model = OpenAI(base_url=url, api_key="-").models.list().data[0].id
    print(agent(row, url, model), responses_agent(row, url, model))
