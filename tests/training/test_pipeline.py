"""Pipelined rollouts (``rollout.async_steps``, ``peergrade.training.pipeline``): deterministic versions
and bounded staleness under uneven timings with nothing discarded, the same weights as a run
without the delays, behaviour log-probs equal to the trainer's recomputation at the sampling
version, exact resume after Ctrl-C and after SIGKILL, a producer that never outlives the run,
its errors raised in the trainer, and k = 0 leaving the synchronous step alone."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from peergrade.config import ConfigError, load_config
from peergrade.training import pipeline
from peergrade.training import trainer as trainer_mod
from peergrade.training.trainer import train
from peergrade.training.update import frozen_logprobs
from test_experience import _processed_logprobs
from test_trainer import REWARD_FILE, comparable, read_metrics, tiny_overrides, weights


@pytest.fixture
def reward_file(tmp_path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARD_FILE)
    return p


def _cfg(model_dir, rewards, **extra):
    return load_config(None, tiny_overrides(model_dir, rewards, **extra))


def _train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss/policy" in r]


def _producers_alive() -> list:
    """Producer threads and producer processes still running."""
    threads = [t for t in threading.enumerate() if t.name.startswith("peergrade-producer")]
    return threads + [
        p for p in multiprocessing.active_children() if p.name == "peergrade-producer"
    ]


def test_sampled_version_is_a_function_of_step_and_k():
    assert [pipeline.sampled_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]
    assert [pipeline.sampled_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [pipeline.sampled_version(t, 3) for t in range(1, 7)] == [0, 0, 0, 0, 1, 2]


@pytest.mark.parametrize(
    "over,match",
    [
        ({"rollout.async_steps": -1}, "rollout.async_steps must be >= 0"),
        ({"rollout.async_steps": 1, "algo.name": "ppo"}, "is a GRPO option"),
        ({"rollout.async_steps": 1, "dist.strategy": "fsdp"}, "dist.strategy ddp"),
    ],
)
def test_config_is_validated(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, list(over.items()))


def test_k0_starts_no_producer(tiny_model_dir, reward_file, tmp_path, monkeypatch):
    """k = 0 is the synchronous loop: no producer, no async/ metrics, sampled by step - 1."""

    def refuse(*a, **kw):
        raise AssertionError("a producer was started with async_steps 0")

    monkeypatch.setattr(pipeline, "Producer", refuse)
    versions = []
    real_learn = trainer_mod.learn

    def learn(run, exp, step):
        versions.append((step, exp.policy_version))
        return real_learn(run, exp, step)

    monkeypatch.setattr(trainer_mod, "learn", learn)
    train(_cfg(tiny_model_dir, reward_file, **{"train.steps": 2}), tmp_path / "run")
    assert versions == [(1, 0), (2, 1)]
    assert not any(k.startswith("async/") for r in read_metrics(tmp_path / "run") for k in r)


def _jittered(monkeypatch, seed: int):
    """Uneven generation and update times (sleeps from a private generator), and a record of
    every collected and every trained experience."""
    rng = random.Random(seed)
    lock = threading.Lock()
    collected, trained = [], []
    real_sample, real_collect, real_learn = (
        trainer_mod.sample,
        trainer_mod.collect,
        trainer_mod.learn,
    )

    def nap(scale):
        with lock:
            d = rng.uniform(0, scale)
        time.sleep(d)

    def sample(*a, **kw):
        nap(0.08)
        return real_sample(*a, **kw)

    def collect(run, step, rows, *a, **kw):
        exp = real_collect(run, step, rows, *a, **kw)
        with lock:
            collected.append(step)
        return exp

    def learn(run, exp, step):
        nap(0.08)
        trained.append((step, exp.policy_version))
        return real_learn(run, exp, step)

    monkeypatch.setattr(trainer_mod, "sample", sample)
    monkeypatch.setattr(trainer_mod, "collect", collect)
    monkeypatch.setattr(trainer_mod, "learn", learn)
    return collected, trained


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded_nothing_discarded_and_timing_changes_nothing(
    tiny_model_dir,
    reward_file,
    tmp_path,
    monkeypatch,
    k,
):
    steps = 6
    over = {"train.steps": steps, "rollout.async_steps": k, "rollout.producer": "thread"}
    cfg = _cfg(tiny_model_dir, reward_file, **over)
    train(cfg, tmp_path / "plain")
    for seed in (1, 2):  # two different patterns of delays
        with monkeypatch.context() as m:
            collected, trained = _jittered(m, seed)
            train(cfg, tmp_path / f"jitter{seed}")
        # every step collected once and trained once, in order: nothing discarded or redone
        assert sorted(collected) == list(range(1, steps + 1))
        assert [s for s, _ in trained] == list(range(1, steps + 1))
        for step, version in trained:  # trained by version step - 1
            assert version == max(0, step - 1 - k)
            assert 0 <= (step - 1) - version <= k
        rows = _train_rows(tmp_path / f"jitter{seed}")
        assert [r["async/staleness_max"] for r in rows] == [min(k, s - 1) for s in range(1, 7)]
        assert comparable(rows) == comparable(_train_rows(tmp_path / "plain"))
        wa = weights(tmp_path / f"jitter{seed}" / f"checkpoints/step-{steps}")
        wb = weights(tmp_path / "plain" / f"checkpoints/step-{steps}")
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name
    assert not _producers_alive()
    # k >= 1 trains on older rollouts than the synchronous run: the result differs
    sync = weights(
        _sync_run(tiny_model_dir, reward_file, tmp_path, steps) / f"checkpoints/step-{steps}"
    )
    assert any(not torch.equal(sync[n], wb[n]) for n in sync)


def _sync_run(model_dir, rewards, tmp_path, steps):
    run = tmp_path / "sync"
    if not run.exists():
        train(_cfg(model_dir, rewards, **{"train.steps": steps}), run)
    return run


def test_behaviour_logprobs_match_the_trainer_at_the_sampling_version(
    tiny_model_dir,
    reward_file,
    tmp_path,
    monkeypatch,
):
    """T = 0.7 with top-k and top-p, k = 1: each trained experience's sampler log-probs are
    the processed (tempered, cut, renormalised) distribution of the weights that sampled it,
    recomputed by the trainer's log-prob engine, and not those of the weights it trains."""
    over = {
        "train.steps": 4,
        "rollout.async_steps": 1,
        "rollout.temperature": 0.7,
        "rollout.top_k": 5,
        "rollout.top_p": 0.9,
        "rollout.max_completion_length": 6,
    }
    cfg = _cfg(tiny_model_dir, reward_file, **over)
    seen = []  # (experience, the trainer's weights before this step's update)
    real_learn = trainer_mod.learn

    def learn(run, exp, step):
        seen.append((exp, pipeline.trainable_state(run.models.policy), run))
        return real_learn(run, exp, step)

    monkeypatch.setattr(trainer_mod, "learn", learn)
    train(cfg, tmp_path / "run")
    by_version = {i: state for i, (_, state, _) in enumerate(seen)}  # version i = before step i+1
    run = seen[0][2]
    model = run.models.policy
    checked_stale = 0
    for step, (exp, _, _) in enumerate(seen, start=1):
        v = exp.policy_version
        assert v == max(0, step - 2)
        m = exp.loss_mask.bool()

        def processed(state, exp=exp, m=m):
            pipeline._load_state(model, state)
            ids, attn = exp.input_ids, exp.attention_mask
            pos = (attn.cumsum(1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
            C = exp.loss_mask.shape[1]
            pred = logits[:, -C - 1 : -1].float()
            tokens = exp.input_ids[:, -C:]
            return _processed_logprobs(pred[m], tokens[m], 0.7, 5, 0.9), frozen_logprobs(
                model, exp.batch, cfg
            )

        want, tempered = processed(by_version[v])
        got = exp.sampler_logprobs[m].double()
        torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=0)
        # the trainer's engine (tempered, not cut) agrees with the sampler's uncut log-probs
        assert (got >= tempered[m].double() - 1e-5).all()
        if step - 1 != v:  # the weights trained are newer: another distribution (the test
            # has power: recomputing with them, as a trainer without versions would, is off)
            pipeline._load_state(model, by_version[step - 1])
            newer = frozen_logprobs(model, exp.batch, cfg)
            assert (newer[m] - tempered[m]).abs().max() > 1e-3
            checked_stale += 1
    assert checked_stale >= 2


@pytest.mark.parametrize("producer", ["process", "thread"])
def test_ctrl_c_stops_the_producer_and_resume_is_exact(
    tiny_model_dir,
    reward_file,
    tmp_path,
    monkeypatch,
    producer,
):
    """A second Ctrl-C inside step 3's update: the run saves step 2 (with the weights that
    sample its in-flight steps), no producer thread is left, and --resume ends where a run
    never stopped ends, bit for bit."""
    over = {"train.steps": 5, "rollout.async_steps": 2, "train.save_every": 1}
    cfg = _cfg(tiny_model_dir, reward_file, **over, **{"rollout.producer": producer})
    train(cfg, tmp_path / "a")

    real_learn = trainer_mod.learn

    def learn(run, exp, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_learn(run, exp, step)

    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "learn", learn)
        summary = train(cfg, tmp_path / "b")
    assert summary["interrupted"] and summary["step"] == 2
    assert not _producers_alive()
    saved = torch.load(tmp_path / "b/checkpoints/step-2" / pipeline.VERSIONS_FILE)
    assert sorted(saved) == [0, 1]  # steps 3 and 4 are sampled by versions 0 and 1
    train(load_config(tmp_path / "b/config.yaml"), tmp_path / "b", resume=True)
    assert not _producers_alive()
    assert comparable(_train_rows(tmp_path / "a")) == comparable(_train_rows(tmp_path / "b"))
    wa, wb = weights(tmp_path / "a/checkpoints/step-5"), weights(tmp_path / "b/checkpoints/step-5")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize("producer", ["process", "thread"])
def test_a_failing_reward_in_the_producer_is_raised_by_the_trainer(
    tiny_model_dir, tmp_path, producer
):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def boom(prompts, completions, trainer_state=None, **kw):\n"
        "    if getattr(trainer_state, 'global_step', 0) >= 2:\n"
        "        raise ValueError('boom at step 3')\n"
        "    return [0.0 if i % 2 else 1.0 for i in range(len(completions))]\n"
    )
    over = {
        "train.steps": 4,
        "rollout.async_steps": 1,
        "train.on_reward_error": "fail",
        "train.audit_rewards": "off",
        "rollout.producer": producer,
    }
    cfg = load_config(None, tiny_overrides(tiny_model_dir, bad, **over))
    cfg.rewards[0].name = f"{bad}:boom"
    with pytest.raises(Exception, match="boom at step 3") as info:
        train(cfg, tmp_path / "run")
    assert not _producers_alive()
    if producer == "process":  # the producer's own traceback comes with it
        assert any("in the rollout producer process" in n for n in info.value.__notes__)
        assert any("boom" in n and "bad.py" in n for n in info.value.__notes__)


KILL_AFTER_SAVE = """
import os, signal, sys
from peergrade.training import checkpoint
real_save = checkpoint.save_checkpoint


def save_checkpoint(run_dir, step, **kw):
    out = real_save(run_dir, step, **kw)
    if step == int(os.environ["KILL_AT"]):  # the producer is collecting steps ahead: kill -9
        os.kill(os.getpid(), signal.SIGKILL)
    return out


checkpoint.save_checkpoint = save_checkpoint
from peergrade.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(tiny_model_dir, reward_file, tmp_path):
    """A real SIGKILL right after the checkpoint of step 2 (k = 1: step 3 in flight, sampled by
    version 1): `peergrade train --resume` regenerates it from the saved version and ends with
    the weights and metrics of a run never stopped."""
    from peergrade.cli import main

    over = {"train.steps": 4, "rollout.async_steps": 1, "train.save_every": 1}
    args = [x for k, v in tiny_overrides(tiny_model_dir, reward_file, **over) for x in _flag(k, v)]
    assert main(["train", *args, "-o", str(tmp_path / "a")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(pipeline.__file__).parents[1]), *sys.path])
    proc = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_SAVE, "train", *args, "-o", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    b = tmp_path / "b"
    # the producer process (a fork: the trainer's command line) died with the trainer
    deadline = time.monotonic() + 30
    while _processes_running(str(b)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_running(str(b))
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert sorted(torch.load(b / "checkpoints/step-2" / pipeline.VERSIONS_FILE)) == [1]
    assert main(["train", "--resume", str(b)]) == 0
    assert comparable(_train_rows(tmp_path / "a")) == comparable(_train_rows(b))
    wa, wb = weights(tmp_path / "a/checkpoints/step-4"), weights(b / "checkpoints/step-4")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _cli_train(model_dir, rewards, run_dir, threads="1", env=None, **over):
    """`python -m peergrade train` with ``over`` in a fresh process (a hang fails at 300 s)."""
    args = [x for k, v in tiny_overrides(model_dir, rewards, **over) for x in _flag(k, v)]
    env = {**os.environ, "OMP_NUM_THREADS": threads, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(pipeline.__file__).parents[1]), *sys.path])
    return subprocess.run(
        [sys.executable, "-m", "peergrade", "train", *args, "-o", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _processes_running(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(int(d.name))
    return found


def _flag(key, value):
    if key == "rewards":
        return ["--reward", value[0]["name"]]
    if key == "model.path":
        return ["--model", str(value)]
    return [f"--{key}", str(value)]


def test_lora_producer_shares_the_base_and_copies_the_adapters(tiny_model_dir, reward_file):
    """With LoRA the producer's copy holds its own adapters and the trainer's frozen base (no
    second copy of the model); the reference (the adapter disabled) runs on its own copy."""
    over = {"model.lora.enabled": True, "model.lora.r": 4, "algo.beta": 0.1}
    run = trainer_mod.setup(_cfg(tiny_model_dir, reward_file, **over))
    prun = pipeline.producer_run(run)
    mine = dict(run.models.policy.named_parameters())
    theirs = dict(prun.models.policy.named_parameters())
    assert mine.keys() == theirs.keys()
    trainable = [n for n, p in mine.items() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    for n, p in mine.items():
        assert (theirs[n] is p) == (not p.requires_grad), n
        assert torch.equal(theirs[n], p)
    assert prun.models.tokenizer is not run.models.tokenizer
    rows = [next(iter(run.task.train_rows(0)))] * 2
    exp = trainer_mod.collect(prun, 1, rows, advantages=False)
    assert exp.advantages is None and exp.ref_logprobs is not None


@pytest.mark.slow
def test_two_ranks_equal_one_process(tiny_model_dir, reward_file, tmp_path):
    """k = 1 under torchrun: each rank's producer samples its whole groups with keyed draws,
    the advantages gather on the main thread; 2 ranks end where 1 process ends (LoRA, KL)."""
    from test_distributed import (
        assert_same_metrics,
        assert_same_weights,
        check,
        cli_args,
        run,
        torchrun,
    )
    from test_distributed import weights as ckpt_weights

    over = {
        "rollout.async_steps": 1,
        "model.lora.enabled": True,
        "model.lora.r": 4,
        "algo.beta": 0.1,
        "optim.lr": 1e-2,
    }
    one, two = tmp_path / "one", tmp_path / "two"
    check(run([sys.executable, *cli_args(tiny_model_dir, reward_file, one, **over)]))
    check(run(torchrun(2, *cli_args(tiny_model_dir, reward_file, two, **over))))
    ma, mb = read_metrics(one), read_metrics(two)
    assert [r["async/staleness_max"] for r in ma if "loss/policy" in r] == [0, 1, 1]
    assert_same_metrics(ma, mb, atol=1e-6, rel=0)
    assert_same_weights(
        ckpt_weights(one / "checkpoints/step-3"), ckpt_weights(two / "checkpoints/step-3")
    )


def test_close_stops_a_producer_in_the_middle_of_a_generation(tiny_model_dir, reward_file):
    """A collect that would run forward passes forever ends at close(): the hook raises inside
    the producer's thread at its next forward, and the thread is gone."""
    run = trainer_mod.setup(_cfg(tiny_model_dir, reward_file))
    prun = pipeline.producer_run(run)
    running = threading.Event()
    ids = torch.tensor([[5, 6, 7]])

    def endless(r, step, rows):
        while True:
            with torch.no_grad():
                r.models.policy(input_ids=ids)
            running.set()

    state = {0: pipeline.trainable_state(run.models.policy)}
    prod = pipeline.Producer(endless, prun, 1, range(1, 3), lambda: [], state, 1).start()
    assert running.wait(60)
    prod.close(timeout=60)
    assert not prod.thread.is_alive() and prod.error is None
    with pytest.raises(RuntimeError, match="stopped before step 1"):
        prod.take(1)


def test_dynamic_sampling_runs_in_the_producer(tiny_model_dir, reward_file, tmp_path):
    """Dynamic sampling's rounds run in the producer with the step's version; the run repeats
    exactly, and the trainer's informative_seen (which a checkpoint keeps) follows the steps."""
    over = {
        "train.steps": 3,
        "rollout.async_steps": 1,
        "rollout.dynamic_sampling": True,
        "rollout.max_rounds": 2,
    }
    cfg = _cfg(tiny_model_dir, reward_file, **over)
    for name in ("a", "b"):
        train(cfg, tmp_path / name)
    ra, rb = _train_rows(tmp_path / "a"), _train_rows(tmp_path / "b")
    assert [r["async/staleness_max"] for r in ra] == [0, 1, 1]
    assert all(r["dynamic/rounds"] >= 1 for r in ra)
    assert comparable(ra) == comparable(rb)
    state = (tmp_path / "a/checkpoints/step-3/trainer_state.json").read_text()
    assert '"dynamic_informative_seen": true' in state


def test_dynamic_sampling_with_a_producer_is_refused_under_torchrun(
    tiny_model_dir, reward_file, monkeypatch
):
    over = {"rollout.async_steps": 1, "rollout.dynamic_sampling": True}
    run = trainer_mod.setup(_cfg(tiny_model_dir, reward_file, **over))
    monkeypatch.setattr(trainer_mod.dist, "parallel", lambda: True)
    with pytest.raises(ConfigError, match="under torchrun set one of them off"):
        trainer_mod.start_producer(run, None, iter([]), 0, None)
    assert not _producers_alive()


# ------------------------------------------------------------------ the producer as a process


def test_producer_kind_resolves_auto_and_refuses_a_process_on_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert pipeline.producer_kind("auto", cpu) == "process"  # Linux: fork exists
    assert pipeline.producer_kind("auto", cpu, threads=2) == "process"  # one thread each
    assert pipeline.producer_kind("auto", cpu, threads=4) == "thread"  # a process runs one
    assert pipeline.producer_kind("process", cpu, threads=8) == "process"  # as asked
    assert pipeline.producer_kind("auto", gpu) == "thread"
    assert pipeline.producer_kind("thread", cpu) == "thread"
    with pytest.raises(ValueError, match="cannot be forked.*rollout.producer to thread"):
        pipeline.producer_kind("process", gpu)


def test_producer_kind_off_linux_is_a_thread(monkeypatch):
    monkeypatch.setattr(pipeline.sys, "platform", "darwin")
    assert pipeline.producer_kind("auto", torch.device("cpu")) == "thread"
    with pytest.raises(ValueError, match="needs Linux's fork"):
        pipeline.producer_kind("process", torch.device("cpu"))


@pytest.mark.parametrize(
    "extra",
    [
        {"rollout.async_steps": 1},
        {
            "rollout.async_steps": 2,
            "model.lora.enabled": True,
            "model.lora.r": 4,
            "algo.beta": 0.1,
            "optim.lr": 1e-2,
        },
    ],
    ids=["k1", "k2-lora-kl"],
)
def test_a_producer_process_trains_exactly_as_a_producer_thread(
    tiny_model_dir, reward_file, tmp_path, extra
):
    """Where the producer runs changes nothing but the timings: the same metrics and samples,
    and the same weights bit for bit (and no producer left behind)."""
    for kind in ("thread", "process"):
        over = {"train.steps": 4, **extra, "rollout.producer": kind}
        train(_cfg(tiny_model_dir, reward_file, **over), tmp_path / kind)
        assert not _producers_alive()
    a, b = _train_rows(tmp_path / "thread"), _train_rows(tmp_path / "process")
    assert [r["async/policy_version"] for r in b] == [
        max(0, s - 1 - extra["rollout.async_steps"]) for s in range(1, 5)
    ]
    assert comparable(a) == comparable(b)
    sa = (tmp_path / "thread/samples.jsonl").read_text()
    assert sa and sa == (tmp_path / "process/samples.jsonl").read_text()
    from test_distributed import weights as ckpt_weights  # LoRA: the adapter

    wa = ckpt_weights(tmp_path / "thread/checkpoints/step-4")
    wb = ckpt_weights(tmp_path / "process/checkpoints/step-4")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_close_ends_a_producer_process_in_the_middle_of_a_generation(tiny_model_dir, reward_file):
    """A collect that would run forever ends at close(); take() then says the producer ended."""
    run = trainer_mod.setup(_cfg(tiny_model_dir, reward_file))
    ids = torch.tensor([[5, 6, 7]])

    def endless(r, step, rows):
        while True:
            with torch.no_grad():
                r.models.policy(input_ids=ids)

    state = {0: pipeline.trainable_state(run.models.policy)}
    prod = pipeline.ProcessProducer(endless, run, 1, range(1, 3), lambda: [], state, 1).start()
    time.sleep(0.5)
    assert prod.process.is_alive()
    t0 = time.monotonic()
    prod.close(timeout=60)
    assert time.monotonic() - t0 < 30 and not prod.process.is_alive()
    assert not _producers_alive()
    with pytest.raises(RuntimeError, match="ended before step 1"):
        prod.take(1)


def test_process_slots_never_hand_out_a_version_being_written(tiny_model_dir, reward_file):
    """Version v lives in slot v mod (k + 1): writing version v (after step v was taken)
    overwrites v - k - 1, older than any version a step still to be collected needs (v - k and
    newer); the checkpoint gets copies of versions step - k .. step - 1."""
    run = trainer_mod.setup(_cfg(tiny_model_dir, reward_file))
    model = run.models.policy
    with torch.no_grad():  # version u: every parameter is u
        for p in model.parameters():
            p.zero_()
    k = 2
    state = {0: pipeline.trainable_state(model)}
    prod = pipeline.ProcessProducer(None, run, k, range(1, 10), lambda: [], state, 1)
    for v in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(v))
        prod.slots.write(v, pipeline.trainable_state(model))
        needed = [prod.version_of(t) for t in range(v + 1, v + 2 + k)]  # steps not yet collected
        for u in needed:
            assert all(float(t.flatten()[0]) == u for t in prod.slots.read(u).values())
    saved = prod.checkpoint_versions(6)
    assert sorted(saved) == [4, 5]
    view = next(iter(prod.slots.read(4).values()))
    first = next(iter(saved[4].values()))
    assert first.untyped_storage().nbytes() == view.numel() * view.element_size()


ASYNC_REWARD = """
import asyncio


async def char_score(completions, **kw):  # the name tiny_overrides gives
    await asyncio.sleep(0)
    return [float(i % 2) for i in range(len(completions))]
"""


@pytest.mark.slow
def test_an_async_reward_runs_in_the_producer_process(tiny_model_dir, tmp_path):
    """The reward event loop's thread stays in the trainer when it forks (the audit started
    it): the producer starts its own instead of waiting forever on the trainer's."""
    from peergrade.cli import main  # noqa: F401  (the same interpreter setup as a user's)

    rewards = tmp_path / "async_rewards.py"
    rewards.write_text(ASYNC_REWARD)
    over = {"train.steps": 3, "rollout.async_steps": 1}
    proc = _cli_train(tiny_model_dir, rewards, tmp_path / "run", **over)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _train_rows(tmp_path / "run")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["reward/char_score/mean"] == 0.5 for r in rows)


def test_a_python_closure_reward_runs_in_the_producer_process(tiny_model_dir, tmp_path):
    """Nothing is pickled into the producer: a reward that is a closure over local state (which
    no pickle could send) scores there, from the Python API."""
    from datasets import Dataset

    from peergrade.api import GRPOConfig, GRPOTrainer

    target = "7"

    def exact(completions, answer, **kw):
        return [float(target in c) for c in completions]

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    args = GRPOConfig(
        str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=exact,
        args=args,
        train_dataset=Dataset.from_list(rows),
    )
    trainer.config.rollout.async_steps = 1
    trainer.train()
    steps = [h for h in trainer.state.log_history if "async/staleness_max" in h]
    assert [h["async/staleness_max"] for h in steps] == [0, 1, 1]
    assert not _producers_alive()


@pytest.mark.slow
def test_a_producer_process_after_a_multithreaded_parent_runs_on_one_thread(
    tiny_model_dir, reward_file, tmp_path
):
    """train.threads 4 with a producer process: the trainer ran OpenMP regions on several
    threads before the fork (the starting evaluation), so a child running more than one thread
    would wait forever on GNU OpenMP's pool; it runs one, the trainer three, and the run ends."""
    over = {
        "train.steps": 3,
        "train.threads": 4,
        "rollout.async_steps": 1,
        "rollout.producer": "process",
    }
    proc = _cli_train(tiny_model_dir, reward_file, tmp_path / "run", threads="4", **over)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["async/staleness_max"] for r in _train_rows(tmp_path / "run")] == [0, 1, 1]


PRINTING_REWARD = """
import sys


def char_score(completions, **kw):  # the name tiny_overrides gives
    print("scored, stdout is a", type(sys.stdout).__name__, flush=True)
    return [float(i % 2) for i in range(len(completions))]
"""


@pytest.mark.slow
def test_a_reward_that_prints_under_the_rich_display_runs_in_the_producer_process(
    tiny_model_dir, tmp_path
):
    """In a terminal the progress display replaces stdout with a proxy that prints through its
    console (and its lock); a reward function printing in the producer process writes to the
    terminal itself instead, and the run ends."""
    rewards = tmp_path / "printing.py"
    rewards.write_text(PRINTING_REWARD)
    # the held-out scorer is the task's verifier: the printing reward runs in the producer only
    over = {"train.steps": 3, "rollout.async_steps": 1, "train.display": "rich"}
    over["train.eval_reward"] = "arithmetic"
    terminal = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}
    proc = _cli_train(tiny_model_dir, rewards, tmp_path / "run", env=terminal, **over)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [ln for ln in proc.stdout.splitlines() if "scored, stdout is a" in ln]
    assert len(printed) >= 3, proc.stdout[-2000:]  # the audit's call, then the steps'
    assert not any("FileProxy" in ln for ln in printed), printed  # rich's proxy: not used there
    assert [r["async/staleness_max"] for r in _train_rows(tmp_path / "run")] == [0, 1, 1]
