"""``SFTSettings``: the supervised warm-up's options are checked when the record is built (no
model loads), and ``run_sft`` refuses an occupied output directory before it reads them."""

from __future__ import annotations

import pytest

from peergrade.training.checkpoint import RunDirError
from peergrade.training.sft import SFTSettings, run_sft


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(steps=0), r"steps and batch_size must be >= 1 and lr > 0 \(got 0, 64, 0.003\)"),
        (dict(batch_size=0), r"steps and batch_size must be >= 1 and lr > 0 \(got 300, 0,"),
        (dict(lr=0.0), r"lr > 0 \(got 300, 64, 0.0\)"),
        (dict(tool_fraction=1.5), r"tool_fraction must be in \[0, 1\] \(got 1.5\)"),
        (dict(tool_fraction=0.5, tools=["f.py:fn"]), "--tool-fraction .* cannot be added"),
        (dict(tool_fraction=0.5, task="gsm8k"), "needs the arithmetic task .* got 'gsm8k'"),
    ],
)
def test_bad_settings_are_refused_when_built(kw, match):
    with pytest.raises(ValueError, match=match):
        SFTSettings(**kw)


def test_settings_defaults_and_normalised_collections():
    s = SFTSettings()
    assert (s.task, s.steps, s.batch_size, s.lr, s.seed) == ("arithmetic", 300, 64, 3e-3, 0)
    assert s.task_options == {} and s.tools == ()
    given = SFTSettings(task_options=None, tools=["a.py:f"])
    assert given.task_options == {} and given.tools == ("a.py:f",)


def test_an_occupied_output_dir_is_refused_before_any_model_loads(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(RunDirError, match="exists and is not empty; pass --overwrite"):
        run_sft(out=str(out), init="qwen2", model=None, settings=SFTSettings(steps=1))
    assert (out / "x").read_text() == "keep me"
