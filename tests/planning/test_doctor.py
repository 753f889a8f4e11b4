"""``peergrade doctor`` (issue 55): a template that ignores the tools is named with its fix, a
model that sees the tools but makes no calls needs a warm-up, a warmed-up model is ready, and
bad input is one ``error:`` line with exit status 2. The models are the bundled tiny ones (and
one warmed up here from tiny-calc in seconds)."""

from __future__ import annotations

import json

import pytest

from peergrade.cli import main
from peergrade.model.tiny import COMPACT_TOOL_CHAT_TEMPLATE, build_char_tokenizer
from peergrade.planning.doctor import (
    call_problem,
    diagnose,
    judge_answer,
    prompt_rows,
    template_checks,
    tool_specs,
)

TOOL_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a word.

    Args:
        text: the word
    """
    return text.upper()
'''

# The compact template of the tiny models with one short line naming each tool and its
# parameters (the full JSON schemas would not fit their 512-token context).
TOOLS_LINE = (
    "{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(',') }}) {% endfor %}\n"
    "{% endif %}"
)
NAMES_ONLY = (
    "{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
)

SCHEMAS = {
    "add": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor")
    (d / "mytools.py").write_text(TOOL_FILE)
    (d / "compact.jinja").write_text(TOOLS_LINE + COMPACT_TOOL_CHAT_TEMPLATE)
    return d


def doctor(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["doctor", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_template_that_ignores_tools_is_reported_with_the_fix(capsys):
    # tiny-calc's own template renders calls but never the tools' schemas
    rc, out, _ = doctor(
        capsys, "--model", "bundled:tiny-calc", "--tools", "peergrade.envs.calculator:calculate"
    )
    assert rc == 1
    tools_line = next(line for line in out.splitlines() if line.startswith("FAIL tools"))
    assert "ignores tools=" in tools_line and "--chat-template hermes" in tools_line
    assert "model.chat_template: hermes" in tools_line
    assert out.splitlines()[-1].startswith("verdict: needs a template:")
    assert "ok   model: bundled:tiny-calc loads" in out


def test_a_template_showing_names_only_is_named_and_one_showing_parameters_passes():
    fns_schema = [{"type": "function", "function": SCHEMAS["add"]}]
    names_only = build_char_tokenizer(chat_template=NAMES_ONLY + COMPACT_TOOL_CHAT_TEMPLATE)
    tools = template_checks(names_only, fns_schema, unrendered_tools=False)[1]
    assert not tools.ok and "does not show add.a, add.b" in tools.detail
    full = build_char_tokenizer(chat_template=TOOLS_LINE + COMPACT_TOOL_CHAT_TEMPLATE)
    assert all(c.ok for c in template_checks(full, fns_schema, unrendered_tools=False))
    # env.unrendered_tools: the model is said to know its tools; the check passes and says so
    plain = build_char_tokenizer(chat_template=COMPACT_TOOL_CHAT_TEMPLATE)
    told = template_checks(plain, fns_schema, unrendered_tools=True)[1]
    assert told.ok and "env.unrendered_tools" in told.detail
    assert not template_checks(plain, fns_schema, unrendered_tools=False)[1].ok


def test_schemas_too_long_for_the_context_are_a_template_failure(files):
    # hermes renders the full JSON schemas: more than tiny-calc's 512 positions
    found = diagnose(
        "bundled:tiny-calc", [f"{files}/mytools.py:add,shout"], chat_template="hermes", n=2
    )
    by = {c.name: c for c in found.checks}
    assert by["tools"].ok and not by["context"].ok and "512" in by["context"].detail
    assert found.verdict == "template" and found.exit_status == 1 and found.answers == []


def test_a_model_that_sees_the_tools_but_makes_no_calls_needs_a_warm_up(files, capsys):
    tools = f"{files}/mytools.py:add"
    rc, out, _ = doctor(
        capsys,
        "--model",
        "bundled",
        "--tools",
        tools,
        "--chat-template",
        files / "compact.jinja",
        "--n",
        6,
        "--max-new-tokens",
        48,
    )
    assert rc == 1, out
    lines = out.splitlines()
    assert any(line.startswith("ok   tools:") for line in lines)
    calls = next(line for line in lines if line.startswith("FAIL calls"))
    assert "0/6 greedy answers hold a call the hermes parser reads" in calls
    assert "no tool call" in calls
    verdict = lines[-1]
    assert verdict.startswith("verdict: needs a `peergrade sft --tools` warm-up")
    assert (
        f"peergrade sft --model bundled --chat-template {files}/compact.jinja --tools {tools}"
        in verdict
    )


def test_a_warmed_up_model_is_ready(files, tmp_path, capsys):
    from peergrade.training.sft import SFTSettings, run_sft

    tools = f"{files}/mytools.py:add"
    settings = SFTSettings(
        steps=60,
        batch_size=8,
        lr=3e-3,
        seed=0,
        threads=1,
        tools=(tools,),
        chat_template=str(files / "compact.jinja"),
    )
    warm = run_sft(
        out=str(tmp_path / "warm"),
        init=None,
        model="bundled:tiny-calc",
        settings=settings,
        log=lambda *a: None,
    )
    found = diagnose(str(warm), [tools], n=8, max_new_tokens=96)
    assert found.verdict == "ready" and found.exit_status == 0, found.lines()
    assert found.rates["valid"] >= 0.5 and found.rates["parsed"] >= found.rates["valid"]
    for a in found.answers:
        assert a.valid == (judge_answer(a.prompt, a.text, "hermes", SCHEMAS).valid)
    # the command, from a config file (model.path, env.tools), the template saved with the model
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {warm}\nenv:\n  tools: [{tools}]\n")
    rc, out, _ = doctor(capsys, "--config", cfg, "--n", 8, "--max-new-tokens", 96)
    assert rc == 0, out
    assert out.splitlines()[-1].startswith("verdict: ready: ")
    # the same model against a tool it was never warmed up on is not ready
    found = diagnose(str(warm), [f"{files}/mytools.py:shout"], n=4, max_new_tokens=96)
    assert found.verdict == "warm-up" and found.rates["valid"] == 0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tools", "{d}/missing.py:add"], "missing.py' does not exist"),
        (["--tools", "{d}/mytools.py:mul"], "has no attribute 'mul'"),
        (["--tools", "{d}/mytools.py:add", "--data", "{d}/none.jsonl"], "none.jsonl"),
        (["--tools", "{d}/mytools.py:add", "--chat-template", "nosuch"], "nosuch"),
        ([], "no tools"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(files, capsys, argv, says):
    rc, out, err = doctor(capsys, "--model", "bundled", *[a.format(d=files) for a in argv])
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_a_model_dir_that_is_no_model_and_a_missing_model_are_exit_2(tmp_path, files, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    rc, _, err = doctor(capsys, "--model", tmp_path, "--tools", f"{files}/mytools.py:add")
    assert rc == 2 and err.startswith("error: ") and str(tmp_path) in err
    rc, _, err = doctor(capsys, "--tools", f"{files}/mytools.py:add")
    assert rc == 2 and "--model" in err


def test_calls_are_judged_against_the_tools_schemas():
    def call(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args}}

    assert call_problem(call("add", a=1, b=2), SCHEMAS) is None
    assert "not one of the tools (add)" in call_problem(call("sub", a=1, b=2), SCHEMAS)
    assert "missing argument b" in call_problem(call("add", a=1), SCHEMAS)
    assert "takes no argument c" in call_problem(call("add", a=1, b=2, c=3), SCHEMAS)
    assert "a='1'" in call_problem(call("add", a="1", b=2), SCHEMAS)
    assert "a=True" in call_problem(call("add", a=True, b=2), SCHEMAS)  # a bool is no integer
    hermes = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert judge_answer("p", hermes, "hermes", SCHEMAS).valid
    broken = judge_answer("p", "<tool_call>{'name': add}</tool_call>", "hermes", SCHEMAS)
    assert not broken.parsed and "not valid JSON" in broken.problem
    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert judge_answer("p", llama, "llama3", SCHEMAS).valid
    assert not judge_answer("p", llama, "hermes", SCHEMAS).parsed  # not that format's call
    wrong = judge_answer("p", hermes.replace('"b": 2', '"c": 2'), "hermes", SCHEMAS)
    assert wrong.parsed and not wrong.valid


def test_prompts_come_from_the_data_file_or_the_warm_ups_writer(files, tmp_path):
    from peergrade.errors import InputError
    from peergrade.planning.doctor import load_tools

    fns = load_tools([f"{files}/mytools.py:add,shout"])
    assert [f.__name__ for f in fns] == ["add", "shout"]
    assert tool_specs(["m.py:a, b", "pkg.mod:c"]) == ["m.py:a", "m.py:b", "pkg.mod:c"]
    written = prompt_rows(fns, 6, seed=0)
    assert len(written) == 6
    assert all(
        r["prompt"].startswith(("Add two integers: a = ", "Upper-case a word: text = "))
        for r in written
    )
    assert written == prompt_rows(fns, 6, seed=0) != prompt_rows(fns, 6, seed=1)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"what is {i}+1?"}) for i in range(5)) + "\n")
    assert [r["prompt"] for r in prompt_rows(fns, 3, data=str(data))] == [
        "what is 0+1?",
        "what is 1+1?",
        "what is 2+1?",
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    with pytest.raises(InputError, match="row 2: expected an object with a 'prompt'"):
        prompt_rows(fns, 5, data=str(bad))
