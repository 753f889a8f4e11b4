"""The package's import graph follows the layering of docs/architecture.md, stated as rules on
folders: no cycles (lazy imports inside functions included); ``algo`` imports torch only; the
foundation modules import nothing of ours; ``generation`` and ``model`` never reach into
``training`` (nor take the config); ``envs`` never imports ``generation``; ``rewards`` and
``tasks`` import no model or generation code (the reward-model loader ``rewards.models`` is the
one door to ``model``); only ``cli``, ``api`` and ``planning`` import the trainer; ``update``
sits below ``trainer`` and ``ppo``; the ``Experience`` record imports no other module of ours."""

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


def _package(mod: str) -> str:
    """peergrade.training.trainer -> training; peergrade.errors -> errors."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _deps_of(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    return {m: d for m, d in graph.items() if _package(m) == package}


#: what the sampler, the rewards and everything below them make: what a folder that sits
#: below the trainer may build on
_BELOW_TRAINING = {
    *("errors", "files", "seeds", "limits", "distributed"),
    *("algo", "model", "generation", "envs", "rewards", "tasks"),
}

#: the folders (and top-level modules) each folder may import, besides itself
ALLOWED = {
    "algo": set(),
    "errors": set(),
    "seeds": set(),
    "limits": set(),
    "files": {"errors"},
    "tasks": {"errors", "files", "seeds", "rewards"},
    "rewards": {"errors", "files", "seeds", "limits", "algo", "distributed", "model", "monitoring"},
    "envs": {"errors", "files", "seeds", "limits", "rewards", "tasks"},
    "model": {"errors", "files", "seeds", "algo", "distributed"},
    "generation": {"errors", "files", "seeds", "limits", "envs", "model", "rewards"},
    # the endpoint and the external agents' episodes: above the sampler it serves
    "serving": {"errors", "files", "seeds", "limits", "envs", "model", "rewards", "generation"},
    # the local Tinker server: a front door onto the sampler, the losses and the optimizer
    # builder (training.update, never the trainer: the test below says who may import it)
    "tinker_server": {
        *("errors", "files", "seeds", "limits"),
        *("algo", "model", "generation", "training"),
    },
    "distributed": {"errors", "algo", "model"},
    # the config tree names the sampler's settings record (generation.SamplerSettings) only
    "config": {"errors", "files", "generation"},
    "monitoring": {"errors", "files"},
    # pass@k and the sampling of answers: below training/ (the trainer's held-out machinery
    # is training.held_out, the command's is cli.evaluate)
    "evaluation": {*_BELOW_TRAINING},
    "training": {*_BELOW_TRAINING, "config", "evaluation", "monitoring", "serving"},
    "planning": {*_BELOW_TRAINING, "config", "evaluation", "monitoring", "training"},
    "api": {*_BELOW_TRAINING, "config", "evaluation", "monitoring", "training", "planning"},
}
#: cli may import every folder; ``python -m peergrade`` only the cli
ALLOWED["cli"] = set(ALLOWED) | {"serving", "tinker_server"}
ALLOWED["__main__"] = {"cli"}


def test_folders_import_only_the_layers_below_them():
    graph = import_graph()
    bad = []
    for package, allowed in ALLOWED.items():
        for mod, deps in _deps_of(graph, package).items():
            for dep in deps:
                if _package(dep) not in allowed | {package}:
                    bad.append(f"{mod} -> {dep}")
    assert bad == [], bad


def test_every_folder_and_top_level_module_has_a_rule():
    """The next folder (or module at the top of the package) gets a rule, so no back arrow
    can hide in a folder the test does not look at."""
    packages = {_package(m) for m in import_graph()} - {""}
    assert sorted(packages - set(ALLOWED)) == []


def test_the_folder_rules_can_fail():
    assert _package("peergrade.training.trainer") == "training"
    assert _package("peergrade.errors") == "errors"
    fake = {"peergrade.generation.kernel": {"peergrade.training.trainer"}}
    assert "training" not in ALLOWED["generation"]
    assert _deps_of(fake, "generation") == fake


def test_only_cli_api_and_planning_import_the_trainer():
    importers = {m for m, deps in import_graph().items() if "peergrade.training.trainer" in deps}
    assert {_package(m) for m in importers} <= {"cli", "api", "planning"}, importers
    assert "peergrade.api.trainer" in importers  # GRPOTrainer (api/trainer.py)
    assert "peergrade.cli.train" in importers


def test_the_update_sits_below_the_trainer_and_ppo():
    graph = import_graph()
    assert not graph["peergrade.training.update"] & {
        "peergrade.training.trainer",
        "peergrade.training.ppo",
    }
    assert "peergrade.training.trainer" not in graph["peergrade.training.ppo"]


def test_only_the_reward_model_loader_reaches_model_code_from_rewards():
    graph = import_graph()
    for mod, deps in graph.items():
        if _package(mod) in {"rewards", "tasks"} and mod != "peergrade.rewards.models":
            assert not {d for d in deps if _package(d) in {"model", "generation"}}, (mod, deps)


def test_lower_layers_take_plain_arguments_not_the_config():
    for mod, deps in import_graph().items():
        if _package(mod) in {"algo", "generation", "model", "envs", "rewards", "tasks"}:
            # the package or any of its modules (config.load, config.schema, ...)
            config = {d for d in deps if _package(d) == "config"}
            assert not config, (mod, config, "takes plain arguments, not the config")


def test_the_experience_record_stands_alone():
    """``Experience`` travels from generation to the update: it depends on neither end."""
    assert import_graph()["peergrade.training.experience"] == set()


def test_at_most_twelve_modules_sit_directly_in_the_package():
    flat = sorted(p.name for p in PKG.glob("*.py"))
    assert len(flat) <= 12, flat
