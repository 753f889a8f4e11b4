"""Failures that show where the user looks (issue 50, part 4).

- failed harness episodes are counted on the progress line (``failed F/N``), in metrics
  (``harness/failed_episodes`` of ``harness/episodes``) and in the alert ``harness_failing``
  with the most common error, on the step they happen (item 1);
- the held-out score is the training reward unless ``train.eval_reward`` names another: a TRL
  script's own reward (not ``math_accuracy`` because rows have an ``answer``), a harness's
  return value for its held-out episodes (item 2);
- a reward that returns the wrong number of scores stops the run before the model loads, in
  one line (item 3);
- the header counts the held-out problems the split has and says nothing of a held-out
  evaluation when there is none; the progress line calls a mean score ``score`` (item 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peergrade.cli import main
from peergrade.monitoring.metrics import Display
from test_own_data import TINY as OWN_DATA_TINY

# test_own_data's tiny run, shown as plain lines, two samples per held-out problem
TINY = [*OWN_DATA_TINY, "--train.display", "plain", "--train.eval_samples", "2"]

REWARDS = """
def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def half(completions, **kwargs):
    return [0.5] * len(completions)
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n: int, start: int = 10) -> list[dict]:
    return [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(start, start + n)]


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", sums(4))
    write_jsonl(tmp_path / "held.jsonl", sums(3, start=40))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def calls_then_raises():
    """An async harness whose first call talks to the server and scores 1; every later call
    raises, as an agent whose upstream timed out does."""
    import openai

    calls = []

    async def harness(row, base_url, model):
        calls.append(row)
        if len(calls) > 1:
            raise TimeoutError("the upstream API took too long")
        c = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        await c.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
        return 1.0

    return harness


# ----------------------------------------------------------------------------- item 1


def test_failed_harness_episodes_show_on_the_progress_line_and_alert(tmp_path, capsys):
    """3 of a step's 4 episodes fail: the progress line says so, the alert quotes the error,
    on that step (it used to read ``reward 0.250 ... len 0.6`` and nothing else)."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from peergrade import GRPOConfig, GRPOTrainer

    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)}
        for a in (12, 23)
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=8,
        gradient_checkpointing=False,
        peergrade={"train.on_reward_error": "zero", "train.display": "plain"},
    )
    trainer = GRPOTrainer("bundled:tiny-calc", None, args, rows, harness=calls_then_raises())
    trainer.train()
    out = capsys.readouterr().out
    (step,) = [x for x in out.splitlines() if x.startswith("step 1/")]
    assert "failed 3/4" in step, out
    alert = "3/4 episodes failed on this step: TimeoutError: the upstream API took too long (3x"
    assert f"[alert] step 1: {alert}" in out, out
    (m,) = [m for m in metrics_lines(tmp_path / "run") if "loss/policy" in m]
    assert m["harness/episodes"] == 4 and m["harness/failed_episodes"] == 3
    assert m["harness/failed"] == 0.75 and m["alert/harness_failing"] == 1.0
    assert alert in m["alerts"]["harness_failing"]


def test_progress_line_counts_failed_episodes_only_when_some_failed():
    """Display's note: ``failed F/N`` after the columns; nothing when none failed."""
    import contextlib
    import io

    display = Display("plain", 3)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        display.update(
            1, {"reward/total/mean": 0.0, "harness/episodes": 16.0, "harness/failed_episodes": 15.0}
        )
        display.update(
            2, {"reward/total/mean": 0.5, "harness/episodes": 16.0, "harness/failed_episodes": 0.0}
        )
    first, second = buf.getvalue().splitlines()
    assert "failed 15/16" in first and "failed" not in second


# ----------------------------------------------------------------------------- item 2


def test_a_trl_script_s_held_out_score_is_its_own_reward(tmp_path):
    """Rows with an ``answer`` column used to be scored by math_accuracy whatever the script
    trained on; the script's reward is the training reward, so it scores held-out answers."""
    from peergrade import GRPOConfig, GRPOTrainer
    from peergrade.training.components import run_header

    def length_reward(completions, **kwargs):
        return [min(1.0, len(c) / 10) for c in completions]

    def args(**peergrade):
        return GRPOConfig(
            output_dir=str(tmp_path / "run"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=1,
            max_completion_length=8,
            gradient_checkpointing=False,
            peergrade=peergrade,
        )

    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 16)]
    trainer = GRPOTrainer("bundled", length_reward, args(), rows[:4], eval_dataset=rows[4:])
    run = trainer._run
    assert run.accuracy.fn is length_reward and run.accuracy_in_mix
    header = run_header(
        run.cfg, run.task, run.models.tokenizer, run.accuracy, run.accuracy_why, None, 2
    )
    assert header[0].startswith("held-out scorer: length_reward (the training reward;"), header
    # a scorer the user names still wins
    named = GRPOTrainer(
        "bundled",
        length_reward,
        args(**{"train.eval_reward": "math_accuracy"}),
        rows[:4],
        eval_dataset=rows[4:],
    )._run
    assert named.accuracy.name == "math_accuracy" and named.accuracy_why == "train.eval_reward"


def test_a_harness_run_scores_held_out_episodes_with_its_return_value(tmp_path, capsys):
    """Rows without an ``answer`` (no verifier) and a held-out split: the run used to stop
    with "task 'file' has no verifier" although the agent returns its own reward; now the
    held-out episodes score what the harness returned."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import openai

    from peergrade import GRPOConfig, GRPOTrainer

    async def always_right(row, base_url, model):
        c = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        await c.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
        return 1.0

    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}]} for a in range(10, 14)]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=8,
        gradient_checkpointing=False,
        num_generations_eval=1,
        peergrade={"train.display": "plain"},
    )
    trainer = GRPOTrainer(
        "bundled:tiny-calc", None, args, rows[:2], eval_dataset=rows[2:], harness=always_right
    )
    assert trainer._run.accuracy.name == "harness"
    trainer.train()
    out = capsys.readouterr().out
    assert "held-out scorer: harness (what the harness returns: the training reward;" in out
    assert "held-out evaluation: 2 problems" in out
    lines = metrics_lines(tmp_path / "run")
    before, after = lines[0], lines[-1]
    assert before["step"] == 0 and after.get("final")
    assert before["eval/pass@1_greedy"] == after["eval/pass@1_greedy"] == 1.0
    assert after["eval/pass@1_sampled"] == 1.0


# ----------------------------------------------------------------------------- item 3


def test_a_reward_of_the_wrong_length_stops_before_the_model_loads(files, capsys, monkeypatch):
    """The start-up audit used to flag it ("fix it before training") and the run went on to
    load the model and fail at the first step, leaving a run directory behind."""
    from peergrade.training import trainer

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(trainer, "setup_models", no_model)
    args = ["train", "--data", "train.jsonl", "--reward", "my_rewards.py:short", "--steps", "1"]
    assert main([*args, *TINY, "-o", "run"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()  # one line, nothing else
    assert line.startswith("error: reward 'short' returned ") and "scores for " in line, err
    returned, expected = line.split(" returned ")[1].split(" completions")[0].split(" scores for ")
    assert int(returned) == int(expected) - 1
    assert line.endswith("fix it before training")
    assert not (files / "run").exists()


# ----------------------------------------------------------------------------- item 4


def test_header_counts_the_held_out_problems_the_split_has(files, capsys):
    """3 held-out rows and train.eval_size 200: the header said "200 problems". A 0/1
    scorer's mean stays ``acc`` on the progress line."""
    args = ["train", "--data", "train.jsonl", "--data.eval_path", "held.jsonl", "--steps", "1"]
    assert main([*args, *TINY, "-o", "run"]) == 0
    out = capsys.readouterr().out
    assert "held-out evaluation: 3 problems (all the held-out split has; train.eval_size 200)" in (
        out
    )
    assert "200 problems" not in out
    assert "held-out scorer: math_accuracy (the training reward;" in out
    (step,) = [x for x in out.splitlines() if x.startswith("step 1/1")]
    assert "  acc " in step and "score" not in step


def test_without_held_out_nothing_is_said_of_it_and_a_mean_score_is_a_score(files, capsys):
    """No held-out split: no "held-out scorer" or "200 problems" line; a scorer that gives 0.5
    is a mean score on the progress line (``score``), not a share correct (``acc``)."""
    args = ["train", "--data", "train.jsonl", "--reward", "my_rewards.py:half", "--steps", "2"]
    assert main([*args, *TINY, "-o", "run"]) == 0
    out = capsys.readouterr().out
    assert "held-out scorer" not in out and "held-out evaluation" not in out
    assert "problems" not in out
    assert "scorer: half (the training reward;" in out
    steps = [x for x in out.splitlines() if x.startswith("step ")]
    assert len(steps) == 2 and all("score 0.500" in x and " acc " not in x for x in steps), out


def test_the_progress_line_names_a_mean_score_for_what_it_is():
    import contextlib
    import io

    display = Display("plain", 2)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        display.update(1, {"reward/accuracy": 1.0})
        display.partial_scores()
        display.update(2, {"reward/accuracy": 0.5})
    first, second = buf.getvalue().splitlines()
    assert "acc 1.000" in first and "score 0.500" in second and " acc " not in second
