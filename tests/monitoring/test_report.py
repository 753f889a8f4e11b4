"""The HTML run report: reading run dirs (partial, killed, damaged, not a run), what the page
holds (plots, config, sampled groups with per-function rewards, alerts, no URLs), and the page
rendered by real headless Chromium from a real tiny training run, with a screenshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cli_helper import cli
from peergrade.cli import main
from peergrade.files import read_jsonl
from peergrade.monitoring.report import OPTIONAL_PANELS, PANELS, load_run, render_report

TINY = {
    "rollout.prompts_per_step": "2",
    "rollout.group_size": "3",
    "rollout.max_completion_length": "4",
    "train.eval_size": "4",
    "train.eval_samples": "2",
    "train.eval_every": "2",
    "train.display": "none",
    "train.threads": "1",
    "train.log_samples": "2",
    "train.save_every": "0",
}


def synthetic_run(path: Path, *, steps: int = 4, G: int = 2, alert_at: int | None = 3) -> Path:
    """A run dir written by hand: what the trainer writes, plus the per-function rewards in
    samples and an ``alert/*`` metric (issue 15 items 1 and 3, built elsewhere)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        f"rollout:\n  group_size: {G}\n  prompts_per_step: 1\nalgo:\n  name: grpo\ntrain:\n  steps: {steps}\n"
    )
    rows = [{"step": 0, "eval/pass@1_greedy": 0.25, "eval/n": 4, "eval/k": 2}]
    for s in range(1, steps + 1):
        m = {
            "step": s,
            "reward/acc/mean": 0.1 * s,
            "reward/fmt/mean": 0.5,
            "reward/total/mean": 0.1 * s + 0.5,
            "kl/mean": 0.01 * s,
            "entropy/mean": 1.0 / s,
            "rollout/len_mean": 3.0,
            "rollout/frac_zero_std_groups": 0.5,
            "clip/frac": 0.0,
            "ratio/max": 1.0 + 0.01 * s,
            "correction/weight_mean": 1.0,
            "dynamic/rounds": 1.0 + s % 2,
            "dynamic/frac_zero_std_groups_sampled": 0.5,
            "perf/tokens_per_s": 100.0,
            "time/generate_s": 1.0,
            "time/reward_s": 0.5,
            "time/ref_s": 0.0,
            "time/update_s": 2.0,
            "time/step_s": 4.0,
            "loss/policy": 0.0,
        }
        if s == alert_at:
            m["alert/entropy_collapse"] = "entropy fell below 0.4; try a higher temperature"
        rows.append(m)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [
        {
            "step": s,
            "prompt": f"{s}+{s}= <b>not a tag</b>",
            "answer": str(2 * s),
            "completions": [str(2 * s), "x"][:G],
            "rewards": [1.5, 0.0][:G],
            "rewards_per_fn": {"acc": [1.0, 0.0][:G], "fmt": [0.5, 0.0][:G]},
            "advantages": [0.7071, -0.7071][:G],
            "finish_reason": ["eos", "length"][:G],
        }
        for s in range(1, steps + 1)
    ]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    return path


# ----------------------------------------------------------------------------- reading


def test_read_jsonl_tolerates_a_cut_last_line_and_names_a_damaged_one(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n{"step": 4, "x": 1')
    notes: list[str] = []
    rows = read_jsonl(p, notes)
    assert [r["step"] for r in rows] == [1, 3]
    assert any("line 2" in n and "skipped" in n for n in notes), notes
    assert any("last line 4" in n and "incomplete" in n for n in notes), notes
    assert read_jsonl(tmp_path / "missing.jsonl", notes) == []


def test_killed_run_loads_with_its_complete_steps(tmp_path):
    run = synthetic_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/acc/me')  # killed mid-write
    r = load_run(run)
    assert r.last_step == 4 and not r.finished
    assert len(r.samples) == 4
    html = render_report([r])
    assert "stopped or running at step 4/4" in html
    assert "incomplete" in html


@pytest.mark.parametrize("make", ["missing", "file", "empty_dir"])
def test_not_a_run_dir_is_a_clear_error(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make == "file":
        target.write_text("hi")
    elif make == "empty_dir":
        target.mkdir()
    assert main(["report", str(target), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(target) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_report_content_and_overlay(tmp_path, capsys):
    a = synthetic_run(tmp_path / "A")
    b = synthetic_run(tmp_path / "B", G=2, alert_at=None)
    out = tmp_path / "report.html"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    html = out.read_text()
    # per-function rewards from samples, escaped prompts, alert highlighted, both runs overlaid
    assert "acc&nbsp;1.000" in html and "fmt&nbsp;0.500" in html
    assert "&lt;b&gt;not a tag&lt;/b&gt;" in html and "<b>not a tag</b>" not in html
    assert "alert/entropy_collapse" in html and "try a higher temperature" in html
    assert "A: reward/acc/mean" in html and "B: reward/acc/mean" in html
    # every panel with data is a figure, or a note when constant by construction
    figures = re.findall(r'<figure class="plot" data-panel="([^"]+)">', html)
    notes = re.findall(r'<figure class="note" data-panel="([^"]+)">', html)
    assert "Reward per function" in figures and "Held-out accuracy" in figures
    assert "Time per phase" in figures and "Importance ratio" in figures
    # clip/frac is 0 on every step of both runs, whose one update per batch makes it so
    assert notes == ["Clip fractions"]
    # the synthetic runs log something for every panel but the optional ones of pipelined
    # rollouts, the correction's masking and FLOP/s: each is there exactly once
    logged = OPTIONAL_PANELS - {"Dynamic sampling"}
    assert sorted(figures + notes) == sorted(t for t, _, _ in PANELS if t not in logged)
    # 4 steps x 2 completions per run; the table holds all 16 rows
    assert html.count('data-group="') == 16
    # nothing that could fetch: no http(s) anywhere, CSP forbids any request
    assert not re.search(r"https?:", html)
    assert "Content-Security-Policy" in html and "default-src 'none'" in html


# ----------------------------------------------------------------------------- Chromium


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _chrome(args: list[str]) -> subprocess.CompletedProcess:
    exe = _chromium()
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(scope="module")
def real_run(tiny_model_dir, tmp_path_factory):
    """A real 4-step training run of the tiny model (eval at steps 0, 2, 4)."""
    cwd = tmp_path_factory.mktemp("realrun")
    flags = [x for k, v in {**TINY, "train.steps": "4"}.items() for x in (f"--{k}", v)]
    res = cli(["train", "--model", str(tiny_model_dir), *flags, "-o", "run"], cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    return cwd / "run"


@pytest.mark.slow
@pytest.mark.skipif(
    _chromium() is None,
    reason="headless Chromium not installed (Debian: apt-get install chromium; .ci/run does it); "
    "the report's browser test needs it",
)
def test_report_renders_in_headless_chromium(real_run, tmp_path):
    synth = synthetic_run(tmp_path / "synthetic")
    out = tmp_path / "report.html"
    assert main(["report", str(real_run), str(synth), "-o", str(out)]) == 0
    html = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    n_fig = html.count('<figure class="plot"')
    n_rows = html.count('data-group="')
    real_groups = [json.loads(x) for x in (real_run / "samples.jsonl").read_text().splitlines()]
    assert n_rows == sum(len(g["completions"]) for g in real_groups) + 4 * 2

    dom = _chrome(["--dump-dom", out.as_uri()])
    assert dom.returncode == 0, dom.stderr[-2000:]
    d = dom.stdout
    # the page's script ran: every figure was laid out with a size, the table filtered to all
    assert d.count('data-rendered="1"') == n_fig >= 10
    assert f'data-plots-rendered="{n_fig}"' in d
    n_groups = len(real_groups) + 4
    assert f"{n_groups} of {n_groups} groups shown" in d
    assert d.count("<svg") >= n_fig
    # the browser's own record of fetched resources: none
    assert 'data-resource-requests="0"' in d

    shots = Path(tempfile.mkdtemp(prefix="peergrade-report-shot-"))
    png = shots / "report.png"
    shot = _chrome(["--window-size=1400,2400", f"--screenshot={png}", out.as_uri()])
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    print(f"screenshot: {png}")


def test_a_panel_with_nothing_logged_is_named_not_drawn(tmp_path):
    run = synthetic_run(tmp_path / "run")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("kl/mean", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = render_report([load_run(run)])
    assert 'data-panel="KL to the reference"' not in html
    assert "Not logged in these runs: KL to the reference." in html


@pytest.mark.parametrize(
    "field",
    [
        {"rewards_per_fn": {"acc": [1.0, 0.0], "fmt": [0.5, 0.25]}},
        {"per_fn": [{"acc": 1.0, "fmt": 0.5}, {"acc": 0.0, "fmt": 0.25}]},
        {"reward/acc": [1.0, 0.0], "reward/fmt": [0.5, 0.25]},
    ],
)
def test_per_function_rewards_in_any_logged_shape(tmp_path, field):
    from peergrade.monitoring.report import samples_section

    run = synthetic_run(tmp_path / "run", steps=1)
    s = json.loads((run / "samples.jsonl").read_text())
    s.pop("rewards_per_fn")
    s.update(field)
    (run / "samples.jsonl").write_text(json.dumps(s) + "\n")
    html = samples_section([load_run(run)]).html
    for cell in ("acc&nbsp;1.000<br>fmt&nbsp;0.500", "acc&nbsp;0.000<br>fmt&nbsp;0.250"):
        assert cell in html


def test_no_per_function_column_when_none_logged(tmp_path):
    from peergrade.monitoring.report import samples_section

    run = synthetic_run(tmp_path / "run", steps=2)
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert "<th>per function</th>" in samples_section([load_run(run)]).html
    for r in rows:
        r.pop("rewards_per_fn")
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = samples_section([load_run(run)]).html
    assert "<th>per function</th>" not in html and html.count("<tr class=") == 4


# ----------------------------------------------------------------------------- constant panels


def _rewrite(run: Path, config: str | None = None, **per_step) -> Path:
    """Replace the config and set metric keys per step (a function of the step)."""
    if config is not None:
        (run / "config.yaml").write_text(config)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] > 0:
            for key, fn in per_step.items():
                r[key.replace("__", "/")] = fn(r["step"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


BASE = "rollout:\n  group_size: 2\n  prompts_per_step: 4\n"


def _panels(html: str) -> tuple[list[str], list[str]]:
    figures = re.findall(r'<figure class="plot" data-panel="([^"]+)">', html)
    notes = re.findall(r'<figure class="note" data-panel="([^"]+)">', html)
    return figures, notes


def test_constant_by_construction_panels_say_why_instead_of_a_flat_line(tmp_path):
    flat = {"kl__mean": lambda s: 0.0, "ratio__max": lambda s: 1.0, "clip__frac": lambda s: 0.0}
    run = _rewrite(
        synthetic_run(tmp_path / "flat"), BASE + "algo:\n  beta: 0.0\n  num_iterations: 1\n", **flat
    )
    figures, notes = _panels(render_report([load_run(run)]))
    assert set(notes) == {"KL to the reference", "Importance ratio", "Clip fractions"}
    assert not set(notes) & set(figures)
    html = render_report([load_run(run)])
    assert "algo.beta is 0" in html and "the ratio is exactly 1 on every token" in html

    # two passes (or minibatches below the batch): the ratio and the clip move, and are drawn
    for extra in ("algo:\n  beta: 0.0\n  num_iterations: 2\n", "optim:\n  minibatch_size: 4\n"):
        _rewrite(run, BASE + extra)
        figures, notes = _panels(render_report([load_run(run)]))
        assert notes == ["KL to the reference"], extra
        assert {"Importance ratio", "Clip fractions"} <= set(figures)

    # a KL penalty whose logged KL happens to be flat is drawn: its config says it can move
    _rewrite(run, BASE + "algo:\n  beta: 0.04\n")
    figures, notes = _panels(render_report([load_run(run)]))
    assert "KL to the reference" in figures and "KL to the reference" not in notes


def test_a_constant_run_is_left_out_of_an_overlay_and_named(tmp_path):
    a = _rewrite(synthetic_run(tmp_path / "A"), BASE, kl__mean=lambda s: 0.0)
    b = _rewrite(synthetic_run(tmp_path / "B"), BASE + "algo:\n  beta: 0.04\n")
    html = render_report([load_run(a, "A"), load_run(b, "B")])
    figures, notes = _panels(html)
    assert "KL to the reference" in figures and "KL to the reference" not in notes
    kl_fig = html[html.index('data-panel="KL to the reference"') :]
    kl_fig = kl_fig[: kl_fig.index("</figure>")]
    assert "B: kl/mean" in kl_fig and "A: kl/mean" not in kl_fig
    assert "A: not drawn, constant by construction: algo.beta is 0" in kl_fig


def test_ema_is_tensorboards_debiased_average():
    from peergrade.monitoring.report import ema

    assert ema([4.0], 0.6) == [4.0]  # debiased: the first point is not pulled toward 0
    out = ema([1.0, 3.0], 0.5)
    assert out[0] == 1.0 and abs(out[1] - (0.25 + 1.5) / 0.75) < 1e-12
    assert ema([2.0] * 5, 0.9) == pytest.approx([2.0] * 5)


def test_noisy_curves_get_a_smoothed_line_beside_the_raw_one(tmp_path):
    import random

    from peergrade.monitoring.report import is_noisy, panel_series

    rng = random.Random(0)
    noise = [0.5 + 0.01 * s + rng.uniform(-0.3, 0.3) for s in range(60)]
    run = synthetic_run(tmp_path / "run", steps=60)
    _rewrite(run, reward__acc__mean=lambda s: noise[s - 1])
    assert is_noisy(noise)
    assert not is_noisy([0.1 * s for s in range(60)])  # a steep trend is not noise
    assert not is_noisy(noise[:9])  # too few points to tell
    lines = panel_series([load_run(run)], [r"reward/acc/mean", r"reward/fmt/mean"])
    labels = [label for label, *_ in lines]
    raw = lines[labels.index("_raw reward/acc/mean")]
    smooth = next(line for line in lines if line[0].startswith("reward/acc/mean (EMA "))
    assert raw[2] == noise and raw[3]["alpha"] < 1 and raw[3]["color"] == smooth[3]["color"]

    # the smoothed line varies less from step to step than the raw one
    def tv(ys):
        return sum(abs(b - a) for a, b in zip(ys, ys[1:]))

    assert tv(smooth[2]) < tv(noise) / 3
    assert "reward/fmt/mean" in labels  # constant 0.5: one line, not smoothed
    html = render_report([load_run(run)])
    assert "exponential moving average" in html


# ----------------------------------------------------------------------------- episodes


def test_episodes_show_turn_by_turn_with_the_masked_turns_marked(tmp_path):
    """samples.jsonl of a run with tools holds message lists (trainer.step_result); the report
    labels every turn and marks the ones not trained on (tool and environment messages)."""
    from peergrade.monitoring.report import samples_section

    run = synthetic_run(tmp_path / "run", steps=1)
    s = json.loads((run / "samples.jsonl").read_text())
    s["prompt"] = [{"role": "user", "content": "What is 123 * 45?"}]
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 123, "b": 45}}}
    s["completions"] = [
        [
            {"role": "assistant", "content": "let me see", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": "5535 <tool>"},
            {"role": "user", "content": "higher"},
            {"role": "assistant", "content": "5535"},
        ],
        [{"role": "assistant", "content": "5000"}],
    ]
    (run / "samples.jsonl").write_text(json.dumps(s) + "\n")
    page = samples_section([load_run(run)]).html
    assert 'id="episode-legend"' in page
    turn = r'<div class="turn( masked)?"><span class="role">([^<]*)</span>(.*?)</div>'
    turns = re.findall(turn, page, flags=re.S)
    assert [(bool(m), role) for m, role, _ in turns] == [
        (False, "assistant"),
        (True, "tool · multiply"),
        (True, "user"),
        (False, "assistant"),
        (False, "assistant"),
    ]
    for masked, _, body in turns:  # exactly the masked turns say so
        assert ("not trained on" in body) == bool(masked)
    assert "multiply({&quot;a&quot;: 123, &quot;b&quot;: 45})" in turns[0][2]
    assert "5535 &lt;tool&gt;" in turns[1][2]  # escaped
    # a plain completion (single replies) is shown as before, with no legend
    plain = synthetic_run(tmp_path / "plain", steps=1)
    page = samples_section([load_run(plain)]).html
    assert 'class="turn' not in page and "episode-legend" not in page and "<pre>2</pre>" in page


# ----------------------------------------------------------------------------- optional panels

ASYNC = {  # what a pipelined run with a correction, dynamic sampling and FLOP/s metrics logs
    "async/staleness_mean": lambda s: 0.5 + 0.1 * (s % 2),
    "async/staleness_max": lambda s: 1.0,
    "correction/weight_min": lambda s: 0.5,
    "correction/weight_max": lambda s: 2.0,
    "correction/masked_frac": lambda s: 0.01 * s,
    "correction/truncated_frac": lambda s: 0.02,
    "dynamic/rounds": lambda s: float(1 + s % 3),
    "dynamic/unfilled_groups": lambda s: float(s == 4),
    "dynamic/completions_per_informative_group": lambda s: 12.0,
    "perf/gen_tflops": lambda s: 0.03,
    "perf/update_tflops": lambda s: 0.02,
    "perf/step_tflops": lambda s: 0.025,
    "tools/call_frequency": lambda s: 0.2 * s,
    "tools/failure_frequency": lambda s: 0.5 / s,
}


def _async_run(path: Path) -> Path:
    run = synthetic_run(path)
    return _rewrite(run, **{k.replace("/", "__"): fn for k, fn in ASYNC.items()})


def _figure(html: str, title: str) -> str:
    fig = html[html.index(f'data-panel="{title}"') :]
    return fig[: fig.index("</figure>")]


def _sync_run(path: Path) -> Path:
    """The synthetic run without what only dynamic sampling logs: a plain synchronous run."""
    run = synthetic_run(path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith("dynamic/")} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_a_synchronous_run_shows_no_optional_panel_and_names_none(tmp_path):
    html = render_report([load_run(_sync_run(tmp_path / "sync"))])
    for title in OPTIONAL_PANELS:
        assert title not in html, title  # neither drawn nor listed as not logged
    figures, _ = _panels(html)
    assert "Tokens per second" in figures and "Off-policy correction" in figures


def test_optional_panels_draw_their_own_metrics(tmp_path):
    html = render_report([load_run(_async_run(tmp_path / "async"))])
    figures, notes = _panels(html)
    assert set(figures) >= OPTIONAL_PANELS and not OPTIONAL_PANELS & set(notes)
    where = {
        "Staleness of the rollouts": ["async/staleness_mean", "async/staleness_max"],
        "Off-policy correction": [
            "correction/weight_mean",
            "correction/weight_min",
            "correction/weight_max",
        ],
        "Tokens masked or truncated by the correction": [
            "correction/masked_frac",
            "correction/truncated_frac",
        ],
        "Dynamic sampling": [
            "dynamic/rounds",
            "dynamic/unfilled_groups",
            "dynamic/completions_per_informative_group",
        ],
        "Model FLOP/s per phase": ["perf/gen_tflops", "perf/update_tflops", "perf/step_tflops"],
        "Tool use": ["tools/call_frequency", "tools/failure_frequency"],
        "Tokens per second": ["perf/tokens_per_s"],
    }
    for title, keys in where.items():
        fig = _figure(html, title)
        for key in keys:
            assert key in fig, (title, key)
        # each metric is in its own panel only (FLOP/s are not tokens per second)
        others = [k for t, ks in where.items() if t != title for k in ks]
        assert not [k for k in others if f">{k}<" in fig], title


def test_an_overlay_draws_the_optional_panel_for_the_run_that_logged_it(tmp_path):
    a = _sync_run(tmp_path / "A")
    b = _async_run(tmp_path / "B")
    html = render_report([load_run(a, "A"), load_run(b, "B")])
    fig = _figure(html, "Staleness of the rollouts")
    assert "B: async/staleness_mean" in fig and "A: async/staleness" not in fig
    missing = re.search(r"Not logged in these runs: ([^<]*)", html)
    assert missing is None or "Staleness" not in missing.group(1)


def test_training_time_leaves_out_evaluation_and_does_not_add_overlapped_phases():
    """``step_train_seconds``: a synchronous step is the sum of its phases; a pipelined one
    (time/wait_s logged) generated while it updated, so its phases overlap and it is the step's
    wall time less its held-out evaluation (time/eval_s)."""
    from peergrade.monitoring.report import step_train_seconds, train_seconds

    phases = {"time/generate_s": 3.0, "time/reward_s": 0.5, "time/ref_s": 0.5, "time/update_s": 2.0}
    sync = {**phases, "time/step_s": 6.1}
    sync_eval = {**phases, "time/eval_s": 20.0, "time/step_s": 26.1}
    piped = {**phases, "time/wait_s": 1.0, "time/step_s": 3.2}
    piped_eval = {**phases, "time/wait_s": 0.0, "time/eval_s": 20.0, "time/step_s": 22.5}
    assert step_train_seconds(sync) == step_train_seconds(sync_eval) == 6.0
    assert step_train_seconds(piped) == pytest.approx(3.2)
    assert step_train_seconds(piped_eval) == pytest.approx(2.5)
    assert step_train_seconds({"time/step_s": 4.0}) == 4.0  # only the wall time logged
    assert step_train_seconds({"eval/pass@1": 0.5}) is None
    assert train_seconds([sync, {"eval/pass@1": 0.5}, piped]) == pytest.approx([6.0, 6.0, 9.2])
