"""Rendering: the resolved config as commented YAML (``to_yaml``, what ``peergrade config``
prints and every run directory holds), the configuration reference's Markdown table
(``to_markdown``) and every dotted key (``all_keys``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from peergrade.config.load import _hints
from peergrade.config.schema import Config
from peergrade.config.sections import RewardItem


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text.removesuffix("...").strip()


def to_yaml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as YAML; with ``comments`` each field's help is written above it,
    and a path given relative (``Config.given_paths``) says how it was typed."""
    lines: list[str] = []

    def typed(key: str) -> str:
        """How a path was typed, as a comment (or nothing)."""
        given = cfg.given_paths.get(key)
        return f"# given as {given}" if comments and given is not None else ""

    def emit(obj: Any, indent: int, prefix: str = "") -> None:
        pad = "  " * indent
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if comments and f.metadata.get("help"):
                lines.append(f"{pad}# {f.metadata['help']}")
            if dataclasses.is_dataclass(value):
                lines.append(f"{pad}{f.name}:")
                emit(value, indent + 1, f"{prefix}{f.name}.")
            elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                lines.append(f"{pad}{f.name}:")
                for i, item in enumerate(value):
                    if note := typed(f"{f.name}[{i}].name"):
                        lines.append(f"{pad}  {note}")
                    sub = (
                        yaml.safe_dump(dataclasses.asdict(item), sort_keys=False)
                        .rstrip()
                        .splitlines()
                    )
                    lines.append(f"{pad}  - {sub[0]}")
                    lines.extend(f"{pad}    {s}" for s in sub[1:])
            else:
                note = typed(prefix + f.name)
                lines.append(
                    f"{pad}{f.name}: {_yaml_scalar(value)}" + (f"  {note}" if note else "")
                )
            if indent == 0:
                lines.append("")

    emit(cfg, 0)
    if cfg.given_paths:  # read back by load_config, so a resumed run keeps them
        if comments:
            lines.append("# Not a config key: the paths above as they were typed, relative to the")
            lines.append("# config file that held them or to the working directory.")
        lines.append("given_paths:")
        lines.extend(f"  {_yaml_scalar(k)}: {_yaml_scalar(v)}" for k, v in cfg.given_paths.items())
    return "\n".join(lines).rstrip() + "\n"


def to_markdown(cfg: Config | None = None, section: str | None = None) -> str:
    """A Markdown table of every key, its default and its documentation (the configuration
    reference); ``section`` (a top-level key such as ``"algo"``) keeps only that part."""
    cfg = cfg or Config()
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def emit(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            if section is not None and not prefix and f.name != section:
                continue
            value = getattr(obj, f.name)
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                emit(value, key + ".")
                continue
            if f.name == "rewards":
                default = "`[]`"
                help_ = (
                    f.metadata.get("help", "")
                    + " Each item: "
                    + "; ".join(
                        f"`{g.name}`: {g.metadata['help']}" for g in dataclasses.fields(RewardItem)
                    )
                )
            else:
                default = f"`{_yaml_scalar(value)}`"
                help_ = f.metadata.get("help", "")
            rows.append(f"| `{key}` | {default} | {help_.replace('|', '/')} |")

    emit(cfg, "")
    return "\n".join(rows) + "\n"


def all_keys() -> list[str]:
    """Every dotted leaf key of the config tree (used for CLI help and suggestions)."""
    keys: list[str] = []

    def walk(cls, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
            else:
                keys.append(f"{prefix}{name}")

    walk(Config, "")
    return keys
