"""The package's import graph follows the layering of docs/architecture.md: no cycles (lazy
imports inside functions included), only ``cli``, ``memory`` and ``api`` import the trainer,
``update`` sits below both ``trainer`` and ``ppo``, rewards/tasks/rollout/models never reach up
into the step, and the ``Experience`` record imports no other peergrade module."""

from __future__ import annotations

import ast
from pathlib import Path

import peergrade

PKG = Path(peergrade.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(mod: str, names: list[str], modules: set[str]) -> set[str]:
    """``from mod import a, b`` -> the package modules it loads (mod, or mod.a when a module)."""
    out = set()
    for n in names:
        if f"{mod}.{n}" in modules:
            out.add(f"{mod}.{n}")
        elif mod in modules:
            out.add(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != "peergrade":
                    continue
                deps |= _resolve(mod, [a.name for a in node.names], modules)
        # a package's submodules import its __init__ on the way; that is no layering edge
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycles_in_the_package():
    cycles = _cycles(import_graph())
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_only_cli_memory_and_api_import_the_trainer():
    importers = {m for m, deps in import_graph().items() if "peergrade.trainer" in deps}
    assert importers <= {"peergrade.cli", "peergrade.memory", "peergrade.api"}, importers
    assert "peergrade.api" in importers
    assert "peergrade.cli" in importers


def test_lower_layers_do_not_reach_up():
    graph = import_graph()
    step_modules = {"peergrade.trainer", "peergrade.ppo", "peergrade.update", "peergrade.memory"}
    for mod, deps in graph.items():
        if mod == "peergrade.update":
            assert not deps & {"peergrade.trainer", "peergrade.ppo"}, (mod, deps)
        if mod == "peergrade.ppo":
            assert "peergrade.trainer" not in deps, (mod, deps)
        lower = mod.startswith(("peergrade.rewards", "peergrade.tasks", "peergrade.algo"))
        lower |= mod in {
            "peergrade.rollout",
            "peergrade.models",
            "peergrade.logprobs",
            "peergrade.experience",
        }
        if lower:
            assert not deps & step_modules, (mod, deps & step_modules)
            assert "peergrade.config" not in deps, (mod, "takes plain arguments, not the config")
        if mod.startswith(("peergrade.rewards", "peergrade.tasks")):
            model_code = {"peergrade.models", "peergrade.logprobs", "peergrade.rollout"}
            assert not deps & model_code, (mod, deps & model_code)


def test_the_experience_record_stands_alone():
    """``Experience`` travels from generation to the update: it depends on neither end."""
    assert import_graph()["peergrade.experience"] == set()
