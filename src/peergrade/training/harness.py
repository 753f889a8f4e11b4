"""Training through an external agent (``harness:``, ``GRPOTrainer(harness=fn)``): the parts of
a step that differ from in-process episodes.

``start(run)`` serves the policy (``serving.harness.HarnessRunner``: the OpenAI-compatible
endpoint on a free local port, recording every episode in tokens). ``sample(run, rows, step,
keys)`` runs the harness once per (prompt, sample) with the step's sampling settings (the
trainer's win over the client's; every draw keyed by (seed, step, prompt, sample, turn)) and
returns the recorded ``Episode`` records, the one record the in-process engine makes, so
scoring, advantages and the update are unchanged. The harness's return value is the reward
``harness`` (one more reward function, reading the ``harness_result`` column); a failed harness
(raised, timed out, returned something else, never called the server) scores 0, its error
written into ``samples.jsonl`` (``extra.harness_error``) and counted (``harness/failed*``;
``step_metrics``: ``harness/failed_episodes`` of ``harness/episodes`` and the most common error,
which the progress line and the alert ``harness_failing`` show), unless
``train.on_reward_error: fail``, which stops the run naming the episode and the error. The
reward ``harness`` is the run's training reward, so it is the held-out scorer too
(``evaluation.held_out_scorer``) unless ``train.eval_reward`` names another.

With ``rollout.engine vllm`` the endpoint samples with the run's ``VllmEngine`` (``run.engine``,
continuously batched; its weights are the policy's after each step, ``sampling.push_weights``):
the recorded tokens and behaviour log-probs are vLLM's, and the step logs their gap to the
trainer's forward (``engine/*``) as for vLLM's own episodes.

``episode_fn(run)`` is the same for the held-out evaluation (greedy and sampled passes run the
harness too). It does not score with other reward functions or train.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence

from peergrade.config import PYTHON_ONLY
from peergrade.envs.harness_pool import HarnessPool
from peergrade.rewards import make_reward_specs
from peergrade.rewards.registry import RewardError
from peergrade.seeds import step_seed
from peergrade.serving.harness import HarnessResult, HarnessRunner, harness_metrics

#: the column the reward ``harness`` reads: one ``HarnessResult`` per episode
COLUMN = "harness_result"


def harness_reward(
    completions, harness_result=None, env_reward=None, log_extra=None, log_metric=None, **kwargs
):
    """The reward ``harness``: what each episode's harness returned (0 for a failed one). The
    held-out evaluation's episodes come without ``harness_result``: each episode's record
    carries the same value (``Episode.reward``), which the evaluator passes as ``env_reward``."""
    if harness_result is None:
        if env_reward is None:
            raise ValueError("the reward 'harness' scores episodes run through a harness only")
        return [0.0 if r is None else float(r) for r in env_reward]
    results: list[HarnessResult] = list(harness_result)
    if log_extra is not None and any(r.error for r in results):
        log_extra("harness_error", [r.error for r in results])
    if log_metric is not None:
        for name, value in harness_metrics(results).items():
            log_metric(name, value)
    return [r.reward for r in results]


def reward_specs():
    return make_reward_specs([(harness_reward, 1.0, {}, "harness")])


def step_metrics(metrics: dict, errors: Sequence | None, episodes: int) -> dict:
    """What the progress line and the alert ``harness_failing`` read of a step's ``episodes``
    harness runs (every rank's, every round's): ``harness/episodes``,
    ``harness/failed_episodes`` (from ``harness/failed``, the share the reward logged) and,
    when some failed, ``harness/top_error``: the most common error text among ``errors``
    (this rank's logged episodes: ``extra.harness_error``) with its count
    (``harness/top_error_count``, of those episodes)."""
    share = metrics.get("harness/failed")
    if share is None:
        return {}
    out = {
        "harness/episodes": float(episodes),
        "harness/failed_episodes": float(round(share * episodes)),
    }
    seen = Counter(e for e in errors or () if e)
    if share > 0 and seen:
        text, count = seen.most_common(1)[0]
        out["harness/top_error"] = text
        out["harness/top_error_count"] = float(count)
    return out


def load(cfg, given_fn: Callable | None = None) -> Callable | None:
    """The harness function: the Python caller's, else ``harness.fn`` loaded (None: none)."""
    if given_fn is not None:
        if not callable(given_fn):
            from peergrade.errors import InputError

            raise InputError(
                f"harness must be a callable fn(row, base_url, model), got {given_fn!r}"
            )
        return given_fn
    if cfg.harness.fn is None:
        return None
    from peergrade.envs.load import load_object

    fn = load_object(cfg.harness.fn, "harness.fn")
    if not callable(fn):
        from peergrade.errors import InputError

        raise InputError(f"harness.fn {cfg.harness.fn!r} is not callable")
    return fn


def start(run) -> HarnessRunner:
    """The endpoint, and with ``harness.processes >= 1`` (a sync harness) its worker pool
    (``run.harness_pool``; the workers start at the first step, ``close(run)`` stops them)."""
    h = run.cfg.harness
    run.harness_pool = pool_of(h.fn, h.processes, run.harness)
    engine = getattr(run, "engine", None)
    return runner_of(run.cfg, run.models.policy, run.models.tokenizer, engine=engine)


def runner_of(cfg, model, tokenizer, engine=None) -> HarnessRunner:
    """The endpoint a run's harness talks to (training and ``peergrade eval`` alike);
    ``engine``: the run's rollout engine (``sampling.build_engine``; a ``VllmEngine`` samples
    the episodes, with the weights ``sampling.push_weights`` gives it after each step)."""
    return HarnessRunner(
        model,
        tokenizer,
        cfg.harness.model_name,
        unrendered_tools=cfg.env.unrendered_tools,
        vllm=engine,
    )


#: ``harness.processes: auto``: at most this many workers (one per CPU below it)
AUTO_PROCESSES = 4


def processes_of(spec: str | None, processes: int | str, fn: Callable | None) -> int:
    """How many worker processes ``harness.processes`` means for this harness: 0 for an
    ``async def`` one (it runs on the trainer's loop); ``auto``: ``min(4, CPUs)`` (under
    torchrun, the CPUs per rank on this machine) for a harness given by name (``path/file.py:fn``, ``module:fn``), 0 for a Python function."""
    import inspect

    if fn is None or inspect.iscoroutinefunction(fn):
        return 0
    if processes == "auto":
        by_name = spec is not None and not spec.startswith(PYTHON_ONLY)
        # under torchrun each rank on this machine starts its own: its share of the CPUs
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        cpus = max(1, (os.cpu_count() or 1) // ranks_here)
        return min(AUTO_PROCESSES, cpus) if by_name else 0
    return int(processes)


def describe(run) -> str:
    """The start-up line: where the harness runs, how many episodes at once, their limit."""
    import inspect

    h = run.cfg.harness
    pool = getattr(run, "harness_pool", None)
    name = h.fn[len(PYTHON_ONLY) :] if h.fn and h.fn.startswith(PYTHON_ONLY) else h.fn
    if pool is not None:
        where = f"in {pool.processes} worker process{'es' if pool.processes > 1 else ''}"
    elif inspect.iscoroutinefunction(run.harness):
        where = "on the trainer's event loop (async def)"
    else:
        where = "on threads of the trainer's process"
    at_once = f"{h.concurrency} episodes" if h.concurrency else "all of a step's episodes"
    limit = f"{h.timeout_s:g} s" if h.timeout_s else "no time limit"
    return (
        f"harness: {name} runs {where} (harness.processes: {h.processes}; 0 = threads), "
        f"{at_once} at once (harness.concurrency), each within {limit} (harness.timeout_s)"
    )


def pool_of(spec: str | None, processes: int | str, fn: Callable | None) -> HarnessPool | None:
    """The worker pool for ``harness.processes`` (None: threads of this process, also for an
    ``async def`` harness); an InputError for a harness the workers cannot load by name."""
    processes = processes_of(spec, processes, fn)
    if processes < 1:
        return None
    if spec is None or spec.startswith(PYTHON_ONLY):
        from peergrade.errors import InputError

        name = (spec or "")[len(PYTHON_ONLY) :] or repr(fn)
        raise InputError(
            f"harness.processes: {processes} runs the harness in worker processes, which load "
            f"it by name, but the harness {name} cannot be imported by name (defined in "
            "__main__, inside a function, or a lambda): define it at the top level of an "
            "importable module (or pass 'path/to/file.py:fn' as harness.fn), or set "
            "harness.processes: 0 to run it on threads of this process"
        )
    return HarnessPool(spec, processes)


def close(run) -> None:
    """Stop the harness's worker processes and the endpoint's sampling (the end of a run,
    Ctrl-C or an error): no agent outlives the run, and no thread is inside the model when
    the process exits. The endpoint itself stays up for the next ``train`` call (Python)."""
    pool = getattr(run, "harness_pool", None)
    if pool is not None:
        pool.close()
    runner = getattr(run, "harness_runner", None)
    if runner is not None:
        runner.stop_sampling()


def _run(run, rows, settings, *, seed, row_keys) -> list[HarnessResult]:
    cfg = run.cfg
    h, n = cfg.harness, settings.n
    results = run.harness_runner.run(
        run.harness,
        rows,
        settings,
        seed=seed,
        row_keys=row_keys,
        concurrency=h.concurrency,
        timeout_s=h.timeout_s,
        pool=run.harness_pool,
    )
    failed = [(i, res) for i, res in enumerate(results) if res.error]
    if failed and cfg.train.on_reward_error == "fail":
        i, res = failed[0]
        raise RewardError(
            f"harness {cfg.harness.fn or 'harness'} failed on episode {i} (rows[{i // n}], sample "
            f"{i % n}): {res.error}; {len(failed)} of {len(results)} episodes failed. Set "
            "train.on_reward_error: zero to score a failed harness 0 and go on"
        )
    return results


def sample(run, rows: list[dict], step: int, row_keys: Sequence[int]):
    """(episodes, results) of G harness runs per row with the run's sampling settings
    (``Config.sampler_settings``) and the step's seed."""
    settings = run.cfg.sampler_settings()
    seed = step_seed(run.cfg.train.seed, step)
    results = _run(run, rows, settings, seed=seed, row_keys=row_keys)
    return [res.episode for res in results], results


def episode_fn(run) -> Callable:
    """The harness as ``generation.sample``'s ``episodes_from`` (called as ``run_episodes``
    is): the held-out evaluation's episodes, with the evaluation's settings."""

    def episodes(model, tokenizer, rows, make_env, settings, *, seed, row_keys, eos_token_ids):
        return [res.episode for res in _run(run, rows, settings, seed=seed, row_keys=None)]

    return episodes
