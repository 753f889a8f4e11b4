"""model.chat_template and the bundled tool-call templates (issue 55): each bundled format
renders a call that its parser reads back exactly, the template is set on the tokenizer where
it is prepared and saved with it, and the environments parse calls in the template's format."""

from __future__ import annotations

import asyncio
import json

import pytest

from peergrade.envs.template import check_template, check_tools_rendered
from peergrade.envs.tools import ToolEnvironment, parse_tool_calls, tool_environment_factory
from peergrade.errors import InputError
from peergrade.model.chat_templates import (
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    NAMED,
    format_tool_call,
    resolve_chat_template,
    tool_format,
)
from peergrade.model.tiny import (
    CHARS,
    COMPACT_TOOL_CHAT_TEMPLATE,
    TOOL_CHAT_TEMPLATE,
    _char_tokenizer_from_vocab,
    build_char_tokenizer,
)

LLAMA3_SPECIALS = [
    "<|finetune_right_pad_id|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def convert(value: float, unit: str) -> str:
    """Convert a length to metres.

    Args:
        value: the number to convert
        unit: its unit, e.g. "ft"
    """
    return str(round(value * {"ft": 0.3048, "in": 0.0254}.get(unit, 1.0), 4))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert a length to metres.",
            "parameters": {
                "type": "object",
                "properties": {"value": {"type": "number"}, "unit": {"type": "string"}},
                "required": ["value", "unit"],
            },
        },
    }
]


def tokenizer_for(fmt: str):
    if fmt == "hermes":
        return build_char_tokenizer(chat_template=HERMES_TEMPLATE)
    vocab = {t: i for i, t in enumerate(LLAMA3_SPECIALS + CHARS)}
    tok = _char_tokenizer_from_vocab(
        vocab,
        LLAMA3_SPECIALS,
        pad="<|finetune_right_pad_id|>",
        eos="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
    )
    tok.bos_token = "<|begin_of_text|>"
    return tok


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALLS = {
    "one": [call("convert", value=3.5, unit="ft")],
    "two": [call("convert", value=1, unit="in"), call("convert", value=2, unit="ft")],
    "unicode": [call("convert", value=-0.25, unit='in "quoted"')],
}


def model_turn(tok, messages, turn) -> str:
    """What the model writes for ``turn``: the rendering after the generation prompt, up to
    the end-of-turn token (as the episode runner samples it)."""
    prompt = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    full = tok.apply_chat_template(messages + [turn], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt) :].split(tok.eos_token)[0]


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
@pytest.mark.parametrize("which", sorted(CALLS))
def test_a_rendered_call_parses_back_to_the_same_call(fmt, which):
    tok = tokenizer_for(fmt)
    user = [{"role": "user", "content": "How many metres is 3.5 ft?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": CALLS[which]}
    text = model_turn(tok, user, turn)
    content, calls, errors = parse_tool_calls(text, fmt)
    assert (content, calls, errors) == ("", CALLS[which], [])
    assert tool_format(tok.chat_template) == fmt
    if which == "one":  # the text a warm-up teaches is the text the template renders
        f = CALLS[which][0]["function"]
        assert format_tool_call(f["name"], f["arguments"], fmt) == text


def test_hermes_keeps_the_text_beside_its_calls():
    tok = tokenizer_for("hermes")
    user = [{"role": "user", "content": "q"}]
    turn = {"role": "assistant", "content": "Let me convert.", "tool_calls": CALLS["two"]}
    assert parse_tool_calls(model_turn(tok, user, turn), "hermes") == (
        "Let me convert.",
        CALLS["two"],
        [],
    )


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_bundled_templates_render_episodes_token_exactly_and_show_the_tools(fmt):
    tok = tokenizer_for(fmt)
    check_template(tok, eos_ids=[tok.eos_token_id], tools=TOOLS)  # raises if not
    check_tools_rendered(tok, TOOLS)
    shown = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert json.dumps(TOOLS[0]) in shown


def test_llama3_parser_tells_answers_from_calls_and_reports_broken_ones():
    assert parse_tool_calls("It is 1.0668 metres.", "llama3") == ("It is 1.0668 metres.", [], [])
    tagged = '<|python_tag|>{"name": "convert", "parameters": {"value": 1, "unit": "ft"}}'
    assert parse_tool_calls(tagged, "llama3") == ("", [call("convert", value=1, unit="ft")], [])
    args_key = '{"name": "convert", "arguments": "{\\"value\\": 2, \\"unit\\": \\"in\\"}"}'
    assert parse_tool_calls(args_key, "llama3")[1] == [call("convert", value=2, unit="in")]
    broken = '{"name": "convert", "parameters": {"value": 1'
    content, calls, errors = parse_tool_calls(broken, "llama3")
    assert (content, calls) == (broken, []) and len(errors) == 1 and "JSON" in errors[0]
    content, calls, errors = parse_tool_calls('{"name": "convert", "parameters": 3}', "llama3")
    assert calls == [] and "must be a JSON object" in errors[0]
    # a Hermes block is text to the Llama 3 parser, and the other way round
    hermes = format_tool_call("convert", {"value": 1, "unit": "ft"}, "hermes")
    assert parse_tool_calls(hermes, "llama3")[1] == []
    assert parse_tool_calls(format_tool_call("convert", {}, "llama3"), "hermes")[1] == []
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "mistral")


def test_tool_format_of_known_templates():
    for name, (template, fmt) in NAMED.items():
        assert tool_format(template) == fmt, name
    assert tool_format(TOOL_CHAT_TEMPLATE) == "hermes"
    assert tool_format(COMPACT_TOOL_CHAT_TEMPLATE) == "hermes"
    assert tool_format(None) == "hermes"


def test_resolve_chat_template_names_files_directories_and_errors(tmp_path):
    assert resolve_chat_template(None) is None
    assert resolve_chat_template("hermes") == HERMES_TEMPLATE
    assert resolve_chat_template("qwen2.5") == HERMES_TEMPLATE
    assert resolve_chat_template("llama3") == LLAMA3_TEMPLATE
    f = tmp_path / "mine.jinja"
    f.write_text("{{ messages }}")
    assert resolve_chat_template(str(f)) == "{{ messages }}"
    d = tmp_path / "tokdir"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    assert resolve_chat_template(str(d)) == "T"
    with pytest.raises(InputError, match="hermes.*llama3|llama3.*hermes"):
        resolve_chat_template("no-such-template")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(InputError, match="no template"):
        resolve_chat_template(str(tmp_path / "empty.jinja"))


def test_the_template_is_set_where_the_tokenizer_is_prepared_and_saved_with_it(tmp_path):
    from transformers import AutoTokenizer

    from peergrade.model.load import load_tokenizer, resolve_model_path, save_tokenizer

    path = resolve_model_path("bundled:tiny-calc")
    own = load_tokenizer(path).chat_template
    tok = load_tokenizer(path, "hermes")
    assert own != HERMES_TEMPLATE and tok.chat_template == HERMES_TEMPLATE
    save_tokenizer(tok, tmp_path)  # what every checkpoint, sft output and export does
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert auto.chat_template == HERMES_TEMPLATE
    msgs = [{"role": "user", "content": "q"}]
    assert auto.apply_chat_template(msgs, tools=TOOLS, tokenize=False) == tok.apply_chat_template(
        msgs, tools=TOOLS, tokenize=False
    )


def test_config_key_and_trls_chat_template_path(tmp_path):
    from peergrade.api import GRPOConfig
    from peergrade.config import load_config

    cfg = load_config(None, [("model.chat_template", "llama3")])
    assert cfg.model.chat_template == "llama3"
    assert load_config(None, []).model.chat_template is None
    out = str(tmp_path / "o")
    assert (
        GRPOConfig(out, max_steps=2, chat_template_path="hermes").to_config().model.chat_template
        == "hermes"
    )
    assert GRPOConfig(out, max_steps=2).to_config().model.chat_template is None


def test_setup_models_applies_model_chat_template():
    from peergrade.config import load_config
    from peergrade.training.components import setup_models

    cfg = load_config(
        None,
        [
            ("model.path", "bundled:tiny-calc"),
            ("model.device", "cpu"),
            ("model.chat_template", "hermes"),
        ],
    )
    assert setup_models(cfg).tokenizer.chat_template == HERMES_TEMPLATE


def test_environments_parse_calls_in_the_templates_format():
    """A llama3 template's turn runs the tool; with the factory left at hermes it is an answer."""
    make = tool_environment_factory([convert])
    text = format_tool_call("convert", {"value": 2, "unit": "ft"}, "llama3")
    env = make({"prompt": "q"})
    assert asyncio.run(env.step({"role": "assistant", "content": text})).done  # hermes: answer
    make.tool_format = "llama3"  # what training.components.set_tool_format does
    env = make({"prompt": "q"})
    assert isinstance(env, ToolEnvironment) and env.tool_format == "llama3"
    message = {"role": "assistant", "content": text}
    step = asyncio.run(env.step(message))
    assert not step.done and step.tool_calls == 1 and step.tool_failures == 0
    assert step.messages == [{"role": "tool", "name": "convert", "content": "0.6096"}]
    assert message["tool_calls"] == [call("convert", value=2, unit="ft")]


def test_set_tool_format_reads_the_tokenizers_template():
    from peergrade.training.components import set_tool_format

    make = tool_environment_factory([convert])
    set_tool_format(make, tokenizer_for("llama3"))
    assert make.tool_format == "llama3"
    set_tool_format(make, tokenizer_for("hermes"))
    assert make.tool_format == "hermes"
    set_tool_format(None, tokenizer_for("hermes"))  # single-turn runs: nothing to set


# ----------------------------------------------------------------- the warm-up from your tools


def _warmup(fmt: str, rows=None, n: int = 6) -> list[dict]:
    import itertools

    from peergrade.training.sft import tool_warmup_rows

    return list(itertools.islice(tool_warmup_rows([convert], fmt=fmt, seed=0, rows=rows), n))


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_warmup_episodes_call_the_users_tool_well_formed_with_its_real_result(fmt):
    for ep in _warmup(fmt):
        first, result, answer = ep["turns"]
        content, calls, errors = parse_tool_calls(first["content"], fmt)
        assert content == "" and errors == [] and len(calls) == 1
        args = calls[0]["function"]["arguments"]
        assert calls[0]["function"]["name"] == "convert" and set(args) == {"value", "unit"}
        assert isinstance(args["value"], (int, float)) and isinstance(args["unit"], str)
        # the prompt names the arguments it asks for; the tool message is the real result
        assert all(json.dumps(v) in ep["prompt"] for v in args.values())
        assert result == {"role": "tool", "name": "convert", "content": convert(**args)}
        assert answer == {"role": "assistant", "content": convert(**args)}


def test_warmup_from_rows_uses_their_prompts_calls_and_answers():
    rows = [
        {
            "prompt": "3 ft in m?",
            "call": {"name": "convert", "arguments": {"value": 3, "unit": "ft"}},
            "answer": "0.9144 m",
        },
        {
            "prompt": "2 in in m?",
            "call": {"name": "convert", "arguments": {"value": 2, "unit": "in"}},
        },
    ]
    eps = _warmup("hermes", rows, n=4)
    by_prompt = {ep["prompt"]: ep for ep in eps}
    assert set(by_prompt) == {"3 ft in m?", "2 in in m?"}
    assert by_prompt["3 ft in m?"]["turns"][1]["content"] == "0.9144"
    assert by_prompt["3 ft in m?"]["turns"][2]["content"] == "0.9144 m"
    assert by_prompt["2 in in m?"]["turns"][2]["content"] == "0.0508"  # no answer: the result
    with pytest.raises(InputError, match="warm-up row 0"):
        _warmup("hermes", [{"prompt": "x", "call": {"name": "nope", "arguments": {}}}])


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_warmup_tokens_train_the_call_and_answer_and_mask_the_tool_text(fmt):
    from peergrade.envs.tools import tool_schema
    from peergrade.training.sft import episode_example

    tok = tokenizer_for(fmt)
    ep = _warmup(fmt, n=1)[0]
    ids, labels = episode_example(ep, tok, None, [tool_schema(convert)])
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
    call_text, result, answer = (m["content"] for m in ep["turns"])
    eos = tok.eos_token
    assert trained == call_text + eos + answer + eos  # only the model's turns carry loss
    context = tok.decode([t for t, lab in zip(ids, labels) if lab == -100])
    assert result in context and '"description": "Convert a length to metres."' in context
    # the sequence is what the chat template renders for the whole episode
    messages = [{"role": "user", "content": ep["prompt"]}]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": parse_tool_calls(call_text, fmt)[1]},
        ep["turns"][1],
        ep["turns"][2],
    ]
    whole = tok.apply_chat_template(messages, tools=[tool_schema(convert)], tokenize=False)
    assert tok.decode(ids) == whole.rstrip("\n")


def test_sft_cli_warms_up_on_a_tools_file_and_saves_the_template(tmp_path):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    tools = tmp_path / "mytools.py"
    tools.write_text(
        "def convert(value: float, unit: str) -> str:\n"
        '    """Convert a length to metres.\n\n    Args:\n        value: the number\n'
        '        unit: its unit, e.g. "ft"\n    """\n'
        '    return str(round(value * {"ft": 0.3048}.get(unit, 1.0), 4))\n'
    )
    out = tmp_path / "warm"
    cmd = [sys.executable, "-m", "peergrade", "sft", "--init", "qwen2", "--out", str(out)]
    cmd += ["--tools", f"{tools}:convert", "--chat-template", "hermes", "--steps", "2"]
    cmd += ["--batch-size", "2", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "calling convert (hermes calls)" in r.stdout
    auto = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert auto.chat_template == HERMES_TEMPLATE
    info = json.loads((out / "sft_info.json").read_text())
    assert info["tools"] == ["convert"] and info["chat_template"] == "hermes"
    bad = cmd[:-6] + ["--tool-fraction", "0.5", "--steps", "1", "--overwrite"]
    r = subprocess.run(bad, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--tool-fraction" in r.stderr


def test_the_endpoint_parses_replies_in_its_templates_format():
    from peergrade.model.load import load_model, load_tokenizer, resolve_model_path
    from peergrade.serving.openai_schema import Settings
    from peergrade.serving.server import Engine, Sampled, chat_choice

    path = resolve_model_path("bundled:tiny-calc")
    model, tok = load_model(path).eval(), load_tokenizer(path)
    text = format_tool_call("convert", {"value": 1, "unit": "ft"}, "llama3")
    for template, fmt, calls in ((None, "hermes", 0), (LLAMA3_TEMPLATE, "llama3", 1)):
        engine = Engine(model, tok, "m", chat_template=template)
        try:
            assert engine.tool_format == fmt
            sampled = Sampled(token_ids=[], logprobs=[], text=text, finish="eos")
            choice, _ = chat_choice(engine, 0, sampled, Settings(), TOOLS)
            got = choice["message"].get("tool_calls") or []
            assert len(got) == calls
            if calls:
                assert choice["finish_reason"] == "tool_calls"
                assert got[0]["function"]["name"] == "convert"
                assert json.loads(got[0]["function"]["arguments"]) == {"value": 1, "unit": "ft"}
        finally:
            engine.close()
