"""A verifiers 0.4 taskset for the calculator problems: ``ArithTask`` (a problem's operands
``a`` and ``b`` and its ``answer``; reward 1 for the exact final reply) and its ``calculate``
tool, served by verifiers as an MCP tool server.

Nothing here imports peergrade. verifiers runs the tool server as a separate program,
``python -m vf_arith`` (hence the ``__main__`` entry at the end), so this module must be
importable by that name in the tool server's process (``agent.py`` puts this folder on
``PYTHONPATH``).
"""

from __future__ import annotations

import ast

import verifiers.v1 as vf


def evaluate(expression: str, names: dict[str, int]) -> str:
    """+, -, * over integers and the names ``a`` and ``b`` (parsed with ``ast``, no eval)."""
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


class ArithData(vf.TaskData):
    a: int = 0
    b: int = 0
    answer: str = ""


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called "calculate", as the bundled tiny-calc model calls it

    async def setup_task(self, task: ArithData) -> None:  # the rollout's task data
        self.names = {"a": task.a, "b": task.b}

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression exactly (+, -, * and the operands a, b)."""
        return evaluate(expression, self.names)


class ArithTask(vf.Task[ArithData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class ArithTaskset(vf.Taskset[ArithTask]):
    def load(self):  # the tasks come from peergrade's rows (agent.py builds each one)
        yield ArithTask(ArithData(prompt="What is 2 * 3?", a=2, b=3, answer="6"))


__all__ = ["ArithTaskset"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m vf_arith`
    Calculator.run()
