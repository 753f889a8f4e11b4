"""``peergrade audit`` from the command line, ``train.audit_rewards`` at start-up, the samples
mode on a real run, and the TRL / open-r1 reward functions users bring (tests/trl_recipes)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from cli_helper import cli
from peergrade.cli import main
from peergrade.rewards import RewardSpec
from peergrade.rewards.audit import audit_rewards, samples_audit
from peergrade.tasks import load_task

WEAK = '''
import re


def answer_anywhere(completions, answer, **_):
    """Deliberately weak: the reference appears anywhere in the completion."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.search(r"(?<!\\d)" + re.escape(a) + r"(?!\\d)", t) else 0.0
            for t, a in zip(texts, answer)]


def last_integer(completions, answer, **_):
    """The fix: one answer block holding exactly the integer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    out = []
    for t, a in zip(texts, answer):
        found = re.findall(r"<answer>\\s*(-?\\d+)\\s*</answer>", t)
        out.append(1.0 if t.count("<answer>") == 1 and found == [a] else 0.0)
    return out
'''


@pytest.fixture
def weak_file(tmp_path) -> Path:
    p = tmp_path / "weak.py"
    p.write_text(WEAK)
    return p


def test_cli_table_json_and_exit_status(weak_file, capsys):
    assert main(["audit", "--reward", f"{weak_file}:answer_anywhere", "--rows", "8"]) == 1
    out = capsys.readouterr().out
    assert "answer_anywhere" in out and "EXPLOIT" in out and "FAILED" in out
    assert main(["audit", "--reward", f"{weak_file}:last_integer", "--rows", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["failed"] is False and data["functions"][0]["verdict"] == "clean"
    # the demo's own reward on the demo's task
    assert main(["audit", "--task", "arithmetic", "--rows", "8"]) == 0


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["audit", "--fail-share", "0", "--rows", "4"]) == 2
    assert main(["audit", "--samples", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "samples.jsonl" in err


@pytest.mark.parametrize("mode,code", [("warn", 2), ("fail", 2), ("off", 2)])
def test_startup_audit_runs_before_the_model_loads(weak_file, tmp_path, mode, code):
    """A model path that does not exist: whatever the mode, the run stops at the model; the
    audit's line (and with fail, its error) comes first, so it ran before the model loaded."""
    res = cli(
        [
            "train",
            "--model",
            str(tmp_path / "no-such-model"),
            "--reward",
            f"{weak_file}:answer_anywhere",
            "--train.audit_rewards",
            mode,
            "-o",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
    )
    assert res.returncode == code, res.stderr
    line = "reward audit: answer_anywhere is exploitable: "
    if mode == "off":
        assert line not in res.stderr
    else:
        assert line in res.stderr
        assert ("no-such-model" in res.stderr) == (mode == "warn"), res.stderr


@pytest.mark.slow
def test_samples_mode_finds_planted_hacks_in_a_real_run(weak_file, tmp_path):
    """A real run on the bundled model with a weak reward, then hacks planted among its logged
    completions (scored by the same weak reward): the audit lists the planted ones first and
    none of the model's own correct answers."""
    run = tmp_path / "run"
    res = cli(
        [
            "train",
            "--steps",
            "1",
            "--reward",
            f"{weak_file}:answer_anywhere",
            "--train.log_samples",
            "16",
            "--train.eval_size",
            "2",
            "--train.eval_samples",
            "2",
            "--train.display",
            "none",
            "-o",
            str(run),
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert audit_rewards  # the battery itself is tested in test_audit.py
    path = run / "samples.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    sys.path.insert(0, str(weak_file.parent))
    from weak import answer_anywhere

    planted = []
    for rec, hack in zip(
        records, ["{a}, {b}, {c}", "<answer>{b}</answer><answer>{a}</answer>", "{q}{a}"]
    ):
        a = rec["answer"]
        text = hack.format(a=a, b=int(a) + 1, c=int(a) - 1, q=rec["prompt"][-1]["content"])
        rec["completions"][0] = text
        rec["rewards"][0] = rec["rewards_by_fn"]["answer_anywhere"][0] = answer_anywhere(
            [text], [a]
        )[0]
        assert rec["rewards"][0] == 1.0
        planted.append(text)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    found = samples_audit(run)
    assert found["completions"] == sum(len(r["completions"]) for r in records)
    suspects = [s["completion"] for s in found["suspects"]]
    assert set(planted) <= set(suspects), found
    # the model's own completions that the weak reward paid for are right: not suspects
    assert all(s in planted for s in suspects), suspects
    assert main(["audit", "--samples", str(run)]) == 1


# ------------------------------------------------------------------ TRL / open-r1 recipes

RECIPES = Path(__file__).resolve().parents[1] / "trl_recipes"
#: what the audit finds in the reward functions of public TRL / open-r1 recipes (docs/audit.md)
TRL_FINDINGS = {
    ("recipes_a", "accuracy_reward", "conv"): {"question_as_answer"},
    ("recipes_a", "format_reward", "conv"): {"empty_tags", "empty_think", "format_repeated"},
    ("recipes_a", "tag_count_reward", "conv"): {"empty_tags", "empty_think"},
    ("recipes_a", "reasoning_steps_reward", "conv"): {
        "truncated_at_cap",
        "unclosed_tags",
        "nested_tags",
        "format_repeated",
    },
    ("recipes_a", "len_reward", "conv"): set(),
    ("recipes_a", "conv_logging_reward", "conv"): {"trailing_decimals"},
    ("recipes_a", "ground_truth_reward", "plain"): {"trailing_decimals"},
    ("recipes_a", "plain_curriculum_reward", "plain"): {"empty_completion"},
    ("recipes_a", "exact_match", "plain"): set(),
    ("recipes_a", "char_length_reward", "plain"): {
        "truncated_at_cap",
        "long_filler",
        "nested_tags",
        "format_repeated",
        "padded_answer",
    },
    ("recipes_a", "token_length_reward", "plain"): {
        "truncated_at_cap",
        "long_filler",
        "nested_tags",
        "format_repeated",
        "padded_answer",
    },
    ("recipes_b", "accuracy_reward", "conv"): set(),
    ("recipes_b", "exact_match", "plain"): set(),
}


def test_trl_and_open_r1_reward_functions(monkeypatch, tmp_path):
    monkeypatch.setenv("PEERGRADE_COMPAT_LOG", str(tmp_path / "compat.jsonl"))
    monkeypatch.syspath_prepend(str(RECIPES))
    import importlib

    base = list(itertools.islice(load_task("arithmetic").train_rows(0), 12))
    rows = {
        "conv": [
            {
                "prompt": [{"role": "user", "content": f"What is {r['a']} {r['op']} {r['b']}?"}],
                "solution": r["answer"],
            }
            for r in base
        ],
        "plain": [
            {"prompt": f"{r['a']}{r['op']}{r['b']}=", "ground_truth": int(r["answer"])}
            for r in base
        ],
    }
    got = {}
    for module, name, kind in TRL_FINDINGS:
        fn = getattr(importlib.import_module(module), name)
        report = audit_rewards([RewardSpec(name=name, fn=fn)], rows[kind], max_steps=100)
        got[(module, name, kind)] = {
            f.exploit for f in report.units[0].findings if f.status == "EXPLOIT"
        }
    assert got == TRL_FINDINGS
    for module in ("recipes_a", "recipes_b"):
        sys.modules.pop(module, None)
