"""Held-out evaluation: the unbiased pass@k estimator (hand values and a brute-force subset
count), ``evaluate`` against a slow per-sample reference, and the prompt/column helpers."""

from __future__ import annotations

import itertools

import pytest

from peergrade.errors import InputError
from peergrade.evaluation import evaluate, pass_at_k
from peergrade.rewards import RewardSpec, columns_for
from peergrade.rollout import generate
from peergrade.tasks.prompts import encode_prompts


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (8, 3, 1, 3 / 8),  # pass@1 = c / n
        (8, 0, 8, 0.0),
        (8, 1, 8, 1.0),
        (10, 4, 5, 1 - 6 / 252),  # 1 - C(6,5)/C(10,5)
        (3, 2, 2, 1.0),  # n - c < k: every 2-subset holds a correct sample
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_matches_subset_count(n):
    """pass@k = the fraction of k-subsets of the n samples that contain a correct one."""
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(correct, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 2), (4, -1, 2), (4, 2, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def _first_char_even(prompts, completions, **kw):
    """Deterministic 'correctness' for a random model: about half the completions pass."""
    return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


def test_evaluate_matches_reference(tiny_qwen2):
    model, tok = tiny_qwen2
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(5)]
    ids = encode_prompts(rows, tok)
    acc = RewardSpec(name="even", fn=_first_char_even, weight=1.0, kwargs={})
    k, seed = 4, 11
    out = evaluate(model, tok, rows, ids, acc, k=k, temperature=1.0, max_new_tokens=3, seed=seed)

    # reference: the same generations, scored one sample at a time
    greedy = generate(model, tok, ids, n=1, max_new_tokens=3, temperature=0.0, seed=seed)
    sampled = generate(model, tok, ids, n=k, max_new_tokens=3, temperature=1.0, seed=seed + 1)
    g = [_first_char_even(None, [t])[0] for t in greedy.completion_text]
    s = [_first_char_even(None, [t])[0] for t in sampled.completion_text]
    per_row = [sum(s[i * k : (i + 1) * k]) for i in range(len(rows))]
    assert out["n"] == 5 and out["k"] == k
    assert out["pass@1_greedy"] == pytest.approx(sum(g) / len(rows), abs=1e-9)
    assert out["pass@1_sampled"] == pytest.approx(sum(s) / len(s), abs=1e-9)
    expected_k = sum(1.0 if c > 0 else 0.0 for c in per_row) / len(rows)
    assert out[f"pass@{k}"] == pytest.approx(expected_k, abs=1e-9)
    # the check is not vacuous: some samples pass and some fail
    assert 0 < sum(s) < len(s)
    assert out[f"pass@{k}"] >= out["pass@1_sampled"] - 1e-9


def test_encode_prompts_too_long_names_row(char_tokenizer):
    rows = [{"prompt": "1+1"}, {"prompt": "9" * 200}]
    ids = encode_prompts(rows[:1], char_tokenizer, use_chat_template=False)
    assert ids == [char_tokenizer("1+1", add_special_tokens=False)["input_ids"]]
    with pytest.raises(InputError, match="row 1 has .* tokens.*max_prompt_length=50"):
        encode_prompts(rows, char_tokenizer, use_chat_template=False, max_prompt_length=50)


def test_columns_for_aligns_with_completions():
    rows = [{"prompt": "a", "answer": "1", "x": 5}, {"prompt": "b", "answer": "2", "x": 6}]
    cols = columns_for(rows, 3)
    assert cols == {"answer": ["1"] * 3 + ["2"] * 3, "x": [5] * 3 + [6] * 3}


def test_prompt_tokens_as_trl_makes_them(char_tokenizer):
    """Plain text: ``tokenizer(text)`` (a BOS-adding tokenizer adds its BOS); chat messages:
    ``apply_chat_template(tokenize=True)`` (the template's tokens only)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(char_tokenizer)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    chat = [{"role": "user", "content": "12+7="}]
    rows = [{"prompt": "12+7="}, {"prompt": chat}]
    plain_ids, chat_ids = encode_prompts(rows, tok)
    assert plain_ids == tok("12+7=")["input_ids"] and plain_ids[0] == bos
    trl_chat = tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert chat_ids == list(trl_chat)  # no second BOS before the template's own tokens
