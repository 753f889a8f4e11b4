"""Held-out evaluation: the unbiased pass@k estimator (hand values and a brute-force subset
count), ``evaluate`` against a slow per-sample reference, and the prompt/column helpers."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from peergrade.cli.evaluate import EvalRequest, run_eval_command
from peergrade.errors import InputError
from peergrade.evaluation import AnswerSource, EvalOptions, evaluate, pass_at_k, pass_at_k_curve
from peergrade.generation import SamplerSettings
from peergrade.generation.kernel import generate
from peergrade.rewards import RewardSpec, columns_for
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


def test_pass_at_k_curve_hand_values():
    # three problems, 4 samples each, with 0, 1 and 4 correct
    curve = pass_at_k_curve([0, 1, 4], 4)
    assert list(curve) == ["pass@1", "pass@2", "pass@3", "pass@4"]
    expected = {
        "pass@1": (0 + 1 / 4 + 1) / 3,  # c / n per problem
        "pass@2": (0 + (1 - 3 / 6) + 1) / 3,  # 1 - C(3,2)/C(4,2) for the middle one
        "pass@3": (0 + (1 - 1 / 4) + 1) / 3,  # 1 - C(3,3)/C(4,3)
        "pass@4": (0 + 1 + 1) / 3,
    }
    for key, value in expected.items():
        assert curve[key] == pytest.approx(value, abs=1e-12)
    # 16 samples, 2 correct: pass@8 = 1 - C(14,8)/C(16,8) = 1 - 3003/12870
    assert pass_at_k_curve([2], 16)["pass@8"] == pytest.approx(1 - 3003 / 12870, abs=1e-12)
    with pytest.raises(ValueError, match="at least one problem"):
        pass_at_k_curve([], 4)


def _first_char_even(prompts, completions, **kw):
    """Deterministic 'correctness' for a random model: about half the completions pass."""
    return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


def test_evaluate_matches_reference(tiny_qwen2):
    model, tok = tiny_qwen2
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(5)]
    ids = encode_prompts(rows, tok)
    acc = RewardSpec(name="even", fn=_first_char_even, weight=1.0, kwargs={})
    k, seed = 4, 11
    opts = EvalOptions(k=k, settings=SamplerSettings(n=1, max_new_tokens=3), seed=seed)
    out = evaluate(model, tok, rows, ids, acc, opts)

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
    assert "pass@1" not in out  # the curve is opt-in: the trainer's metrics stay as they were

    # the curve, from the same samples: each pass@j is the share of j-subsets of a problem's
    # samples that hold a correct one, averaged over problems (brute force, not the formula)
    full = evaluate(model, tok, rows, ids, acc, replace(opts, curve=True))
    assert {key: full[key] for key in out} == out
    for j in range(1, k + 1):
        per_problem = []
        for i in range(len(rows)):
            subsets = list(itertools.combinations(s[i * k : (i + 1) * k], j))
            per_problem.append(sum(any(x) for x in subsets) / len(subsets))
        assert full[f"pass@{j}"] == pytest.approx(sum(per_problem) / len(rows), abs=1e-9)
    assert full["pass@1"] == pytest.approx(full["pass@1_sampled"], abs=1e-12)
    assert full[f"pass@{k}"] == out[f"pass@{k}"]
    assert all(full[f"pass@{j}"] <= full[f"pass@{j + 1}"] + 1e-12 for j in range(1, k))


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


def test_eval_few_shot_prompts_carry_training_examples(tiny_model_dir, monkeypatch):
    """``--few-shot 2``: every held-out prompt gets two solved examples drawn from training
    problems (never a held-out one); the default stays zero-shot."""
    import peergrade.training.held_out as ev  # evaluate_config's evaluate

    seen = {}

    def fake_evaluate(model, tokenizer, rows, prompt_ids, acc, options, source=None):
        seen["rows"], seen["ids"] = rows, prompt_ids
        return {"n": len(rows), "k": options.k}

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    model = str(tiny_model_dir)
    zero = run_eval_command(model=model, request=EvalRequest(n=6, k=1))
    assert "few_shot" not in zero
    # the built-in task's prompts are chat messages: one user turn each, zero-shot
    assert all([m["role"] for m in r["prompt"]] == ["user"] for r in seen["rows"])
    held_out = {r["prompt"][-1]["content"] for r in seen["rows"]}
    zero_ids = seen["ids"]

    two = EvalRequest(n=6, k=1, few_shot=2, few_shot_answer="<answer>{answer}</answer>")
    out = run_eval_command(model=model, request=two)
    assert out["few_shot"] == 2
    rows = seen["rows"]
    assert {r["prompt"][-1]["content"] for r in rows} == held_out  # same problems, same order
    for row, ids0, ids in zip(rows, zero_ids, seen["ids"]):
        turns = row["prompt"][:-1]
        assert [t["role"] for t in turns] == ["user", "assistant"] * 2
        for question, reply in zip(turns[::2], turns[1::2]):
            assert question["content"] not in held_out
            assert reply["content"].startswith("<answer>") and reply["content"].endswith(
                "</answer>"
            )
        assert len(ids) > len(ids0)  # the examples are in the encoded prompt too
    with pytest.raises(InputError, match="--few-shot must be >= 0"):
        EvalRequest(n=6, k=1, few_shot=-1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n=0), r"--n and --k must be >= 1 \(got n=0, k=None\)"),
        (dict(k=0), r"--n and --k must be >= 1 \(got n=None, k=0\)"),
        (dict(temperature=0.0), r"--temperature must be > 0 for sampled pass@k \(got 0.0\)"),
    ],
)
def test_eval_request_rejects_bad_flags(kw, match):
    with pytest.raises(InputError, match=match):
        EvalRequest(**kw)


def test_eval_options_reject_bad_values():
    settings = SamplerSettings(n=1, max_new_tokens=3)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        EvalOptions(k=0, settings=settings, seed=0)
    with pytest.raises(ValueError, match="settings must be a SamplerSettings, got dict"):
        EvalOptions(k=1, settings={"n": 1}, seed=0)
    # a list of extra specs is kept as a tuple: the options stay immutable
    spec = RewardSpec(name="even", fn=_first_char_even, weight=1.0, kwargs={})
    assert EvalOptions(k=1, settings=settings, seed=0, extra=[spec]).extra == (spec,)


def test_eval_reward_options_and_samples_file(tiny_model_dir, tmp_path):
    """``--reward-option extract=last_number`` reaches the correctness reward, ``--samples``
    writes every problem's answers with the verdicts behind the pass@1 figures, and a misspelt
    option fails before anything is generated."""
    import json

    from peergrade.rewards.math import extract_integer

    common = dict(n=4, k=3, max_new_tokens=4)
    out_file = tmp_path / "answers.jsonl"
    request = EvalRequest(
        **common, reward_options={"extract": "last_number"}, samples=str(out_file)
    )
    out = run_eval_command(model=str(tiny_model_dir), request=request)
    assert out["reward_options"] == {"extract": "last_number"}
    lines = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert len(lines) == 4 and not (tmp_path / "answers.jsonl.tmp").exists()
    assert all(len(x["sampled"]) == 3 == len(x["sampled_correct"]) for x in lines)
    greedy = sum(x["greedy_correct"] for x in lines) / 4
    sampled = sum(sum(x["sampled_correct"]) for x in lines) / 12
    assert out["pass@1_greedy"] == pytest.approx(greedy)
    assert out["pass@1_sampled"] == pytest.approx(sampled)
    # the verdicts are the last-number rule's, applied to the written answers
    for x in lines:
        want = int(x["columns"]["answer"])
        assert x["greedy_correct"] == (extract_integer(x["greedy"], "last_number") == want)
        for text, ok in zip(x["sampled"], x["sampled_correct"]):
            assert ok == (extract_integer(text, "last_number") == want)

    with pytest.raises(InputError, match="has no option 'extrct'.*extract"):
        run_eval_command(
            model=str(tiny_model_dir),
            request=EvalRequest(**common, reward_options={"extrct": "tag"}),
        )


def test_reward_option_scoring_differs_by_extract():
    """The option changes the verdict: a worked reply without tags is wrong for the default
    extraction and right for ``extract=last_number`` (what the recipe's before/after table
    reports as 'last-number accuracy')."""
    from peergrade.evaluation import accuracy_spec
    from peergrade.tasks import load_task

    task = load_task("arithmetic")
    strict, lenient = accuracy_spec(task), accuracy_spec(task, None, {"extract": "last_number"})
    completions = ["12 + 7 = 19", "<answer>19</answer>", "12 + 7 = 18"]
    answer = ["19"] * 3
    assert strict.fn(["q"] * 3, completions, answer=answer, **strict.kwargs) == [0.0, 1.0, 0.0]
    assert lenient.fn(["q"] * 3, completions, answer=answer, **lenient.kwargs) == [1.0, 1.0, 0.0]


def test_eval_batch_size_changes_no_number(tiny_qwen2, monkeypatch):
    """train.eval_batch_size only bounds memory: the draws are keyed per (seed, prompt, sample,
    token), so 1, 3, 7 sequences at a time and auto give the same answers and the same numbers,
    and the batch the evaluation really generates with is the resolved one."""
    import peergrade.generation as generation
    from peergrade.config import load_config
    from peergrade.training.held_out import evaluate_config

    model, tok = tiny_qwen2
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(5)]
    ids = encode_prompts(rows, tok)
    acc = RewardSpec(name="even", fn=_first_char_even, weight=1.0, kwargs={})
    seen = []
    real = generation.sample

    def spy(model_, tok_, rows_, settings, **kw):
        seen.append(settings.batch_size)
        return real(model_, tok_, rows_, settings, **kw)

    monkeypatch.setattr(generation, "sample", spy)
    results = {}
    for size in (1, 3, 7, "auto"):
        cfg = load_config(
            None,
            [
                ("train.eval_batch_size", size),
                ("train.eval_samples", 4),
                ("train.eval_size", 5),
                ("rollout.max_completion_length", 3),
                ("rollout.prompts_per_step", 2),
                ("rollout.group_size", 2),
            ],
        )
        seen.clear()
        results[size] = evaluate_config(cfg, model, tok, rows, ids, acc, keep_completions=True)
        # auto: the step's generation call, 2 x 2 = 4 sequences, below the sampled pass's 20
        assert seen == [4 if size == "auto" else size] * 2
    assert 0 < results[1]["pass@1_sampled"] < 1  # not vacuous: some pass, some fail
    for size in (3, 7, "auto"):
        assert results[size] == results[1], size


def test_held_out_replies_come_from_the_runs_engine(tiny_qwen2):
    """With another rollout engine (rollout.engine vllm), the held-out answers are sampled by
    it, as the run's training replies are: every evaluate() call goes through engine.sample
    (greedy and the k samples), and its answers are what is scored."""
    from peergrade.generation.kernel import generate

    model, tok = tiny_qwen2
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
    ids = encode_prompts(rows, tok)
    acc = RewardSpec(name="even", fn=_first_char_even, weight=1.0, kwargs={})
    calls = []

    class Engine:  # the own kernel behind the engine's interface, counting its calls
        def sample(self, model_, tok_, prompt_ids, settings, *, seed, row_keys, eos_token_ids):
            calls.append((settings.n, seed))
            return generate(
                model_,
                tok_,
                prompt_ids,
                max_new_tokens=settings.max_new_tokens,
                n=settings.n,
                temperature=settings.temperature,
                seed=seed,
            )

    settings = SamplerSettings(n=1, max_new_tokens=3, temperature=1.0)
    opts = EvalOptions(k=2, settings=settings, seed=5)
    with_engine = evaluate(model, tok, rows, ids, acc, opts, AnswerSource(engine=Engine()))
    assert calls == [(1, 5), (2, 6)]  # greedy from seed, the k samples from seed + 1
    without = evaluate(model, tok, rows, ids, acc, opts)
    assert with_engine["pass@1_greedy"] == without["pass@1_greedy"]
