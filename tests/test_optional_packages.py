"""Every missing optional package is one ``error:`` line with the pip command, exit 2 (issue 23
item 10): the import sites go through ``peergrade.errors.require``."""

from __future__ import annotations

import sys

import pytest

from peergrade import cli
from peergrade.errors import MissingPackageError, PeergradeError, require


def test_require_names_the_feature_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    with pytest.raises(MissingPackageError) as info:
        require("pandas", needed_for="reading x.csv", pip="pandas", extra="data")
    msg = str(info.value)
    assert msg.startswith("reading x.csv needs pandas, which is not installed")
    assert "pip install pandas" in msg and "peergrade[data]" in msg
    assert isinstance(info.value, (PeergradeError, ImportError))


def test_csv_without_pandas_is_one_error_line_exit_2(tmp_path, monkeypatch, capsys):
    data = tmp_path / "rows.csv"
    data.write_text("prompt,answer\n1+1=,2\n")
    monkeypatch.setitem(sys.modules, "pandas", None)
    code = cli.main(["train", "--data", str(data), "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "pip install pandas" in lines[0] and "rows.csv" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "module, call",
    [
        ("pyarrow", lambda p: __import__("peergrade.tasks.files").tasks.files._read_parquet(p)),
        ("datasets", lambda p: __import__("peergrade.tasks.files").tasks.files._read_hf_dir(p)),
        ("reasoning_gym", lambda p: __import__("peergrade.tasks.logic").tasks.logic._rg()),
        (
            "matplotlib",
            lambda p: __import__("peergrade.monitoring.report").monitoring.report._mpl(),
        ),
        (
            "starlette",
            lambda p: __import__("peergrade.serving.server").serving.server.build_app(None),
        ),
        (
            "uvicorn",
            lambda p: __import__("peergrade.serving.server").serving.server.Server(None),
        ),
    ],
)
def test_each_optional_import_is_a_missing_package_error(module, call, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingPackageError, match="pip install"):
        call(tmp_path / "data.parquet")


def test_lora_without_peft(monkeypatch, tiny_qwen2):
    from peergrade.model.load import apply_lora

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingPackageError, match="pip install peft"):
        apply_lora(tiny_qwen2[0], r=2, alpha=4)


def test_reward_file_importing_a_missing_package(tmp_path, capsys):
    f = tmp_path / "my_rewards.py"
    f.write_text("import surely_not_installed_pkg\n\ndef fn(completions, **kw):\n    return []\n")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    code = cli.main(
        ["train", "--data", str(data), "--reward", f"{f}:fn", "-o", str(tmp_path / "r")]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "surely_not_installed_pkg" in err and "pip install" in err
