"""In-process trainer tests: exact resume (metrics and weights bit-identical to an uninterrupted
run), Ctrl-C handling through the stop flag, the overwrite / no-eval paths, and (issue 13) a
reward function drawing from random/numpy repeating under one seed and across a resume, a
reward beyond float32 going through on_reward_error, and a kill inside checkpoint pruning.

A random tiny model scores ~0 on arithmetic, so every group has zero reward spread and the
weights would never move; these runs use a user reward file (TRL signature) that scores the
characters of each completion, which gives every group a spread and the policy a gradient.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.config import load_config
from peergrade.training import checkpoint as ckpt
from peergrade.training.checkpoint import RunDirError
from peergrade.training.trainer import train

REWARD_FILE = '''
def char_score(prompts, completions, **kwargs):
    """A dense, deterministic score of the completion text (TRL signature: chat prompts, as
    the arithmetic task's, give [{"role": "assistant", "content": ...}], text prompts text)."""
    assert len(prompts) == len(completions)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 for t in texts]
'''


def tiny_overrides(model_dir: Path, reward_path: Path, **extra) -> list[tuple[str, object]]:
    base = {
        "model.path": str(model_dir),
        "rewards": [{"name": f"{reward_path}:char_score", "weight": 1.0}],
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_completion_length": 4,
        "optim.lr": 1e-2,
        "train.eval_size": 2,
        "train.eval_samples": 2,
        "train.display": "none",
        "train.log_samples": 1,
        "train.threads": 1,
    }
    base.update(extra)
    return list(base.items())


@pytest.fixture
def reward_file(tmp_path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARD_FILE)
    return p


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics without wall-clock quantities (time/, perf/), which differ between runs."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ckpt_dir) / "model.safetensors"))


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="mu1-single-update"),
        pytest.param(
            {
                "algo.beta": 0.1,
                "algo.num_iterations": 2,
                "optim.minibatch_size": 2,
                "optim.micro_batch_size": 1,
                # warmup, not cosine/linear: those depend on train.steps, which B changes
                "optim.warmup_steps": 1,
            },
            id="beta-mu2-minibatches",
        ),
        pytest.param({"data.few_shot": 1, "data.few_shot_fade_steps": 3}, id="fading-few-shot"),
        pytest.param(
            # the adaptive bonus applies only after a step measured the entropy below the
            # target, and its coefficient grows each step: both must survive the resume
            {
                "algo.use_adaptive_entropy": True,
                "algo.entropy_coef": 0.05,
                "algo.entropy_coef_delta": 0.05,
                "algo.entropy_target": 100.0,
            },
            id="adaptive-entropy",
        ),
    ],
)
def test_resume_is_exact(tiny_model_dir, reward_file, tmp_path, extra):
    steps = {"train.steps": 4, "train.save_every": 2, "train.keep_last": 5}
    cfg_a = load_config(None, tiny_overrides(tiny_model_dir, reward_file, **steps, **extra))
    run_a = tmp_path / "a"
    train(cfg_a, run_a)

    # run B: stop after step 2 (its config says 2 steps), then resume with train.steps 4
    cfg_b1 = load_config(
        None, tiny_overrides(tiny_model_dir, reward_file, **{**steps, "train.steps": 2}, **extra)
    )
    run_b = tmp_path / "b"
    train(cfg_b1, run_b)
    assert ckpt.latest_checkpoint(run_b).name == "step-2"
    cfg_b2 = load_config(
        run_b / "config.yaml", [("train.steps", 4)]
    )  # what `peergrade train --resume b --train.steps 4` does
    train(cfg_b2, run_b, resume=True)

    ma, mb = read_metrics(run_a), read_metrics(run_b)
    # B's first leg wrote a final eval at step 2; resume drops nothing at or before step 2, so
    # compare the per-step training rows and the final eval.
    train_a = [r for r in ma if "loss/policy" in r]
    train_b = [r for r in mb if "loss/policy" in r]
    assert [r["step"] for r in train_a] == [1, 2, 3, 4]
    assert comparable(train_a) == comparable(train_b)
    assert [r for r in ma if r.get("final")] == [r for r in mb if r.get("final") and r["step"] == 4]

    # the weights actually moved, and the two runs end bit-identical
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    wa, wb = weights(run_a / "checkpoints/step-4"), weights(run_b / "checkpoints/step-4")
    assert wa.keys() == wb.keys() == start.keys()
    assert any(not torch.equal(wa[k], start[k]) for k in wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    if extra.get("algo.beta"):
        assert all(r["kl/mean"] >= 0 for r in train_a)
        assert any(r["kl/mean"] > 0 for r in train_a[1:])  # the policy moved off the reference
    # the samples log is resumed exactly too
    sa = (run_a / "samples.jsonl").read_text()
    sb = (run_b / "samples.jsonl").read_text()
    assert sa == sb


def test_stop_flag_saves_last_completed_step_and_resumes(tiny_model_dir, reward_file, tmp_path):
    """A Ctrl-C during step 2 (the flag set by the SIGINT handler) finishes step 2, saves it and
    returns interrupted; --resume then runs to the end."""
    import peergrade.training.update as update_mod  # GRPO.update calls update.grpo_update

    cfg = load_config(None, tiny_overrides(tiny_model_dir, reward_file, **{"train.steps": 4}))
    run = tmp_path / "run"
    real_update = update_mod.grpo_update
    calls = []

    def update_then_interrupt(*args, **kwargs):
        out = real_update(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the SIGINT handler's first press sets this flag
            import signal

            signal.raise_signal(signal.SIGINT)
        return out

    update_mod.grpo_update = update_then_interrupt
    try:
        summary = train(cfg, run)
    finally:
        update_mod.grpo_update = real_update
    assert summary["interrupted"] is True
    assert summary["step"] == 2
    assert [p.name for _, p in ckpt.list_checkpoints(run)] == ["step-2"]
    assert ckpt.read_trainer_state(run / "checkpoints/step-2")["step"] == 2
    assert [r["step"] for r in read_metrics(run) if "loss/policy" in r] == [1, 2]

    cfg2 = load_config(run / "config.yaml")
    summary = train(cfg2, run, resume=True)
    assert summary["interrupted"] is False
    assert [r["step"] for r in read_metrics(run) if "loss/policy" in r] == [1, 2, 3, 4]
    assert ckpt.latest_checkpoint(run).name == "step-4"


def test_existing_run_dir_needs_overwrite_and_survives_bad_input(
    tiny_model_dir, reward_file, tmp_path
):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_config(None, tiny_overrides(tiny_model_dir, reward_file, **{"train.steps": 1}))
    with pytest.raises(RunDirError, match="--overwrite"):
        train(cfg, run)
    # overwrite with a broken reward: fails while loading, the old run is still there
    bad = load_config(
        None,
        tiny_overrides(
            tiny_model_dir, reward_file, rewards=[{"name": "no_such_reward", "weight": 1.0}]
        ),
    )
    with pytest.raises(ValueError, match="no_such_reward"):
        train(bad, run, overwrite=True)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # overwrite with a good config replaces it
    train(cfg, run, overwrite=True)
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss/policy" in r] == [1]
    assert all(math.isfinite(r["loss/policy"]) for r in rows if "loss/policy" in r)


def test_dataset_without_eval_split_skips_eval(tiny_model_dir, reward_file, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(6)))
    cfg = load_config(
        None,
        tiny_overrides(tiny_model_dir, reward_file, **{"data.path": str(data), "train.steps": 2}),
    )
    summary = train(cfg, tmp_path / "run")
    assert "eval_after" not in summary
    rows = read_metrics(tmp_path / "run")
    assert not any(k.startswith("eval/") for r in rows for k in r)
    assert [r["step"] for r in rows] == [1, 2]


ZERO_REWARD_FILE = """
def constant(prompts, completions, **kwargs):
    return [0.5 for _ in completions]
"""


@pytest.mark.parametrize("mu", [1, 2])
def test_zero_signal_batch_skips_forward_and_leaves_weights(
    tiny_model_dir, tmp_path, monkeypatch, mu
):
    """All rewards equal and beta 0: the loss is exactly 0, so no forward/backward is run (the
    patched log-prob function would raise) and, with a fresh AdamW and no weight decay, the
    weights do not move at all."""
    import peergrade.training.update as update_mod

    reward = tmp_path / "const.py"
    reward.write_text(ZERO_REWARD_FILE)

    def boom(*a, **k):
        raise AssertionError("the update ran a forward pass on a batch with no signal")

    monkeypatch.setattr(update_mod, "logprobs_of", boom)
    overrides = tiny_overrides(
        tiny_model_dir, reward, **{"train.steps": 2, "algo.num_iterations": mu}
    )
    overrides = [(k, v) for k, v in overrides if k != "rewards"]
    overrides.append(("rewards", [{"name": f"{reward}:constant"}]))
    cfg = load_config(None, overrides)
    run = tmp_path / "run"
    train(cfg, run)
    rows = [r for r in read_metrics(run) if "update/zero_signal_frac" in r]
    assert [r["update/zero_signal_frac"] for r in rows] == [1.0, 1.0]
    assert [r["loss/policy"] for r in rows] == [0.0, 0.0]
    before, after = weights(tiny_model_dir), weights(ckpt.latest_checkpoint(run))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_build_optimizer_is_fused_adamw_and_steps_like_the_reference():
    """The trainer's AdamW is the fused kernel (no per-tensor temporaries) and takes the same
    step as torch's single-tensor AdamW to float32 rounding."""
    from peergrade.config import OptimConfig
    from peergrade.training.update import build_optimizer

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, adam_betas=[0.9, 0.99])
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    init = [p.detach().clone() for p in a]
    fused = build_optimizer(a, cfg)
    assert fused.defaults["fused"] is True
    assert build_optimizer(a, cfg, lr=0.5).defaults["lr"] == 0.5
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), foreach=False)
    for _ in range(3):
        for opt, ps in ((fused, a), (ref, b)):
            opt.zero_grad()
            sum((p**2).sum() for p in ps).backward()
            opt.step()
    for p, q, p0 in zip(a, b, init):
        assert (p - p0).abs().min() > 1e-3  # it did step
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    # float64 parameters (gradcheck-style use) fall back to the plain implementation
    f64 = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert not build_optimizer(f64, cfg).defaults["fused"]


class _Rows:
    """A task stand-in: train_rows(seed) yields numbered problems."""

    def __init__(self, n=None):
        self.n = n

    def train_rows(self, seed=0):
        i = 0
        while True:
            k = i if self.n is None else i % self.n
            yield {"prompt": f"q{seed}-{k}", "answer": str(k)}
            i += 1


def _few_shot(k=1, fade=0, reply="<answer>{answer}</answer>", n=None, seed=0):
    from peergrade.tasks.curriculum import FewShot

    return FewShot(k, fade, reply, _Rows(n), seed)


def test_few_shot_schedule_and_examples():
    off = _few_shot(k=0)
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(200)]
    assert off.apply(rows, 1) == (rows, 0.0) and off.pool == []

    always = _few_shot(k=2)
    out, frac = always.apply(rows, 5)
    assert frac == 1.0 and [r["answer"] for r in out] == [r["answer"] for r in rows]
    first = out[0]["prompt"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant", "user"]
    assert first[-1]["content"] == "p0"
    # examples come from the separate stream (seed + 1), with their own answers as replies
    for q, a in zip(first[0:4:2], first[1:4:2]):
        assert q["content"].startswith("q1-")
        assert a["content"] == f"<answer>{q['content'].split('-')[1]}</answer>"
    assert rows[0]["prompt"] == "p0"  # the input rows are not modified
    assert always.apply(rows, 5) == (out, 1.0)  # a function of (seed, step): resume-exact
    assert always.apply(rows, 6)[0] != out

    fading = _few_shot(k=1, fade=10)
    assert [fading.chance(s) for s in (1, 6, 11, 50)] == [1.0, 0.5, 0.0, 0.0]
    _, half = fading.apply(rows, 6)
    assert 0.35 < half < 0.65
    assert fading.apply(rows, 11) == (rows, 0.0)


def test_few_shot_never_shows_the_question_itself():
    shots = _few_shot(k=2, n=3)  # a 3-problem dataset: q1-0, q1-1, q1-2 repeated
    rows = [{"prompt": "q1-1", "answer": "1"}] * 20
    for step in range(1, 6):
        out, _ = shots.apply(rows, step)
        for r in out:
            shown = [m["content"] for m in r["prompt"][:-1] if m["role"] == "user"]
            assert "q1-1" not in shown and len(shown) == 2


def test_few_shot_bad_reply_template_names_the_key():
    from peergrade.errors import InputError

    with pytest.raises(InputError, match=r"few_shot_answer.*row 0.*prompt, answer.*solution"):
        _few_shot(reply="<answer>{solution}</answer>")


def test_few_shot_run_logs_the_curriculum(tiny_model_dir, reward_file, tmp_path):
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_dir,
            reward_file,
            **{"train.steps": 3, "data.few_shot": 1, "data.few_shot_fade_steps": 2},
        ),
    )
    train(cfg, tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "loss/policy" in r]
    fracs = [r["curriculum/few_shot_frac"] for r in rows]
    assert fracs[0] == 1.0 and fracs[2] == 0.0  # step 2 is a coin flip per prompt (chance 0.5)
    samples = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    first = samples[0]["prompt"]
    assert isinstance(first, list) and first[1]["role"] == "assistant"
    assert first[1]["content"].startswith("<answer>")
    assert [m["role"] for m in samples[-1]["prompt"]] == ["user"]  # step 3: zero-shot again


def test_ref_offload_puts_the_reference_on_the_device_for_its_pass_only(monkeypatch):
    """model.ref_offload: the reference lives in host memory and visits the device for the
    reference log-prob pass, and goes back even when the pass fails."""
    from peergrade.training import update as tr

    ref = torch.nn.Linear(2, 2)  # on the CPU, while the run's device is an accelerator
    moves: list[str] = []
    monkeypatch.setattr(ref, "to", lambda d: moves.append(str(d)) or ref)
    during: list[list[str]] = []
    fail = {"now": False}

    def fake_frozen(model, batch, cfg):
        assert model is ref
        during.append(list(moves))
        if fail["now"]:
            raise RuntimeError("out of memory")
        return "logprobs"

    monkeypatch.setattr(tr, "frozen_logprobs", fake_frozen)
    models = tr.Models(policy=None, tokenizer=None, reference=ref, device=torch.device("cuda"))
    assert tr.ref_logprobs(models, None, None) == "logprobs"
    assert during == [["cuda"]] and moves == ["cuda", "cpu"]
    fail["now"] = True
    with pytest.raises(RuntimeError, match="out of memory"):
        tr.ref_logprobs(models, None, None)
    assert moves[-2:] == ["cuda", "cpu"]
    # a resident reference (same device as the run) is never moved
    moves.clear()
    fail["now"] = False
    resident = tr.Models(policy=None, tokenizer=None, reference=ref, device=torch.device("cpu"))
    assert tr.ref_logprobs(resident, None, None) == "logprobs" and moves == []


# ----------------------------------------------------------------------------- issue 13 item 4

RANDOM_REWARD_FILE = """
import random

try:
    import numpy
except ImportError:
    numpy = None


def noisy(prompts, completions, **kwargs):
    # a reward drawn from the global generators, as user code often does
    out = []
    for c in completions:
        r = random.random()
        if numpy is not None:
            r += float(numpy.random.random())
        out.append(r)
    return out
"""


def test_reward_fn_using_random_repeats_under_seed_and_resume(tiny_model_dir, tmp_path):
    """Python's random and numpy's global generator are seeded per step from (seed, step):
    the same rewards in a second run with the same seed, across a resume, and not with
    another seed."""
    reward = tmp_path / "noisy.py"
    reward.write_text(RANDOM_REWARD_FILE)

    def cfg(steps, seed=0):
        overrides = dict(tiny_overrides(tiny_model_dir, reward, **{"train.steps": steps}))
        overrides["rewards"] = [{"name": f"{reward}:noisy"}]
        overrides["train.seed"] = seed
        overrides["train.eval_size"] = 1
        return load_config(None, list(overrides.items()))

    def rewards(run):
        samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        rows = [r for r in read_metrics(run) if "loss/policy" in r]
        return [s["rewards"] for s in samples], [r["reward/noisy/mean"] for r in rows]

    train(cfg(3), tmp_path / "a")
    train(cfg(3), tmp_path / "b")  # same process: the generators were not reset in between
    train(cfg(1), tmp_path / "c")
    train(
        load_config(tmp_path / "c/config.yaml", [("train.steps", 3)]), tmp_path / "c", resume=True
    )
    train(cfg(3, seed=1), tmp_path / "d")
    a = rewards(tmp_path / "a")
    assert len(a[0]) == 3 and len(set(map(tuple, a[0]))) == 3  # random, different every step
    assert rewards(tmp_path / "b") == a
    assert rewards(tmp_path / "c") == a
    assert rewards(tmp_path / "d")[0][0] != a[0][0]


HUGE_REWARD_FILE = """
def huge(prompts, completions, **kwargs):
    return [1e300] + [0.25 * i for i in range(1, len(completions))]
"""


def test_reward_beyond_float32_follows_on_reward_error(tiny_model_dir, tmp_path):
    """1e300 is finite in float64 but inf in float32: a RewardError under fail, a zero and a
    count under zero -- never an inf in the loop."""
    from peergrade.rewards import RewardError

    reward = tmp_path / "huge.py"
    reward.write_text(HUGE_REWARD_FILE)
    base = dict(tiny_overrides(tiny_model_dir, reward, **{"train.steps": 2}))
    base["rewards"] = [{"name": f"{reward}:huge"}]
    with pytest.raises(RewardError, match=r"'huge' sample 0: score 1e\+300 is outside the float32"):
        train(load_config(None, list(base.items())), tmp_path / "fail")
    base["train.on_reward_error"] = "zero"
    train(load_config(None, list(base.items())), tmp_path / "zero")
    rows = [r for r in read_metrics(tmp_path / "zero") if "loss/policy" in r]
    assert [r["reward/errors"] for r in rows] == [1.0, 1.0]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    samples = [json.loads(x) for x in (tmp_path / "zero/samples.jsonl").read_text().splitlines()]
    assert [s["rewards"] for s in samples] == [[0.0, 0.25], [0.0, 0.25]]


class _Killed(BaseException):
    """Stands in for SIGKILL: nothing in the trainer catches it."""


def test_kill_while_pruning_then_resume_and_eval(tiny_model_dir, reward_file, tmp_path, capsys):
    """Stopped inside the prune of an old checkpoint (after it lost its weights): resume and
    `peergrade eval` only ever see complete checkpoints, and resume sweeps the leftover."""
    from peergrade.cli import main

    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_dir,
            reward_file,
            **{"train.steps": 3, "train.save_every": 1, "train.keep_last": 1},
        ),
    )
    run = tmp_path / "run"
    real_rmtree = ckpt.shutil.rmtree

    def dying_rmtree(path, *a, **kw):  # the prune of step-1, during save(2)
        if Path(path).name.startswith("step-") or Path(path).name.startswith(".prune-"):
            (Path(path) / "model.safetensors").unlink()
            raise _Killed(str(path))
        return real_rmtree(path, *a, **kw)

    ckpt.shutil.rmtree = dying_rmtree
    try:
        with pytest.raises(_Killed, match="prune-step-1"):
            train(cfg, run)
    finally:
        ckpt.shutil.rmtree = real_rmtree
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".prune-step-1", "step-2"]
    assert [p.name for _, p in ckpt.list_checkpoints(run)] == ["step-2"]

    args = ["eval", "--n", "2", "--k", "1", "--max-new-tokens", "2", "--json"]
    assert main([*args, "--model", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(root / "step-2")
    assert main([*args, "--model", str(root / ".prune-step-1")]) == 2
    err = capsys.readouterr().err
    assert "is not complete" in err and "complete checkpoints of this run: step-2" in err

    train(load_config(run / "config.yaml"), run, resume=True)
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]
    assert [r["step"] for r in read_metrics(run) if "loss/policy" in r] == [1, 2, 3]


def test_held_out_accuracy_uses_the_verifier_as_configured(tiny_model_dir):
    """A recipe that configures the task's verifier with options (issue 16's arithmetic with
    ``extract: last_number``) is evaluated with those options too, and the training accuracy
    reuses the reward's own scores; without it, the task's default verifier."""
    import peergrade.training.trainer as trainer

    base = [("model.path", str(tiny_model_dir)), ("train.threads", 1)]
    lenient = [{"name": "arithmetic", "weight": 1.0, "kwargs": {"extract": "last_number"}}]
    run = trainer.setup(load_config(None, base + [("rewards", lenient)]))
    assert run.accuracy.name == "arithmetic" and run.accuracy.kwargs == {"extract": "last_number"}
    assert run.accuracy_in_mix
    scores = run.accuracy.fn(["q"], ["12 + 7 = 19"], answer=["19"], **run.accuracy.kwargs)
    assert scores == [1.0]
    default = trainer.setup(load_config(None, base))
    assert default.accuracy.kwargs == {}
    assert default.accuracy.fn(["q"], ["12 + 7 = 19"], answer=["19"]) == [0.0]


def test_misspelt_reward_option_fails_before_the_model_loads(reward_file, tmp_path):
    """`kwargs: {extrct: last_number}` for `arithmetic` was accepted and ignored in training
    (while `peergrade eval --reward-option` rejected it). The model path does not exist: the
    option error comes first."""
    from peergrade.errors import InputError
    from peergrade.training import trainer

    bad = [{"name": "arithmetic", "weight": 1.0, "kwargs": {"extrct": "last_number"}}]
    over = tiny_overrides(tmp_path / "no-model-here", reward_file) + [("rewards", bad)]
    with pytest.raises(InputError, match=r"'extrct' \(did you mean 'extract'\?\)"):
        trainer.setup(load_config(None, over))
