"""render_prompt: chat template with generation prompt, system prompt, plain-text fallback."""

from __future__ import annotations

import pytest

from peergrade.tasks import render_prompt


def test_plain_string_becomes_user_message(char_tokenizer):
    out = render_prompt("12+7=", char_tokenizer)
    assert out == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"


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
