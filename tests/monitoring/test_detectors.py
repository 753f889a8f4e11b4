"""Failure-mode detectors (peergrade.monitoring.detectors): each one fires on a synthetic metrics stream
that has its failure -- and only that one fires -- and all stay silent on a healthy synthetic
stream and on the real metrics of the CPU demo run (tests/data/demo_metrics.jsonl).

The synthetic streams start from a healthy step that looks like the demo's (reward ~0.5 and
noisy, a fifth of the groups all-equal, ~3 tokens, entropy ~0.4, ratio 1, no KL), seeded, and
change one quantity from step ``ONSET`` on.

tests/data/demo_metrics.jsonl is the metrics.jsonl of a real demo run on this code,
``peergrade train -o DIR --train.display plain`` (all defaults: 250 steps, seed 0, CPU), with
the wall-clock keys (time/, perf/) dropped and floats cut to 6 significant digits.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from peergrade.config import AlertConfig
from peergrade.files import read_jsonl
from peergrade.monitoring.detectors import ALERT_NAMES, Detectors, repetition_rate
from peergrade.monitoring.metrics import Display

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo_metrics.jsonl"
ONSET = 30
STEPS = 80


def healthy(step: int, rng: random.Random) -> dict:
    return {
        "step": step,
        "reward/accuracy/mean": 0.5 + rng.uniform(-0.1, 0.1),
        "reward/accuracy/std": 0.45 + rng.uniform(-0.05, 0.05),
        "reward/format/mean": 0.6 + rng.uniform(-0.1, 0.1),
        "reward/format/std": 0.4 + rng.uniform(-0.05, 0.05),
        "reward/total/mean": 0.5 + rng.uniform(-0.1, 0.1),
        "reward/total/std": 0.45,
        "reward/errors": 0.0,
        "loss/policy": rng.uniform(-0.01, 0.01),
        "rollout/len_mean": 3.2 + rng.uniform(-0.3, 0.3),
        "rollout/frac_truncated": rng.choice([0.0, 0.0, 0.05]),
        "rollout/frac_zero_std_groups": rng.choice([0.0, 0.125, 0.25]),
        "rollout/repetition": rng.uniform(0.0, 0.05),
        "entropy/mean": 0.4 + rng.uniform(-0.05, 0.05),
        "kl/mean": 0.0,
        "ratio/max": 1.0,
        "grad/norm": 2.5 + rng.uniform(-1, 1),
        "update/nonfinite_frac": 0.0,
    }


def stream(fault=None, evals=None, seed=0) -> list[dict]:
    """Healthy steps 1..STEPS, ``fault(step, metrics)`` applied from ONSET on; ``evals`` maps a
    step to its held-out pass@1 (step 0 is its own line, as the trainer writes it)."""
    rng = random.Random(seed)
    lines = []
    evals = evals or {}
    if 0 in evals:
        lines.append({"step": 0, "eval/pass@1_sampled": evals[0], "eval/n": 200})
    for s in range(1, STEPS + 1):
        m = healthy(s, rng)
        if fault is not None and s >= ONSET:
            fault(s, m)
        if s in evals:
            m["eval/pass@1_sampled"] = evals[s]
        lines.append(m)
    return lines


def run(lines, settings=None, updates_per_step=1) -> dict[int, dict]:
    """step -> what the detectors added to that step's line."""
    d = Detectors(settings or AlertConfig(), updates_per_step)
    return {m["step"]: d.update(m) for m in lines}


def fired(out: dict[int, dict]) -> dict[str, int]:
    """alert name -> first step it was active."""
    first: dict[str, int] = {}
    for step in sorted(out):
        for name in out[step].get("alerts", {}):
            first.setdefault(name, step)
    return first


# ----------------------------------------------------------------------------- faults


def no_signal(s, m):
    m["rollout/frac_zero_std_groups"] = 1.0
    m["reward/total/mean"], m["reward/total/std"] = 0.0, 0.0


def length_cap(s, m):
    m["rollout/frac_truncated"] = 0.8


def length_collapse(s, m):
    m["rollout/len_mean"] = max(0.5, 3.2 - 0.2 * (s - ONSET))


def repetition(s, m):
    m["rollout/repetition"] = min(0.9, 0.05 + 0.05 * (s - ONSET))


def entropy_collapse(s, m):
    m["entropy/mean"] = max(0.005, 0.4 * 0.8 ** (s - ONSET))


def kl_blowup(s, m):
    m["kl/mean"] = 0.01 if s < 60 else 5.0


def ratio_blowup(s, m):
    if s == 50:
        m["ratio/max"] = 300.0


def nonfinite(s, m):
    if s in (40, 41):
        m["loss/policy"] = math.nan
        m["grad/norm"] = math.nan
        m["update/nonfinite_frac"] = 0.5  # one of the step's two optimizer steps


def bf16_update(s, m):
    if s == ONSET:  # the first step's probe (peergrade.training.precision) says 90x
        m["precision/bf16_step_ratio"], m["precision/bf16_tie_frac"] = 90.0, 0.081


def tools_always_fail(s, m):
    m["tools/call_frequency"], m["tools/failure_frequency"] = 1.2, 1.0


def harness_failing(s, m):
    if s == ONSET:  # 15 of the step's 16 harness episodes failed, 15 with the same error
        m.update(
            {
                "harness/failed": 15 / 16,
                "harness/failed_episodes": 15.0,
                "harness/episodes": 16.0,
                "harness/top_error": "TimeoutError: upstream",
                "harness/top_error_count": 15.0,
            }
        )
    elif s > ONSET:  # 1 in 16: below the threshold (the progress line still counts it)
        m.update(
            {"harness/failed": 1 / 16, "harness/failed_episodes": 1.0, "harness/episodes": 16.0}
        )


def judge_failing(s, m):
    if s == ONSET:  # the judge could score none of the step's 16 answers: they abstained
        m.update({"judge/unscored": 16.0, "judge/unscored_share": 1.0, "judge/failed_steps": 1.0})
    elif s > ONSET:  # 2 in 16 unscored: below the judge's fail_share, not a failing step
        m.update({"judge/unscored": 2.0, "judge/unscored_share": 0.125, "judge/failed_steps": 0.0})


def reward_imbalance(s, m):
    # format saturates at 1.0 on every sample; accuracy slides from 0.5 to ~0.05
    m["reward/format/mean"], m["reward/format/std"] = 1.0, 0.0
    m["reward/accuracy/mean"] = max(0.05, 0.5 - 0.03 * (s - ONSET))


def reward_up(s, m):
    m["reward/total/mean"] = 0.5 + 0.01 * (s - ONSET)


CASES = {
    # name: (fault, evals, first step it may fire, last step it must have fired by)
    "no_signal": (no_signal, None, ONSET + 9, ONSET + 9),
    "length_cap": (length_cap, None, ONSET + 9, ONSET + 9),
    "length_collapse": (length_collapse, None, ONSET + 10, ONSET + 20),
    "repetition": (repetition, None, ONSET, ONSET + 20),
    "entropy_collapse": (entropy_collapse, None, ONSET, ONSET + 20),
    "kl_blowup": (kl_blowup, None, 60, 60),
    "ratio_blowup": (ratio_blowup, None, 50, 50),
    "nonfinite": (nonfinite, None, 40, 40),
    "bf16_update": (bf16_update, None, ONSET, ONSET),
    "tools_always_fail": (tools_always_fail, None, ONSET + 9, ONSET + 9),
    "harness_failing": (harness_failing, None, ONSET, ONSET),  # on the step itself
    "judge_failing": (judge_failing, None, ONSET, ONSET),  # on the step itself
    "reward_imbalance": (reward_imbalance, None, ONSET + 9, ONSET + 25),
    # training reward climbs while held-out accuracy falls at the step-60 evaluation
    "reward_vs_eval": (reward_up, {0: 0.40, 30: 0.45, 60: 0.30}, 60, 60),
}


def test_every_detector_has_a_case():
    assert set(CASES) == set(ALERT_NAMES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_detector_fires_on_its_failure_and_only_there(name):
    fault, evals, earliest, latest = CASES[name]
    out = run(stream(fault, evals))
    first = fired(out)
    assert set(first) == {name}, f"expected only {name} to fire, got {first}"
    assert earliest <= first[name] <= latest, first
    line = next(out[s] for s in sorted(out) if out[s].get("alerts"))
    assert line[f"alert/{name}"] == 1.0
    message = line["alerts"][name]
    # says what it saw (a number from the stream) and what to try
    assert any(ch.isdigit() for ch in message) and "try" in message.lower(), message


@pytest.mark.parametrize("name", sorted(CASES))
def test_healthy_stream_with_the_same_evals_is_silent(name):
    _, evals, _, _ = CASES[name]
    healthy_evals = {s: 0.4 + 0.001 * s for s in evals} if evals else None
    assert fired(run(stream(None, healthy_evals, seed=3))) == {}


def test_no_signal_message_says_every_reward_was_identical():
    out = run(stream(no_signal))
    msg = out[ONSET + 9]["alerts"]["no_signal"]
    assert "every completion of this step scored 0" in msg
    assert "alert/no_signal" not in out[ONSET + 8]  # not before `window` steps in a row


def test_no_signal_resets_when_signal_returns():
    def burst(s, m):
        if s < ONSET + 15:
            no_signal(s, m)

    out = run(stream(burst))
    assert "alert/no_signal" in out[ONSET + 14]
    assert "alert/no_signal" not in out[ONSET + 15]


def test_thresholds_come_from_the_settings():
    lines = stream(kl_blowup)
    assert fired(run(lines, replace(AlertConfig(), kl_max=10.0))) == {}
    assert fired(run(lines, replace(AlertConfig(), enabled=False))) == {}
    # a window of 3 makes no_signal fire after 3 steps instead of 10
    assert fired(run(stream(no_signal), replace(AlertConfig(), window=3)))["no_signal"] == ONSET + 2


def test_nonfinite_counts_skipped_optimizer_steps():
    out = run(stream(nonfinite), updates_per_step=2)
    assert out[40]["update/skipped_total"] == 1
    assert out[41]["update/skipped_total"] == 2
    assert out[STEPS]["update/skipped_total"] == 2  # carried on later lines
    assert "alert/nonfinite" not in out[42]
    assert "2 skipped so far" in out[41]["alerts"]["nonfinite"]


def test_replay_continues_the_windows():
    lines = stream(no_signal)
    whole = run(lines)
    d = Detectors(AlertConfig())
    d.replay(lines[: ONSET + 5])  # a run resumed at step ONSET + 5
    resumed = {m["step"]: d.update(m) for m in lines[ONSET + 5 :]}
    assert resumed == {s: whole[s] for s in resumed}


def test_repetition_rate_hand_computed():
    assert repetition_rate([[1, 2, 3, 4, 5, 6]], n=2) == 0.0
    # 2-grams of 1 2 1 2 1 2: (1,2) x3, (2,1) x2 -> 1 - 2/5
    assert repetition_rate([[1, 2, 1, 2, 1, 2]], n=2) == pytest.approx(0.6)
    # a completion too short to repeat counts 0; the mean is over completions
    assert repetition_rate([[7, 7, 7, 7, 7], [1]], n=2) == pytest.approx((1 - 1 / 4) / 2)
    assert repetition_rate([], n=4) == 0.0


def test_silent_on_the_real_demo_run():
    """The demo (``peergrade train`` with defaults: bundled model, arithmetic, 250 steps)
    learns cleanly: no detector may fire anywhere in its metrics, replayed line by line."""
    lines = read_jsonl(DEMO)
    steps = [m for m in lines if "rollout/len_mean" in m]
    assert len(steps) == 250 and sum("eval/pass@1_sampled" in m for m in lines) >= 5
    assert all("rollout/repetition" in m and "entropy/mean" in m for m in steps)
    assert lines[-1].get("final") and "eval/pass@1_sampled" in lines[-1]
    d = Detectors(AlertConfig())
    out = [(m["step"], d.update(m)) for m in lines]
    assert [(s, a) for s, a in out if a] == []
    # and the run wrote no alert while it trained either
    assert not any(k.startswith("alert") for m in lines for k in m)


def test_display_prints_an_alert_when_it_starts(capsys):
    out = run(stream(kl_blowup))
    display = Display("plain", STEPS)
    lines = stream(kl_blowup)
    for m in lines:
        display.update(m["step"], {**m, **out[m["step"]]})
    text = capsys.readouterr().out
    assert text.count("[alert] step 60: KL blow-up") == 1  # once, at onset
    assert "alerts: kl_blowup" in text.splitlines()[-1]  # listed on every step it lasts


def test_display_none_still_reports_alerts_on_stderr(capsys):
    display = Display("none", 10)
    display.update(1, {"alerts": {"nonfinite": "non-finite loss ..."}})
    captured = capsys.readouterr()
    assert captured.out == "" and "non-finite loss" in captured.err


def test_alert_lines_are_json():
    out = run(stream(nonfinite))
    json.dumps(out[40])  # what metrics.jsonl receives


def test_the_final_evaluation_line_is_checked():
    """The trainer feeds the after-training evaluation (``"final": true``, no step metrics)
    too: a drop there, with the reward up, is the last chance to see reward hacking."""
    lines = stream(reward_up, {0: 0.40, 30: 0.45})
    d = Detectors(AlertConfig())
    for m in lines:
        assert d.update(m) == {}
    last = d.update({"step": STEPS, "eval/pass@1_sampled": 0.30, "eval/n": 200, "final": True})
    assert set(last["alerts"]) == {"reward_vs_eval"}
    assert "from 0.450 (step 30) to 0.300 (step 80)" in last["alerts"]["reward_vs_eval"]


def test_bf16_update_probe_and_alert(tiny_qwen2):
    """Weights on bfloat16 midpoints: a 1e-7 update moves their bf16 casts a whole bfloat16 step
    (ratio >> 3, alert bf16_update with the numbers); rounded first, the casts move about as
    far as the float32 weights (no alert)."""
    import copy

    import torch

    from peergrade.config import AlertConfig
    from peergrade.model.gguf import round_bf16_ties
    from peergrade.monitoring.detectors import Detectors
    from peergrade.training.precision import Bf16StepProbe

    def first_step_ratio(model) -> dict:
        probe = Bf16StepProbe(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-7 * torch.sign(torch.randn_like(p)))  # a tiny Adam-like first step
        return probe.metrics()

    torch.manual_seed(0)
    model = copy.deepcopy(tiny_qwen2[0]).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(((p.view(torch.int32) & -65536) | 0x8000).view(torch.float32))
    tied = first_step_ratio(copy.deepcopy(model))
    assert tied["precision/bf16_tie_frac"] == 1.0 and tied["precision/bf16_step_ratio"] > 100
    line = {"step": 1, "loss/policy": 0.0, **tied}
    alert = Detectors(AlertConfig()).update(line)
    assert (
        "bf16_update" in alert["alerts"]
        and "100.0% of the weights" in alert["alerts"]["bf16_update"]
    )
    round_bf16_ties(model)
    fixed = first_step_ratio(model)
    assert fixed["precision/bf16_tie_frac"] == 0.0 and fixed["precision/bf16_step_ratio"] < 3
    assert not Detectors(AlertConfig()).update({"step": 1, "loss/policy": 0.0, **fixed})


def test_harness_failing_counts_the_episodes_and_quotes_the_most_common_error():
    out = run(stream(harness_failing))
    msg = out[ONSET]["alerts"]["harness_failing"]
    assert msg.startswith("15/16 episodes failed on this step: TimeoutError: upstream (15x"), msg
    assert "alert/harness_failing" not in out[ONSET + 1]  # 1/16: under harness_failed_frac
    loose = replace(AlertConfig(), harness_failed_frac=0.05)
    assert (
        "1/16 episodes failed"
        in run(stream(harness_failing), loose)[ONSET + 1]["alerts"]["harness_failing"]
    )


def test_tools_always_fail_fires_after_a_window_of_failed_calls():
    from peergrade.config import AlertConfig
    from peergrade.monitoring.detectors import Detectors

    d = Detectors(AlertConfig(window=3))
    line = {"loss/policy": 0.0, "tools/call_frequency": 1.5, "tools/failure_frequency": 1.0}
    assert not d.update(line) and not d.update(line)
    assert "tools_always_fail" in d.update(line)["alerts"]
    assert not d.update({**line, "tools/failure_frequency": 0.5})  # one call worked: reset
    assert not Detectors(AlertConfig(window=1)).update({**line, "tools/call_frequency": 0.0})
