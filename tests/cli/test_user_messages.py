"""What a new user reads (issue 23 items 11, 12, 14): ``peergrade eval --data FILE`` scores the
file's rows; an unknown task option is named with the valid ones, in words; the rich display
keeps the step counter and the ETA on a narrow terminal."""

from __future__ import annotations

import io
import json
import re

import pytest

from peergrade.cli import build_parser, main
from peergrade.monitoring.metrics import Display
from peergrade.tasks import load_task


def test_eval_data_scores_the_files_rows(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--n", "3", "--k", "2"]
    assert main([*args, "--max-new-tokens", "2", "--json"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 3 and result["task"] == str(data)


def test_eval_names_the_file_its_held_out_rows_come_from(tiny_model_dir, tmp_path, capsys):
    """A config's data.eval_path (the convert example's eval.jsonl beside train.jsonl): the
    result says the rows came from it, not only the training file the task is named by."""
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for path, n in ((train, 6), (held, 4)):
        rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "--model", str(tiny_model_dir), "--data", str(train), "--n", "4"]
    args += ["--task-option", f"eval_path={held}", "--k", "1", "--max-new-tokens", "2"]
    assert main([*args, "--json"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == str(train) and result["eval_data"] == str(held)
    assert main(args) == 0
    assert f"problems: 4 (from {held})" in capsys.readouterr().out


def test_eval_help_documents_data():
    text = build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    assert "--data FILE" in text and "the rows to evaluate" in text
    assert "eval --model runs/X --data test.jsonl" in text


@pytest.mark.parametrize(
    "task, option, expected",
    [
        ("arithmetic", "max_digit", r"no option 'max_digit' \(did you mean 'max_digits'\?\)"),
        ("file", "eval_pth", r"no option 'eval_pth' \(did you mean 'eval_path'\?\)"),
    ],
)
def test_unknown_task_option_is_named_in_words(task, option, expected, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    options = {option: 1, **({"path": str(tmp_path / "d.jsonl")} if task == "file" else {})}
    with pytest.raises(ValueError) as info:
        load_task(task, **options)
    msg = str(info.value)
    assert re.search(expected, msg), msg
    assert "its options are" in msg and "__init__" not in msg and "keyword argument" not in msg


def test_unknown_task_option_through_the_cli(capsys):
    assert main(["eval", "--task", "arithmetic", "--task-option", "colour=red"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no option 'colour'" in err and "max_digits" in err


@pytest.mark.parametrize("width", [60, 80])
def test_rich_display_keeps_counter_and_eta_when_narrow(width):
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width)
    display = Display("rich", 250, console=console)
    metrics = {
        "reward/total/mean": 0.422,
        "reward/accuracy": 0.453,
        "kl/mean": 0.0012,
        "rollout/len_mean": 5.25,
        "perf/tokens_per_s": 1234.0,
    }
    try:
        display.update(12, metrics)
        console.file.truncate(0)
        console.file.seek(0)
        console.print(display._progress.get_renderable())
    finally:
        display.close()
    text = console.file.getvalue()
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    assert "12/250" in lines[0] and re.search(r"(-:--:--|\d+:\d\d:\d\d)$", lines[0].rstrip()), text
    assert "reward 0.422" in text and "tok/s 1234" in text and "…" not in text
