"""A new user's own JSONL and reward file, end to end through the CLI on the bundled model
(issue 23, items 1-5, 13, 15, 19; issue 24's "eval builds prompts as training does").

- plain-text prompts on a tokenizer with a chat template: one start-up line naming
  ``data.use_chat_template`` with both renderings; ``samples.jsonl`` and the report show the
  prompt the model saw (item 1);
- the held-out scorer is ``train.eval_reward`` (default: the training reward, issue 50),
  printed in the run header and used by ``peergrade eval`` (item 2);
- a column a reward requires (a parameter without a default) must exist, non-null, in every row:
  checked before the model loads, with the file, line and the ``data.columns`` fix (items 3, 4);
- ``peergrade eval --model RUN_DIR`` reads the run's config and reproduces the run's held-out
  numbers, sampled ones included (item 5), with ``--section.key`` winning over flags;
- evaluations during the run are printed (item 13), config.yaml says ``task: file`` (item 15),
  ``data/epoch`` is logged (item 19).

The walk-through's files are the ones docs/own-data.md shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cli_helper import cli
from peergrade.cli import main
from peergrade.config import load_config
from peergrade.rewards import RewardSpec, make_reward_spec, required_columns
from peergrade.tasks import load_task
from peergrade.tasks.files import DataError
from peergrade.tasks.prompts import chat_template_note
from peergrade.training.held_out import check_reward_columns, held_out_scorer

ROOT = Path(__file__).resolve().parents[2]
# the walk-through's reward file, read from docs/own-data.md so that the tests and the page
# cannot drift (tests/test_reward_example.py checks every page shows this same block), plus
# two rewards of the tests' own
_PAGE = (ROOT / "docs" / "own-data.md").read_text()
MY_REWARDS = re.search(r"```python\n(# my_rewards\.py\n.*?)```", _PAGE, re.S).group(1)
MY_REWARDS += """

def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def needs_solution(completions, solution, **kwargs):
    return [0.0] * len(completions)
"""

TINY = [
    "--rollout.prompts_per_step",
    "2",
    "--rollout.group_size",
    "2",
    "--rollout.max_completion_length",
    "4",
    "--train.threads",
    "1",
    "--train.save_every",
    "0",
]


def sums(n: int, start: int = 10) -> list[dict]:
    return [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def walkthrough(tmp_path) -> Path:
    write_jsonl(tmp_path / "sums.jsonl", sums(6))
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    return tmp_path


# ----------------------------------------------------------------------------- units


def test_required_columns_read_the_signature():
    def trl_style(prompts, completions, **kwargs):
        return []

    def needs(prompts, completions, answer, completion_ids, trainer_state, *, unit, tol=0.1):
        return []

    assert required_columns(RewardSpec("a", trl_style)) == []  # **kwargs requires nothing
    assert required_columns(RewardSpec("b", needs)) == ["answer", "unit"]
    assert required_columns(RewardSpec("c", needs, kwargs={"unit": "m"})) == ["answer"]
    # the built-ins take answer=None but cannot score without it
    assert required_columns(make_reward_spec("math_accuracy")) == ["answer"]
    assert required_columns(make_reward_spec("format")) == []


def test_file_task_names_the_row_whose_required_column_is_null(tmp_path):
    rows = sums(5)
    rows[3]["answer"] = None
    del rows[4]["answer"]
    task = load_task("file", path=str(write_jsonl(tmp_path / "d.jsonl", rows)))
    with pytest.raises(DataError, match=r"d.jsonl: line 4: column 'answer' is missing or null"):
        task.check_columns({"answer": ["exact"]})
    with pytest.raises(DataError, match=r"needs the column 'solution'.*columns: prompt, answer"):
        task.check_columns({"solution": ["mine"]})


def test_chat_template_note_only_for_plain_text_on_a_chat_tokenizer():
    from peergrade.model.load import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("bundled"))
    note = chat_template_note("16+44=", tok)
    assert "data.use_chat_template=auto" in note and "'16+44='" in note
    templated = tok.apply_chat_template(
        [{"role": "user", "content": "16+44="}], tokenize=False, add_generation_prompt=True
    )
    assert repr(templated) in note and templated != "16+44="
    assert "puts them through" in chat_template_note("16+44=", tok, use_chat_template=True)
    assert chat_template_note([{"role": "user", "content": "16+44="}], tok) is None


def test_held_out_scorer_rule(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sums(4))
    task = load_task("file", path=str(data))
    mine = make_reward_spec(f"{write_reward(tmp_path)}:always_one")
    # the training reward, not math_accuracy because the rows have an answer (issue 50)
    acc, why = held_out_scorer(task, [mine])
    assert acc.fn is mine.fn and why == "the training reward"
    acc, why = held_out_scorer(task, [mine], "math_accuracy")
    assert acc.name == "math_accuracy" and why == "train.eval_reward"
    fmt = make_reward_spec("format")
    acc, why = held_out_scorer(task, [fmt, mine])
    assert acc.fn is fmt.fn and why == "the first of the 2 training rewards"
    acc, why = held_out_scorer(task, [fmt, mine], "always_one")
    assert acc.fn is mine.fn and why == "train.eval_reward"
    no_answer = load_task("file", path=str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "q"}])))
    acc, why = held_out_scorer(no_answer, [mine])
    assert acc.fn is mine.fn and why == "the training reward"
    # the scorer's own required column is checked too, and named as the scorer
    with pytest.raises(Exception, match="held-out scorer"):
        check_reward_columns(no_answer, [mine], make_reward_spec("math_accuracy"))


def write_reward(tmp_path: Path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(MY_REWARDS)
    return p


def test_data_path_is_saved_as_task_file(tmp_path):
    """Item 15: a --data run's config says what was used."""
    cfg = load_config(None, [("data.path", "x.jsonl")])
    assert cfg.data.task == "file"


# ----------------------------------------------------------------------------- items 3, 4


def test_missing_columns_stop_before_the_model_loads(walkthrough, capsys, monkeypatch):
    """The model path does not exist: an error about the data proves the check came first."""
    monkeypatch.chdir(walkthrough)
    base = ["train", "--data", "sums.jsonl", "--model", "no/such/model", "--steps", "1", *TINY]
    # a reward parameter no column matches: the columns that exist and the data.columns fix
    assert main([*base, "--reward", "my_rewards.py:needs_solution", "-o", "r1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "'needs_solution' needs the column 'solution'" in err
    assert "columns: prompt, answer" in err and "data.columns '{solution: answer}'" in err
    # a null answer in one row: file and line named
    rows = sums(6)
    rows[2]["answer"] = None
    write_jsonl(walkthrough / "sums.jsonl", rows)
    assert main([*base, "--reward", "my_rewards.py:exact", "-o", "r2"]) == 2
    err = capsys.readouterr().err
    assert "sums.jsonl: line 3: column 'answer' is missing or null" in err
    # a held-out scorer named apart from the rewards needs it too, even when they do not
    r3 = ["--reward", "my_rewards.py:always_one", "--train.eval_reward", "math_accuracy"]
    assert main([*base, *r3, "-o", "r3"]) == 2
    assert "held-out scorer (train.eval_reward)" in capsys.readouterr().err
    # no prompt column: data.columns named
    write_jsonl(walkthrough / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    assert main([*base[:2], "q.jsonl", *base[3:], "-o", "r4"]) == 2
    err = capsys.readouterr().err
    assert "missing column 'prompt'" in err and "data.columns" in err
    assert not any((walkthrough / r).exists() for r in ("r1", "r2", "r3", "r4"))


# ----------------------------------------------------------------------------- items 1, 2, 13, 15, 19


@pytest.mark.slow
def test_walkthrough_plain_prompts_scorer_epoch_and_eval_lines(walkthrough):
    """The docs/own-data.md run: plain-text sums with a TRL-style reward file on the bundled
    model, an eval split, an evaluation every step."""
    args = [
        "train",
        "--data",
        "sums.jsonl",
        "--reward",
        "my_rewards.py:exact",
        "--reward",
        "my_rewards.py:always_one",
        "--data.task_options.eval_fraction",
        "0.34",
        "--train.eval_size",
        "2",
        "--train.eval_samples",
        "2",
        "--train.eval_every",
        "1",
        "--train.display",
        "plain",
        "--steps",
        "2",
        *TINY,
    ]
    proc = cli([*args, "-o", "run"], walkthrough)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    run = walkthrough / "run"
    # item 1: what the model sees, either way
    assert "data.use_chat_template=auto feeds them as they are" in out
    assert "--data.use_chat_template true: 'Q:" in out  # the bundled model's chat template
    samples = jsonl(run / "samples.jsonl")
    assert samples and all(s["prompt_rendered"] == s["prompt"] for s in samples)
    # item 2: the scorer is named: the first training reward (issue 50)
    assert "held-out scorer: exact (the first of the 2 training rewards; train.eval_reward" in out
    # item 13: the evaluation of step 1 is on screen (step 2 is the final table)
    assert "eval after step 1 (2 held-out problems): pass@1_greedy" in out
    # item 15: config.yaml says what was used
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["task"] == "file"
    # item 19: 4 training rows, 2 a step
    steps = [m for m in jsonl(run / "metrics.jsonl") if "loss/policy" in m]
    assert [m["data/epoch"] for m in steps] == [0.5, 1.0]
    assert "4 training rows, 2 a step: 1.00 epochs in 2 steps" in out
    # the evaluation's own time, inside the step's wall time (training-time figures leave it out)
    assert 0 < steps[0]["time/eval_s"] < steps[0]["time/step_s"] and "time/eval_s" not in steps[1]

    # item 1 the other way: through the template; the report shows what the model saw
    proc = cli(
        [*args, "--data.use_chat_template", "true", "--train.eval_every", "0", "-o", "chat"],
        walkthrough,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.use_chat_template=true puts them through" in proc.stdout
    samples = jsonl(walkthrough / "chat/samples.jsonl")
    assert all(
        s["prompt_rendered"].startswith("Q:") and s["prompt"] in s["prompt_rendered"]
        for s in samples
    )
    assert main(["report", str(walkthrough / "chat"), "-o", str(walkthrough / "r.html")]) == 0
    page = (walkthrough / "r.html").read_text()
    assert "the model saw this" in page and "Q:" + samples[0]["prompt"] in page


@pytest.mark.slow
def test_eval_reward_scores_held_out_in_training_and_eval(walkthrough, capsys):
    """Item 2: train.eval_reward is the held-out scorer of the run and of `peergrade eval`."""
    args = [
        "train",
        "--data",
        str(walkthrough / "sums.jsonl"),
        "--reward",
        f"{walkthrough / 'my_rewards.py'}:always_one",
        "--data.task_options.eval_fraction",
        "0.34",
        "--train.eval_size",
        "2",
        "--train.eval_samples",
        "2",
        "--train.display",
        "plain",
        "--steps",
        "1",
        "--train.eval_reward",
        "always_one",
        *TINY,
        "-o",
        str(walkthrough / "run"),
    ]
    assert main(args) == 0
    assert "held-out scorer: always_one (train.eval_reward" in capsys.readouterr().out
    final = jsonl(walkthrough / "run/metrics.jsonl")[-1]
    assert final["eval/pass@1_greedy"] == final["eval/pass@1_sampled"] == 1.0
    assert main(["eval", "--model", str(walkthrough / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["scorer"] == "always_one" and result["pass@1_greedy"] == 1.0


# ----------------------------------------------------------------------------- item 5


@pytest.mark.slow
def test_eval_of_a_run_reproduces_its_held_out_table(tmp_path, capsys):
    """Item 5 and issue 24: `peergrade eval --model RUN_DIR` reads the run's config (stop
    strings, top_p, length, seed) and gives the numbers the run logged, sampled ones included
    (before: its own seed 0, and 0.417 sampled where the run logged 0.4375); an explicit
    --section.key wins over the run's config and the flags."""
    run = tmp_path / "run"
    args = [
        "train",
        "--steps",
        "1",
        "--train.eval_size",
        "12",
        "--train.eval_samples",
        "4",
        "--train.seed",
        "3",
        "--rollout.stop",
        '["\\n"]',
        "--rollout.top_p",
        "0.9",
        "--train.display",
        "none",
        *TINY,
        "-o",
        str(run),
    ]
    assert main(args) == 0
    final = jsonl(run / "metrics.jsonl")[-1]
    assert final.get("final") and 0 < final["eval/pass@1_sampled"] < 1  # numbers that can differ
    assert main(["eval", "--model", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"].endswith("config.yaml") and (result["n"], result["k"]) == (12, 4)
    for key in ("pass@1_greedy", "pass@1_sampled", "pass@4"):
        assert result[key] == pytest.approx(final[f"eval/{key}"], abs=1e-12), key
    # a flag changes one setting, a --section.key wins over it; a system prompt reaches the
    # prompts (the bundled model, trained without one, then answers differently)
    over = ["--k", "2", "--train.eval_samples", "3", "--data.system_prompt", "Add the numbers."]
    assert main(["eval", "--model", str(run), *over, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["k"] == 3 and result["pass@1_greedy"] != final["eval/pass@1_greedy"]
    # --config: another model (here the bundled one, where the run started) with the run's settings
    assert main(["eval", "--config", str(run / "config.yaml"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["n"], result["k"], result["config"]) == (12, 4, str(run / "config.yaml"))
