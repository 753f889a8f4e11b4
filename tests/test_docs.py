"""The documentation stays true to the code: the generated references match what the code
renders now, the module map lists every module, and every `peergrade` command shown in a shell
block of README.md or docs/ parses against the real argparse parser and config keys (the cheap
ones, `--help` and `peergrade config`, are run). The site itself is built by `mkdocs build
--strict` in .ci/run, which checks links and pages."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from peergrade import cli
from peergrade.cli import docgen
from peergrade.config import ConfigError, all_keys, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_generated_pages_match_the_code():
    stale = docgen.stale_pages(DOCS)
    assert stale == [], (
        f"stale generated pages {stale}: regenerate with `python -m peergrade.cli.docgen`"
    )


def test_a_stale_page_is_caught(tmp_path):
    assert sorted(docgen.stale_pages(tmp_path)) == sorted(docgen.PAGES)  # missing
    assert docgen.main(["--docs", str(tmp_path)]) == 0
    assert docgen.main(["--docs", str(tmp_path), "--check"]) == 0
    page = tmp_path / "reference" / "configuration.md"
    page.write_text(page.read_text().replace("`algo.beta` | `0.0`", "`algo.beta` | `0.1`"))
    assert docgen.stale_pages(tmp_path) == ["reference/configuration.md"]
    assert docgen.main(["--docs", str(tmp_path), "--check"]) == 1


def test_references_cover_every_key_and_subcommand():
    config_page = docgen.render_config()
    rows = re.findall(r"^\| `([\w.]+)` \|", config_page, re.M)
    assert sorted(rows) == sorted(set(rows)), "a key is listed twice"
    missing = [k for k in all_keys() if k not in rows and not k.startswith("rewards")]
    assert missing == [] and "rewards" in rows
    cli_page = docgen.render_cli()
    for name in docgen._subcommands(cli.build_parser()):
        assert f"## `peergrade {name}`" in cli_page


def test_architecture_map_has_a_row_per_folder():
    """docs/architecture.md's "Where things live" table (CONTRIBUTING.md sends contributors
    there) has one row per package folder of src/peergrade."""
    import peergrade

    pkg = Path(peergrade.__file__).parent
    folders = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("## Where things live") : text.index("## Layering")]
    rows = {
        line.split("|")[1].strip().strip("`/")
        for line in table.splitlines()
        if line.startswith("| `")
    }
    assert sorted(folders - rows) == [], "docs/architecture.md 'Where things live' lacks them"
    assert (ROOT / "CONTRIBUTING.md").read_text().count("docs/architecture.md") >= 1


def test_module_map_lists_every_folder_module_and_command():
    """One row per folder of src/peergrade (``algo/``, ...); the top-level modules named in
    the top-level row; every command in the cli row."""
    import peergrade

    pkg = Path(peergrade.__file__).parent
    modules = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    folders = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    folders.add("assets")
    text = (DOCS / "index.md").read_text()
    table = text[text.index("## What is in the box") :]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    missing = sorted(f for f in folders if not any(r.startswith(f"| `{f}/`") for r in rows))
    top = next(r for r in rows if r.startswith("| `peergrade` (top level)"))
    missing += sorted(m for m in modules if f"`{m}`" not in top)
    assert missing == [], f"docs/index.md 'What is in the box' does not list: {missing}"
    cli_row = next(r for r in rows if r.startswith("| `cli/`"))
    for name in docgen._subcommands(cli.build_parser()):
        assert name in cli_row, f"the module map's cli row lacks {name}"


# ----------------------------------------------------------------------------- commands


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv after `peergrade`) of every peergrade command in the text's shell blocks.

    Lines are joined at a trailing backslash, comments dropped, `&&`/`;`/`|` split, redirections
    and leading VAR=value assignments dropped; `peergrade ...`, `python -m peergrade ...` and
    `torchrun ... -m peergrade ...` count. Synopsis notation is read loosely: `...` is dropped
    and `[--flag value]` unwrapped."""
    found = []
    for block in re.finditer(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, re.S | re.M):
        first = text[: block.start()].count("\n") + 2
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            line = re.sub(r"^\$\s+", "", line.strip())
            for part in re.split(r"&&|;|\|(?!\|)", line):
                argv = _peergrade_argv(shlex.split(part, comments=True))
                if argv is not None:
                    found.append((first + start, argv))
    return found


def inline_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, argv) of the `peergrade ...` commands in inline code outside shell blocks, e.g. the
    command a measured figure names. Synopses (`[--lora]`, `...`, `RUN_DIR`) and mentions of a
    command or of one flag (`peergrade memory --budget`) are left out."""
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    found = []
    for m in re.finditer(r"`((?:peergrade|torchrun|python -m peergrade) [^`]+)`", prose):
        tokens = shlex.split(" ".join(m.group(1).split()))
        argv = _peergrade_argv(tokens)
        synopsis = any(
            t in ("/", "...") or t.startswith("[") or re.fullmatch(r"[A-Z][A-Z_]*", t)
            for t in tokens
        )
        if (
            argv is None
            or synopsis
            or len(argv) < 2
            or (len(argv) == 2 and argv[1].startswith("-"))
        ):
            continue
        found.append((prose[: m.start()].count("\n") + 1, argv))
    return found


def _peergrade_argv(tokens: list[str]) -> list[str] | None:
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "peergrade":
        rest = tokens[1:]
    elif tokens[0] in ("torchrun", "python", "python3") and "-m" in tokens:
        at = tokens.index("-m")
        if at + 1 >= len(tokens) or tokens[at + 1] != "peergrade":
            return None
        rest = tokens[at + 2 :]
    else:
        return None
    out = []
    for tok in rest:
        if tok in (">", ">>", "2>", "<"):
            break
        if not (tok.startswith("[") and tok.endswith("]")) or tok.startswith("[-"):
            tok = tok.removeprefix("[").removesuffix("]")  # else a YAML list: '[tensorboard]'
        if tok != "...":
            out.append(tok)
    return out


def check_command(argv: list[str]) -> str | None:
    """None when ``peergrade *argv`` would be accepted by the parser and the config; else why."""
    if argv[:1] == ["launch"]:  # torchrun's options, then the command each rank runs
        from peergrade.cli.launch import split

        try:
            return check_command(split(argv[1:])[1])
        except cli.UserError as e:
            return str(e)
    parser = cli.build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        return "argparse refused it"
    if args.command is None:
        return None if not extra else f"unknown arguments {extra}"
    sub = docgen._subcommands(parser)[args.command]
    takes_config = any("--config" in a.option_strings for a in sub._actions)
    if not takes_config:
        return None if not extra else f"`peergrade {args.command}` takes no {extra}"
    try:
        overrides = cli.split_overrides(extra)
    except cli.UserError as e:
        return str(e)
    keys = all_keys()
    for key, _ in overrides:
        if key not in keys and not any(key.startswith(k + ".") for k in keys):
            return f"unknown config key --{key}"
    if getattr(args, "config", None) is None:
        try:
            load_config(None, overrides)
        except ConfigError as e:
            return str(e)
    return None


def _all_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for line, argv in shell_commands(text) + inline_commands(text):
            out.append((f"{page.relative_to(ROOT)}:{line}", argv))
    return out


def test_every_documented_command_parses():
    commands = _all_commands()
    assert len(commands) > 40, "the command extractor found too few commands"
    bad = [
        f"{where}: peergrade {' '.join(argv)}: {why}"
        for where, argv in commands
        if (why := check_command(argv))
    ]
    assert bad == [], "\n".join(bad)


def test_the_command_checker_can_fail():
    text = "```bash\npeergrade train --algo.bta 0.04   # typo\nOMP_NUM_THREADS=1 peergrade eval --nope 3 \\\n  --k 8\n```\n"
    (l1, a1), (l2, a2) = shell_commands(text)
    assert (l1, a1) == (2, ["train", "--algo.bta", "0.04"])
    assert (l2, a2) == (3, ["eval", "--nope", "3", "--k", "8"])
    assert "unknown config key --algo.bta" in check_command(a1)
    assert check_command(a2) is not None
    assert check_command(["train", "--rollout.group_size", "1"]) is not None  # a bad value
    assert check_command(["memory", "--budget", "24GiB", "--algos"]) is not None
    assert check_command(["train", "--algo.beta", "0.04"]) is None
    synopsis = (
        "```bash\ntorchrun -m peergrade report A [B ...] [-o x.html] [--json] --k '[1]'\n```\n"
    )
    assert shell_commands(synopsis) == [
        (2, ["report", "A", "B", "-o", "x.html", "--json", "--k", "[1]"])
    ]


def test_inline_commands_skip_synopses_and_mentions():
    text = (
        "Run `peergrade sweep --set KEY=V1,V2,... [--steps N]` or `peergrade memory -o`;\n"
        "measured with `peergrade train --algo.name ppo\n--steps 60` (`peergrade eval`).\n"
        "```bash\npeergrade train --not-inline 1\n```\n"
    )
    assert inline_commands(text) == [(2, ["train", "--algo.name", "ppo", "--steps", "60"])]


def _cheap(argv: list[str]) -> bool:
    """--help anywhere, `peergrade config`, and `peergrade memory` estimates (--budget, --world:
    no model weights, no step), unless they read a file that exists only in the example."""
    if "--help" in argv or "-h" in argv:
        return True
    estimate = argv[:1] == ["memory"] and {"--budget", "--world"} & set(argv) and "-o" not in argv
    if argv[:1] != ["config"] and not estimate:
        return False
    args, _ = cli.build_parser().parse_known_args(argv)
    return args.config is None or (ROOT / args.config).is_file()


def test_cheap_documented_commands_run(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cheap = [(w, a) for w, a in _all_commands() if _cheap(a)]
    cheap += [("--help", ["--help"])] + [
        ("--help", [name, "--help"]) for name in docgen._subcommands(cli.build_parser())
    ]
    for command in ("config", "memory"):
        assert any(a[:1] == [command] for _, a in cheap), f"no `peergrade {command}` was run"
    for where, argv in cheap:
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:  # --help exits 0 through argparse
            rc = e.code
        out = capsys.readouterr()
        assert rc in (0, None), f"{where}: peergrade {' '.join(argv)} -> {rc}\n{out.err}"


# ----------------------------------------------------------------------------- README


README = ROOT / "README.md"


def test_readme_is_a_landing_page():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """mkdocs checks links between pages; this also covers README.md, which is not a page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_compile_and_import_what_exists(page):
    for code in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
        compile(code, str(page), "exec")
        for module, names in re.findall(r"^from (peergrade[\w.]*) import (.+)$", code, re.M):
            mod = __import__(module, fromlist=["_"])
            for name in names.split(","):
                assert hasattr(mod, name.strip()), f"{page.name} imports {name} from {module}"


def test_readme_config_example_is_real(tmp_path):
    text = README.read_text()
    (yaml_block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(yaml_block.strip().splitlines()) <= 5
    (tmp_path / "my.yaml").write_text(yaml_block)
    cfg = load_config(tmp_path / "my.yaml")
    assert cfg.algo.loss_type == "dapo" and [r.name for r in cfg.rewards][1] == "format"


def test_argparse_namespace_is_what_the_checker_reads():
    """check_command reads argparse's private actions; fail loudly if that ever changes."""
    parser = cli.build_parser()
    assert any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
