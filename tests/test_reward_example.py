"""The reward example a new user copies (issue 23 item 18): the README's ``my_rewards.py`` works
on both rows of the JSONL example in docs/rewards.md (plain text and chat), matches exactly (the
answer "17" earns nothing for "171"), and every docs page that shows it shows the same code."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(# my_rewards\.py\n.*?)```", re.S)


def _example(path: Path) -> str:
    found = BLOCK.findall(path.read_text())
    assert found, f"{path.name} lost its my_rewards.py example"
    return found[0]


def _accuracy():
    namespace: dict = {}
    exec(_example(ROOT / "README.md"), namespace)
    return namespace["accuracy"]


def _jsonl_rows() -> list[dict]:
    text = (ROOT / "docs" / "rewards.md").read_text()
    block = re.search(r"```jsonl\n(.*?)```", text, re.S).group(1)
    return [json.loads(line) for line in block.splitlines() if line.strip()]


def test_example_reward_scores_the_example_rows():
    accuracy = _accuracy()
    rows = _jsonl_rows()
    assert {type(r["prompt"]) for r in rows} == {str, list}  # both kinds of prompt

    def completion(row, text):  # what peergrade passes for the row's kind of prompt
        return text if isinstance(row["prompt"], str) else [{"role": "assistant", "content": text}]

    right = [
        completion(
            r, f"<answer>{r['answer']}</answer>" if "<answer>" in str(r["prompt"]) else r["answer"]
        )
        for r in rows
    ]
    assert accuracy(right, [r["answer"] for r in rows]) == [1.0] * len(rows)
    wrong = [completion(r, f"<answer>{r['answer']}1</answer>") for r in rows]
    assert accuracy(wrong, [r["answer"] for r in rows]) == [0.0] * len(rows)


def test_example_reward_is_exact_not_substring():
    accuracy = _accuracy()
    completions = [
        "<answer>171</answer>",
        "The answer is 17, or 171",
        "<answer> 17 </answer>",
        "17",
    ]
    assert accuracy(completions, ["17"] * 4) == [0.0, 0.0, 1.0, 1.0]


def test_docs_show_the_same_example():
    readme = _example(ROOT / "README.md")
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if "# my_rewards.py" in p.read_text()]
    assert pages, "no docs page walks through the README's reward example"
    for page in pages:
        assert _example(page) == readme, f"{page.name} shows another my_rewards.py"
