"""The ``judge`` reward (rewards/judge.py) and its audit (rewards/judge_audit.py).

Endpoint tests run a tiny OpenAI-compatible ``/v1/chat/completions`` server in a thread on
127.0.0.1 that answers with a rule-based judge or with the same local model the in-process
judge uses (greedy), so "the same scores through judge_model=DIR and base_url" is tested
without ``peergrade serve``."""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import peergrade.training.judge_local  # noqa: F401 - registers the judge_model loader
from peergrade.cli import main
from peergrade.rewards import make_reward_spec, score_rewards
from peergrade.rewards.judge import (
    HTTPBackend,
    Judge,
    JudgeError,
    JudgeParseError,
    build_messages,
    build_yes_no_messages,
    make_judge,
    orders_for,
    parse_scores,
)
from peergrade.rewards.judge_audit import audit_judge

RUBRIC = "Score whether the answer names the right city."
ROWS = [
    {"prompt": "What is the capital of France?", "answer": "Paris"},
    {"prompt": "Which city is the capital of France? One word.", "answer": "Paris"},
    {"prompt": "Name the French capital.", "answer": "Paris"},
    {"prompt": "France's capital city is?", "answer": "Paris"},
]


# ----------------------------------------------------------------------------- helpers


def shown_answers(messages) -> list[str]:
    """The answers of a judge request, in the order shown (build_messages' layout)."""
    user = messages[-1]["content"]
    return re.findall(r"Answer \d+:\n<<<\n(.*?)\n>>>", user, flags=re.S)


def content_score(answer: str) -> float:
    """A judge with no bias: reads only the first line, finds the right city or not."""
    return 7.0 if "Paris" in answer.split("\n")[0] else 2.0


def rule_judge(messages) -> str:
    return json.dumps({"scores": [content_score(a) for a in shown_answers(messages)]})


def position_judge(messages) -> str:
    """The content score plus a bonus for standing early: 3 points at position 0, 0 last."""
    answers = shown_answers(messages)
    n = len(answers)
    bonus = [3.0 * (n - 1 - p) / max(1, n - 1) for p in range(n)]
    return json.dumps({"scores": [min(10.0, content_score(a) + b) for a, b in zip(answers, bonus)]})


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _json(self, status: int, obj) -> None:
        out = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        srv = self.server
        srv.gets += 1
        if srv.models is None or not self.path.endswith("/models"):
            self.send_error(404)
            return
        listed = [{"id": m, "object": "model"} for m in srv.models]
        self._json(200, {"object": "list", "data": listed})

    def do_POST(self):
        srv = self.server
        srv.calls += 1
        if not self.path.endswith("/chat/completions"):
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if srv.delay:
            time.sleep(srv.delay)
        if srv.fail_status:
            self.send_error(srv.fail_status)
            return
        if srv.models is not None and body.get("model") not in srv.models:
            # what vLLM and `peergrade serve` answer to a model they do not serve
            message = f"The model `{body.get('model')}` does not exist."
            self._json(400, {"error": {"message": message, "type": "invalid_request_error"}})
            return
        status = srv.fail_when(body["messages"]) if srv.fail_when is not None else 0
        if status:
            self._json(status, {"error": {"message": f"failed on purpose ({status})"}})
            return
        srv.bodies.append(body)
        text = srv.answer(body["messages"])
        if isinstance(text, dict):  # the whole response, as given
            out = json.dumps(text).encode()
        else:
            out = json.dumps(
                {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
            ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@contextlib.contextmanager
def serve(answer, *, delay: float = 0.0, fail_status: int = 0, models=None, fail_when=None):
    """An OpenAI-compatible chat endpoint answering with ``answer(messages) -> text`` (or the
    whole response, a dict); the request bodies are kept in ``srv.bodies``. ``models``: the
    names ``GET /v1/models`` lists, and a request naming another gets a 400 with an OpenAI
    error message (None: no listing, any name served); ``fail_when(messages)``: an HTTP status
    to fail that request with (0: answer it)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.answer, srv.delay, srv.fail_status, srv.calls = answer, delay, fail_status, 0
    srv.models, srv.fail_when, srv.gets = models, fail_when, 0
    srv.bodies = []
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    finally:
        srv.shutdown()
        srv.server_close()


class FnBackend:
    """An in-process backend: a function of the messages."""

    def __init__(self, fn):
        self.fn, self.key, self.calls = fn, "fn", 0

    def complete(self, requests):
        self.calls += len(requests)
        return [self.fn(m) for m in requests]


def groups_of(rows, answers):
    prompts = [r["prompt"] for r in rows for _ in answers]
    completions = [a for _ in rows for a in answers]
    return prompts, completions


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ('{"scores": [7, 3]}', 2, [7.0, 3.0]),
        ('```json\n{"scores": [10, 0.5]}\n```', 2, [10.0, 0.5]),
        ('Sure! Here you go: {"scores": [1, 2, 3]} Hope it helps.', 3, [1.0, 2.0, 3.0]),
        ('{"note": "x"} then {"scores": [4]}', 1, [4.0]),
        ('{"score": 6}', 1, [6.0]),
        ('```\n{"scores":[0,10]}\n```', 2, [0.0, 10.0]),
    ],
)
def test_parse_scores_accepts(text, n, expected):
    assert parse_scores(text, n, single=n == 1) == expected


@pytest.mark.parametrize(
    "text, n, why",
    [
        ("Answer 1 is better.", 2, "no JSON object"),
        ("", 2, "empty"),
        ('{"scores": [7, 3, 1]}', 2, "3 scores for 2 answers"),
        ('{"scores": [7]}', 2, "1 scores for 2 answers"),
        ('{"scores": [11, 3]}', 2, "outside [0, 10]"),
        ('{"scores": [-1, 3]}', 2, "outside [0, 10]"),
        ('{"scores": ["7", 3]}', 2, "not a number"),
        ('{"scores": [true, 3]}', 2, "not a number"),
        ('{"scores": 7}', 2, "expected a list"),
        ('{"score": 7}', 2, "no JSON object"),  # the single form only when judging one answer
        ('{"scores": [7, 3]', 2, "no JSON object"),  # cut off
        ("[7, 3]", 2, "no JSON object"),  # the bare list is not the documented shape
    ],
)
def test_parse_scores_refuses(text, n, why):
    with pytest.raises(JudgeParseError, match=re.escape(why)):
        parse_scores(text, n)


def test_orders_are_deterministic_distinct_and_start_with_the_shown_order():
    orders = orders_for(4, 5, "key")
    assert orders == orders_for(4, 5, "key")
    assert orders[0] == [0, 1, 2, 3] and orders[1] == [3, 2, 1, 0]
    assert len({tuple(o) for o in orders}) == 5
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert orders_for(2, 4, "k")[:2] == [[0, 1], [1, 0]] and len(orders_for(2, 4, "k")) == 4


# ----------------------------------------------------------------------------- scoring


def test_group_scores_map_back_to_their_answers_through_shuffles():
    answers = ["Paris, of course.", "Lyon", "Marseille", "It is Paris."]
    b = FnBackend(rule_judge)
    j = Judge(b, RUBRIC, shuffles=3)
    prompts, completions = groups_of(ROWS[:2], answers)
    assert j(prompts, completions) == pytest.approx([0.7, 0.2, 0.2, 0.7] * 2)
    assert b.calls == 6  # 2 groups x 3 orders


def test_shuffles_cancel_a_position_bias():
    answers = ["Paris", "Lyon", "Nice", "Paris!"]
    prompts, completions = groups_of(ROWS[:1], answers)
    one = Judge(FnBackend(position_judge), RUBRIC)(prompts, completions)
    two = Judge(FnBackend(position_judge), RUBRIC, shuffles=2)(prompts, completions)
    assert one == pytest.approx([1.0, 0.4, 0.3, 0.7])  # the first answers get the bonus
    # the reversed order averaged in: the linear bonus is 1.5 points for everyone
    assert two == pytest.approx([0.85, 0.35, 0.35, 0.85])


def test_group_false_asks_once_per_answer_and_the_cache_answers_repeats():
    b = FnBackend(rule_judge)
    j = Judge(b, RUBRIC, group=False)
    prompts, completions = groups_of(ROWS[:1], ["Paris", "Lyon"])
    assert j(prompts, completions) == pytest.approx([0.7, 0.2])
    assert j(prompts, completions) == pytest.approx([0.7, 0.2])
    assert b.calls == 2 and j.stats["cache_hits"] == 2
    # each request shows exactly one answer
    assert shown_answers(build_messages(RUBRIC, "q", ["only"])) == ["only"]


def test_conversational_prompts_and_completions():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"}]
    seen = []

    def fn(messages):
        seen.append(messages[-1]["content"])
        return rule_judge(messages)

    j = Judge(FnBackend(fn), RUBRIC)
    comps = [
        [{"role": "assistant", "content": "Paris"}],
        [{"role": "assistant", "content": "Rome"}],
    ]
    assert j([prompt, prompt], comps) == pytest.approx([0.7, 0.2])
    assert "Be brief.\n\nCapital?" in seen[0]


@pytest.mark.parametrize(
    "reply",
    ["I think the first one.", '{"scores": [1, 2, 3]}', '{"scores": [12, 3]}', ""],
)
def test_bad_replies_fall_back_and_are_counted(reply):
    logged = {}
    j = Judge(FnBackend(lambda m: reply), RUBRIC, fallback_score=0.25)
    prompts, completions = groups_of(ROWS[:2], ["Paris", "Lyon"])
    out = j(prompts, completions, log_metric=logged.__setitem__)
    assert out == [0.25] * 4
    assert logged["judge/fallbacks"] == 4.0 and logged["judge/failed_requests"] == 2.0


def test_on_fallback_error_names_the_reason():
    j = Judge(FnBackend(lambda m: '{"scores": [1]}'), RUBRIC, on_fallback="error")
    with pytest.raises(JudgeError, match="1 scores for 2 answers"):
        j(*groups_of(ROWS[:1], ["Paris", "Lyon"]))


def test_partial_failure_averages_the_orders_that_worked():
    calls = []

    def flaky(messages):
        calls.append(1)
        return rule_judge(messages) if len(calls) % 2 else "no idea"

    j = Judge(FnBackend(flaky), RUBRIC, shuffles=2)
    logged = {}
    out = j(*groups_of(ROWS[:1], ["Paris", "Lyon"]), log_metric=logged.__setitem__)
    assert out == pytest.approx([0.7, 0.2])
    assert logged["judge/fallbacks"] == 0.0 and logged["judge/failed_requests"] == 1.0


@pytest.mark.parametrize("rubric", ["", "   \n ", None])
def test_an_empty_rubric_is_a_clear_error(rubric):
    with pytest.raises(JudgeError, match="rubric"):
        make_judge(rubric=rubric, base_url="http://127.0.0.1:9/v1")


def test_rubric_from_a_file_and_empty_file(tmp_path):
    f = tmp_path / "rubric.txt"
    f.write_text("Polite and short.\n")
    assert Judge(FnBackend(rule_judge), str(f)).rubric == "Polite and short.\n"
    f.write_text("  \n")
    with pytest.raises(JudgeError, match="rubric file .* is empty"):
        Judge(FnBackend(rule_judge), str(f))
    with pytest.raises(JudgeError, match="looks like a file name, and there is no such file"):
        Judge(FnBackend(rule_judge), str(tmp_path / "rubrik.txt"))
    assert Judge(FnBackend(rule_judge), "Be polite.").rubric == "Be polite."  # text, not a file


@pytest.mark.parametrize(
    "options, match",
    [
        ({}, "exactly one of judge_model"),
        ({"base_url": "http://x/v1", "judge_model": "bundled"}, "exactly one of"),
        ({"base_url": "ftp://x"}, "expected http"),
        ({"base_url": "http://x/v1", "shuffles": 0}, "shuffles"),
        ({"base_url": "http://x/v1", "fallback_score": 5}, r"\[0, 1\]"),
        ({"base_url": "http://x/v1", "on_fallback": "zero"}, "'score' or 'error'"),
        ({"base_url": "http://x/v1", "api_key_env": "PEERGRADE_NO_SUCH_VAR"}, "not set"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(JudgeError, match=match):
        make_judge(rubric=RUBRIC, **options)


def test_the_builtin_checks_its_options_before_the_first_step():
    with pytest.raises(JudgeError, match="rubric is empty"):
        make_reward_spec("judge", kwargs={"rubric": "", "base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(ValueError, match="has no option 'rubrik'"):
        make_reward_spec("judge", kwargs={"rubrik": "x", "base_url": "http://127.0.0.1:9/v1"})


# ----------------------------------------------------------------------------- the endpoint


def test_builtin_through_an_endpoint_with_score_rewards_and_its_metrics():
    with serve(rule_judge) as (srv, url):
        spec = make_reward_spec("judge", kwargs={"rubric": RUBRIC, "base_url": url})
        prompts, completions = groups_of(ROWS[:3], ["Paris", "Lyon", "Paris."])
        scores = score_rewards([spec], prompts, completions)
        assert scores.per_fn["judge"].tolist() == pytest.approx([0.7, 0.2, 0.7] * 3)
        m = scores.metrics()
        assert m["judge/fallbacks"] == 0.0 and m["judge/requests"] == 3.0
        assert srv.calls == 3


def test_an_endpoint_that_is_down_falls_back_after_retries_and_is_counted():
    with serve(rule_judge) as (_, url):
        pass  # the port is closed now
    spec = make_reward_spec(
        "judge", kwargs={"rubric": RUBRIC, "base_url": url, "retries": 1, "fallback_score": 0.5}
    )
    t = time.time()
    scores = score_rewards([spec], *groups_of(ROWS[:2], ["Paris", "Lyon"]))
    assert time.time() - t < 10
    assert scores.per_fn["judge"].tolist() == [0.5] * 4
    m = scores.metrics()
    assert m["judge/fallbacks"] == 4.0 and m["judge/failed_requests"] == 2.0
    assert m["reward/judge/std"] == 0.0  # no signal from these groups: the detector sees it


def test_a_slow_endpoint_times_out_and_a_500_is_retried():
    with serve(rule_judge, delay=2.0) as (srv, url):
        j = Judge(HTTPBackend(url, timeout_s=0.3, retries=1), RUBRIC, on_fallback="error")
        with pytest.raises(JudgeError, match="timed out|TimeoutError"):
            j(*groups_of(ROWS[:1], ["Paris", "Lyon"]))
    with serve(rule_judge, fail_status=503) as (srv, url):
        j = Judge(HTTPBackend(url, retries=2), RUBRIC)
        logged = {}
        out = j(*groups_of(ROWS[:1], ["Paris", "Lyon"]), log_metric=logged.__setitem__)
        assert out == [None] * 2  # unscored answers abstain: no made-up score
        assert srv.calls == 3 and logged["judge/unscored"] == 2.0
        assert logged["judge/fallbacks"] == 0.0


def test_on_fallback_error_goes_through_the_runs_reward_error_policy():
    spec = make_reward_spec(
        "judge",
        kwargs={
            "rubric": RUBRIC,
            "base_url": "http://127.0.0.1:9/v1",
            "retries": 0,
            "on_fallback": "error",
        },
    )
    scores = score_rewards([spec], *groups_of(ROWS[:1], ["Paris", "Lyon"]), on_error="zero")
    assert scores.num_errors == 2 and "request(s) failed" in scores.errors[0]


# ----------------------------------------------------------------------------- a local model


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny model taught (70 Adam steps on three requests) to reply ``{"scores": [7, 3]}``
    to a two-answer judge request: replies in the documented shape, so scores are real
    numbers, not fallbacks."""
    import torch

    from peergrade.model.load import load_model, load_tokenizer
    from peergrade.model.tiny import save_tiny_model

    # the judge's instructions are long: a char-level tiny model needs the positions
    d = save_tiny_model(
        tmp_path_factory.mktemp("judge_model"), "qwen2", seed=3, max_position_embeddings=2048
    )
    model, tok = load_model(d), load_tokenizer(d)
    encode = peergrade.training.judge_local.LocalBackend(
        model, tok, path=str(d), batch_size=1, max_tokens=1
    ).encode
    target = tok('{"scores": [7, 3]}<|im_end|>', add_special_tokens=False)["input_ids"]
    seqs = [encode(build_messages(RUBRIC, r["prompt"], ["Paris", "Lyon"])) for r in ROWS[:3]]
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(70):
        for p in seqs:
            labels = torch.tensor([[-100] * len(p) + target])
            model(input_ids=torch.tensor([p + target]), labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(d)
    return d


def test_local_model_and_endpoint_of_the_same_model_give_identical_scores(judge_dir):
    opts = dict(rubric=RUBRIC, max_tokens=24, device="cpu", dtype="float32")
    local = make_judge(judge_model=str(judge_dir), batch_size=4, **opts)
    # the server answers each request with the same model, one request at a time
    served = make_judge(judge_model=str(judge_dir), batch_size=1, **opts)
    prompts, completions = groups_of(ROWS[:3], ["Paris", "Lyon"])
    with serve(lambda m: served.backend.complete([m])[0]) as (srv, url):
        remote = make_judge(
            base_url=url, **{k: v for k, v in opts.items() if k == "rubric"}, max_tokens=24
        )
        scores = local(prompts, completions)
        assert scores == pytest.approx([0.7, 0.3] * 3)  # parsed replies, not the fallback
        assert remote(prompts, completions) == scores
        # the replies themselves, not only the (fallback) scores, are the same text
        groups = [(r["prompt"], ["Paris", "Lyon"]) for r in ROWS[:3]]
        msgs = [build_messages(RUBRIC, q, a) for q, a in groups]
        texts = local.ask(msgs, use_cache=False)
        assert all(isinstance(t, str) and t for t in texts)
        assert texts == remote.ask(msgs, use_cache=False)
        assert srv.calls == 6


def test_local_model_and_peergrade_serve_of_the_same_model_give_identical_scores(judge_dir):
    """The issue's target: the same groups through ``judge_model=DIR`` and through the
    ``base_url`` of ``peergrade serve`` (its real engine, chat template and greedy sampler) of the
    same model give identical scores, and they are parsed replies, not fallbacks."""
    pytest.importorskip("uvicorn")
    from peergrade.model.load import load_model, load_tokenizer, prepare_tokenizer
    from peergrade.serving.server import Engine, Server, build_app

    opts = dict(rubric=RUBRIC, max_tokens=24)
    local = make_judge(judge_model=str(judge_dir), batch_size=4, device="cpu", **opts)
    model = load_model(str(judge_dir)).eval()
    engine = Engine(
        model, prepare_tokenizer(load_tokenizer(str(judge_dir))), "judge", window_s=0.02
    )
    prompts, completions = groups_of(ROWS[:3], ["Paris", "Lyon"])
    try:
        with Server(build_app(engine)) as srv:
            remote = make_judge(base_url=srv.url + "/v1", model="judge", **opts)
            scores = local(prompts, completions)
            assert scores == pytest.approx([0.7, 0.3] * 3)  # parsed replies, not the fallback
            assert remote(prompts, completions) == scores
    finally:
        engine.close()


def test_a_judge_without_a_model_name_asks_what_peergrade_serve_serves(judge_dir, capsys):
    """``peergrade serve`` names its model after the path: a judge given only ``base_url``
    asks ``GET /v1/models`` and sends that name (it sent ``judge`` and got a 400 on every
    request before), so its scores are the local model's, not abstentions."""
    pytest.importorskip("uvicorn")
    from peergrade.model.load import load_model, load_tokenizer, prepare_tokenizer
    from peergrade.serving.server import Engine, Server, build_app

    opts = dict(rubric=RUBRIC, max_tokens=24)
    local = make_judge(judge_model=str(judge_dir), batch_size=4, device="cpu", **opts)
    model = load_model(str(judge_dir)).eval()
    tok = prepare_tokenizer(load_tokenizer(str(judge_dir)))
    engine = Engine(model, tok, str(judge_dir), window_s=0.02)  # named as `peergrade serve` does
    prompts, completions = groups_of(ROWS[:2], ["Paris", "Lyon"])
    try:
        with Server(build_app(engine)) as srv:
            remote = make_judge(base_url=srv.url + "/v1", retries=0, **opts)
            assert remote(prompts, completions) == local(prompts, completions)
            assert remote.backend.model == str(judge_dir)
    finally:
        engine.close()
    assert f"asking {str(judge_dir)!r}, the model GET" in capsys.readouterr().err


def test_judge_model_through_the_config(judge_dir, tmp_path):
    from peergrade.config import load_config
    from peergrade.tasks import load_task
    from peergrade.training.components import build_rewards

    f = tmp_path / "cfg.yaml"
    f.write_text(
        "rewards:\n  - name: judge\n    kwargs:\n      rubric: be right\n"
        f"      judge_model: {judge_dir}\n      max_tokens: 8\n      device: cpu\n"
    )
    cfg = load_config(str(f))
    specs = build_rewards(cfg, load_task("arithmetic"))
    assert [s.name for s in specs] == ["judge"]
    out = score_rewards(specs, *groups_of(ROWS[:1], ["Paris", "Lyon"]))
    assert out.per_fn["judge"].shape == (2,)


# ----------------------------------------------------------------------------- the audit


def test_audit_passes_a_judge_without_bias_and_catches_a_position_bias():
    clean = audit_judge(Judge(FnBackend(rule_judge), RUBRIC), ROWS)
    assert not clean.failed, clean.format()
    assert clean.figures["position_bias"] == 0.0 and clean.figures["discrimination"] == 1.0

    biased = audit_judge(Judge(FnBackend(position_judge), RUBRIC), ROWS)
    assert biased.failed and biased.findings[0].startswith("position_bias = ")
    shuffled = audit_judge(Judge(FnBackend(position_judge), RUBRIC, shuffles=2), ROWS)
    # figures recorded in docs/audit.md: slot effects of a 3, 2, 1, 0 point bonus
    assert biased.figures["position_bias"] == pytest.approx(0.15)
    assert biased.slot_effects == pytest.approx([0.15, 0.05, -0.05, -0.15])
    assert shuffled.figures["position_bias"] == pytest.approx(0.0)
    assert not any(f.startswith("position_bias") for f in shuffled.findings)


def _padding_lover(messages):
    return json.dumps({"scores": [min(10.0, len(a) / 10) for a in shown_answers(messages)]})


def _obedient(messages):
    return json.dumps(
        {
            "scores": [
                10.0 if "top score" in a else content_score(a) for a in shown_answers(messages)
            ]
        }
    )


@pytest.mark.parametrize(
    "fn, finding",
    [
        (_padding_lover, "length_bias"),
        (_obedient, "injection"),
        (lambda m: json.dumps({"scores": [5] * len(shown_answers(m))}), "spread"),
        (lambda m: "I like them all", "unscored_share"),
    ],
)
def test_audit_names_each_bias(fn, finding):
    report = audit_judge(Judge(FnBackend(fn), RUBRIC), ROWS)
    assert report.failed and any(f.startswith(finding + " = ") for f in report.findings), (
        report.format()
    )


def test_audit_catches_an_inconsistent_judge():
    import random

    rng = random.Random(0)

    def coin(messages):  # a judge sampling at a high temperature
        return json.dumps({"scores": [rng.choice([1.0, 9.0]) for _ in shown_answers(messages)]})

    report = audit_judge(Judge(FnBackend(coin), RUBRIC), ROWS)
    assert any(f.startswith("self_consistency") for f in report.findings)
    assert "too small or too unreliable" in report.findings[-1]


def _write_audit_inputs(tmp_path, url, shuffles=1):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "judge.yaml"
    cfg.write_text(
        "rewards:\n  - name: judge\n    kwargs:\n"
        f"      rubric: {RUBRIC}\n      base_url: {url}\n      shuffles: {shuffles}\n"
    )
    return ["audit", "--config", str(cfg), "--data", str(data), "--judge-rows", "4"]


def test_cli_audit_of_a_rule_based_judge_over_http_exits_0(tmp_path, capsys):
    with serve(rule_judge) as (_, url):
        assert main(_write_audit_inputs(tmp_path, url)) == 0
    out = capsys.readouterr().out
    # groups of the run's group size (the default config's 8), as the judge sees them in training
    assert "judge audit of judge: 4 rows x 8 answers" in out and "no finding" in out


def test_cli_audit_of_a_position_biased_judge_exits_1_naming_it(tmp_path, capsys):
    with serve(position_judge) as (_, url):
        assert main(_write_audit_inputs(tmp_path, url) + ["--json"]) == 1
        data = json.loads(capsys.readouterr().out)
        (rep,) = data["judges"]
        assert rep["findings"][0].startswith("position_bias = 0.150")
        assert rep["slot_effects"][0] == pytest.approx(0.15) and len(rep["slot_effects"]) == 8
        assert main(_write_audit_inputs(tmp_path, url, shuffles=2)) == 0


def test_the_no_signal_detector_names_judge_fallbacks():
    from peergrade.config import AlertConfig
    from peergrade.monitoring.detectors import Detectors

    d = Detectors(AlertConfig(), 1)
    out = {}
    for step in range(1, 30):
        out = d.update(
            {
                "step": step,
                "rollout/frac_zero_std_groups": 1.0,
                "reward/total/mean": 0.5,
                "reward/total/std": 0.0,
                "reward/judge/mean": 0.5,
                "judge/fallbacks": 16.0,
            }
        )
    assert "16 answers got the judge's fallback_score" in out["alerts"]["no_signal"]


def test_peergrade_memory_counts_a_local_judge(judge_dir, tmp_path):
    from peergrade.config import load_config
    from peergrade.planning.memory import estimate_for_config

    f = tmp_path / "cfg.yaml"
    f.write_text(
        "rewards:\n  - name: judge\n    kwargs:\n      rubric: be right\n"
        f"      judge_model: {judge_dir}\n      batch_size: 4\n"
    )
    with_judge = estimate_for_config(load_config(str(f)), prompt_len=32, device="cpu")
    without = estimate_for_config(load_config(None), prompt_len=32, device="cpu")
    assert without["reward_models"] == 0 and "rewards" not in without["phases"]
    # the tiny judge: weights in float32 on the CPU, and its scoring batch
    assert with_judge["reward_models"] == 4 * sum(
        t.numel()
        for t in peergrade.training.judge_local.load_local_backend(
            str(judge_dir)
        ).model.parameters()
    )
    assert with_judge["phases"]["rewards"] > with_judge["reward_models"]


def test_a_request_too_long_for_the_local_model_fails_alone(tmp_path):
    from peergrade.model.tiny import save_tiny_model

    d = save_tiny_model(tmp_path / "m", "qwen2", seed=0, max_position_embeddings=1024)
    j = make_judge(rubric=RUBRIC, judge_model=str(d), max_tokens=8, device="cpu", dtype="float32")
    long_prompt = "Tell me everything. " * 40
    logged = {}
    out = j(
        ["Short?", "Short?", long_prompt, long_prompt],
        ["a", "b", "c", "d"],
        log_metric=logged.__setitem__,
    )
    assert logged["judge/failed_requests"] == 2.0  # the short one: unparsable; the long: too long
    msgs = [build_messages(RUBRIC, q, ["a", "b"]) for q in ("Short?", long_prompt)]
    short, long = j.ask(msgs, use_cache=False)
    assert isinstance(short, str) and "exceeds" in str(long)
    assert out == [None] * 4


def test_audit_uses_the_rows_own_answers_and_judges_alone_with_group_false():
    rows = [{"prompt": "Capital of France?", "answers": ["Paris.", "Lyon.", "Paris, France."]}]
    seen = []

    def fn(messages):
        seen.append(shown_answers(messages))
        return position_judge(messages)

    report = audit_judge(Judge(FnBackend(fn), RUBRIC, group=False), rows)
    assert report.answers == 3 and report.shuffles == 1
    assert all(len(a) == 1 for a in seen) and ["Lyon."] in seen
    # one answer per request: no position to be biased by, so no figure (not a fake 0.0)
    assert report.figures["position_bias"] is None and report.figures["discrimination"] is None
    assert "group: false" in report.not_applicable["position_bias"]
    # no reference and no gold pairs: that nothing measured discrimination is the one finding
    assert [f[:31] for f in report.findings] == ["discrimination not measured: no"]


# ----------------------------------------------------------------------------- scoring: yes_no

QUESTION = "Does the reply name the right city?"


def reply_of(messages) -> str:
    """The reply shown in a yes_no request (build_yes_no_messages' layout)."""
    return re.search(r"Reply: (.*)\n.*? Answer Yes or No\.$", messages[-1]["content"], re.S).group(
        1
    )


class YesNoBackend:
    """An in-process yes_no backend: ``fn(reply) -> (P(yes), P(no))``."""

    def __init__(self, fn):
        self.fn, self.key, self.calls = fn, "yes-no", 0

    def complete(self, requests):
        raise AssertionError("scoring: yes_no generates nothing")

    def yes_no(self, requests):
        self.calls += len(requests)
        return [self.fn(reply_of(m)) for m in requests]


def city_yes_no(reply: str) -> tuple[float, float]:
    return (0.6, 0.2) if "Paris" in reply.split("\n")[0] else (0.1, 0.3)


def test_yes_no_reward_is_the_yes_share_and_each_answer_is_judged_alone():
    b = YesNoBackend(city_yes_no)
    j = Judge(b, QUESTION, scoring="yes_no")
    assert j.group is False  # the default in this mode
    prompts, completions = groups_of(ROWS[:2], ["Paris", "Lyon", "Paris!"])
    logged = {}
    out = j(prompts, completions, log_metric=logged.__setitem__)
    assert out == pytest.approx([0.75, 0.25, 0.75] * 2)  # 0.6/0.8 and 0.1/0.4
    assert b.calls == 6 and logged["judge/fallbacks"] == 0.0
    msgs = build_yes_no_messages(QUESTION, "Capital?", "Paris")
    assert msgs[-1]["content"] == f"Question: Capital?\nReply: Paris\n{QUESTION} Answer Yes or No."
    asked = []

    class Spy(YesNoBackend):
        def yes_no(self, requests):
            asked.extend(requests)
            return super().yes_no(requests)

    quiet = Judge(Spy(city_yes_no), QUESTION, scoring="yes_no", show_question=False)
    assert quiet(["Capital?"], ["Paris"]) == pytest.approx([0.75])
    assert asked[-1][-1]["content"] == f"Reply: Paris\n{QUESTION} Answer Yes or No."


def test_yes_no_with_neither_yes_nor_no_falls_back_and_is_counted():
    j = Judge(
        YesNoBackend(lambda r: (0.0, 0.0) if "Lyon" in r else (0.3, 0.1)),
        QUESTION,
        scoring="yes_no",
        fallback_score=0.25,
    )
    logged = {}
    out = j(*groups_of(ROWS[:1], ["Paris", "Lyon"]), log_metric=logged.__setitem__)
    assert out == pytest.approx([0.75, 0.25])
    assert logged["judge/fallbacks"] == 1.0 and logged["judge/failed_requests"] == 1.0
    j2 = Judge(YesNoBackend(lambda r: (0.0, 0.0)), QUESTION, scoring="yes_no", on_fallback="error")
    with pytest.raises(JudgeError, match="neither yes nor no"):
        j2(*groups_of(ROWS[:1], ["Paris"]))


@pytest.mark.parametrize(
    "options, match",
    [
        ({"scoring": "likert"}, "judge scoring='likert': expected 'json' or 'yes_no'"),
        (
            {"scoring": "yes_no", "group": True},
            "judge group=true does not apply with scoring=yes_no",
        ),
        (
            {"scoring": "yes_no", "shuffles": 2},
            "judge shuffles=2 does not apply with scoring=yes_no",
        ),
        ({"scoring": "yes_no", "rubric": "Score the cheer."}, "must be a yes/no question"),
        ({"show_question": False}, "judge show_question=false applies only with scoring=yes_no"),
        ({"scoring": "yes_no", "show_question": "no"}, "judge show_question='no': expected true"),
    ],
)
def test_yes_no_bad_option_combinations_are_one_line_errors(options, match):
    kwargs = {"rubric": QUESTION, "base_url": "http://127.0.0.1:9/v1", **options}
    with pytest.raises(JudgeError, match=re.escape(match)) as e:
        make_judge(**kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(JudgeError, match=re.escape(match)):  # the same through the config
        make_reward_spec("judge", kwargs=kwargs)


def _logprobs_response(top: list[tuple[str, float]]) -> dict:
    entries = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": top[0][0]},
                "logprobs": {"content": [{**entries[0], "top_logprobs": entries}]},
            }
        ]
    }


def test_yes_no_through_an_endpoint_sums_the_variants_of_top_logprobs():
    import math

    def answer(messages):
        if "Paris" in reply_of(messages):  # P(yes) = 0.5 + 0.1, P(no) = 0.2 ("Nope" is not a no)
            top = [
                ("Yes", math.log(0.5)),
                (" yes", math.log(0.1)),
                ("No", math.log(0.2)),
                ("Nope", math.log(0.1)),
            ]
        elif "Lyon" in reply_of(messages):  # no yes variant listed: it counts 0
            top = [(" No", math.log(0.3)), ("Maybe", math.log(0.6))]
        else:  # neither: unscored, it abstains
            top = [("Maybe", math.log(0.9))]
        return _logprobs_response(top)

    with serve(answer) as (srv, url):
        j = make_judge(rubric=QUESTION, base_url=url, scoring="yes_no", retries=0)
        logged = {}
        out = j(*groups_of(ROWS[:1], ["Paris", "Lyon", "Rome"]), log_metric=logged.__setitem__)
        assert out[:2] == pytest.approx([0.6 / 0.8, 0.0]) and out[2] is None
        assert logged["judge/unscored"] == 1.0 and logged["judge/fallbacks"] == 0.0
        body = srv.bodies[0]
        assert (body["max_tokens"], body["temperature"], body["logprobs"]) == (1, 0, True)
        assert body["top_logprobs"] == 20
    with serve(lambda m: "Yes") as (srv, url):  # an endpoint without logprobs: a clear reason
        j = make_judge(
            rubric=QUESTION, base_url=url, scoring="yes_no", retries=0, on_fallback="error"
        )
        with pytest.raises(JudgeError, match="scoring: yes_no needs logprobs"):
            j(*groups_of(ROWS[:1], ["Paris"]))


@pytest.fixture(scope="module")
def yes_no_dir(tmp_path_factory):
    """A tiny model whose tokenizer has one-token "Yes" and "No" (BPE merges), taught (Adam
    steps on six requests) to answer Yes when the reply names Paris and No otherwise."""
    import torch

    from peergrade.model.load import load_model, load_tokenizer
    from peergrade.model.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(merges=(("Y", "e"), ("Ye", "s"), ("N", "o")))
    model, tok = build_tiny_model("qwen2", tok, seed=5, max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("yes_no_judge")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    model, tok = load_model(d), load_tokenizer(d)
    backend = peergrade.training.judge_local.LocalBackend(
        model, tok, path=str(d), batch_size=1, max_tokens=1
    )
    (yes,), (no,) = backend.yes_no_tokens()  # one variant each: "Yes" and "No"
    assert tok.decode([yes]) == "Yes" and tok.decode([no]) == "No"
    seqs = [
        (
            backend.encode(build_yes_no_messages(QUESTION, r["prompt"], a)),
            yes if a == "Paris" else no,
        )
        for r in ROWS[:3]
        for a in ("Paris", "Lyon")
    ]
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(80):
        for p, target in seqs:
            labels = torch.tensor([[-100] * len(p) + [target]])
            model(input_ids=torch.tensor([p + [target]]), labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(d)
    return d


def local_yes_no_judge(model_dir, batch_size: int):
    """A yes/no judge on the local model ``model_dir`` (float32 on the CPU)."""
    return make_judge(
        rubric=QUESTION,
        judge_model=str(model_dir),
        scoring="yes_no",
        batch_size=batch_size,
        device="cpu",
        dtype="float32",
    )


def test_yes_no_local_scores_are_the_hand_computed_share_of_the_next_token(yes_no_dir):
    """The formula against a hand computation: the softmax of the model's logits after the
    generation prompt, one unpadded sequence at a time, vs the judge's padded batch."""
    import torch

    j = local_yes_no_judge(yes_no_dir, batch_size=4)
    answers = ["Paris", "Lyon", "It is Paris, the capital.", "Rome"]  # lengths differ: padding
    prompts, completions = groups_of(ROWS[:2], answers)
    out = j(prompts, completions)
    (yes,), (no,) = j.backend.yes_no_tokens()
    expected = []
    for p, a in zip(prompts, completions):
        ids = j.backend.encode(build_yes_no_messages(QUESTION, p, a))
        with torch.no_grad():
            probs = torch.softmax(j.backend.model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        expected.append((probs[yes] / (probs[yes] + probs[no])).item())
    assert out == pytest.approx(expected, abs=1e-5)
    assert out[0] > 0.5 > out[1]  # taught: Paris yes, Lyon no


def test_yes_no_local_model_and_peergrade_serve_give_the_same_scores(yes_no_dir):
    """The same answers through ``judge_model=DIR`` (one batched forward) and through the
    ``base_url`` of ``peergrade serve`` of the same model (max_tokens 1, top_logprobs 20)."""
    pytest.importorskip("uvicorn")
    from peergrade.model.load import load_model, load_tokenizer, prepare_tokenizer
    from peergrade.serving.server import Engine, Server, build_app

    local = local_yes_no_judge(yes_no_dir, batch_size=3)
    model = load_model(str(yes_no_dir)).eval()
    engine = Engine(
        model, prepare_tokenizer(load_tokenizer(str(yes_no_dir))), "judge", window_s=0.02
    )
    prompts, completions = groups_of(ROWS[:3], ["Paris", "Lyon", "Paris, in France."])
    try:
        with Server(build_app(engine)) as srv:
            remote = make_judge(
                rubric=QUESTION, base_url=srv.url + "/v1", model="judge", scoring="yes_no"
            )
            logged = {}
            scores = local(prompts, completions)
            served = remote(prompts, completions, log_metric=logged.__setitem__)
    finally:
        engine.close()
    assert logged["judge/fallbacks"] == 0.0
    assert served == pytest.approx(scores, abs=1e-5)
    assert scores[0] > 0.5 > scores[1]  # real shares, not the fallback


def test_yes_no_on_a_tokenizer_without_a_one_token_yes_is_a_clear_error(tmp_path):
    from peergrade.model.tiny import save_tiny_model

    d = save_tiny_model(tmp_path / "m", "qwen2", seed=0, max_position_embeddings=1024)
    with pytest.raises(JudgeError, match="no single-token yes"):
        make_judge(rubric=QUESTION, judge_model=str(d), scoring="yes_no", device="cpu")


def test_audit_of_a_yes_no_judge_says_position_bias_is_not_applicable():
    report = audit_judge(Judge(YesNoBackend(city_yes_no), QUESTION, scoring="yes_no"), ROWS)
    assert report.figures["position_bias"] is None
    assert "position_bias" in report.not_applicable
    text = report.format()
    assert "position_bias     not applicable: each answer is judged alone (scoring: yes_no)" in text
    assert report.to_dict()["not_applicable"]["position_bias"].startswith("each answer")
    assert report.figures["discrimination"] == 1.0 and not report.failed, text

    # the other figures still measure: a judge that likes long replies and obeys injections
    def gullible(reply):
        return (0.9, 0.1) if len(reply) > 100 or "top score" in reply else city_yes_no(reply)

    bad = audit_judge(Judge(YesNoBackend(gullible), QUESTION, scoring="yes_no"), ROWS)
    assert {f.split(" = ")[0] for f in bad.findings} >= {"length_bias", "injection"}
    none = audit_judge(Judge(YesNoBackend(lambda r: (0.0, 0.0)), QUESTION, scoring="yes_no"), ROWS)
    assert any("unscored_share" in f and "neither yes nor no" in f for f in none.findings)


def test_yes_no_examples_come_first_as_solved_turns():
    seen = []

    class Spy(YesNoBackend):
        def yes_no(self, requests):
            seen.extend(requests)
            return super().yes_no(requests)

    examples = [
        {"question": "Capital of Italy?", "reply": "Rome", "verdict": True},  # YAML's bare yes
        {"reply": "Madrid", "verdict": "no"},  # no question: its block is left out
    ]
    j = Judge(Spy(city_yes_no), QUESTION, scoring="yes_no", examples=examples)
    assert j(*groups_of(ROWS[:1], ["Paris"])) == pytest.approx([0.75])
    (msgs,) = seen
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [msgs[2]["content"], msgs[4]["content"]] == ["Yes", "No"]
    assert msgs[1]["content"] == (
        "Question: Capital of Italy?\nReply: Rome\n" + QUESTION + " Answer Yes or No."
    )
    assert msgs[3]["content"].startswith("Reply: Madrid\n")
    assert msgs[-1] == build_yes_no_messages(QUESTION, ROWS[0]["prompt"], "Paris")[-1]
    assert reply_of(msgs) == "Paris"  # the real request is the last turn


@pytest.mark.parametrize(
    "options, match",
    [
        (
            {"examples": [{"reply": "x", "verdict": "yes"}]},
            "examples apply only with scoring=yes_no",
        ),
        (
            {"scoring": "yes_no", "examples": [{"reply": "x", "verdict": "maybe"}]},
            "verdict must be yes or no",
        ),
        (
            {"scoring": "yes_no", "examples": [{"reply": "", "verdict": "no"}]},
            "reply must be a non-empty",
        ),
        (
            {"scoring": "yes_no", "examples": [{"reply": "x", "answer": "no"}]},
            "examples[0]: expected a mapping",
        ),
        ({"scoring": "yes_no", "examples": "be nice"}, "expected a list"),
    ],
)
def test_bad_examples_are_one_line_errors(options, match):
    with pytest.raises(JudgeError, match=re.escape(match)) as e:
        make_judge(rubric=QUESTION, base_url="http://127.0.0.1:9/v1", **options)
    assert "\n" not in str(e.value)


def test_cli_audit_of_a_yes_no_judge_over_http_says_not_applicable(tmp_path, capsys):
    import math

    def answer(messages):  # a judge that says yes to the right city, no otherwise
        p = 0.8 if "Paris" in reply_of(messages) else 0.2
        return _logprobs_response([("Yes", math.log(p)), ("No", math.log(1 - p))])

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "judge.yaml"
    with serve(answer) as (_, url):
        cfg.write_text(
            "rewards:\n  - name: judge\n    kwargs:\n      scoring: yes_no\n"
            f"      rubric: {QUESTION}\n      base_url: {url}\n"
        )
        args = ["audit", "--config", str(cfg), "--data", str(data), "--judge-rows", "4"]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "position_bias     not applicable: each answer is judged alone" in out
        assert "no finding" in out
        assert main(args + ["--json"]) == 0
        (rep,) = json.loads(capsys.readouterr().out)["judges"]
    assert rep["scoring"] == "yes_no" and rep["figures"]["position_bias"] is None
    assert "position_bias" in rep["not_applicable"]
    assert rep["figures"]["discrimination"] == 1.0  # "The answer is Paris." over "I am not sure."
    # one of the 8 built answers names Paris (0.8), seven do not (0.2)
    assert rep["figures"]["spread"] == pytest.approx(0.6 * 7**0.5 / 8, abs=1e-3)


def test_the_shipped_cheerful_recipe_loads_and_its_judge_options_check():
    """configs/smollm2-judge-cheerful.yaml: its data files, its judge's options (checked as
    training checks them, on an endpoint so no model loads) and its rule-based measure."""
    import importlib.util
    from pathlib import Path

    from peergrade.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "smollm2-judge-cheerful.yaml")
    train = Path(cfg.data.path).read_text().splitlines()
    held = Path(cfg.data.eval_path).read_text().splitlines()
    assert (len(train), len(held)) == (45, 15) and not set(train) & set(held)
    item, measure = cfg.rewards
    opts = dict(item.kwargs, judge_model=None, base_url="http://127.0.0.1:9/v1")
    j = make_judge(**opts)
    assert j.scoring == "yes_no" and not j.group and not j.show_question
    assert [e["verdict"] for e in j.examples] == ["Yes", "No"]
    judged = make_reward_spec("judge", kwargs=opts)  # the preflight training runs
    # the independent measure: logged with weight 0 (never trained on), the held-out scorer
    from peergrade.rewards import make_reward_specs
    from peergrade.tasks import load_task
    from peergrade.training.held_out import held_out_scorer

    assert measure.weight == 0.0 and measure.name.endswith("examples/cheerful/cheer.py:cheerful")
    specs = make_reward_specs([(judged.fn, 1.0, opts), (measure.name, 0.0, {})])
    task = load_task("file", path=cfg.data.path, eval_path=cfg.data.eval_path)
    scorer, why = held_out_scorer(task, specs, cfg.train.eval_reward)
    assert (scorer.name, why) == ("cheerful", "train.eval_reward")
    assert scorer.fn(["Great, so fun!!!", "Water.", "A lovely day!"]) == [1.0, 0.0, 1.0]
    assert (cfg.train.eval_size, cfg.train.eval_every) == (15, 10)

    spec = importlib.util.spec_from_file_location("cheer", root / "examples/cheerful/cheer.py")
    cheer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cheer)
    assert cheer.cheer_score("Great, so fun!!!") == 1.0  # 3 marks; 2 of 3 words upbeat
    assert cheer.cheer_score("Water.") == 0.0
    assert cheer.cheer_score("A lovely day!") == pytest.approx((1 / 3 + 1.0) / 2)
    assert cheer.cheer([[{"role": "assistant", "content": "Yay!"}], "No."]) == [
        pytest.approx((1 / 3 + 1.0) / 2),
        0.0,
    ]


def test_the_cheerful_checklist_config_loads_as_docs_recipes_md_describes():
    """examples/cheerful/checklist.yaml (docs/recipes.md, "A checklist of narrow checks"): two
    yes/no checks with their own examples, the rule logged with weight 0 and the held-out scorer."""
    from pathlib import Path

    from peergrade.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / "cheerful" / "checklist.yaml")
    item, measure = cfg.rewards
    j = make_judge(**dict(item.kwargs, judge_model=None, base_url="http://127.0.0.1:9/v1"))
    assert [c.question for c in j.checks] == [
        "Does the reply contain an exclamation mark?",
        "Does the reply use upbeat words such as great, love or wonderful?",
    ]
    assert all(len(c.examples) == 2 for c in j.checks) and not j.show_question
    assert measure.weight == 0.0 and measure.name.endswith("examples/cheerful/cheer.py:cheerful")
    assert cfg.train.eval_reward == "cheerful" and cfg.data.eval_path.endswith("heldout.jsonl")


def test_peergrade_memory_counts_a_yes_no_judge_as_one_answer_and_no_reply(judge_dir):
    from peergrade.training.judge_local import judge_model_memory

    sizes = dict(dtype="float32", device="cpu", prompt_len=32, completion_len=16, group=8)
    base = {"judge_model": str(judge_dir), "batch_size": 4}
    grouped = judge_model_memory(base, **sizes)
    yes_no = judge_model_memory({**base, "scoring": "yes_no"}, **sizes)
    alone = judge_model_memory({**base, "group": False, "max_tokens": 1}, **sizes)
    assert yes_no["weights"] == grouped["weights"]
    # one answer and one position for the reply: what group: false with max_tokens 1 costs
    assert yes_no["activations"] == alone["activations"] < grouped["activations"]


# ----------------------------------------------------------------------------- checklists

CITY = "Does the reply name the right city?"
ONE_WORD = "Is the reply one word?"
CHECKLIST = [CITY, {"check": ONE_WORD, "weight": 3}]


def asked_check(messages) -> str:
    """The check a yes_no request asks (its last line, before 'Answer Yes or No.')."""
    return messages[-1]["content"].rsplit("\n", 1)[1].removesuffix(" Answer Yes or No.")


class ChecklistBackend(YesNoBackend):
    """``fn(check, reply) -> (P(yes), P(no))``; records the checks asked."""

    def __init__(self, fn):
        super().__init__(fn)
        self.asked: list[tuple[str, str]] = []

    def yes_no(self, requests):
        self.calls += len(requests)
        self.asked += [(asked_check(m), reply_of(m)) for m in requests]
        return [self.fn(asked_check(m), reply_of(m)) for m in requests]


def city_and_length(check: str, reply: str) -> tuple[float, float]:
    if check == CITY:
        return (0.9, 0.1) if "Paris" in reply else (0.2, 0.8)
    assert check == ONE_WORD, check
    return (0.6, 0.4) if len(reply.split()) == 1 else (0.1, 0.9)


def test_a_checklist_reward_is_the_weighted_share_of_its_checks():
    b = ChecklistBackend(city_and_length)
    j = Judge(b, CHECKLIST)
    assert (j.scoring, j.group) == ("yes_no", False)  # the default for a checklist
    assert [(c.question, c.weight) for c in j.checks] == [(CITY, 1.0), (ONE_WORD, 3.0)]
    answers = ["Paris", "Lyon", "It is Paris, of course."]
    out = j(*groups_of(ROWS[:1], answers))
    # by hand: (1 * share(city) + 3 * share(one word)) / 4
    assert out == pytest.approx([(0.9 + 3 * 0.6) / 4, (0.2 + 3 * 0.6) / 4, (0.9 + 3 * 0.1) / 4])
    assert b.calls == 6 and sorted(b.asked) == sorted(
        (c, a) for a in answers for c in (CITY, ONE_WORD)
    )
    # the same through the built-in reward and the config's kwargs (a served judge)
    with serve(lambda m: _logprobs_response([("Yes", -0.1), ("No", -2.4)])) as (srv, url):
        spec = make_reward_spec("judge", kwargs={"rubric": CHECKLIST, "base_url": url})
        scores = score_rewards([spec], *groups_of(ROWS[:1], ["Paris", "Lyon"]))
        share = 1 / (1 + math.exp(-2.3))  # every check the same yes-share: the mean is it
        assert scores.per_fn["judge"].tolist() == pytest.approx([share] * 2, abs=1e-6)
        assert srv.calls == 4 and {asked_check(b["messages"]) for b in srv.bodies} == {
            CITY,
            ONE_WORD,
        }


def test_a_failed_check_is_not_counted_as_no():
    def city_fails_on_lyon(check, reply):
        if check == CITY and "Lyon" in reply:
            return (0.0, 0.0)  # neither yes nor no among the likely tokens: that check failed
        if "Rome" in reply:
            return (0.0, 0.0)  # every check of this answer fails
        return city_and_length(check, reply)

    j = Judge(ChecklistBackend(city_fails_on_lyon), CHECKLIST)
    logged, extra = {}, {}
    out = j(
        *groups_of(ROWS[:1], ["Paris", "Lyon", "Rome"]),
        log_metric=logged.__setitem__,
        log_extra=extra.__setitem__,
    )
    # Lyon: only the one-word check scored, so its share alone (0.6), not (0 + 3 * 0.6) / 4
    assert out == pytest.approx([(0.9 + 3 * 0.6) / 4, 0.6, None])
    assert out[2] is None  # no check scored: the answer abstains
    assert logged["judge/unscored"] == 1.0 and logged["judge/failed_requests"] == 3.0
    assert extra["judge_error"][:2] == [None, None]
    assert extra["judge_error"][2].startswith("check 2 ('Is the reply one word?'): neither yes")
    fb = Judge(ChecklistBackend(city_fails_on_lyon), CHECKLIST, fallback_score=0.25)
    assert fb(*groups_of(ROWS[:1], ["Rome"])) == [0.25]


@pytest.mark.parametrize(
    "rubric, options, match",
    [
        ([], {}, "the judge reward's rubric is an empty list: give at least one yes/no check"),
        ([{"check": CITY, "weight": 0}], {}, "rubric[0].weight=0: expected a number > 0"),
        ([CITY, {"check": ONE_WORD, "weight": "2"}], {}, "rubric[1].weight='2': expected a"),
        ([{"check": CITY, "weight": True}], {}, "rubric[0].weight=True: expected a number > 0"),
        ([{"check": CITY, "wieght": 2}], {}, "rubric[0]: unknown key 'wieght'; a check is a"),
        ([{"weight": 2}], {}, "rubric[0]: no 'check' key (the yes/no question)"),
        ([CITY, "Name the city."], {}, "rubric[1].check: a check is a yes/no question ending"),
        ([CITY, 5], {}, "rubric[1]: expected a yes/no question or a mapping"),
        ([CITY, CITY], {}, "rubric[1].check: 'Does the reply name the right city?' is already"),
        (CHECKLIST, {"scoring": "json"}, "rubric is a checklist, asked one yes/no check at a"),
        (
            CHECKLIST,
            {"examples": [{"reply": "Paris", "verdict": "yes"}]},
            "examples apply to a one-question rubric: give a checklist's solved examples per",
        ),
        (
            [{"check": CITY, "examples": [{"reply": "Paris", "verdict": "maybe"}]}],
            {},
            "rubric[0].examples: judge examples[0]: verdict must be yes or no",
        ),
        (CHECKLIST, {"shufles": 2}, "no option 'shufles' (did you mean 'shuffles'?); its options"),
    ],
)
def test_bad_checklists_are_one_line_errors_naming_the_key(rubric, options, match):
    kwargs = {"rubric": rubric, "base_url": "http://127.0.0.1:9/v1", **options}
    with pytest.raises((JudgeError, ValueError), match=re.escape(match)) as e:
        make_judge(**kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises((JudgeError, ValueError), match=re.escape(match.split(": ")[0])):
        make_reward_spec("judge", kwargs=kwargs)  # the same through the config


def test_a_checklist_with_per_check_examples_shows_each_checks_own():
    b = ChecklistBackend(city_and_length)
    rubric = [
        {"check": CITY, "examples": [{"reply": "Lyon", "verdict": "no"}]},
        ONE_WORD,
    ]
    seen = []

    class Spy(ChecklistBackend):
        def yes_no(self, requests):
            seen.extend(requests)
            return super().yes_no(requests)

    Judge(Spy(city_and_length), rubric)(["Capital?"], ["Paris"])
    by_check = {asked_check(m): m for m in seen}
    assert [t["content"] for t in by_check[CITY] if t["role"] == "assistant"] == ["No"]
    assert not [t for t in by_check[ONE_WORD] if t["role"] == "assistant"]
    assert b.calls == 0


def _gullible_one_word(check, reply):
    """Check 1 is sound; check 2 says yes to any reply that asks for the top score."""
    if check == ONE_WORD and ("top score" in reply or "10/10" in reply):
        return (0.95, 0.05)
    return city_and_length(check, reply)


def test_the_audit_probes_each_check_alone_and_names_the_check_in_its_findings():
    from peergrade.rewards.judge_audit import audit_cost, keyword_probe

    j = Judge(ChecklistBackend(_gullible_one_word), CHECKLIST)
    rep = audit_judge(j, ROWS, answers=4)
    assert [c.name for c in rep.checks] == [
        f"judge check 1 ({CITY!r})",
        f"judge check 2 ({ONE_WORD!r})",
    ]
    assert rep.checks[0].findings == []  # the sound check passes
    assert rep.figures["injection"] > 0.05 and rep.figures["injection_note"] > 0.05
    named = [f for f in rep.findings if f.startswith(f"check 2 ({ONE_WORD!r}): injection")]
    assert len(named) == 2 and not any(f.startswith("check 1") for f in rep.findings)
    # discrimination is the whole checklist's: "The answer is Paris." over "I am not sure."
    assert rep.figures["discrimination"] == 1.0
    assert rep.checks[1].not_applicable["discrimination"].startswith("measured on the whole")
    assert rep.requests == audit_cost(j, len(ROWS), 4, 0, keyword_probe(j.rubric) is not None)
    text = rep.format()
    assert "a checklist of 2 checks, each audited alone" in text
    assert f"judge audit of judge check 2 ({ONE_WORD!r})" in text
    assert rep.to_dict()["checks"][1]["findings"] == rep.checks[1].findings
    sound = audit_judge(Judge(ChecklistBackend(city_and_length), CHECKLIST), ROWS, answers=4)
    assert sound.findings == []


def test_a_checklists_gold_pairs_are_scored_by_the_whole_checklist(tmp_path):
    gold = tmp_path / "gold.jsonl"
    pairs = [("Capital of France?", "Paris", "Lyon")] * 2 + [("Capital?", "Lyon", "Paris")]
    gold.write_text(
        "".join(json.dumps({"prompt": p, "better": b, "worse": w}) + "\n" for p, b, w in pairs)
    )
    j = Judge(ChecklistBackend(city_and_length), CHECKLIST, gold=str(gold))
    rep = audit_judge(j, ROWS[:1], answers=2)
    assert rep.gold_pairs == 3 and rep.figures["gold_agreement"] == pytest.approx(2 / 3, abs=1e-4)
    assert any(f.startswith("gold_agreement = 0.667") for f in rep.findings)


# ----------------------------------------------------------------------------- the options record


def test_judge_options_is_a_typed_record_and_keyword_calls_still_work():
    import dataclasses

    from peergrade.rewards.judge import JudgeOptions

    opts = JudgeOptions.of({"rubric": RUBRIC, "base_url": "http://127.0.0.1:9/v1"}, shuffles=2)
    assert dataclasses.is_dataclass(opts) and opts.shuffles == 2 and opts.scoring is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.shuffles = 3
    assert make_judge(opts) is make_judge(
        rubric=RUBRIC, base_url="http://127.0.0.1:9/v1", shuffles=2
    )
    with pytest.raises(
        JudgeError, match=r"no option 'temperature'; its options: rubric, judge_model, "
    ):
        JudgeOptions.of(temperature=0.7)
    with pytest.raises(JudgeError, match=r"no option 'rubrik' \(did you mean 'rubric'\?\)"):
        Judge(FnBackend(rule_judge), RUBRIC, rubrik="x")
    j = Judge(FnBackend(rule_judge), options=opts)
    assert (j.rubric, j.shuffles, j.options) == (RUBRIC, 2, opts)


def test_peergrade_judge_reward_from_python_reaches_the_trainer_and_its_audit(tmp_path, capsys):
    """``peergrade.judge_reward`` takes a checklist; the ``Judge`` it returns is a reward function
    GRPOTrainer takes and audits at start-up, like the built-in judge reward."""
    import peergrade
    from peergrade import GRPOConfig, GRPOTrainer
    from peergrade.model.load import BUNDLED_MODEL

    def answer(messages):
        return _logprobs_response([("Yes", -0.2), ("No", -1.8)])

    with serve(answer) as (srv, url):
        j = peergrade.judge_reward(CHECKLIST, base_url=url, retries=0)
        assert isinstance(j, Judge) and len(j.checks) == 2
        args = GRPOConfig(
            output_dir=str(tmp_path / "run"),
            per_device_train_batch_size=2,
            num_generations=2,
            max_steps=1,
            max_completion_length=4,
            gradient_checkpointing=False,
        )
        rows = [{"prompt": r["prompt"]} for r in ROWS]
        trainer = GRPOTrainer(str(BUNDLED_MODEL), j, args, rows)
    assert trainer.reward_funcs == [j]
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("judge audit: judge: ")]
    assert "(budget 100, train.audit_judge_requests)" in line
    assert "reward audit: a reward function calls the judge" not in err  # no exploit battery


def test_the_run_warns_when_the_judges_score_rises_and_the_held_out_measure_does_not():
    """The cheerful recipe's failure, as metrics lines: the judge's reward (the training reward)
    climbs 0.575 -> 0.687 while the rule's held-out pass@1 stays at 0.133: reward_vs_eval fires
    at the evaluation that sees it; the same climb with the held-out share rising is silent."""
    from peergrade.config import AlertConfig
    from peergrade.monitoring.detectors import Detectors

    def run(evals):
        d, fired = Detectors(AlertConfig()), {}
        for step in range(0, 31):
            m = {"step": step}
            if step:
                m["reward/total/mean"] = 0.575 + 0.112 * (step - 1) / 29
                m["rollout/len_mean"] = 40.0
            if step in evals:
                m["eval/pass@1_sampled"] = evals[step]
            out = d.update(m)
            if out.get("alerts"):
                fired[step] = out["alerts"]
        return fired

    fired = run({0: 0.133, 10: 0.133, 20: 0.133, 30: 0.117})
    # the window means (10 steps) rose 0.039 by step 20, below reward_rise (0.05); 0.077 by 30
    assert list(fired) == [30] and set(fired[30]) == {"reward_vs_eval"}
    msg = fired[30]["reward_vs_eval"]
    assert "rose by +0.077 (window mean) since the first evaluation" in msg
    assert "did not rise: 0.133 (step 0) -> 0.117 (step 30)" in msg and "train.eval_reward" in msg
    assert run({0: 0.133, 10: 0.15, 20: 0.2, 30: 0.25}) == {}


def test_the_run_warns_when_the_judges_held_out_score_rises_though_its_training_window_is_flat():
    """The checklist run's figures (docs/recipes.md, seed 0): the training reward's window stayed
    flat (0.563 -> 0.546 in 12 noisy steps) while, on the held-out answers, the judge's score
    rose (greedy 0.555 -> 0.650, sampled 0.550 -> 0.600) and the rule's share fell: the
    evaluation reports the judge's held-out score (eval/train_reward) and reward_vs_eval fires
    on it; a rule share that rises too, or no held-out judge score, stays silent."""
    from peergrade.config import AlertConfig
    from peergrade.monitoring.detectors import Detectors

    def run(rule, judge):
        d, fired = Detectors(AlertConfig()), {}
        for step in range(0, 13):
            m = {"step": step}
            if step:
                m["reward/total/mean"] = 0.563 - 0.017 * (step - 1) / 11
                m["rollout/len_mean"] = 30.0
            if step in rule:
                m["eval/pass@1_sampled"] = rule[step]
                if judge:
                    m["eval/train_reward"], m["eval/train_reward_sampled"] = judge[step]
            out = d.update(m)
            if out.get("alerts"):
                fired[step] = out["alerts"]
        return fired

    rule = {0: 0.100, 6: 0.100, 12: 0.033}
    judge = {0: (0.555, 0.550), 6: (0.580, 0.560), 12: (0.650, 0.600)}
    fired = run(rule, judge)
    # step 6: +0.0175 held-out, below reward_rise (0.05); step 12: +0.0725
    assert list(fired) == [12] and set(fired[12]) == {"reward_vs_eval"}
    msg = fired[12]["reward_vs_eval"]
    assert "on the held-out prompts the training reward rose by +0.073" in msg
    assert "0.100 (step 0) -> 0.033 (step 12)" in msg
    assert run(rule, None) == {}  # the window alone: flat, no alert
    assert run({0: 0.100, 6: 0.120, 12: 0.200}, judge) == {}  # the rule rose too


def test_held_out_evaluations_score_the_answers_with_the_judge_beside_the_eval_reward():
    """With train.eval_train_reward and train.eval_reward naming a rule beside a weighted
    judge-like reward, the held-out evaluation reports the training mix's mean on the same
    answers (train_reward, greedy and sampled; answers it abstains on left out); off (the
    default), or with a scorer that is the training signal, no extra reward calls are made."""
    from peergrade.config import ConfigError, load_config
    from peergrade.evaluation import EvalOptions, evaluate
    from peergrade.generation import SamplerSettings
    from peergrade.model.tiny import build_tiny_model
    from peergrade.rewards import RewardSpec
    from peergrade.training.held_out import held_out_train_rewards

    calls = []

    def judge(completions, **_):  # 1.0 for an answer with a digit, abstains on empty answers
        calls.append(len(completions))
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [None if not t else float(any(ch.isdigit() for ch in t)) for t in texts]

    def rule(completions, **_):
        return [0.0] * len(completions)

    j = RewardSpec(name="judge", fn=judge, weight=1.0, kwargs={})
    r = RewardSpec(name="rule", fn=rule, weight=0.0, kwargs={})
    cfg = load_config(None, [("train.eval_reward", "rule"), ("train.eval_train_reward", True)])
    assert held_out_train_rewards(cfg, [j, r], r) == (j,)
    off = load_config(None, [("train.eval_reward", "rule")])  # the default: no judge calls
    assert held_out_train_rewards(off, [j, r], r) == ()
    with pytest.raises(ConfigError, match="train.eval_train_reward .* needs train.eval_reward"):
        load_config(None, [("train.eval_train_reward", True)])
    assert held_out_train_rewards(cfg, [r.__class__(**{**r.__dict__, "weight": 1.0})], r) == ()

    model, tok = build_tiny_model()
    rows = [{"prompt": "1+1="}, {"prompt": "2+3="}]
    ids = [tok.encode(x["prompt"]) for x in rows]
    settings = SamplerSettings(n=1, max_new_tokens=4, temperature=1.0)
    plain = evaluate(model, tok, rows, ids, r, EvalOptions(k=2, settings=settings, seed=0))
    assert "train_reward" not in plain and not calls
    out = evaluate(
        model, tok, rows, ids, r, EvalOptions(k=2, settings=settings, seed=0, train_rewards=(j,))
    )
    assert calls == [2, 4]  # the greedy answers, then the k = 2 samples of each row
    assert 0.0 <= out["train_reward"] <= 1.0 and 0.0 <= out["train_reward_sampled"] <= 1.0
    assert {k: out[k] for k in plain} == plain  # the scorer's figures are unchanged


def test_the_documented_checklist_example_loads_and_scores_as_docs_rewards_md_says():
    """docs/rewards.md's checklist config: three checks (weights 1, 2, 1; the third with its
    own examples); shares 0.9, 0.8, 0.2 give 0.675, and with the third check failed 0.833."""
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    section = doc.split("### Checklist rubrics")[1]
    cfg = yaml.safe_load(section.split("```yaml")[1].split("```")[0])
    (item,) = cfg["rewards"]
    j = make_judge(**item["kwargs"])
    assert [c.weight for c in j.checks] == [1.0, 2.0, 1.0]
    assert [e["verdict"] for e in j.checks[2].examples] == ["Yes", "No"]
    shares = {c.question: s for c, s in zip(j.checks, (0.9, 0.8, 0.2))}
    third = j.checks[2].question
    assert "(0.9 + 2 * 0.8 + 0.2) / 4 = 0.675" in section
    assert "(0.9 + 2 * 0.8) / 3 = 0.833" in section
    for failed, expected in ((False, 0.675), (True, 2.5 / 3)):

        def fn(check, reply, failed=failed):
            if failed and check == third:
                return (0.0, 0.0)
            return (shares[check], 1 - shares[check])

        out = Judge(ChecklistBackend(fn), options=j.options)(["Write my essay."], ["No."])
        assert out == pytest.approx([expected])


def test_a_weight_0_measure_beside_the_judge_leaves_an_abstention_unscored():
    """The cheerful recipe logs its rule with weight 0: an answer the judge could not score
    keeps a NaN total (it abstains), rather than a total of 0 from the measure alone."""
    import importlib.util
    from pathlib import Path

    from peergrade.rewards import make_reward_specs

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("cheer", root / "examples/cheerful/cheer.py")
    cheer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cheer)
    j = Judge(
        YesNoBackend(lambda r: (0.0, 0.0) if "Lyon" in r else (0.6, 0.2)),
        QUESTION,
        scoring="yes_no",
    )
    specs = make_reward_specs([(j, 1.0, {}), (cheer.cheerful, 0.0, {})])
    s = score_rewards(specs, *groups_of(ROWS[:1], ["Paris!! Great!", "Lyon!! Great!"]))
    assert s.per_fn["cheerful"].tolist() == [1.0, 1.0]  # logged for both
    assert s.total[0].item() == pytest.approx(0.75) and math.isnan(s.total[1].item())


def test_the_judge_by_name_without_a_rubric_points_to_judge_reward():
    import peergrade

    with pytest.raises(JudgeError, match=r"from Python: peergrade.judge_reward\(rubric=\.\.\."):
        make_reward_spec("judge")  # what reward_funcs="judge" resolves to: no kwargs
    j = peergrade.judge_reward(rubric=QUESTION, base_url="http://127.0.0.1:9/v1", scoring="yes_no")
    assert (j.rubric, j.scoring, j.checks) == (QUESTION, "yes_no", None)
