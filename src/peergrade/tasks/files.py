"""User datasets as tasks: JSONL, JSON, CSV, Parquet files or a local HF ``datasets`` directory.

``load_task("file", path=..., **options)`` or ``load_task("data/my.jsonl", **options)``; rows
already in memory (a list of dicts, a ``datasets.Dataset`` or ``DatasetDict``: the Python API's
``train_dataset`` / ``eval_dataset``) are ``load_task("file", data=..., eval_data=...)`` and go
through the same checks, named ``train_dataset: row N``.

Formats (by suffix; a directory is a ``datasets.save_to_disk`` layout):

- ``.jsonl``: one JSON object per line; blank lines are skipped; rows are numbered by their
  1-based line number.
- ``.json``: a list of objects (rows numbered 1, 2, ... in list order).
- ``.csv``: read as ``datasets.load_dataset("csv", ...)`` reads it: ``pandas.read_csv`` with
  its defaults, then Arrow (imported lazily; ``pip install 'peergrade[data]'``). So values are
  typed as pandas infers them per column (a column of integers gives ints, of numbers floats,
  ``True``/``False`` bools, anything else strings), an empty cell (or ``NA``, ``null``, ...)
  is ``None``, and a cell holding JSON text stays that string (a prompt cell too: it is fed as
  text, as TRL does). A row with more cells than the header is an error; rows are numbered by
  their line (the header being line 1).
- ``.parquet``: read with ``pyarrow`` (imported lazily; rows numbered 1, 2, ...).
- directory: ``datasets.load_from_disk`` (imported lazily); a ``DatasetDict`` gives its
  ``train`` split, and its ``test`` or ``validation`` split as the eval split unless
  ``eval_path``/``eval_fraction`` say otherwise.

Columns: ``columns={"prompt": "question", "answer": "solution"}`` maps our names to the file's
column names; ``prompt_column=``/``answer_column=`` are shorthands for the two common ones.
Every row must have the prompt column and each mapped column (else: file, row number and the
missing column). The other columns are kept as they are and passed to reward functions
(``Task.columns`` lists them; a row lacking one gets ``None``); a column may not be named like
an argument the trainer passes itself (``prompts``, ``completions``, ``trainer_state``,
``log_extra``, ``log_metric``). Prompts are a non-empty string
or a non-empty list of ``{"role": "system"|"user"|"assistant", "content": str}`` messages.
``system_prompt`` turns each prompt into a message list that starts with that system message
(unless the row's messages already start with a system message).

Eval split: ``eval_path`` (another file, same options), or ``eval_fraction`` in (0, 1): a
seeded shuffle (``split_seed``) of the rows puts ``round(eval_fraction * N)`` rows (at least
one) in eval and the rest in train. Without either there is no eval split (``has_eval`` is
False and ``eval_rows`` raises). ``eval_rows(n)`` returns the first ``min(n, size)`` eval rows
in file order (a file cannot invent more). ``train_rows(seed)`` cycles over the train rows with
a fresh seeded shuffle every epoch.

Default rewards: ``math_accuracy`` when the rows have an ``answer`` column, else none (name
one with ``--reward``).

This module does not tokenize or apply chat templates.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from pathlib import Path

from peergrade.errors import PeergradeError, require

from ..rewards.registry import CONTRACT_KWARGS
from .base import Task, missing_column_message, rewards_phrase

__all__ = ["FileTask", "DataError", "dataset_rows", "memory_rows", "read_rows"]

_ROLES = ("system", "user", "assistant")


class DataError(PeergradeError, ValueError):
    """A malformed dataset file or row (the message names the file and row)."""


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {lineno}: invalid JSON ({exc.msg})") from None
    return out


def _read_json(path: Path) -> list[tuple[int, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, list):
        raise DataError(
            f"{path}: expected a JSON list of row objects, got a {type(data).__name__} "
            "(use .jsonl for one object per line)"
        )
    return list(enumerate(data, start=1))


def _csv_line_numbers(path: Path) -> list[int]:
    """The line each CSV record ends on (``csv`` module), checking that none has more cells
    than the header (pandas would take an extra leading column as the index, or fail)."""
    lines = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: empty CSV file (expected a header row)")
        for cells in reader:
            if not cells:
                continue  # a blank line, skipped by pandas too
            if len(cells) > len(header):
                raise DataError(
                    f"{path}: line {reader.line_num}: {len(cells)} cells but the header has "
                    f"{len(header)} columns"
                )
            lines.append(reader.line_num)
    return lines


def _read_csv(path: Path) -> list[tuple[int, object]]:
    # CSV is read as datasets reads it: pandas, then Arrow
    pd = require("pandas", needed_for=f"reading {path}", pip="pandas", extra="data")
    pa = require("pyarrow", needed_for=f"reading {path}", pip="pyarrow", extra="data")
    lines = _csv_line_numbers(path)
    try:
        # datasets' CSV builder: pd.read_csv with pandas' defaults, then pa.Table.from_pandas
        rows = pa.Table.from_pandas(pd.read_csv(path)).to_pylist()
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: empty CSV file (expected a header row)") from None
    except Exception as exc:
        raise DataError(f"{path}: cannot read CSV: {type(exc).__name__}: {exc}") from exc
    if len(lines) != len(rows):  # the two parsers disagree on an odd file: number the rows
        lines = [i + 2 for i in range(len(rows))]
    return list(zip(lines, rows))


def _read_parquet(path: Path) -> list[tuple[int, object]]:
    pq = require("pyarrow.parquet", needed_for=f"reading {path}", pip="pyarrow", extra="data")
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot read Parquet: {type(exc).__name__}: {exc}") from exc
    return list(enumerate(table.to_pylist(), start=1))


def _read_hf_dir(path: Path) -> tuple[list[tuple[int, object]], list[tuple[int, object]] | None]:
    datasets = require(
        "datasets",
        needed_for=f"reading the datasets directory {path}",
        pip="datasets",
        extra="data",
    )
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: not a Hugging Face datasets directory (save_to_disk layout): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return dataset_rows(ds, str(path))


def dataset_rows(ds, where: str):
    """(numbered rows, numbered eval rows or None) of a ``datasets.Dataset`` or ``DatasetDict``
    already in memory: a DatasetDict gives its ``train`` split, and its ``test`` or
    ``validation`` split as the eval split."""
    eval_part = None
    if hasattr(ds, "keys") and not hasattr(ds, "to_list"):  # a DatasetDict (or a plain dict)
        if "train" not in ds:
            raise DataError(f"{where}: DatasetDict has no 'train' split (splits: {list(ds)})")
        for name in ("test", "validation"):
            if name in ds:
                eval_part = list(enumerate(ds[name].to_list(), start=1))
                break
        ds = ds["train"]
    return list(enumerate(ds.to_list(), start=1)), eval_part


def memory_rows(data, where: str):
    """(numbered rows, numbered eval rows or None) of rows given in memory: a list of dicts, a
    ``datasets.Dataset`` or a ``DatasetDict`` (what the Python API's ``train_dataset`` takes)."""
    if isinstance(data, (list, tuple)):
        return list(enumerate(data, start=1)), None
    if hasattr(data, "to_list") or hasattr(data, "keys"):
        return dataset_rows(data, where)
    raise DataError(
        f"{where}: expected a datasets.Dataset, a DatasetDict or a list of dicts, got "
        f"{type(data).__name__}"
    )


def _not_utf8(path: Path) -> str:
    """The first line of ``path`` that is not UTF-8, named with its byte column and bytes."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = line[exc.start : exc.end]
                return (
                    f"{path}: line {lineno}: not UTF-8 (byte {exc.start + 1} of the line, "
                    f"{bad!r}); dataset files are read as UTF-8: convert it, e.g. `iconv -f "
                    f"latin1 -t utf-8 {path.name} > utf8-{path.name}`"
                )
    return f"{path}: not UTF-8; dataset files are read as UTF-8"


def read_rows(path) -> tuple[list[tuple[int, object]], list[tuple[int, object]] | None]:
    """(numbered raw rows, numbered raw eval rows of a DatasetDict or None) of ``path``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"dataset {str(path)!r} does not exist")
    if path.is_dir():
        return _read_hf_dir(path)
    suffix = path.suffix.lower()
    text_readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}
    if suffix in text_readers:
        try:
            return text_readers[suffix](path), None
        except UnicodeDecodeError:
            raise DataError(_not_utf8(path)) from None
    elif suffix == ".parquet":
        return _read_parquet(path), None
    else:
        raise DataError(
            f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .json, .csv, .parquet "
            "or a Hugging Face datasets directory"
        )


def _check_prompt(prompt, where: str):
    if prompt is None:
        raise DataError(f"{where}: empty prompt (no value)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{where}: prompt is an empty message list")
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(
                    f"{where}: prompt message {j} must be an object with 'role' and 'content', "
                    f"got {m!r}"
                )
            if m["role"] not in _ROLES:
                raise DataError(
                    f"{where}: prompt message {j} has role {m['role']!r}; expected one of "
                    f"{', '.join(_ROLES)}"
                )
            if not isinstance(m["content"], str):
                raise DataError(
                    f"{where}: prompt message {j} content must be a string, got "
                    f"{type(m['content']).__name__}"
                )
        if not any(str(m["content"]).strip() for m in prompt):
            raise DataError(f"{where}: every prompt message is empty")
        return [dict(m) for m in prompt]
    raise DataError(
        f"{where}: prompt must be a string or a list of chat messages, got "
        f"{type(prompt).__name__} ({prompt!r:.60})"
    )


def _column_mapping(columns: dict | None, prompt_column, answer_column) -> dict[str, str]:
    """Our column names -> the file's, from ``columns`` and the two shorthands (checked)."""
    mapping = dict(columns or {})
    for ours, given in (("prompt", prompt_column), ("answer", answer_column)):
        if given is not None:
            if ours in mapping and mapping[ours] != given:
                raise ValueError(
                    f"{ours}_column={given!r} conflicts with columns[{ours!r}]={mapping[ours]!r}"
                )
            mapping[ours] = given
    mapping.setdefault("prompt", "prompt")
    for k, v in mapping.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"columns must map names to file column names, got {k!r}: {v!r}")
    return mapping


def _check_sources(path, data, eval_data, eval_path, eval_fraction) -> None:
    """Raise unless exactly one train source and at most one eval source are given."""
    if eval_path is not None and eval_fraction is not None:
        raise ValueError("give eval_path or eval_fraction, not both")
    if eval_fraction is not None and not 0.0 < float(eval_fraction) < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    if (path is None) == (data is None):
        raise ValueError("give a dataset path or in-memory rows (data=...), exactly one")
    if eval_data is not None and (eval_path is not None or eval_fraction is not None):
        raise ValueError("give eval_data, eval_path or eval_fraction, only one")


def _hold_out(rows: list[dict], where: list[str], eval_fraction: float, split_seed: int):
    """Split ``eval_fraction`` of the rows off by a seeded shuffle: (rows, where, eval_rows,
    eval_where), each side in file order."""
    order = list(range(len(rows)))
    random.Random(f"file-split/{split_seed}").shuffle(order)
    k = max(1, round(float(eval_fraction) * len(rows)))
    if k >= len(rows):
        raise ValueError(
            f"eval_fraction={eval_fraction} leaves no training rows out of {len(rows)}"
        )
    held = set(order[:k])
    eval_rows = [r for i, r in enumerate(rows) if i in held]
    eval_where = [w for i, w in enumerate(where) if i in held]
    rows = [r for i, r in enumerate(rows) if i not in held]
    where = [w for i, w in enumerate(where) if i not in held]
    return rows, where, eval_rows, eval_where


def _fill_columns(rows: list[dict]) -> list[str]:
    """The non-prompt column names in first-seen order; rows lacking one get ``None`` there."""
    names = []
    for r in rows:
        for k in r:
            if k != "prompt" and k not in names:
                names.append(k)
    for r in rows:  # a column some rows lack: None there
        for k in names:
            r.setdefault(k, None)
    return names


class FileTask(Task):
    """Rows from a user dataset file or directory (see module docstring)."""

    name = "file"

    def __init__(
        self,
        path=None,
        *,
        data=None,
        eval_data=None,
        prompt_column: str | None = None,
        answer_column: str | None = None,
        columns: dict | None = None,
        system_prompt: str | None = None,
        eval_path=None,
        eval_fraction: float | None = None,
        split_seed: int = 0,
    ):
        mapping = _column_mapping(columns, prompt_column, answer_column)
        _check_sources(path, data, eval_data, eval_path, eval_fraction)
        # in-memory rows are named as the Python API's arguments are in messages
        self.path = Path(path) if path is not None else Path("train_dataset")
        self.mapping = mapping
        self.system_prompt = system_prompt

        raw, raw_eval = read_rows(self.path) if data is None else memory_rows(data, "train_dataset")
        rows, where = self._convert(raw, self.path)
        if not rows:
            raise DataError(f"{self.path}: no rows")
        eval_where: list[str] = []
        if eval_path is not None:
            eval_raw, _ = read_rows(eval_path)
            eval_rows, eval_where = self._convert(eval_raw, Path(eval_path))
        elif eval_data is not None:
            eval_raw, _ = memory_rows(eval_data, "eval_dataset")
            eval_rows, eval_where = self._convert(eval_raw, Path("eval_dataset"))
        elif eval_fraction is not None:
            rows, where, eval_rows, eval_where = _hold_out(rows, where, eval_fraction, split_seed)
        elif raw_eval is not None:
            eval_rows, eval_where = self._convert(raw_eval, self.path / "<eval split>")
        else:
            eval_rows = None
        # "file: line N" of every row, for the column check before the model loads
        self._where = where + eval_where
        self._train = rows
        self._eval = eval_rows
        self.has_eval = eval_rows is not None
        names = _fill_columns(rows + (eval_rows or []))
        self.columns = tuple(names)
        self.default_rewards = [("math_accuracy", 1.0)] if "answer" in names else []

    def _convert(self, raw: list[tuple[int, object]], path: Path) -> tuple[list[dict], list[str]]:
        """The rows of ``raw`` in our column names, and where each came from."""
        is_jsonl_or_csv = path.suffix.lower() in (".jsonl", ".csv")
        unit = "line" if is_jsonl_or_csv else "row"
        inverse = {v: k for k, v in self.mapping.items()}
        out, wheres = [], []
        for num, obj in raw:
            where = f"{path}: {unit} {num}"
            wheres.append(where)
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected an object, got {type(obj).__name__}")
            for ours, theirs in self.mapping.items():
                if theirs not in obj:
                    raise DataError(
                        f"{where}: missing column {theirs!r}"
                        + (f" (mapped to {ours!r})" if theirs != ours else "")
                        + f"; the row has {sorted(obj)}. Map the file's columns to ours with "
                        "data.columns, e.g. --data.columns '{prompt: question, answer: solution}' "
                        "(ours: theirs)"
                    )
            row = {inverse.get(k, k): v for k, v in obj.items()}
            reserved = sorted(k for k in row if k in CONTRACT_KWARGS)
            if reserved:
                raise DataError(
                    f"{where}: column {reserved[0]!r} has the name of an argument the trainer "
                    f"passes reward functions itself ({', '.join(CONTRACT_KWARGS)}); rename it "
                    "in the file or map it with data.columns"
                )
            row["prompt"] = _check_prompt(row["prompt"], where)
            if self.system_prompt:
                msgs = (
                    [{"role": "user", "content": row["prompt"]}]
                    if isinstance(row["prompt"], str)
                    else row["prompt"]
                )
                if msgs[0]["role"] != "system":
                    msgs = [{"role": "system", "content": self.system_prompt}] + msgs
                row["prompt"] = msgs
            out.append(row)
        return out, wheres

    def check_columns(self, required: dict[str, list[str]]) -> None:
        """Every row has a non-null value for every column a reward requires (``{column:
        [reward names]}``); else ``DataError`` naming the file, the row and the column."""
        rows = self._train + (self._eval or [])
        for column, who in required.items():
            if column not in self.columns:
                raise DataError(missing_column_message(column, who, str(self.path), self.columns))
            for row, where in zip(rows, self._where):
                if row.get(column) is None:
                    raise DataError(
                        f"{where}: column {column!r} is missing or null, and "
                        f"{rewards_phrase(who)} {'needs' if len(who) == 1 else 'need'} it in "
                        "every row (fill it in, or drop the row)"
                    )

    def __len__(self) -> int:
        return len(self._train)

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        epoch = 0
        while True:
            order = list(range(len(self._train)))
            random.Random(f"file/train/{seed}/{epoch}").shuffle(order)
            for i in order:
                yield dict(self._train[i])
            epoch += 1

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        if self._eval is None:
            raise ValueError(
                f"{self.path}: no held-out split; pass eval_path=... or eval_fraction=..."
            )
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"eval_rows n must be an integer >= 0, got {n!r}")
        return [dict(r) for r in self._eval[:n]]
