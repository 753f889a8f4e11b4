"""The calculator demo's tool: integer arithmetic evaluated safely.

- ``calculate(expression)``: a TRL-style tool (type hints, Google-style docstring), usable as
  ``--tools peergrade.envs.calculator:calculate``.
- ``Calculator``: the same tool as TRL's ``environment_factory`` (``configs/calculator.yaml``:
  ``env.factory: peergrade.envs.calculator:Calculator``). ``reset(**row)`` binds the problem's
  operands to the names ``a`` and ``b``, so the call ``calculate("a*b")`` computes the row's
  product. This is what lets the bundled 0.75M-parameter character-level model learn the demo in
  minutes: copying eight digits into the call at a distance of some sixty characters is a skill
  it does not pick up in a short warm-up (measured: no exact copy after 600 steps), while
  choosing the operator is.

The expression is parsed with ``ast`` and only integer literals, the bound names, ``+``, ``-``,
``*``, unary minus and parentheses are evaluated; anything else (other names, calls, attributes,
``**``, division, floats) raises ``ValueError``, which the episode runner hands back to the
model as a failed call. Nothing is ever passed to ``eval``. A sampled expression cannot make the
tool slow: no power operator, at most ``MAX_EXPRESSION_CHARS`` characters.

``tool_call_text`` and ``calculator_turns`` write the transcripts the bundled ``tiny-calc`` model
is warmed up on (``peergrade sft --tool-fraction``, see docs/environments.md): the model's call
exactly as the Hermes / Qwen2 parser (``envs.tools.parse_tool_calls``) reads it, the tool's
result, the final answer.

This module does not run episodes or train.
"""

from __future__ import annotations

import ast
import json

MAX_EXPRESSION_CHARS = 64
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _value(node: ast.AST, names: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand, names)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, names), _value(node.right, names))
    raise ValueError(f"unsupported in a calculator expression: {ast.dump(node)[:80]}")


def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression exactly.

    Args:
        expression: integers with +, - and * and parentheses, e.g. "1234*567"
    """
    return evaluate(expression)


class Calculator:
    """TRL's ``environment_factory`` for the calculator demo: the tool ``calculate``, with the
    problem's operands bound to ``a`` and ``b``."""

    def reset(self, **row) -> None:
        self.names = {k: int(row[k]) for k in ("a", "b") if k in row}

    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression exactly.

        Args:
            expression: integers, the problem's operands a and b, +, - and *, e.g. "a*b"
        """
        return evaluate(expression, self.names)


def evaluate(expression: str, names: dict[str, int] | None = None) -> str:
    """The value of ``expression`` as text; ``names`` are the variables it may use."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return str(_value(tree.body, names or {}))


def tool_call_text(expression: str) -> str:
    """The model's call of ``calculate`` in the Hermes / Qwen2 format."""
    call = {"name": "calculate", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def calculator_turns(expression: str, names: dict[str, int] | None = None) -> list[dict]:
    """The messages of a solved calculator episode after the prompt: the call (its raw text as
    the assistant's content, as the model samples it), the tool's result, the answer."""
    result = evaluate(expression, names)
    return [
        {"role": "assistant", "content": tool_call_text(expression)},
        {"role": "tool", "name": "calculate", "content": result},
        {"role": "assistant", "content": result},
    ]
