"""render_prompt: chat template with generation prompt, system prompt, plain-text fallback."""

from __future__ import annotations

import pytest

from peergrade.tasks import render_prompt

CHAT = "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"


def test_auto_templates_messages_and_feeds_plain_text_raw(char_tokenizer):
    # TRL's rule: a conversational prompt through the chat template, a plain one as it is
    assert render_prompt([{"role": "user", "content": "12+7="}], char_tokenizer) == CHAT
    assert render_prompt("12+7=", char_tokenizer) == "12+7="
    assert render_prompt("12+7=", char_tokenizer, use_chat_template="auto") == "12+7="
    # true: a plain string becomes one user message; false: no template even for messages
    assert render_prompt("12+7=", char_tokenizer, use_chat_template=True) == CHAT
    msgs = [{"role": "user", "content": "12+7="}]
    assert render_prompt(msgs, char_tokenizer, use_chat_template=False) == "12+7="
    with pytest.raises(ValueError, match="use_chat_template='yes'"):
        render_prompt("x", char_tokenizer, use_chat_template="yes")


def test_builtin_task_prompts_render_as_before(char_tokenizer):
    from peergrade.tasks import load_task

    row = load_task("arithmetic").make_row(12, "+", 7)
    assert row["prompt"] == [{"role": "user", "content": "12+7="}]
    assert render_prompt(row["prompt"], char_tokenizer) == CHAT


def test_system_prompt_and_chat_list(char_tokenizer):
    out = render_prompt("hi", char_tokenizer, system_prompt="S")
    assert out == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]
    out = render_prompt(msgs, char_tokenizer, system_prompt="S")
    assert out.startswith("<|im_start|>system\nown<|im_end|>") and "\nS<" not in out


def test_plain_text_without_template(char_tokenizer):
    assert render_prompt("12+7=", char_tokenizer, use_chat_template=False) == "12+7="
    assert render_prompt("12+7=", None) == "12+7="
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_prompt(msgs, None, system_prompt="S") == "S\n\na\n\nb"


def test_tokenizer_without_chat_template():
    class Tok:
        chat_template = None

    assert render_prompt("x=", Tok()) == "x="


def test_bad_prompts():
    with pytest.raises(ValueError, match="'role' and 'content'"):
        render_prompt([{"content": "x"}], None)
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        render_prompt(3, None)


def test_with_examples_puts_solved_turns_before_the_question():
    from peergrade.tasks.prompts import with_examples

    out = with_examples("Q3", [("Q1", "A1"), ("Q2", "A2")])
    assert out == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "Q3"},
    ]
    # a row's own system message stays first; an example's system message is dropped
    row = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    ex = [{"role": "system", "content": "S"}, {"role": "user", "content": "E"}]
    assert with_examples(row, [(ex, "R")]) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "E"},
        {"role": "assistant", "content": "R"},
        {"role": "user", "content": "Q"},
    ]
    assert with_examples("Q", []) == [{"role": "user", "content": "Q"}]
    with pytest.raises(ValueError, match="message 0"):
        with_examples("Q", [(["bad"], "R")])


def test_with_examples_renders_as_a_multi_turn_chat(char_tokenizer):
    from peergrade.tasks.prompts import with_examples

    out = render_prompt(with_examples("2+2=", [("1+1=", "<answer>2</answer>")]), char_tokenizer)
    assert out == (
        "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n<answer>2</answer><|im_end|>\n"
        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )
