"""Reward models as rewards (issue 12): a local AutoModelForSequenceClassification directory.

A small Qwen2ForSequenceClassification (num_labels=1) built here from a config scores
prompt + completion text (the chat template for message lists) exactly as a direct forward pass
of that text does, batched or not, in eval mode; bad directories are clear errors naming the
path; a 2-step CLI run trains with it and logs its scores; ``peergrade memory`` counts it; and
the rewards package still imports no model code.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helper import cli
from peergrade.model.load import ModelLoadError
from peergrade.rewards.models import (
    RewardModel,
    is_reward_model_name,
    load_reward_model,
    reward_model_memory,
    reward_texts,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "peergrade"


def make_classifier(out: Path, *, num_labels: int = 1, dropout: float = 0.0, seed: int = 0):
    """A tiny Qwen2ForSequenceClassification + char tokenizer saved in ``out``."""
    from transformers import Qwen2ForSequenceClassification

    from peergrade.model.tiny import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    cfg = tiny_config(
        "qwen2",
        vocab_size=len(tok),
        hidden_size=32,
        num_layers=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg.num_labels = num_labels
    cfg.attention_dropout = dropout
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():  # a score head that gives visibly different scores per text
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("rm") / "tiny-rm", dropout=0.5)


def direct_scores(path: Path, texts: list[str]) -> list[float]:
    """One unpadded forward per text: the score the reward model must reproduce."""
    from transformers import AutoModelForSequenceClassification

    from peergrade.model.load import load_tokenizer

    tok = load_tokenizer(path)
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


PROMPTS = ["12+34=", "7-5=", "99+1=", "50-8=", "3+3="]
COMPLETIONS = ["46", "2 and more text", "", "42<|im_end|>", "6\n6"]


def test_scores_equal_a_direct_forward_pass(rm_dir):
    rm = load_reward_model(rm_dir)
    assert isinstance(rm, RewardModel) and rm.__name__ == "tiny-rm"
    assert not rm.model.training  # dropout 0.5 in the config: eval mode keeps scores exact
    assert not any(p.requires_grad for p in rm.model.parameters())
    expected = direct_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    for bs in (None, 2, 1):
        got = rm(prompts=PROMPTS, completions=COMPLETIONS, answer=["x"] * 5, batch_size=bs)
        assert isinstance(got, list) and len(got) == 5
        assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(x, 4) for x in expected)) > 1  # the texts really are told apart


def test_conversational_prompts_go_through_the_chat_template(rm_dir):
    rm = load_reward_model(rm_dir)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    texts = reward_texts(prompts, completions, rm.tokenizer)
    assert texts[0] == rm.tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
    assert texts[0].startswith("<|im_start|>user\n12+34=")
    expected = direct_scores(rm_dir, texts)
    assert rm(prompts=prompts, completions=completions) == pytest.approx(expected, abs=1e-5)
    # a plain-string completion of a conversational prompt is the assistant message
    assert rm(prompts=prompts, completions=COMPLETIONS) == pytest.approx(expected, abs=1e-5)


def test_not_a_classifier_is_a_clear_error(rm_dir, tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="not a sequence-classification model") as e:
        load_reward_model(tiny_model_dir)
    assert str(tiny_model_dir) in str(e.value) and "Qwen2ForCausalLM" in str(e.value)
    two = make_classifier(tmp_path / "two", num_labels=2)
    with pytest.raises(ModelLoadError, match="num_labels=1"):
        load_reward_model(two)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json") as e:
        load_reward_model(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(e.value)


def test_which_names_are_reward_models(rm_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "format").mkdir()  # a directory named like a built-in: the built-in wins
    assert is_reward_model_name(str(rm_dir))
    assert not is_reward_model_name("format")
    assert not is_reward_model_name(f"{rm_dir}:fn")
    assert not is_reward_model_name("no/such/dir")


def test_rewards_package_imports_no_model_code():
    """Layering: reward functions never import transformers, peergrade.model.load or this seam
    (``rewards.models``, the reward-model loader, is the seam itself)."""
    banned = {
        "transformers",
        "peergrade.model.load",
        "peergrade.rewards.models",
        "peergrade.training.trainer",
    }
    for path in sorted((SRC / "rewards").glob("*.py")):
        if path.name == "models.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert not any(m == b or m.startswith(b + ".") for b in banned), (path.name, m)
    code = (
        "import sys, peergrade.rewards as r\n"
        "[r.resolve_reward(n) for n in r.available_rewards() if n != 'reasoning_gym']\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'"
        " or m in ('peergrade.model.load', 'peergrade.rewards.models')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_memory_counts_the_reward_model(rm_dir, tiny_model_dir):
    from peergrade.config import load_config
    from peergrade.planning.memory import estimate_for_config

    n_params = sum(p.numel() for p in load_reward_model(rm_dir).model.parameters())
    m = reward_model_memory(rm_dir, dtype="float32", seq_len=20, batch_size=4)
    assert m["weights"] == 4 * n_params and m["activations"] > 0
    base = {"model.path": str(tiny_model_dir), "model.device": "cpu"}
    cfg = load_config(None, list(base.items()) + [("rewards", [{"name": "arithmetic"}])])
    with_rm = load_config(
        None,
        list(base.items())
        + [
            (
                "rewards",
                [{"name": "arithmetic"}, {"name": str(rm_dir), "kwargs": {"batch_size": 4}}],
            )
        ],
    )
    e0 = estimate_for_config(cfg, prompt_len=10)
    e1 = estimate_for_config(with_rm, prompt_len=10)
    assert e0["reward_models"] == 0 and "rewards" not in e0["phases"]
    assert e1["reward_models"] == 4 * n_params
    assert e1["phases"]["generate"] - e0["phases"]["generate"] == 4 * n_params
    assert e1["phases"]["rewards"] > e1["phases"]["rewards"] - m["activations"] > 0


TINY = [
    "--rollout.prompts_per_step",
    "2",
    "--rollout.group_size",
    "3",
    "--rollout.max_completion_length",
    "4",
    "--train.eval_size",
    "2",
    "--train.eval_samples",
    "1",
    "--train.display",
    "none",
    "--train.threads",
    "1",
    "--train.steps",
    "2",
    "--train.log_samples",
    "2",
    "--train.save_every",
    "0",
]


@pytest.mark.slow
def test_cli_trains_with_a_reward_model(rm_dir, tmp_path):
    proc = cli(["train", *TINY, "--reward", str(rm_dir), "-o", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss/policy" in r]
    assert len(train) == 2 and all("reward/tiny-rm/mean" in r for r in train)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    from peergrade.model.load import load_tokenizer

    tok = load_tokenizer(rm_dir)
    for s in samples:  # the logged total is the reward model's score of prompt + completion
        # the built-in task's prompts are chat messages: the model reads the rendered chat
        assert isinstance(s["prompt"], list)
        texts = [
            tok.apply_chat_template(
                s["prompt"] + [{"role": "assistant", "content": c}], tokenize=False
            )
            for c in s["completions"]
        ]
        expected = direct_scores(rm_dir, texts)
        assert s["rewards"] == pytest.approx(expected, abs=1e-4)

    bad = cli(["train", *TINY, "--reward", str(tmp_path / "run"), "-o", "run2"], tmp_path)
    assert bad.returncode == 2
    assert str(tmp_path / "run") in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "run2").exists()


@pytest.mark.slow
def test_measured_memory_includes_the_reward_model(tiny_model_dir, tmp_path):
    """A ~50 MiB reward model next to a ~0.1 MiB policy: the measured peak is the reward
    model's, and the estimate (which counts it) lands within 25% of it."""
    from transformers import Qwen2ForSequenceClassification

    from peergrade.config import load_config
    from peergrade.model.tiny import build_char_tokenizer, tiny_config
    from peergrade.planning.memory import estimate_for_config, measure_memory

    tok = build_char_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tok), hidden_size=384, num_layers=6)
    cfg.num_labels = 1
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    c = load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            ("model.device", "cpu"),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 4),
            ("rollout.max_completion_length", 8),
            ("train.threads", 1),
            ("rewards", [{"name": str(tmp_path / "rm"), "kwargs": {"batch_size": 8}}]),
        ],
    )
    m = measure_memory(c, steps=2, timeout=900)
    e = estimate_for_config(c, prompt_len=m["prompt_len"])
    assert "rewards" in m["phases"] and "rewards" in e["phases"]
    assert m["peak"] >= 0.9 * e["reward_models"] > 40 * 2**20
    assert abs(e["peak"] - m["peak"]) <= 0.25 * m["peak"], (e["phases"], m["phases"])
