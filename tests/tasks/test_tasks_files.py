"""User datasets: every format, column mapping, chat prompts, splits, malformed rows."""

from __future__ import annotations

import itertools
import json

import pytest

from peergrade.tasks import load_task
from peergrade.tasks.files import DataError

ROWS = [
    {"question": "1+1?", "solution": "2", "level": 1},
    {"question": "2+2?", "solution": "4", "level": 2},
    {"question": "3+3?", "solution": "6", "level": 3},
    {"question": "4+4?", "solution": "8", "level": 4},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def take(it, n):
    return list(itertools.islice(it, n))


def check_loaded(task, answer_type=str):
    rows = take(task.train_rows(0), 4)
    assert sorted(r["prompt"] for r in rows) == [r["question"] for r in ROWS]
    by_prompt = {r["prompt"]: r for r in rows}
    assert by_prompt["3+3?"]["answer"] == answer_type("6")
    assert by_prompt["3+3?"]["level"] == 3
    assert set(task.columns) == {"answer", "level"}
    assert task.default_rewards == [("math_accuracy", 1.0)]


MAP = {"columns": {"prompt": "question", "answer": "solution"}}


def test_jsonl(tmp_path):
    check_loaded(load_task(str(write_jsonl(tmp_path / "d.jsonl", ROWS)), **MAP))


def test_json(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(ROWS))
    check_loaded(load_task("file", path=str(p), prompt_column="question", answer_column="solution"))


def test_csv(tmp_path):
    pytest.importorskip("pandas", reason="pandas is not installed (pip install pandas)")
    p = tmp_path / "d.csv"
    p.write_text(
        "question,solution,level\n"
        + "".join(f'{r["question"]},"{r["solution"]}",{r["level"]}\n' for r in ROWS)
    )
    # typed as datasets types them: the quoted "6" is the integer 6 there too
    check_loaded(load_task(str(p), **MAP), answer_type=int)


# a CSV with what type inference must get right: JSON text, ints with leading zeros, missing
# values (empty, NA), floats, bools, a blank line, a quoted multi-line cell
CSV_TEXT = (
    "prompt,answer,level,score,flag,meta,note\n"
    '"[{""role"": ""user"", ""content"": ""hi""}]",46,1,0.5,True,"{""a"": 1}",NA\n'
    "plain q,007,2,,False,x,\n"
    "\n"
    'third,-3,3,1e3,True,y,"multi\nline"\n'
)


def test_csv_reads_as_datasets_load_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    p = tmp_path / "d.csv"
    p.write_text(CSV_TEXT)
    theirs = datasets.load_dataset(
        "csv", data_files=str(p), split="train", cache_dir=str(tmp_path / "cache")
    ).to_list()
    task = load_task(str(p))
    ours = sorted(take(task.train_rows(0), 3), key=lambda r: r["level"])
    assert ours == theirs
    assert ours[0]["prompt"] == '[{"role": "user", "content": "hi"}]'  # JSON text stays text
    assert ours[0]["answer"] == 46 and ours[1]["answer"] == 7 and ours[1]["score"] is None


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    check_loaded(load_task(str(p), **MAP))


def test_hf_datasets_dir(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="datasets is not installed (pip install datasets)"
    )
    d = tmp_path / "hf"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(d))
    check_loaded(load_task(str(d), **MAP))
    dd = tmp_path / "hfdict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(dd))
    task = load_task(str(dd), **MAP)
    assert task.has_eval and [r["prompt"] for r in task.eval_rows(5)] == ["1+1?"]


def test_chat_prompts_and_system_prompt(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
        {
            "prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}],
            "answer": "2",
        },
        {"prompt": "plain", "answer": "3"},
    ]
    task = load_task(str(write_jsonl(tmp_path / "c.jsonl", rows)), system_prompt="SYS")
    got = {r["answer"]: r["prompt"] for r in take(task.train_rows(0), 3)}
    assert got["1"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    assert got["2"][0] == {"role": "system", "content": "own"}  # the row's own system wins
    assert got["3"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "plain"}]


def test_reserved_column_names_are_refused(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "trainer_state": 1}])
    with pytest.raises(DataError, match=r"d\.jsonl: line 1: column 'trainer_state'.*rename"):
        load_task(str(p))
    # mapped away, it is fine
    task = load_task(str(p), columns={"state": "trainer_state"})
    assert take(task.train_rows(0), 1)[0]["state"] == 1


def test_eval_fraction_split_is_disjoint_and_seeded(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(50)]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    task = load_task(path, eval_fraction=0.2)
    ev = task.eval_rows(100)
    train = {r["prompt"] for r in take(task.train_rows(0), 200)}
    assert len(ev) == 10 and len(train) == 40
    assert train.isdisjoint({r["prompt"] for r in ev})
    assert ev == load_task(path, eval_fraction=0.2).eval_rows(100)
    assert ev != load_task(path, eval_fraction=0.2, split_seed=1).eval_rows(100)
    # train cycles with a new shuffle each epoch, deterministically
    s = take(task.train_rows(0), 80)
    assert s == take(task.train_rows(0), 80) and s[:40] != s[40:]
    assert sorted(r["prompt"] for r in s[:40]) == sorted(r["prompt"] for r in s[40:])


def test_eval_path_and_no_eval(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}]))
    ev = str(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "b", "answer": "2"}]))
    assert load_task(path, eval_path=ev).eval_rows(5) == [{"prompt": "b", "answer": "2"}]
    task = load_task(path)
    assert not task.has_eval
    with pytest.raises(ValueError, match="no held-out split"):
        task.eval_rows(1)


def test_no_answer_column_means_no_default_reward(tmp_path):
    task = load_task(str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "tests": "x"}])))
    assert task.default_rewards == [] and task.columns == ("tests",)


BAD_JSONL = [
    ('{"prompt": "a"}\n{"prompt": "b"\n', r"d\.jsonl: line 2: invalid JSON"),
    ('{"prompt": "a"}\n\n{"question": "b"}\n', r"d\.jsonl: line 3: missing column 'prompt'"),
    ('{"prompt": "a"}\n{"prompt": "  "}\n', r"line 2: empty prompt"),
    ('{"prompt": 5}\n', r"line 1: prompt must be a string or a list of chat messages, got int"),
    ('{"prompt": []}\n', r"line 1: prompt is an empty message list"),
    ('{"prompt": [{"role": "bot", "content": "x"}]}\n', r"line 1: prompt message 0 has role 'bot'"),
    ('{"prompt": [{"role": "user"}]}\n', r"line 1: prompt message 0 must be an object"),
    ("[1, 2]\n", r"line 1: expected an object, got list"),
    ("", r"no rows"),
]


@pytest.mark.parametrize("text, match", BAD_JSONL)
def test_malformed_jsonl_names_file_and_line(tmp_path, text, match):
    p = tmp_path / "d.jsonl"
    p.write_text(text)
    with pytest.raises(DataError, match=match):
        load_task(str(p))


def test_missing_mapped_column(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "sol": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"line 2: missing column 'sol' \(mapped to 'answer'\)"):
        load_task(str(p), answer_column="sol")
    p = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"e\.jsonl: line 2: missing column 'answer'"):
        load_task(str(p), answer_column="answer")
    # an unmapped column that some rows lack is None there
    rows = {r["prompt"]: r for r in take(load_task(str(p)).train_rows(0), 2)}
    assert rows["b"]["answer"] is None


def test_malformed_other_formats(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('{"prompt": "a"}')
    with pytest.raises(DataError, match="expected a JSON list"):
        load_task(str(p))
    p.write_text('[{"prompt": "a"}, {"prompt": ""}]')
    with pytest.raises(DataError, match=r"d\.json: row 2: empty prompt"):
        load_task(str(p))
    c = tmp_path / "d.csv"
    c.write_text("prompt,answer\na,1\nb,2,3\n")
    with pytest.raises(DataError, match=r"d\.csv: line 3: 3 cells but the header has 2"):
        load_task(str(c))
    c.write_text("prompt,answer\na,1\n,2\n")
    with pytest.raises(DataError, match=r"d\.csv: line 3: empty prompt"):
        load_task(str(c))
    with pytest.raises(DataError, match="does not exist"):
        load_task(str(tmp_path / "nope.jsonl"))
    t = tmp_path / "d.txt"
    t.write_text("x")
    with pytest.raises(DataError, match="unknown dataset format '.txt'"):
        load_task("file", path=str(t))


def test_bad_options(tmp_path):
    p = str(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}]))
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        load_task(p, eval_fraction=1.5)
    with pytest.raises(ValueError, match="not both"):
        load_task(p, eval_fraction=0.5, eval_path=p)
    with pytest.raises(ValueError, match="conflicts"):
        load_task(p, prompt_column="q", columns={"prompt": "x"})
