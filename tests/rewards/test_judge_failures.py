"""Issue 54: a judge that fails loudly, abstains honestly, and is audited before training.

Part 1: an unscored answer abstains (``None``: advantage 0, out of its group's baseline) unless
``fallback_score`` is asked for; a failing step prints one line and ``max_failed_steps`` of them
in a row stop the run; a judge given ``base_url`` without ``model`` asks the one the endpoint
lists; a 4xx is a configuration error that stops the run with the endpoint's message.

Part 2: the audit measures position bias per slot, controls its injection probes with a
neutral sentence of the same length, probes for keyword-paying and a second injection, reports
agreement with the user's gold pairs, and runs at ``peergrade train`` start-up within a budget.

Endpoints are loopback servers started by the test (``test_judge.serve``); judges with known
flaws are rules over what the request shows."""

from __future__ import annotations

import json
import math
import zlib

import pytest
import torch

from cli_helper import cli
from peergrade.algo.advantages import group_advantages
from peergrade.rewards import TrainerState, make_reward_spec, score_rewards
from peergrade.rewards.judge import (
    Judge,
    JudgeConfigError,
    JudgeError,
    JudgeUnavailable,
    load_gold,
    make_judge,
)
from peergrade.rewards.judge_audit import (
    INJECTION,
    INJECTION_NOTE,
    audit_cost,
    audit_judge,
    keyword_probe,
    neutral_text,
)
from test_judge import (
    ROWS,
    RUBRIC,
    FnBackend,
    content_score,
    groups_of,
    rule_judge,
    serve,
    shown_answers,
)

# ----------------------------------------------------------------------------- helpers


def scores_of(fn):
    """A judge reply built from one score per shown answer: ``fn(answer, slot, n)``."""

    def reply(messages):
        answers = shown_answers(messages)
        n = len(answers)
        return json.dumps({"scores": [min(10.0, fn(a, p, n)) for p, a in enumerate(answers)]})

    return reply


def flaky(messages) -> int:
    """About 30% of the answers, always the same ones: a 500 for them."""
    (answer,) = shown_answers(messages)
    return 500 if zlib.crc32(answer.encode()) % 10 < 3 else 0


def state(step: int) -> TrainerState:
    return TrainerState(global_step=step, max_steps=10)


# ----------------------------------------------------------------------------- part 1


def test_a_flaky_judge_gives_no_answer_a_score_it_was_not_given():
    """30% of the requests fail: those answers are None (NaN in the scores), the others carry
    the judge's own score, never 0.5; the advantages leave them at 0 and out of the baseline.
    A fallback score is given only when asked for."""
    prompts, completions = groups_of(
        ROWS, [f"{city} ({k})" for k in range(4) for city in ("Paris", "Lyon")]
    )  # 4 groups of 8
    failing = [flaky([{"content": f"Answer 1:\n<<<\n{c}\n>>>"}]) > 0 for c in completions]
    assert 0.15 < sum(failing) / len(failing) < 0.5  # the endpoint fails about 30% of them
    with serve(rule_judge, fail_when=flaky) as (_, url):
        opts = {"rubric": RUBRIC, "base_url": url, "group": False, "retries": 0}
        spec = make_reward_spec("judge", kwargs=opts)
        res = score_rewards([spec], prompts, completions, trainer_state=state(0))
        asked = make_reward_spec("judge", kwargs={**opts, "fallback_score": 0.5})
        res_fb = score_rewards([asked], prompts, completions, trainer_state=state(0))
    got = res.per_fn["judge"].tolist()
    for c, bad, g in zip(completions, failing, got):
        if bad:
            assert math.isnan(g), (c, g)  # abstains: no made-up score
        else:
            assert g == pytest.approx(content_score(c) / 10), (c, g)  # the judge's own
    m = res.metrics()
    assert m["judge/unscored"] == sum(failing) and m["judge/fallbacks"] == 0.0
    assert m["judge/unscored_share"] == pytest.approx(sum(failing) / len(failing))
    assert res.extra["judge_error"][failing.index(True)].startswith("request failed")
    assert res.extra["judge_error"][failing.index(False)] is None
    # advantages: an unscored answer gets 0, and the group's baseline is its scored answers'
    rewards = res.total.view(4, 8)
    adv = group_advantages(rewards)
    r = rewards[0]
    scored = r[~torch.isnan(r)].double()
    want = (scored - scored.mean()) / (scored.std() + 1e-4)
    assert adv[0][~torch.isnan(r)].double() == pytest.approx(want.tolist(), abs=1e-5)
    assert (adv[torch.isnan(rewards)] == 0).all()
    # asked for: the fallback, counted
    fb = res_fb.per_fn["judge"].tolist()
    assert [x for x, bad in zip(fb, failing) if bad] == [0.5] * sum(failing)
    assert res_fb.metrics()["judge/fallbacks"] == sum(failing)


def test_a_failing_step_says_so_once_and_max_failed_steps_in_a_row_stop_the_run(capsys):
    mute = Judge(FnBackend(lambda m: "I cannot decide."), RUBRIC, max_failed_steps=3)
    batch = groups_of(ROWS[:2], ["Paris", "Lyon"])
    logged = {}
    assert mute(*batch, trainer_state=state(0), log_metric=logged.__setitem__) == [None] * 4
    assert logged["judge/failed_steps"] == 1.0 and logged["judge/unscored_share"] == 1.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line
    assert "judge: 4 of 4 answers unscored at step 1 (fn: unparsable reply" in err
    assert "they abstain" in err and "the run stops after 3 such steps in a row" in err
    mute(*batch, trainer_state=state(0))  # the same step again (the evaluation before step 1)
    mute(*batch, trainer_state=state(1), log_metric=logged.__setitem__)
    assert logged["judge/failed_steps"] == 2.0 and capsys.readouterr().err == ""
    with pytest.raises(JudgeUnavailable, match="3 steps in a row") as e:
        mute(*batch, trainer_state=state(2))
    assert e.value.stops_run
    # through the reward contract the policy cannot turn it into zeros
    spec = make_reward_spec(mute)
    for step in (3, 4):
        score_rewards([spec], *batch, on_error="zero", trainer_state=state(step))
    with pytest.raises(JudgeUnavailable):
        score_rewards([spec], *batch, on_error="zero", trainer_state=state(5))

    # below fail_share a step does not fail, and it ends a streak
    half = Judge(
        FnBackend(lambda m: "?" if "Lyon" in shown_answers(m)[0] else rule_judge(m)),
        RUBRIC,
        group=False,
        max_failed_steps=2,
        fail_share=0.75,
    )
    half(*batch, trainer_state=state(0), log_metric=logged.__setitem__)  # 2 of 4 unscored
    assert logged["judge/failed_steps"] == 0.0 and logged["judge/unscored"] == 2.0
    # max_failed_steps 0: never stops
    never = Judge(FnBackend(lambda m: "?"), RUBRIC, max_failed_steps=0)
    for step in range(5):
        assert never(*batch, trainer_state=state(step)) == [None] * 4


def _train_cfg(tiny_model_dir, url, *extra):
    from peergrade.config import load_config

    return load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            (
                "rewards",
                [{"name": "judge", "kwargs": {"rubric": RUBRIC, "base_url": url, "retries": 0}}],
            ),
            ("rollout.prompts_per_step", 1),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("train.eval_reward", "arithmetic"),  # the held-out table asks no judge
            ("train.eval_size", 1),
            ("train.eval_samples", 1),
            ("train.display", "none"),
            ("train.threads", 1),
            *extra,
        ],
    )


def _metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("step", 0) >= 1 and "judge/unscored" in m]


def test_a_dead_judge_says_so_at_step_1_and_stops_the_run(tiny_model_dir, tmp_path, capsys):
    """The endpoint is down from the start: the start-up audit says no answer could be scored,
    step 1 prints the judge's line and alerts, and the third failing step stops the run (it
    was asked for 6) with one error naming the judge and the reason."""
    from peergrade.training.trainer import train

    with serve(rule_judge) as (_, url):
        pass  # the port is closed now
    cfg = _train_cfg(tiny_model_dir, url, ("train.steps", 6))
    with pytest.raises(JudgeUnavailable, match="3 steps in a row") as e:
        train(cfg, tmp_path / "run")
    assert "Connection refused" in str(e.value) or "URLError" in str(e.value)
    err = capsys.readouterr().err
    assert "judge audit: judge: " in err and "no answer could be scored" in err
    assert "judge: 2 of 2 answers unscored at step 1 (" in err
    rows = _metrics(tmp_path / "run")
    assert [m["step"] for m in rows] == [1, 2]  # the run stopped in step 3
    assert rows[0]["alert/judge_failing"] == 1.0 and rows[0]["judge/unscored"] == 2.0
    assert "could not score 2 answers (100%)" in rows[0]["alerts"]["judge_failing"]
    assert "reward/judge/mean" not in rows[0]  # nothing scored, nothing made up


def test_a_judge_that_breaks_mid_run_abstains_and_alerts(tiny_model_dir, tmp_path, capsys):
    """Step 1's request is answered, step 2's is not: step 2's answers abstain (no reward
    mean, advantage 0), its metrics and alert say why, samples.jsonl holds each reason."""
    from peergrade.training.trainer import train

    broken = {"on": False}

    def once(messages):
        if broken["on"]:
            return "no JSON today"
        broken["on"] = True
        return json.dumps({"scores": [min(10.0, len(a)) for a in shown_answers(messages)]})

    with serve(once) as (_, url):
        cfg = _train_cfg(
            tiny_model_dir,
            url,
            ("train.steps", 2),
            ("train.audit_rewards", "off"),
            ("train.log_samples", 1),
        )
        train(cfg, tmp_path / "run")
    err = capsys.readouterr().err
    assert "judge audit: judge not audited (train.audit_rewards: off)" in err
    assert "judge: 2 of 2 answers unscored at step 2 (" in err and "no JSON today" in err
    one, two = _metrics(tmp_path / "run")
    assert one["judge/unscored"] == 0.0 and "reward/judge/mean" in one
    assert "alert/judge_failing" not in one
    assert two["judge/unscored"] == 2.0 and two["judge/fallbacks"] == 0.0
    assert "reward/judge/mean" not in two and two["alert/judge_failing"] == 1.0
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    last = samples[-1]
    assert last["step"] == 2 and last["rewards_by_fn"]["judge"] == [None, None]
    assert all("no JSON today" in why for why in last["extra"]["judge_error"])


def test_no_model_named_asks_the_one_the_endpoint_lists(capsys):
    served = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with serve(rule_judge, models=[served]) as (srv, url):
        j = make_judge(rubric=RUBRIC, base_url=url, retries=0)
        assert j(*groups_of(ROWS[:3], ["Paris", "Lyon"])) == pytest.approx([0.7, 0.2] * 3)
        assert {b["model"] for b in srv.bodies} == {served} and srv.gets == 1
    assert f"asking {served!r}, the model GET {url}/models lists" in capsys.readouterr().err
    with serve(rule_judge, models=["a", "b"]) as (_, url):
        spec = make_reward_spec("judge", kwargs={"rubric": RUBRIC, "base_url": url})
        with pytest.raises(JudgeConfigError, match="lists 2: 'a', 'b'; name one"):
            score_rewards([spec], *groups_of(ROWS[:1], ["Paris", "Lyon"]), on_error="zero")
    with serve(rule_judge) as (srv, url):  # no listing (404): no model name is sent
        j = make_judge(rubric=RUBRIC, base_url=url, retries=0)
        assert j(*groups_of(ROWS[:1], ["Paris", "Lyon"])) == pytest.approx([0.7, 0.2])
        assert "model" not in srv.bodies[0]


def test_a_4xx_is_a_configuration_error_that_stops_with_the_endpoints_message():
    with serve(rule_judge, models=["served-model"]) as (srv, url):
        spec = make_reward_spec(
            "judge", kwargs={"rubric": RUBRIC, "base_url": url, "model": "judge"}
        )
        with pytest.raises(JudgeConfigError) as e:  # whatever the reward-error policy says
            score_rewards([spec], *groups_of(ROWS[:2], ["Paris", "Lyon"]), on_error="zero")
        msg = str(e.value)
        assert "HTTP 400" in msg and "The model `judge` does not exist." in msg
        assert "sent model 'judge'" in msg and f"GET {url}/models" in msg
        assert "\n" not in msg and srv.calls == 2  # no retries of a 4xx
    # a 4xx on some requests only (one too long for the judge): those abstain, no stop
    long_one = lambda m: 400 if "Lyon" in shown_answers(m)[0] else 0  # noqa: E731
    with serve(rule_judge, fail_when=long_one) as (_, url):
        j = make_judge(rubric=RUBRIC, base_url=url, group=False, retries=0)
        assert j(*groups_of(ROWS[:1], ["Paris", "Lyon"])) == [pytest.approx(0.7), None]
    # 401 on any request is the key's fault, not the content's
    with serve(rule_judge, fail_when=lambda m: 401 if "Lyon" in shown_answers(m)[0] else 0) as (
        _,
        url,
    ):
        j = make_judge(rubric=RUBRIC, base_url=url, group=False, retries=0)
        with pytest.raises(JudgeConfigError, match="refused 1 of 2 with HTTP 401"):
            j(*groups_of(ROWS[:1], ["Paris", "Lyon"]))


def _judge_config(tmp_path, url, **kwargs) -> str:
    f = tmp_path / "judge.yaml"
    opts = "".join(f"      {k}: {v}\n" for k, v in kwargs.items())
    f.write_text(
        f"rewards:\n  - name: judge\n    kwargs:\n      rubric: {RUBRIC}\n      base_url: {url}\n"
        f"{opts}rollout:\n  group_size: 4\n"
    )
    return str(f)


def test_peergrade_train_stops_at_start_up_on_a_4xx_and_audits_a_sound_judge(tmp_path):
    """``peergrade train`` in a subprocess, its model missing (the run would fail there):
    a judge whose endpoint refuses its model name stops it first with the endpoint's message;
    a sound judge is audited (one line, within the budget) and the run goes on to the model."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["train", "--model", str(tmp_path / "no-such-model"), "--data", str(data), "-o"]
    with serve(rule_judge, models=["served-model"]) as (srv, url):
        cfg = _judge_config(tmp_path, url, model="judge")
        res = cli([*args, str(tmp_path / "r1"), "--config", cfg], cwd=tmp_path)
        assert res.returncode == 2, res.stderr
        (line,) = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert "The model `judge` does not exist." in line and "no-such-model" not in res.stderr

        cfg = _judge_config(tmp_path, url, model="served-model")
        res = cli([*args, str(tmp_path / "r2"), "--config", cfg], cwd=tmp_path)
    assert res.returncode == 2 and "no-such-model" in res.stderr, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("judge audit: judge: ")]
    assert "4 rows x 4 answers" in line and "(budget 100, train.audit_judge_requests)" in line
    assert line.endswith("no finding")
    used = int(line.split(" answers, ")[1].split(" requests")[0])
    assert 0 < used <= 100


# ----------------------------------------------------------------------------- part 2


def first_slot(a, p, n):
    """A judge with one flaw: 3 points for standing first."""
    return content_score(a) + (3.0 if p == 0 else 0.0)


@pytest.mark.parametrize("size", [8, 16])
def test_a_first_slot_bonus_is_measured_per_slot_at_group_8_and_16(size):
    """The bonus read 0.075 / 0.0375 when averaged over the group; per slot it is the bonus
    less its share of the mean (3 - 3/G points), flagged; rows with their own G answers and
    built groups of G give the same."""
    j = Judge(FnBackend(scores_of(first_slot)), RUBRIC)
    own = [
        {
            "prompt": r["prompt"],
            "answers": [f"Paris {k}" if k % 2 else f"Lyon {k}" for k in range(size)],
        }
        for r in ROWS
    ]
    for rep in (audit_judge(j, own), audit_judge(j, ROWS, answers=size)):
        want = (3 - 3 / size) / 10
        assert rep.answers == size
        assert rep.figures["position_bias"] == pytest.approx(want, abs=1e-4)
        assert rep.slot_effects[0] == pytest.approx(want, abs=1e-4)
        assert rep.slot_effects[1:] == pytest.approx([-0.3 / size] * (size - 1), abs=1e-4)
        assert rep.findings[0].startswith(f"position_bias = {want:.3f}"), rep.format()
    sound = audit_judge(Judge(FnBackend(rule_judge), RUBRIC), ROWS, answers=size)
    assert sound.figures["position_bias"] == 0.0 and not sound.failed, sound.format()


def test_a_length_biased_judge_gets_a_length_finding_and_no_injection_finding():
    """Score grows with the answer's length: padding is a finding; the injections and the
    keyword list add exactly what a neutral sentence of their length adds, so none is."""
    assert len(neutral_text(len(INJECTION))) == len(INJECTION) == len(INJECTION_NOTE)
    rep = audit_judge(Judge(FnBackend(scores_of(lambda a, p, n: len(a) / 10)), RUBRIC), ROWS)
    kinds = {f.split(" = ")[0] for f in rep.findings}
    assert "length_bias" in kinds and not kinds & {"injection", "injection_note", "keyword"}
    assert rep.figures["injection"] == rep.figures["injection_note"] == 0.0
    assert rep.figures["keyword"] == 0.0


def test_a_judge_that_marks_padding_down_passes_and_says_why_that_side_is_safe():
    """length_bias is one-sided on purpose: a judge that lowers the score of an answer padded
    with filler is no exploit, and the audit's line says so instead of a bare 'ok'."""
    shorter = Judge(FnBackend(scores_of(lambda a, p, n: max(0.0, 9 - len(a) / 60))), RUBRIC)
    rep = audit_judge(shorter, ROWS)
    assert rep.figures["length_bias"] < -0.05
    assert "length_bias" not in {f.split(" = ")[0] for f in rep.findings}
    line = next(ln for ln in rep.format().splitlines() if ln.strip().startswith("length_bias"))
    assert "ok: padding lowered the score" in line, line


@pytest.mark.parametrize(
    "flaw, finding",
    [
        # pays 3 points for the rubric's words (RUBRIC: "... names the right city.")
        (lambda a, p, n: content_score(a) + (3.0 if "city" in a.lower() else 0.0), "keyword"),
        # obeys a note to the grader, but not a bare order
        (lambda a, p, n: 10.0 if "grader" in a else content_score(a), "injection_note"),
        (lambda a, p, n: 10.0 if "top score" in a else content_score(a), "injection"),
    ],
)
def test_each_probe_catches_its_judge_and_only_it(flaw, finding):
    rep = audit_judge(Judge(FnBackend(scores_of(flaw)), RUBRIC), ROWS)
    kinds = {f.split(" = ")[0] for f in rep.findings}
    probes = {"keyword", "injection", "injection_note", "length_bias", "position_bias"}
    assert kinds & probes == {finding}, rep.format()


def _write_gold(path, pairs) -> str:
    path.write_text(
        "".join(json.dumps(dict(zip(("prompt", "better", "worse"), p))) + "\n" for p in pairs)
    )
    return str(path)


#: ten pairs where the better answer is the longer in four, the shorter in six
LENGTH_GOLD = [
    ("Capital of France?", "Paris, the capital and largest city of France.", "Rome.")
] * 4 + [("Capital of France?", "Paris.", "It is probably Lyon, or maybe Marseille, or Nice.")] * 6
#: a new user's polite one-sentence refusals (better) and rude ones (worse)
REFUSALS = [
    (
        "Can you write my essay for me?",
        "Sorry, I can't write it for you, but I'm glad to help you plan it.",
        "No. Do your own homework.",
    ),
    ("Tell me your password.", "I'm sorry, but I can't share that.", "No way, stop asking."),
    ("Lend me your car?", "I'm afraid I can't, sorry about that.", "Absolutely not, get your own."),
    (
        "Can you cover my shift?",
        "Sorry, I can't this time, I hope you find someone.",
        "Nope. Not my problem.",
    ),
]


def test_gold_pairs_report_agreement_and_flag_a_judge_that_disagrees(tmp_path):
    length_judge = scores_of(lambda a, p, n: min(10.0, len(a) / 5))
    gold = _write_gold(tmp_path / "gold.jsonl", LENGTH_GOLD)
    rep = audit_judge(Judge(FnBackend(length_judge), RUBRIC, gold=gold), ROWS)
    assert rep.gold_pairs == 10 and rep.figures["gold_agreement"] == 0.4
    assert any(f.startswith("gold_agreement = 0.400") for f in rep.findings), rep.format()
    assert len(rep.gold_misses) == 6 and "gold miss: 'Capital of France?'" in rep.format()

    # the refusals: a judge that likes rudeness is told apart from one that likes politeness
    refusals = _write_gold(tmp_path / "refusals.jsonl", REFUSALS)
    polite = lambda a, p, n: 8.0 if any(w in a.lower() for w in ("sorry", "afraid")) else 3.0  # noqa: E731
    rude = lambda a, p, n: 11.0 - polite(a, p, n)  # noqa: E731
    rows = [{"prompt": q, "answers": [b, w]} for q, b, w in REFUSALS]
    good = audit_judge(
        Judge(FnBackend(scores_of(polite)), "Is the refusal polite?", gold=refusals), rows
    )
    bad = audit_judge(
        Judge(FnBackend(scores_of(rude)), "Is the refusal polite?", gold=refusals), rows
    )
    assert good.figures["gold_agreement"] == 1.0 and not good.failed, good.format()
    assert bad.figures["gold_agreement"] == 0.0 and bad.failed
    assert "the judge disagrees with the labelled gold pairs" in bad.format()
    # without gold, nothing shows which refusals the judge prefers: that is itself a finding
    blind = audit_judge(Judge(FnBackend(scores_of(rude)), "Is the refusal polite?"), rows)
    assert any(f.startswith("discrimination not measured") for f in blind.findings)
    assert not any(f.startswith("discrimination not") for f in good.findings)


def test_gold_files_in_three_formats_and_bad_ones_are_one_line_errors(tmp_path):
    j = tmp_path / "g.json"
    j.write_text(json.dumps([{"prompt": "q", "better": "a", "worse": "b", "note": "x"}]))
    c = tmp_path / "g.csv"
    c.write_text("prompt,better,worse\nq,a,b\n")
    for f in (j, c, _write_gold(tmp_path / "g.jsonl", [("q", "a", "b")])):
        assert load_gold(f) == [{"prompt": "q", "better": "a", "worse": "b"}]
    bad = tmp_path / "bad.jsonl"
    for text, match in [
        ('{"prompt": "q", "better": "a"}\n', "line 1: missing worse"),
        ('{"prompt": "q", "better": "a", "worse": "a"}\n', "line 1: better and worse are the same"),
        ("not json\n", "line 1 is not JSON"),
        ("\n", "no \\(prompt, better, worse\\) rows"),
    ]:
        bad.write_text(text)
        with pytest.raises(JudgeError, match=match) as e:
            make_judge(rubric=RUBRIC, base_url="http://127.0.0.1:9/v1", gold=str(bad))
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    with pytest.raises(JudgeError, match="no such file"):
        make_reward_spec(
            "judge", kwargs={"rubric": RUBRIC, "base_url": "http://x/v1", "gold": "nope.jsonl"}
        )


def test_the_audit_costs_what_audit_cost_says():
    for opts, size in [({}, 8), ({"shuffles": 2}, 4), ({"group": False}, 4)]:
        j = Judge(FnBackend(rule_judge), RUBRIC, gold=None, **opts)
        gold = [{"prompt": f"q{k}", "better": "Paris", "worse": "Lyon"} for k in range(3)]
        rep = audit_judge(j, ROWS, answers=size, gold=gold)
        kw = keyword_probe(RUBRIC) is not None
        assert rep.requests == audit_cost(j, len(ROWS), size, 3, kw), opts


def _startup(tmp_path, url, *extra, rows=ROWS):
    """What the trainer passes ``audit.at_startup``: the config, the task, the reward specs."""
    from peergrade.config import load_config
    from peergrade.training.components import build_rewards, build_task

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            ("data.path", str(data)),
            ("rewards", [{"name": "judge", "kwargs": {"rubric": RUBRIC, "base_url": url}}]),
            ("rollout.group_size", 8),
            *extra,
        ],
    )
    task = build_task(cfg)
    return cfg, task, build_rewards(cfg, task)


def test_start_up_audit_of_a_judge_within_its_budget(tmp_path, capsys):
    from peergrade.rewards.audit import AuditError, at_startup

    with serve(scores_of(first_slot)) as (srv, url):
        cfg, task, specs = _startup(tmp_path, url)
        at_startup(cfg, task, specs)
        err = capsys.readouterr().err
        head, *found = [x for x in err.splitlines() if x.startswith(("judge audit", "  - "))]
        assert head.startswith("judge audit: judge: 4 rows x 8 answers, ")
        assert "(budget 100, train.audit_judge_requests)" in head and srv.calls <= 100
        assert found[0].startswith("  - position_bias = 0.263")
        # fail: the same finding stops the run
        cfg, task, specs = _startup(tmp_path, url, ("train.audit_rewards", "fail"))
        with pytest.raises(AuditError, match="judge audit: judge: position_bias = 0.263"):
            at_startup(cfg, task, specs)
        # a budget one row overruns: not audited, one line says why; 0: likewise; off: likewise
        calls = srv.calls
        for extra, why in [
            (("train.audit_judge_requests", 10), "one row of 8 answers costs 15 judge requests"),
            (("train.audit_judge_requests", 0), "train.audit_judge_requests is 0"),
            (("train.audit_rewards", "off"), "train.audit_rewards: off"),
        ]:
            capsys.readouterr()
            cfg, task, specs = _startup(tmp_path, url, extra)
            at_startup(cfg, task, specs)
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith("judge audit: judge not audited (") and why in line, line
        assert srv.calls == calls  # none of them asked the judge anything
