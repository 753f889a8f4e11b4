"""Pipelined rollouts (``rollout.async_steps`` = k >= 1): a producer collects the next steps'
experience with its own copy of the policy while the trainer updates on this one. The producer
is a forked process (``ProcessProducer``, the CPU default) or a thread (``Producer``, the GPU's:
CUDA cannot be forked); ``rollout.producer`` picks, ``producer_kind`` resolves ``auto``.

Versions. Version v is the policy after v updates (0 = the starting weights; the update of step
t turns version t-1 into version t). Step t is sampled by version
``sampled_version(t, k) = max(0, t - 1 - k)`` and trained by version t-1, so its staleness
(version trained minus version sampled) is at most k. The version is a function of (t, k) alone,
never of timing: with keyed sampling (``peergrade.seeds``) a pipelined run samples the same
tokens however fast either side runs, and a resumed run repeats it exactly.

Admission. The producer starts step t only once version v(t) is published (``publish``, after
each update), loads it into its copy, and never samples step t with another version; the
trainer takes step t's experience when it needs it (``take``, waiting if it is not ready).
Nothing finished is ever discarded, and the producer runs at most k + 1 steps ahead.

Weights. ``Producer.versions`` holds a snapshot of the trainable parameters (LoRA: the
adapters) of every version a step not yet trained still needs (at most k + 1): the producer
copies one into its own model before each step whose version changed. Frozen parameters and
buffers are shared with the trainer's model, not copied (LoRA's base weights, rotary tables).
A checkpoint at step s saves the versions s - k .. s - 1 (``checkpoint_versions``) so that a
resumed run regenerates its in-flight steps s + 1 .. s + k from the same weights and keys.

What runs where. The producer (either kind) runs the trainer's ``collect`` without the advantages:
sampling (or episodes), the reward functions, the reference log-probs. The main thread computes
the advantages (under torchrun they gather every rank's rewards, so every collective stays on
the main thread, in the same order on every rank), the update, the metrics, the evaluation and
the checkpoints. Dynamic sampling's rounds gather rewards inside ``collect``, so with several
ranks the trainer refuses it together with a producer.

Threads. A producer process runs one torch thread (``PROCESS_THREADS``: GNU OpenMP cannot run
a parallel region in a forked child after its parent ran one), the trainer the rest; so
``auto`` picks a process only when the producer's half of ``train.threads`` is one anyway.

Stopping. ``close`` wakes a waiting producer, and a forward pre-hook on the producer's input
embeddings raises ``Stopped`` at its next forward pass, so a stop (Ctrl-C, the end of the run,
an error in the trainer) waits for at most one forward pass or one reward call, never a whole
generation.

The process. Torch releases the GIL inside its kernels, but not between them: on a small model
the Python around each op is much of the time, and a producer thread and the trainer then take
turns rather than run side by side (the CPU demo: each phase 1.2 to 1.5 times slower beside the
other, docs/async.md). ``ProcessProducer`` forks the trainer's process once, before the first
pipelined step, so the child starts with everything the trainer has set up (model, reference,
task, reward functions, environments: nothing is pickled, closures and notebook functions
included) and its own interpreter. Its policy is its private copy-on-write view of the
trainer's. Versions travel through k + 1 slots of shared memory made before the fork (version
v in slot v mod (k + 1)). Writing version v overwrites version v - k - 1, whose last user is
step v (sampled by it); the trainer writes v only after it took step v, so the producer never
reads a slot being written. A pipe says which version is ready; the
finished experience comes back pickled through another, read by a thread of the trainer. What
the producer's reward functions and environments change stays in the producer (a reward
function that counts its calls counts them there). It ignores Ctrl-C (the trainer stops it),
dies with the trainer (``PR_SET_PDEATHSIG``), and its errors are raised by the trainer with the
producer's traceback as a note.

Another rollout engine (``rollout.engine vllm``). The producer is then always a thread
(``producer_kind``): the one engine lives in the trainer's process, built on the main thread
before the producer starts, from the version of the first step to sample. The producer samples
through ``_EngineView`` (a stop raises ``Stopped`` at its next engine call) and, when its version
changes, copies the snapshot into its policy and pushes that copy to the engine, which loads it
at its next call (one load per version; ``VllmEngine.defer_pushes`` makes the trainer's own push
after each update only record the version, loaded when the trainer's held-out evaluation
samples with it). The engine's lock keeps a generation, a weight load and the other thread's
calls apart. The producer measures the train/inference gap (``sampling.engine_gap``) with the
version that sampled, before the trainer's weights move on, and hands it over as
``exp.engine_gap``.

What it deliberately does not do: no sampling, scoring or update code of its own (the trainer
passes its ``collect`` in; this module never imports the trainer), no discarding, no PPO (the
config refuses it).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from peergrade.errors import PeergradeError
from peergrade.training.experience import Experience
from peergrade.training.sampling import engine_gap

__all__ = [
    "VERSIONS_FILE",
    "ProcessProducer",
    "Producer",
    "Stopped",
    "producer_kind",
    "producer_run",
    "sampled_version",
    "trainable_state",
]

#: the checkpoint file with the weights of the versions that sampled the in-flight steps
VERSIONS_FILE = "async_versions.pt"


def sampled_version(step: int, k: int) -> int:
    """The policy version that samples step ``step`` with ``async_steps`` = k (0: step - 1)."""
    return max(0, step - 1 - k)


class Stopped(Exception):
    """The producer was asked to stop (raised inside its own thread only)."""


def trainable_state(model) -> dict[str, torch.Tensor]:
    """A snapshot (clone) of ``model``'s trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _load_state(model, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def producer_run(run):
    """A copy of the trainer's ``run`` for the producer: its own policy (trainable parameters
    copied; frozen ones and buffers shared) and tokenizer (fast tokenizers are not safe to use
    from two threads); task, rewards and reference are shared."""
    m = run.models
    shared = {id(p): p for p in m.policy.parameters() if not p.requires_grad}
    shared |= {id(b): b for b in m.policy.buffers()}
    policy = copy.deepcopy(m.policy, shared)
    policy.eval()
    models = dataclasses.replace(m, policy=policy, tokenizer=copy.deepcopy(m.tokenizer))
    return dataclasses.replace(run, models=models)


class ProducerStalled(PeergradeError, RuntimeError):
    """The producer delivered no step within ``rollout.producer_timeout_s``."""


class _Producer:
    """What both kinds of producer hold: ``collect(run, step, rows)`` is the trainer's collect
    without advantages; ``run`` the run it collects with (a thread: ``producer_run``'s copy; a
    process: the trainer's, which the fork copies); ``steps`` the steps to collect, in order;
    ``next_rows()`` the next step's rows; ``versions`` the snapshots already available
    ({version: state}: the trainer's current weights, and those a checkpoint saved);
    ``threads`` the producer's torch intra-op threads."""

    def __init__(
        self,
        collect: Callable[[Any, int, list[dict]], Experience],
        run,
        k: int,
        steps: range,
        next_rows: Callable[[], list[dict]],
        versions: dict[int, dict[str, torch.Tensor]],
        threads: int,
    ):
        self.collect, self.run, self.k, self.steps = collect, run, k, steps
        self.next_rows, self.threads = next_rows, threads
        # after a resume from a checkpoint without the older versions (saved with another k),
        # the first steps are sampled by the oldest version there is, and record it
        self.floor = min(versions)
        self.done: dict[int, Experience] = {}  # collected, not yet taken
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        # rollout.producer_timeout_s: how long take() waits before it names a stalled producer
        self.timeout_s: float | None = None

    def _wait(self, ready: Callable[[], bool], step: int, what: str) -> None:
        """``cond.wait_for(ready)`` (``cond`` held), bounded by ``timeout_s``: past it, an
        error naming the producer and the limit."""
        limit = self.timeout_s or None
        if not self.cond.wait_for(ready, timeout=limit):
            raise ProducerStalled(
                f"the rollout producer ({what}) delivered nothing for step {step} within "
                f"{limit:g} s (rollout.producer_timeout_s): it is stopped, hung in a reward "
                "or a tool, or slower than that; raise the limit if it is only slow"
            )

    def version_of(self, step: int) -> int:
        return max(sampled_version(step, self.k), self.floor)


class Producer(_Producer):
    """The producer thread of one run (module docstring; arguments: ``_Producer``)."""

    def __init__(self, collect, run, k, steps, next_rows, versions, threads):
        super().__init__(collect, run, k, steps, next_rows, versions, threads)
        self.versions = dict(versions)
        self.stopping = False
        self.loaded: int | None = None
        # another rollout engine (vLLM), shared with the trainer's thread: the producer samples
        # through a view of it that stops at its next call (a forward pre-hook never runs there)
        self.engine = getattr(run, "engine", None)
        if self.engine is not None:
            self.run = dataclasses.replace(run, engine=_EngineView(self.engine, self))
        # on the input embeddings: every forward of the copy passes there, whatever wrapper
        # (PEFT) or entry point (the chunked log-prob engine calls the backbone) it goes through
        embed = run.models.policy.get_input_embeddings()
        self._hook = embed.register_forward_pre_hook(self._check_stop)
        self.thread = threading.Thread(target=self._loop, name="peergrade-producer", daemon=True)

    def start(self) -> Producer:
        if self.engine is not None:  # built here, on the main thread, from the first version
            self._start_engine()
        self.thread.start()
        return self

    def _start_engine(self) -> None:
        """The engine holds the version of the first step to sample (its weights in the
        producer's copy), and from now on loads weights only when a call samples with them:
        the trainer's push after each update only records its version (``defer_pushes``)."""
        v = self.version_of(self.steps.start)
        policy = self.run.models.policy
        _load_state(policy, self.versions[v])
        self.loaded = v
        self.engine.defer_pushes = True
        self.engine.push(policy, version=v)
        self.engine.start(policy, self.run.models.tokenizer)

    def _check_stop(self, module, args):
        if self.stopping:
            raise Stopped

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            for t in self.steps:
                v = self.version_of(t)
                with self.cond:  # admission: step t starts only with version v(t) at hand
                    self.cond.wait_for(lambda v=v: self.stopping or v in self.versions)
                    if self.stopping:
                        return
                    state = self.versions[v]
                if self.loaded != v:
                    _load_state(self.run.models.policy, state)
                    self.loaded = v
                    if self.engine is not None:  # loaded by its next call, between calls
                        self.engine.push(self.run.models.policy, version=v)
                exp = self.collect(self.run, t, self.next_rows())
                exp.policy_version = v
                if self.engine is not None:  # measured with the weights that sampled (v)
                    exp.engine_gap = engine_gap(self.run, exp)
                with self.cond:
                    self.done[t] = exp
                    self.cond.notify_all()
        except Stopped:
            return
        except BaseException as exc:  # handed to the trainer, which raises it in its thread
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def take(self, step: int) -> Experience:
        """Step ``step``'s experience (waiting until it is collected); the producer's error,
        re-raised here, when it failed."""
        with self.cond:
            self._wait(
                lambda: step in self.done or self.error is not None or not self.thread.is_alive(),
                step,
                f"thread {self.thread.name}",
            )
            if step in self.done:
                return self.done.pop(step)
            if self.error is not None:
                raise self.error
            raise RuntimeError(f"the rollout producer stopped before step {step}")

    def publish(self, version: int, model) -> None:
        """The trainer's weights after its update number ``version`` (a snapshot: it samples
        step version + 1 + k, of this run or of one resumed from it with more steps). Versions
        no step still needs are dropped."""
        state = trainable_state(model)
        with self.cond:
            self.versions[version] = state
            oldest_needed = self.version_of(version + 1)
            for v in [v for v in self.versions if v < oldest_needed]:
                del self.versions[v]
            self.cond.notify_all()

    def checkpoint_versions(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """What a checkpoint at ``step`` saves: the versions older than ``step`` that sample
        steps step + 1 .. step + k."""
        with self.cond:
            return {v: s for v, s in self.versions.items() if v < step}

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer (at its next forward pass) and wait for its thread to end."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        self._hook.remove()
        if self.engine is not None:  # the trainer's pushes load at once again
            self.engine.defer_pushes = False


class _EngineView:
    """The run's rollout engine as a producer thread calls it: each call (a reply batch, an
    episode's model turn) raises ``Stopped`` once the producer is stopping, so a stop waits
    for at most the engine call in flight; everything else is the engine's."""

    def __init__(self, engine, producer: Producer):
        self._engine, self._producer = engine, producer
        # the engine's own (reentrant) lock around the check and the call: a close on the
        # trainer's thread (after it set ``stopping``) cannot come between them, so a stopped
        # producer never builds the engine again
        self._lock = getattr(engine, "_lock", None) or contextlib.nullcontext()

    def _check(self) -> None:
        if self._producer.stopping:
            raise Stopped

    def sample(self, *args, **kwargs):
        with self._lock:
            self._check()
            return self._engine.sample(*args, **kwargs)

    def turn_sampler(self, *args, **kwargs):
        with self._lock:
            self._check()
            turns = self._engine.turn_sampler(*args, **kwargs)

        def sample_turns(*a, **kw):
            with self._lock:
                self._check()
                return turns(*a, **kw)

        return sample_turns

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


#: torch intra-op threads of a producer process. GNU OpenMP (torch's CPU thread pool) cannot
#: run a parallel region again in a forked child once the parent has run one: the child waits
#: forever for pool threads that were not copied. One thread never opens a region.
PROCESS_THREADS = 1


def producer_kind(
    setting: str, device: torch.device, threads: int = 2, engine: str = "peergrade"
) -> str:
    """``rollout.producer`` resolved: ``process`` or ``thread``. ``auto`` is a process on the
    CPU where fork exists (Linux) when the producer's share of the ``threads`` torch threads is
    one (``threads`` <= 2: a producer process runs ``PROCESS_THREADS``), else a thread; a process
    on a GPU is refused (CUDA cannot be forked). With another rollout ``engine`` (vLLM) it is
    always a thread: the one engine lives in the trainer's process, and the producer thread
    shares it (one call at a time) with the trainer's held-out evaluation."""
    if engine != "peergrade":
        if setting == "process":
            raise ValueError(
                f"rollout.producer process with rollout.engine {engine}: the engine lives in the "
                "trainer's process and the producer shares it as a thread; set rollout.producer "
                "to thread (or auto)"
            )
        return "thread"
    # Linux only: macOS offers fork but its system libraries are not safe to use after it
    can_fork = sys.platform.startswith("linux")
    if setting == "auto":
        process = device.type == "cpu" and can_fork and threads <= 2
        return "process" if process else "thread"
    if setting == "process" and device.type != "cpu":
        raise ValueError(
            f"rollout.producer process runs on the CPU only (the model is on {device}: a process "
            "that uses CUDA cannot be forked); set rollout.producer to thread (or auto)"
        )
    if setting == "process" and not can_fork:
        raise ValueError(
            f"rollout.producer process needs Linux's fork (this is {sys.platform}); "
            "set rollout.producer to thread (or auto)"
        )
    return setting


class _Slots:
    """n = k + 1 snapshots of the trainable parameters in anonymous shared memory (inherited
    by a forked child, no file descriptor per tensor): slot v mod n holds version v."""

    ALIGN = 64

    def __init__(self, template: dict[str, torch.Tensor], n: int):
        self.n = n
        layout, size = [], 0
        for name, t in template.items():
            nbytes = t.numel() * t.element_size()
            layout.append((name, size, nbytes, t.dtype, t.shape))
            size += -(-nbytes // self.ALIGN) * self.ALIGN
        self.maps = [mmap.mmap(-1, max(size, 1)) for _ in range(n)]
        self.views: list[dict[str, torch.Tensor]] = []
        for mm in self.maps:
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            self.views.append(
                {
                    name: buf[off : off + nbytes].view(dtype).view(shape)
                    for name, off, nbytes, dtype, shape in layout
                }
            )
        self.version = [-1] * n  # which version each slot holds (the trainer's record)

    def write(self, version: int, state: dict[str, torch.Tensor]) -> None:
        i = version % self.n
        with torch.no_grad():
            for name, view in self.views[i].items():
                view.copy_(state[name])
        self.version[i] = version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        return self.views[version % self.n]


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when the process that forked it dies (a
    trainer killed with kill -9 leaves no producer behind)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _portable(exp: Experience) -> Experience:
    """What the trainer needs of ``exp``, picklable: episodes lose their environment objects
    (used by the reward functions, in the producer, already)."""
    exp.sampled.samples = exp.sampled.samples.portable()
    return exp


def _error_payload(exc: BaseException) -> bytes:
    """The producer's exception for the trainer: itself when it pickles, else a RuntimeError
    with its type and message; the producer's traceback rides along as a note."""
    tb = "".join(traceback.format_exception(exc))
    try:
        data = pickle.dumps(("error", exc, tb))
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), tb))


class ProcessProducer(_Producer):
    """The producer as a forked process (module docstring; arguments: ``_Producer``); the same
    interface as ``Producer``: ``start``, ``take``, ``publish``, ``checkpoint_versions``,
    ``close``."""

    def __init__(self, collect, run, k, steps, next_rows, versions, threads):
        super().__init__(collect, run, k, steps, next_rows, versions, threads)
        first = self.version_of(steps.start)  # the oldest version a step still needs
        self.slots = _Slots(versions[max(versions)], k + 1)
        for v in sorted(versions):
            if v >= first:
                self.slots.write(v, versions[v])
        self.ended = False
        ctx = multiprocessing.get_context("fork")
        self._from_child, self._child_out = ctx.Pipe(duplex=False)
        self._child_in, self._to_child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=self._child,
            args=([v for v in self.slots.version if v >= 0],),
            name="peergrade-producer",
            daemon=True,
        )
        self.reader = threading.Thread(
            target=self._read, name="peergrade-producer-reader", daemon=True
        )

    def start(self) -> ProcessProducer:
        # the child must not inherit a tokenizer thread pool it cannot use (the tokenizers
        # library would say so on stderr): tokenizers stay sequential from here on
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.process.start()
        self._child_out.close()  # the trainer's copies of the child's ends: EOF when it dies
        self._child_in.close()
        self.reader.start()
        return self

    # ------------------------------------------------------------------ in the child process
    def _child(self, available: list[int]) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
        # and so is SIGTERM (Slurm signals every process of a job): the trainer saves, then
        # ends this process itself (close); a dead trainer ends it too (_die_with_parent)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent()
        # the trainer's progress display may have replaced them with proxies that print through
        # its console (whose lock a display thread, not copied by fork, may have held): what a
        # reward function prints here goes straight to the terminal instead
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        self._from_child.close()
        self._to_child.close()
        out, inbox = self._child_out, self._child_in
        try:
            torch.set_num_threads(self.threads)
            policy = self.run.models.policy  # this process's own copy-on-write view
            policy.eval()
            have, loaded = set(available), None
            for t in self.steps:
                v = self.version_of(t)
                while v not in have:  # admission: step t starts only with version v(t)
                    msg = inbox.recv()
                    if msg is None:
                        return
                    have.add(msg)
                if loaded != v:
                    _load_state(policy, self.slots.read(v))
                    loaded = v
                exp = self.collect(self.run, t, self.next_rows())
                exp.policy_version = v
                out.send_bytes(pickle.dumps(("done", t, _portable(exp)), pickle.HIGHEST_PROTOCOL))
        except (EOFError, BrokenPipeError):  # the trainer is gone
            return
        except BaseException as exc:
            with contextlib.suppress(OSError):
                out.send_bytes(_error_payload(exc))

    # ------------------------------------------------------------------ in the trainer
    def _read(self) -> None:
        while True:
            try:
                kind, *rest = pickle.loads(self._from_child.recv_bytes())
            except (EOFError, OSError):
                break
            with self.cond:
                if kind == "done":
                    self.done[rest[0]] = rest[1]
                else:
                    exc, tb = rest
                    exc.add_note(f"in the rollout producer process:\n{tb.rstrip()}")
                    self.error = exc
                self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def take(self, step: int) -> Experience:
        """Step ``step``'s experience (waiting until it is collected); the producer's error,
        re-raised here, when it failed."""
        with self.cond:
            self._wait(
                lambda: step in self.done or self.error is not None or self.ended,
                step,
                f"process {self.process.pid}",
            )
            if step in self.done:
                return self.done.pop(step)
            if self.error is not None:
                raise self.error
        self.process.join(5)
        code = self.process.exitcode
        why = ""
        if (
            code is not None and code < 0
        ):  # killed by a signal; SIGKILL is the kernel's OOM killer's
            why = f" (signal {-code}" + ("; out of memory?)" if -code == signal.SIGKILL else ")")
        raise RuntimeError(
            f"the rollout producer process ended before step {step}, exit code {code}{why}"
        )

    def publish(self, version: int, model) -> None:
        """The trainer's weights after its update number ``version``, into their slot; the
        producer is told it is there."""
        params = dict(model.named_parameters())
        self.slots.write(version, {n: params[n] for n in self.slots.views[0]})
        with contextlib.suppress(OSError):  # the producer has ended: take() says why
            self._to_child.send(version)

    def checkpoint_versions(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """What a checkpoint at ``step`` saves: the versions older than ``step`` that sample
        steps step + 1 .. step + k (copies: a slot is a view of a larger buffer)."""
        oldest = self.version_of(step + 1)
        return {
            v: {n: t.clone() for n, t in self.slots.read(v).items()}
            for v in self.slots.version
            if oldest <= v < step
        }

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer (at once: it holds nothing the trainer needs) and wait for it."""
        with contextlib.suppress(OSError):
            self._to_child.send(None)  # a producer waiting for weights returns at once
        self.process.join(min(timeout, 2.0))
        if self.process.is_alive():  # mid-step (or stopped): it ignores SIGTERM, see _child
            self.process.kill()
            self.process.join(timeout)
        self._to_child.close()
        self.reader.join(timeout)
        self._from_child.close()
