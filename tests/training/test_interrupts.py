"""Stops that must not lie (issue 33 item 1): a second Ctrl-C during the held-out evaluation,
inside a checkpoint write or inside the update, a SIGTERM, and a third Ctrl-C that abandons the
last save. Each run is the CLI in a subprocess with the signals raised at one hook point (a
driver script wraps a function of peergrade's); the checkpoint left behind must carry the step
whose weights it holds, and ``--resume`` must end bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.training import checkpoint as ckpt

pytestmark = pytest.mark.slow  # each case is two CLI runs in a subprocess

DRIVER = """
import os, signal, sys, threading, time
from peergrade.training import checkpoint as ckpt
from peergrade.training import pipeline

import peergrade.training.trainer as tr
import peergrade.training.update as upd

# STOP_AT: "hook:step:SIG,SIG;..." -- raise those signals in this process at that hook
hooks = {}
for part in filter(None, os.environ.get("STOP_AT", "").split(";")):
    hook, step, sigs = part.split(":")
    hooks[(hook, int(step))] = sigs.split(",")


def fire(hook, step, producer=None):
    if (hook, step) in hooks:
        sigs = hooks.pop((hook, step))  # once
        if os.environ.get("HOOK_TIME"):
            with open(os.environ["HOOK_TIME"], "w") as f:
                f.write(repr(time.time()))
        for s in sigs:
            if s == "STOP":  # the producer process stops (SIGSTOP: alive, never answers)
                os.kill(producer.process.pid, signal.SIGSTOP)
            elif s == "TERMALL":  # as Slurm does: every process of the job, producer too
                os.kill(producer.process.pid, signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)
            elif s == "LATEINT":  # a Ctrl-C a second later, while the trainer waits
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            elif s:
                signal.raise_signal(getattr(signal, "SIG" + s))


real_setup = tr.setup
def setup(cfg):  # loading the model and the data
    fire("load", 0)
    return real_setup(cfg)
tr.setup = setup

real_eval = tr.HeldOut.evaluate_logged
def evaluate_logged(self, step, display):
    fire("eval", step)
    return real_eval(self, step, display)
tr.HeldOut.evaluate_logged = evaluate_logged

real_tok = ckpt.save_tokenizer
def save_tokenizer(tok, path):  # the model's weights are written, the rest is not
    fire("save", int(str(path).rsplit("-", 1)[1]))
    return real_tok(tok, path)
ckpt.save_tokenizer = save_tokenizer

calls = []
real_update = upd.grpo_update
def grpo_update(*a, **kw):  # one call per step here (mu = 1)
    out = real_update(*a, **kw)
    calls.append(1)
    fire("update", len(calls))
    return out
upd.grpo_update = grpo_update

real_collect = tr.collect
def collect(run, step, *a, **kw):
    fire("collect", step)
    return real_collect(run, step, *a, **kw)
tr.collect = collect

real_take = pipeline.ProcessProducer.take
def take(self, step):
    fire("take", step, self)
    return real_take(self, step)
pipeline.ProcessProducer.take = take

real_publish = pipeline.ProcessProducer.publish
def publish(self, version, model):
    if ("publish", version) in hooks:  # once the step before has arrived
        with self.cond:
            self.cond.wait_for(lambda: version + 1 in self.done, timeout=120)
    fire("publish", version, self)
    return real_publish(self, version, model)
pipeline.ProcessProducer.publish = publish

from peergrade.cli import main
sys.exit(main(sys.argv[1:]))
"""

REWARDS_PY = """
def my_fn(prompts, completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 for t in texts]
"""

TINY = {
    "rollout.prompts_per_step": "2",
    "rollout.group_size": "2",
    "rollout.max_completion_length": "4",
    "optim.lr": "1e-2",
    "train.eval_size": "2",
    "train.eval_samples": "2",
    "train.eval_every": "1",
    "train.display": "plain",
    "train.threads": "1",
    "train.steps": "3",
}


def run_cli(tmp_path: Path, args: list[str], stop_at: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STOP_AT": stop_at}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


def start_args(model: Path, reward: Path, run: Path, **more: str) -> list[str]:
    opts = {**TINY, **more}
    args = ["train", "--model", str(model), "--reward", f"{reward}:my_fn", "-o", str(run)]
    return args + [x for k, v in opts.items() for x in (f"--{k}", v)]


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt_dir / "model.safetensors"))


def train_steps(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss/policy" in r]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    """(work dir, reward file, the final weights of a run never stopped)."""
    work = tmp_path_factory.mktemp("interrupts")
    reward = work / "rewards.py"
    reward.write_text(REWARDS_PY)
    proc = run_cli(work, start_args(tiny_model_dir, reward, work / "plain"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work, reward, weights(work / "plain/checkpoints/step-3")


CASES = {
    # name: (STOP_AT, more options, exit code, the step saved, what the user is told)
    "second_ctrl_c_in_eval": ("eval:2:INT,INT", {}, 130, 2, "stopped at step 2"),
    "second_ctrl_c_in_save": (
        "save:2:INT,INT",
        {"train.save_every": "2"},
        130,
        2,
        "stopped at step 2",
    ),
    "second_ctrl_c_in_update": ("update:2:INT,INT", {}, 130, 2, "stopped at step 2"),
    "sigterm": ("collect:2:TERM", {}, 143, 2, "SIGTERM: stopped at step 2"),
    "sigterm_twice_then_ctrl_c": (
        "collect:2:TERM,TERM;eval:2:INT",
        {},
        143,
        2,
        "stopped at step 2",
    ),
    "third_ctrl_c_abandons_the_save": (
        "eval:2:INT,INT;save:2:INT",
        {"train.save_every": "1"},
        130,
        1,
        "the last complete checkpoint is step-1",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stop_then_resume_is_exact(setup, tiny_model_dir, case):
    work, reward, expected = setup
    stop_at, more, code, saved, told = CASES[case]
    run = work / case
    proc = run_cli(work, start_args(tiny_model_dir, reward, run, **more), stop_at)
    said = proc.stdout + proc.stderr
    assert proc.returncode == code, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert told in said and f"--resume {run}" in said, said[-3000:]
    last = ckpt.latest_checkpoint(run)
    assert last is not None and last.name == f"step-{saved}", said[-3000:]
    assert ckpt.read_trainer_state(last)["step"] == saved

    proc = run_cli(work, ["train", "--resume", str(run)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_steps(run) == [1, 2, 3]
    got = weights(run / "checkpoints/step-3")
    assert got.keys() == expected.keys()
    for k in got:
        assert torch.equal(got[k], expected[k]), (case, k)


# ----------------------------------------------------------------------------- pipelined

PIPELINED = {"rollout.async_steps": "1", "rollout.producer": "process", "train.steps": "4"}


@pytest.fixture(scope="module")
def pipelined(setup, tiny_model_dir):
    """The final weights of a pipelined run (a producer process, one step ahead) never stopped."""
    work, reward, _ = setup
    proc = run_cli(work, start_args(tiny_model_dir, reward, work / "plain-pipelined", **PIPELINED))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return weights(work / "plain-pipelined/checkpoints/step-4")


PIPELINED_CASES = {
    # name: (STOP_AT, more options, exit code, the steps it may have saved, what the user is told)
    "second_ctrl_c_in_eval": ("eval:2:INT,INT", {}, 130, (2,), "stopped at step 2"),
    "sigterm_to_every_process": ("take:3:TERMALL", {}, 143, (3,), "SIGTERM: stopped at step 3"),
    # stopped once it has delivered step 2 (sampled by version 0), before version 1 is
    # published: it never samples step 3
    "stopped_producer_then_two_ctrl_c": (
        "publish:1:STOP;take:3:INT,LATEINT",
        {},
        130,
        (2,),
        "stopped at step 2",
    ),
    "stopped_producer_times_out": (
        "publish:1:STOP",
        {"rollout.producer_timeout_s": "3"},
        2,
        (2,),
        "delivered nothing for step 3 within 3 s (rollout.producer_timeout_s)",
    ),
}


@pytest.mark.parametrize("case", list(PIPELINED_CASES))
def test_pipelined_stop_then_resume_is_exact(setup, pipelined, tiny_model_dir, tmp_path, case):
    work, reward, _ = setup
    stop_at, more, code, saved, told = PIPELINED_CASES[case]
    run = work / f"pipelined-{case}"
    hook_time = tmp_path / "hook"
    env_extra = {"HOOK_TIME": str(hook_time)}
    old = os.environ.copy()
    os.environ.update(env_extra)
    try:
        args = start_args(tiny_model_dir, reward, run, **PIPELINED, **more)
        proc = run_cli(work, args, stop_at)
    finally:
        os.environ.clear()
        os.environ.update(old)
    ended = time.time()
    said = proc.stdout + proc.stderr
    assert proc.returncode == code, said[-3000:]
    assert "Traceback" not in said and told in said and f"--resume {run}" in said, said[-3000:]
    # a stopped producer holds nothing up: the run ends within seconds (it waited 60 s before)
    assert ended - float(hook_time.read_text()) < 40, said[-3000:]
    last = ckpt.latest_checkpoint(run)
    assert last is not None and int(last.name.split("-")[1]) in saved, said[-3000:]
    proc = run_cli(work, ["train", "--resume", str(run)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_steps(run) == [1, 2, 3, 4]
    got = weights(run / "checkpoints/step-4")
    for k in got:
        assert torch.equal(got[k], pipelined[k]), (case, k)


# ----------------------------------------------------------------------------- torchrun

TERM_REWARD = '''
import os, signal

CALLS = []

def term_parent(completions, **kwargs):
    """A dense score; on rank 0's 2nd call (step 2) it sends SIGTERM to torchrun, the launcher,
    as a preempting scheduler would: torchrun passes it on to every rank."""
    CALLS.append(1)
    if os.environ.get("RANK") == "0" and len(CALLS) == 2 and os.environ.get("TERM_PARENT"):
        os.kill(os.getppid(), signal.SIGTERM)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 for t in texts]
'''


def torchrun_cmd(run: Path, reward: Path, model: Path, steps: int) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the held-out scorer is the task's verifier, so the reward's calls count training steps
    opts = {
        **TINY,
        "rollout.prompts_per_step": "4",
        "train.eval_every": "0",
        "train.audit_rewards": '"off"',
        "train.steps": str(steps),
        "dist.timeout_s": "120",
        "train.eval_reward": "arithmetic",
    }
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--monitor-interval=0.5",
        "-m",
        "peergrade",
        "train",
        "--model",
        str(model),
        "--reward",
        f"{reward}:term_parent",
        "-o",
        str(run),
        *[x for k, v in opts.items() for x in (f"--{k}", v)],
    ]


def test_sigterm_under_torchrun_saves_on_every_rank_and_resumes_exactly(tiny_model_dir, tmp_path):
    reward = tmp_path / "term.py"
    reward.write_text(TERM_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    plain, stopped = tmp_path / "plain", tmp_path / "stopped"
    out = subprocess.run(
        torchrun_cmd(plain, reward, tiny_model_dir, 4),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    out = subprocess.run(
        torchrun_cmd(stopped, reward, tiny_model_dir, 4),
        env={**env, "TERM_PARENT": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = out.stdout + out.stderr
    assert out.returncode != 0, said[-4000:]
    assert "SIGTERM: stopped at step" in said and f"--resume {stopped}" in said, said[-4000:]
    # torchrun re-raises the SIGTERM it got (no per-rank summary); rank 0 said the above
    last = ckpt.latest_checkpoint(stopped)
    assert last is not None and 2 <= ckpt.read_trainer_state(last)["step"] < 4, said[-4000:]

    cmd = torchrun_cmd(stopped, reward, tiny_model_dir, 4)
    cmd = cmd[: cmd.index("train") + 1] + ["--resume", str(stopped)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert train_steps(stopped) == [1, 2, 3, 4]
    a, b = weights(plain / "checkpoints/step-4"), weights(stopped / "checkpoints/step-4")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigterm_while_the_model_loads_exits_143_with_its_line_and_the_rerun_is_exact(
    setup, tiny_model_dir
):
    """A preemption during start-up (imports, model load) ends like a Ctrl-C there: one line,
    exit 143, not a silent kill; no run directory is left to block the same command again."""
    work, reward, plain = setup
    args = start_args(tiny_model_dir, reward, work / "termload")
    proc = run_cli(work, args, stop_at="load:0:TERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "SIGTERM before the run started: no checkpoint was written" in proc.stderr
    assert "Traceback" not in proc.stderr
    again = run_cli(work, args)
    assert again.returncode == 0, again.stderr[-3000:]
    got = weights(work / "termload/checkpoints/step-3")
    assert got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in plain)


SLOW_HARNESS = """
import os, pathlib, time
pathlib.Path(os.environ["MARK_DIR"], f"importing-{os.getpid()}").touch()
time.sleep(30)  # a heavy import: the Ctrl-C lands while the worker processes load this


def agent(row, base_url, model):
    return 0.0
"""


@pytest.mark.slow
def test_ctrl_c_while_harness_workers_start_prints_one_line_and_exits_130(tmp_path):
    """Ctrl-C on the terminal (SIGINT to the process group) while the harness's worker
    processes import the harness: the trainer's one line and exit 130, no worker traceback;
    a second Ctrl-C while it exits keeps 130 (was: the workers' tracebacks, then exit -2)."""
    import signal

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "slow.py").write_text(SLOW_HARNESS)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MARK_DIR": str(marks)}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "peergrade", "train", "--config"]
    cmd += [str(root / "configs" / "calculator.yaml"), "--env.factory", "null"]
    cmd += ["--harness", "slow.py:agent", "--harness.processes", "2", "--train.steps", "2"]
    cmd += ["--train.audit_rewards", "off", "-o", "run"]
    p = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(list(marks.iterdir())) < 2:  # both workers are importing the harness
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.5)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)  # the impatient second Ctrl-C
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "interrupted" in err
