"""Pipelined rollouts (``rollout.async_steps`` = k >= 1): a producer thread collects the next
steps' experience with its own copy of the policy while the trainer updates on this one.

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

What runs where. The producer thread runs the trainer's ``collect`` without the advantages:
sampling (or episodes), the reward functions, the reference log-probs. The main thread computes
the advantages (under torchrun they gather every rank's rewards, so every collective stays on
the main thread, in the same order on every rank), the update, the metrics, the evaluation and
the checkpoints. Dynamic sampling's rounds gather rewards inside ``collect``, so with several
ranks the trainer refuses it together with a producer.

Stopping. ``close`` wakes a waiting producer, and a forward pre-hook on the producer's input
embeddings raises ``Stopped`` at its next forward pass, so a stop (Ctrl-C, the end of the run,
an error in the trainer) waits for at most one forward pass or one reward call, never a whole
generation.

What it deliberately does not do: no sampling, scoring or update code of its own (the trainer
passes its ``collect`` in; this module never imports the trainer), no processes (a thread:
torch releases the GIL inside its kernels; docs/async.md has the measurements), no discarding,
no PPO (the config refuses it).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from peergrade.experience import Experience

__all__ = [
    "VERSIONS_FILE",
    "Producer",
    "Stopped",
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


class Producer:
    """The producer thread of one run (module docstring).

    ``collect(run, step, rows)`` is the trainer's collect without advantages; ``run`` the
    producer's copy (``producer_run``); ``steps`` the steps to collect, in order; ``next_rows()``
    the next step's rows; ``versions`` the snapshots already available ({version: state}: the
    trainer's current weights, and those a checkpoint saved); ``threads`` the producer's torch
    intra-op threads."""

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
        self.versions = dict(versions)
        # after a resume from a checkpoint without the older versions (saved with another k),
        # the first steps are sampled by the oldest version there is, and record it
        self.floor = min(self.versions)
        self.done: dict[int, Experience] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.cond = threading.Condition()
        self.loaded: int | None = None
        # on the input embeddings: every forward of the copy passes there, whatever wrapper
        # (PEFT) or entry point (the chunked log-prob engine calls the backbone) it goes through
        embed = run.models.policy.get_input_embeddings()
        self._hook = embed.register_forward_pre_hook(self._check_stop)
        self.thread = threading.Thread(target=self._loop, name="peergrade-producer", daemon=True)

    def start(self) -> Producer:
        self.thread.start()
        return self

    def _check_stop(self, module, args):
        if self.stopping:
            raise Stopped

    def version_of(self, step: int) -> int:
        return max(sampled_version(step, self.k), self.floor)

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
                exp = self.collect(self.run, t, self.next_rows())
                exp.policy_version = v
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
            self.cond.wait_for(
                lambda: step in self.done or self.error is not None or not self.thread.is_alive()
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
