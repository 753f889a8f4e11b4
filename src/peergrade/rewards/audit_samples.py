"""The samples audit (``peergrade audit --samples RUN/samples.jsonl``): a run's own logged
completions checked for what a reward may have missed (several numbers where one was asked,
repetition, an answer outside its slot), ranked with their prompts. Part of
``peergrade.rewards.audit``, which re-exports its names.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from peergrade.rewards.audit_battery import _EPS, AuditError, _question
from peergrade.rewards.extract import answer_tag, boxed

# ----------------------------------------------------------------------------- samples


#: two numbers listed in the answer slot ("18, 19", "18 or 19", "18 19"; not "12+7", "1,234")
_LIST_RE = re.compile(r"\d(?:\s*;\s*|\s*,\s+|\s+or\s+|\s+and\s+|\s+)[+-]?\d", re.ASCII)
#: a repeated-word-trigram share at or above this flags a completion as repetitive
REPETITION_FLAG = 0.5


def _final_slot(text: str) -> str:
    """The text a strict reader takes as the answer: one tag, one box, else the last line."""
    tagged = answer_tag(text)
    if tagged is not None:
        return tagged
    box = boxed(text, allow_multiple=True)
    if box is not None:
        return box
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def cross_check(completion: str, prompt, answer, finish_reason=None) -> list[str]:
    """Why a stricter reading doubts ``completion`` (empty: no doubt)."""
    from peergrade.rewards.math import math_accuracy
    from peergrade.rewards.penalties import repetition_penalty

    flags = []
    if answer is not None and str(answer).strip():
        strict = math_accuracy(None, [completion], answer=[str(answer)], extract="auto")[0]
        if strict < 1.0:
            flags.append("strict_check_disagrees")
    blocks = set(re.findall(r"<answer>(.*?)</answer>", completion, re.S))
    boxes = set(re.findall(r"\\boxed\{([^{}]*)\}", completion))
    listed = _LIST_RE.search(_final_slot(completion)) is not None
    if len({b.strip() for b in blocks}) > 1 or len(boxes) > 1 or listed:
        flags.append("several_answers")
    if -repetition_penalty(None, [completion], n=3)[0] >= REPETITION_FLAG:
        flags.append("repetition")
    if finish_reason == "length":
        flags.append("cut_at_length_cap")
    q = re.sub(r"\s+", " ", _question(prompt)).strip()
    if len(q) >= 4 and q in re.sub(r"\s+", " ", completion):
        flags.append("echoes_prompt")
    return flags


def samples_audit(run_dir, *, top: int = 20) -> dict:
    """The run's logged completions with high reward that a stricter cross-check doubts.

    High reward: at or above the median of every logged total reward, and above the lowest.
    Ranked by reward, then by the number of doubts. Returns ``{"run_dir", "completions"
    (how many were read), "suspects": [...]}``; each suspect has the step, prompt, reference
    answer, completion, total and per-function rewards, and its flags."""
    from peergrade.files import read_jsonl

    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        raise AuditError(
            f"{run_dir}: no samples.jsonl (a run directory written by `peergrade train`, with "
            "train.log_samples > 0, is expected)"
        )
    records = read_jsonl(path)
    flat = []
    for n, rec in enumerate(records, start=1):
        comps = rec.get("completions")
        rewards = rec.get("rewards")
        if (
            not isinstance(comps, list)
            or not isinstance(rewards, list)
            or len(comps) != len(rewards)
        ):
            raise AuditError(
                f"{path}: line {n}: expected 'completions' and 'rewards' lists of equal length"
            )
        by_fn = rec.get("rewards_by_fn") or {}
        finish = rec.get("finish_reason") or [None] * len(comps)
        for g, (text, r) in enumerate(zip(comps, rewards)):
            if r is None or not isinstance(text, str) or (isinstance(r, float) and math.isnan(r)):
                continue
            flat.append(
                {
                    "step": rec.get("step"),
                    "prompt": rec.get("prompt"),
                    "answer": rec.get("answer"),
                    "completion": text,
                    "reward": float(r),
                    "rewards_by_fn": {k: v[g] for k, v in by_fn.items() if len(v) > g},
                    "finish_reason": finish[g] if g < len(finish) else None,
                }
            )
    suspects = []
    if flat:
        values = sorted(x["reward"] for x in flat)
        median, lowest = values[len(values) // 2], values[0]
        for x in flat:
            if x["reward"] < median or x["reward"] <= lowest + _EPS:
                continue
            flags = cross_check(x["completion"], x["prompt"], x["answer"], x["finish_reason"])
            if flags:
                suspects.append({**x, "flags": flags})
    suspects.sort(key=lambda x: (-x["reward"], -len(x["flags"])))
    return {"run_dir": str(run_dir), "completions": len(flat), "suspects": suspects[:top]}


def format_samples(result: dict) -> str:
    """The suspects as text, most rewarded first, each with its prompt."""
    out = [
        f"{result['run_dir']}: {result['completions']} logged completions, "
        f"{len(result['suspects'])} suspects"
    ]
    for k, s in enumerate(result["suspects"], start=1):
        fns = ", ".join(f"{n} {v:g}" for n, v in s["rewards_by_fn"].items() if v is not None)
        out.append(
            f"\n{k}. step {s['step']}  reward {s['reward']:g}"
            + (f" ({fns})" if fns else "")
            + f"  flags: {', '.join(s['flags'])}"
        )
        out.append(f"   prompt: {json.dumps(_question(s['prompt']))[:200]}")
        if s["answer"] is not None:
            out.append(f"   reference: {s['answer']}")
        out.append(f"   completion: {json.dumps(s['completion'])[:400]}")
    return "\n".join(out)
