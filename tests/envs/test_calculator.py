"""The calculator demo: the safe ``calculate`` tool, the warm-up that makes ``tiny-calc``
(``peergrade sft --tool-fraction``: episodes tokenised exactly as the runner builds them), held-out
evaluation of episodes (accuracy, tool-call and tool-failure rates, ``peergrade eval --model
RUN_DIR`` reproducing the run's table) and a short run of ``configs/calculator.yaml``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peergrade.envs.calculator import Calculator, calculate, calculator_turns, tool_call_text
from peergrade.envs.tools import parse_tool_calls
from peergrade.model.load import BUNDLED_MODEL, load_tokenizer, resolve_model_path, save_tokenizer
from written_files import assert_same_written

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "calculator.yaml"
TINY_CALC = BUNDLED_MODEL.parent / "tiny-calc"


# ----------------------------------------------------------------------------- the tool


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1234*567", "699678"), ("999+1", "1000"), (" 2*(3-10) ", "-14"), ("-5+2", "-3")],
)
def test_calculate_evaluates_integer_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",  # a call
        "x+1",  # a name
        "2**64",  # no power: a sampled expression must stay cheap
        "7/2",  # no division
        "1.5*2",  # integers only
        "12*",  # not an expression
        "1" * 65,  # too long
        "(1).real",  # an attribute
    ],
)
def test_calculate_refuses_everything_else(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_calculator_environment_binds_the_operands():
    from peergrade.envs.calculator import Calculator

    env = Calculator()
    env.reset(prompt="1234*567=", a=1234, b=567, op="*", answer="699678")
    assert env.calculate("a*b") == "699678" and env.calculate("a+b-1") == "1800"
    with pytest.raises(ValueError):
        env.calculate("c*b")


def test_tool_call_text_parses_as_the_runner_reads_it():
    content, calls, errors = parse_tool_calls(tool_call_text("12*34"))
    assert (content, errors) == ("", [])
    assert calls == [
        {
            "type": "function",
            "function": {"name": "calculate", "arguments": {"expression": "12*34"}},
        }
    ]
    turns = calculator_turns("a*b", {"a": 12, "b": 34})
    assert [m["role"] for m in turns] == ["assistant", "tool", "assistant"]
    assert turns[1]["content"] == turns[2]["content"] == "408"
    assert '"expression": "a*b"' in turns[0]["content"]


# ----------------------------------------------------------------------------- the warm-up


def test_tiny_calc_is_a_bundled_model_name():
    assert Path(resolve_model_path("bundled:tiny-calc")) == TINY_CALC
    from peergrade.errors import InputError

    with pytest.raises(InputError, match="no such bundled model"):
        resolve_model_path("bundled:nope")


def test_tiny_calc_tokenizer_files_are_what_sft_writes(tmp_path):
    """The documented `peergrade sft ... --tool-fraction` writes these tokenizer files byte for
    byte (the weights take the full warm-up to check; docs/environments.md). The second
    command's tokenizer was loaded from the first one's directory, which adds two loading flags
    to tokenizer_config.json: the rest is the same."""
    from peergrade.model.tiny import COMPACT_TOOL_CHAT_TEMPLATE, build_char_tokenizer

    save_tokenizer(build_char_tokenizer(chat_template=COMPACT_TOOL_CHAT_TEMPLATE), tmp_path)
    assert_same_written(tmp_path, TINY_CALC, ("tokenizer.json", "chat_template.jinja"))
    ours = json.loads((tmp_path / "tokenizer_config.json").read_text())
    shipped = json.loads((TINY_CALC / "tokenizer_config.json").read_text())
    assert {k: v for k, v in shipped.items() if k not in ("is_local", "local_files_only")} == ours


@pytest.mark.slow
def test_tiny_calc_config_is_what_the_warm_up_writes(tmp_path):
    """One step of the documented first warm-up command gives the shipped architecture; the
    shipped sft_info.json is the second command's (docs/environments.md)."""
    from peergrade.training.sft import SFTSettings, run_sft

    info = json.loads((TINY_CALC / "sft_info.json").read_text())
    assert info["tool_fraction"] == 0.15 and info["init"] is None
    settings = SFTSettings(
        task=info["task"],
        task_options=info["task_options"],
        steps=1,
        batch_size=4,
        lr=3e-3,
        seed=0,
        threads=1,
        tool_fraction=1.0,
    )
    out = run_sft(
        out=str(tmp_path / "m"), init="qwen2", model=None, settings=settings, log=lambda *_: None
    )
    assert_same_written(out, TINY_CALC, ("config.json", "generation_config.json"))
    assert set(json.loads((out / "sft_info.json").read_text())) == set(info)


@pytest.mark.slow
def test_warm_up_episode_tokens_are_the_runners(tmp_path):
    """A calculator transcript is tokenised as run_episodes builds an episode: the model's turns
    are labels, the tool result and the next generation prompt are the template's delta, never
    labels; a greedy episode of a model that learned the transcript reproduces it token for token."""
    import torch

    from peergrade.envs import make_env_from_objects
    from peergrade.generation.episodes import run_episodes
    from peergrade.model.tiny import (
        COMPACT_TOOL_CHAT_TEMPLATE,
        build_char_tokenizer,
        build_tiny_model,
    )
    from peergrade.training.sft import episode_example, sft_loss

    tok = build_char_tokenizer(chat_template=COMPACT_TOOL_CHAT_TEMPLATE)
    turns = calculator_turns("a*b", {"a": 12, "b": 34})
    row = {"prompt": [{"role": "user", "content": "12*34="}], "a": 12, "b": 34, "turns": turns}
    ids, labels = episode_example(row, tok)
    text = tok.decode(ids)
    assert text == (
        'Q:12*34=\nA:<tool_call>{"name": "calculate", "arguments": {"expression": "a*b"}}'
        "</tool_call><|im_end|>\nR:408       \nA:408<|im_end|>"
    )
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
    assert "R:" not in trained and "Q:" not in trained
    assert trained.startswith("<tool_call>") and trained.endswith(
        "</tool_call><|im_end|>408<|im_end|>"
    )

    torch.manual_seed(0)
    model, tok = build_tiny_model("qwen2", tok, hidden_size=32, num_layers=2, num_heads=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.tensor([ids])
    y = torch.tensor([labels])
    for _ in range(150):  # memorise the one transcript
        loss = sft_loss(model, x, torch.ones_like(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    make_env = make_env_from_objects([], Calculator, max_tool_calling_iterations=2)
    (ep,) = run_episodes(
        model,
        tok,
        [{"prompt": row["prompt"], "a": 12, "b": 34}],
        make_env,
        max_completion_length=120,
        temperature=0,
    )
    assert ep.prompt_ids + ep.completion_ids == ids
    assert [i for i, m in zip(ep.completion_ids, ep.loss_mask) if m] == [
        t for t in labels if t != -100
    ]
    assert (ep.tool_calls, ep.tool_failures, ep.finish_reason) == (1, 0, "answer")


def test_warm_up_prompts_carry_the_tool_schemas_the_episodes_render():
    """With a template that shows tools in the system turn (Qwen2.5-style), a warm-up example's
    prompt, bare answer or episode, is the episode runner's prompt token for token: the same
    tool schemas, not a prompt without them (what a `peergrade sft --model` warm-up of such a
    model would otherwise be taught on)."""
    import torch

    from peergrade.envs import make_env_from_objects
    from peergrade.generation.episodes import run_episodes
    from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
    from peergrade.training.sft import calculator_tools, sft_batch

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    torch.manual_seed(0)
    model, tok = build_tiny_model("qwen2", tok, hidden_size=32, num_layers=2, num_heads=2)
    model.eval()
    prompt = [{"role": "user", "content": "12*34="}]
    make_env = make_env_from_objects([], Calculator, max_tool_calling_iterations=2)
    (ep,) = run_episodes(
        model,
        tok,
        [{"prompt": prompt, "a": 12, "b": 34}],
        make_env,
        max_completion_length=2,
        temperature=0,
    )
    assert '"name": "calculate"' in tok.decode(ep.prompt_ids)  # the template shows the tool
    tools = calculator_tools()
    rows = [
        {"prompt": prompt, "answer": "408"},
        {"prompt": prompt, "turns": calculator_turns("a*b", {"a": 12, "b": 34})},
    ]
    ids, _, labels = sft_batch(rows, tok, tools=tools)
    n = len(ep.prompt_ids)
    for i in range(2):
        assert ids[i, :n].tolist() == ep.prompt_ids
        assert (labels[i, :n] == -100).all() and labels[i, n] != -100
    without, _, _ = sft_batch(rows[:1], tok)  # no tools: the template shows none
    assert '"name": "calculate"' not in tok.decode(without[0])


# ----------------------------------------------------------------------------- the demo


@pytest.mark.slow
def test_calculator_config_runs_episodes_and_reports_tool_rates(tmp_path):
    """A few steps of configs/calculator.yaml on the shipped tiny-calc: the model calls the tool,
    the before/after table has accuracy, tool-call and tool-failure rates, and `peergrade eval
    --model RUN_DIR` (which reads the run's env: from its config) gives the run's final numbers."""
    from tests.cli_helper import cli

    run = tmp_path / "run"
    r = cli(
        [
            "train",
            "--config",
            str(CONFIG),
            "--train.steps",
            "2",
            "--rollout.prompts_per_step",
            "4",
            "--train.eval_size",
            "16",
            "--train.eval_samples",
            "2",
            "--train.threads",
            "1",
            "--train.display",
            "plain",
            "-o",
            str(run),
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("held-out accuracy") :]
    for row in ("pass@1_greedy", "pass@1_sampled", "tool_call_rate", "tool_failure_rate"):
        assert f"\n{row} " in table, table
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "tools/call_frequency" in m]
    assert len(steps) == 2 and sum(m["tools/call_frequency"] for m in steps) > 0
    final = next(m for m in metrics if m.get("final"))
    assert 0 < final["eval/tool_call_rate_sampled"] <= 1
    assert 0 <= final["eval/tool_failure_rate_sampled"] <= 1
    e = cli(["eval", "--model", str(run), "--json"], tmp_path)
    assert e.returncode == 0, e.stderr[-3000:]
    again = json.loads(e.stdout)
    for key in ("pass@1_greedy", "pass@1_sampled", "tool_call_rate", "tool_failure_rate_sampled"):
        assert again[key] == pytest.approx(final[f"eval/{key}"]), key


def test_tiny_calc_template_passes_the_start_up_check():
    from peergrade.envs import check_template

    tok = load_tokenizer(str(TINY_CALC))
    check_template(tok, eos_ids=[tok.eos_token_id])
