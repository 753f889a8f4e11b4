"""The example a new user copies (issue 23 item 18, "Done when"): one ``sums.jsonl`` and one
``my_rewards.py:exact`` on every page a new user reads first. The README's ``my_rewards.py``
scores the rows of docs/own-data.md (the walk-through tests/test_walkthrough.py runs) as plain
text and as chat, matches exactly (the answer "17" earns nothing for "171"), and every page
that shows the reward file or the rows shows the same ones, and names no other reward."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(# my_rewards\.py\n.*?)```", re.S)
# "`sums.jsonl`:" (or "`sums.jsonl`, a few words:"), then the rows
ROWS = re.compile(r"`sums\.jsonl`[^`]*?:\n\n```jsonl\n(.*?)```", re.S)
# the pages a new user reads first: own data, own reward, evaluation, resume
FIRST_PAGES = ["README.md", "docs/own-data.md", "docs/rewards.md", "docs/resume.md"]


def _example(path: Path) -> str:
    found = BLOCK.findall(path.read_text())
    assert found, f"{path.name} lost its my_rewards.py example"
    return found[0]


def _exact():
    namespace: dict = {}
    exec(_example(ROOT / "README.md"), namespace)
    return namespace["exact"]


def _rows(path: Path) -> str:
    found = ROWS.findall(path.read_text())
    assert found, f"{path.name} lost its sums.jsonl example (`sums.jsonl`: then the rows)"
    return found[0]


def _jsonl_rows() -> list[dict]:
    block = _rows(ROOT / "docs" / "own-data.md")
    return [json.loads(line) for line in block.splitlines() if line.strip()]


def test_example_reward_scores_the_example_rows_as_text_and_as_chat():
    exact = _exact()
    rows = _jsonl_rows()
    answers = [r["answer"] for r in rows]
    assert rows and all(isinstance(r["prompt"], str) for r in rows)

    def chat(text):  # what peergrade passes when the prompt is a conversation
        return [{"role": "assistant", "content": text}]

    for form in (lambda t: t, chat):
        assert exact([form(a) for a in answers], answers) == [1.0] * len(rows)
        assert exact([form(f"<answer>{a}</answer>") for a in answers], answers) == [1.0] * len(rows)
        assert exact([form(f"{a}1") for a in answers], answers) == [0.0] * len(rows)
        assert exact([form(f"<answer>{a}1</answer>") for a in answers], answers) == [0.0] * len(
            rows
        )


def test_example_reward_is_exact_not_substring():
    exact = _exact()
    completions = [
        "<answer>171</answer>",
        "The answer is 17, or 171",
        "<answer> 17 </answer>",
        "17",
    ]
    assert exact(completions, ["17"] * 4) == [0.0, 0.0, 1.0, 1.0]


def test_docs_show_the_same_example():
    readme = _example(ROOT / "README.md")
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if "# my_rewards.py" in p.read_text()]
    assert {f"docs/{p.name}" for p in pages} >= set(FIRST_PAGES[1:]), pages
    for page in pages:
        assert _example(page) == readme, f"{page.name} shows another my_rewards.py"
    rows = _rows(ROOT / "docs" / "own-data.md")
    for name in FIRST_PAGES[2:]:
        assert _rows(ROOT / name) == rows, f"{name} shows other sums.jsonl rows"


def test_first_pages_name_one_dataset_and_one_reward():
    """No second example creeps back: the reward file's functions and the datasets named on
    the first pages (and getting-started's command lines) are the walk-through's."""
    for name in [*FIRST_PAGES, "docs/getting-started.md"]:
        text = (ROOT / name).read_text()
        assert set(re.findall(r"my_rewards\.py:(\w+)", text)) <= {"exact"}, name
        data = set(re.findall(r"([\w/.-]+)\.jsonl", text)) - {"metrics", "samples", "answers"}
        assert {d.rsplit("/", 1)[-1] for d in data} <= {"sums", "held_out"}, (name, data)
