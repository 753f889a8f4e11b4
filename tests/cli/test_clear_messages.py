"""What a user reads when something they typed cannot work (issue 53, part 2): one line that
says why and what to do instead, no traceback."""

from __future__ import annotations

import pytest

from peergrade.cli import main


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_hub_id_as_the_model_says_no_hub_is_reached(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [command, "--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    args += ["--steps", "1", "-o", str(tmp_path / "run")] if command == "train" else []
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "Hub id" in err and "never reaches a model hub" in err
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_absolute_path_gets_no_hub_hint(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Hub" not in err


@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        (
            "d.jsonl",
            b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n',
            2,
        ),
        (
            "d.json",
            b'[{"prompt": "1+1=", "answer": "2"},\n{"prompt": "caf\xe9", "answer": "3"}]',
            2,
        ),
        ("d.csv", b"prompt,answer\n1+1=,2\n2+2=,4\ncaf\xe9,3\n", 4),
    ],
)
def test_a_data_file_that_is_not_utf8_is_named_with_its_line(name, content, line, tmp_path):
    from peergrade.tasks.files import DataError, read_rows

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        read_rows(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: line {line}: not UTF-8") and "b'\\xe9'" in msg, msg
    assert "iconv" in msg


def test_bf16_on_a_cpu_without_bf16_units_is_said_once(monkeypatch):
    from peergrade.config import Config
    from peergrade.training import update

    cfg = Config()
    cfg.model.autocast = "bf16"
    monkeypatch.setattr(update, "cpu_bf16_kind", lambda: None)
    note = update.bf16_cpu_note(cfg, "cpu")
    assert note is not None and "emulated" in note and "model.autocast bf16" in note
    assert update.bf16_cpu_note(cfg, "cuda") is None  # a GPU's bf16 is its own
    monkeypatch.setattr(update, "cpu_bf16_kind", lambda: "avx512_bf16")
    assert update.bf16_cpu_note(cfg, "cpu") is None
    cfg.model.autocast = "auto"
    monkeypatch.setattr(update, "cpu_bf16_kind", lambda: None)
    assert update.bf16_cpu_note(cfg, "cpu") is None  # auto decides by itself


def test_start_up_says_what_precision_auto_chose(tmp_path, capsys):
    args = ["train", "-o", str(tmp_path / "run"), "--steps", "1", "--train.threads", "1"]
    args += ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    args += ["--rollout.max_completion_length", "4", "--train.eval_size", "4"]
    assert main([*args, "--train.display", "plain"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("precision: float32 (model.autocast auto: the model has 0.") == 1, text


def test_start_up_says_bf16_is_emulated_and_the_producer_is_on(monkeypatch, tmp_path, capsys):
    """A short demo run with bf16 asked for on a CPU without bf16 units (simulated) and
    pipelined rollouts: both are said at start-up, once."""
    from peergrade.training import update

    monkeypatch.setattr(update, "cpu_bf16_kind", lambda: None)
    args = ["train", "-o", str(tmp_path / "run"), "--steps", "2", "--train.threads", "1"]
    args += ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    args += ["--rollout.max_completion_length", "4", "--train.eval_size", "4"]
    args += ["--model.autocast", "bf16", "--rollout.async_steps", "1"]
    args += ["--rollout.producer", "thread", "--train.display", "plain"]
    assert main(args) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("bf16 is emulated here") == 1, text
    assert text.count("pipelined rollouts: a producer thread") == 1, text


def test_the_progress_line_has_one_kl_form(capsys):
    """beta 0 (no reference): no kl field at all, whether the update ran (kl/mean 0.0) or was
    skipped (no kl/mean); beta > 0: the measured value, or '-' when none was measured."""
    from peergrade.monitoring.metrics import Display

    off = Display("plain", 3, show_kl=False)
    off.update(1, {"reward/total/mean": 0.5, "kl/mean": 0.0})
    off.update(2, {"reward/total/mean": 0.5})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert len(lines) == 2 and not any(" kl " in ln for ln in lines), lines
    on = Display("plain", 3)
    on.update(1, {"kl/mean": 0.0123})
    on.update(2, {})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert " kl 0.0123 " in lines[0] and " kl - " in lines[1], lines


def test_an_address_space_limit_too_small_for_torch_names_the_limit(tmp_path):
    """``ulimit -v`` below what importing torch maps: one line naming the limit and what it
    counts, not torch's ImportError traceback (or an empty MemoryError)."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    import peergrade

    limit = 300 * 2**20  # bytes: below torch's own mapping, above the interpreter's

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = dict(os.environ, PYTHONPATH=str(Path(peergrade.__file__).parents[1]))
    cmd = [sys.executable, "-m", "peergrade", "train", "--steps", "1", "-o", str(tmp_path / "r")]
    out = subprocess.run(cmd, env=env, preexec_fn=cap, capture_output=True, text=True, timeout=300)
    err = out.stderr.strip()
    assert out.returncode == 1, err[-2000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("error: ") and "ulimit -v 307200" in err and "address space" in err


def test_out_of_memory_inside_a_command_is_one_line(monkeypatch, capsys):
    import resource

    from peergrade.cli import train

    def exhausted(args, extra):
        raise MemoryError()

    monkeypatch.setattr(train, "run", exhausted)  # add_parser reads it when main builds
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY,) * 2)
    assert main(["train", "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: out of memory:") and "peergrade memory" in err
