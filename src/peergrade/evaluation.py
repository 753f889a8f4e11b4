"""Held-out evaluation: greedy pass@1, sampled pass@1 and pass@k.

Correctness is the task's *accuracy reward* (its first default reward, e.g. ``arithmetic``
for the arithmetic task) scoring 1.0. ``pass@k`` uses the unbiased estimator of Chen et al.
(2021), ``1 - C(n - c, k) / C(n, k)`` for n samples with c correct (here n == k).

The pass@k curve (``EvalOptions(curve=True)``, ``peergrade eval --curve``): from the same k
samples per problem, ``pass@j`` for every j = 1..k, each averaged over problems. It costs no
extra generation; ``pass@1`` equals ``pass@1_sampled`` and ``pass@k`` is the usual key. The
gap between pass@k and pass@1 is the headroom GRPO can turn into pass@1 (docs/recipes.md).

``peergrade eval --few-shot N`` puts N solved example turns before every held-out prompt (the
training curriculum's examples, ``peergrade.tasks.curriculum.FewShot``, drawn from training
problems only), to measure how a model does when shown the format; it is reported as
``few_shot`` and is never the default: held-out accuracy is zero-shot.

``format_rate`` (``peergrade eval``, when the prompts ask for ``<answer>`` tags): the share of
greedy answers that the ``format`` reward in mode ``answer_only`` accepts (one final non-empty
``<answer>...</answer>`` block).

This module sits below ``training/``: the held-out machinery the trainer runs (``HeldOut``,
``results_table``, the scorer ``held_out_scorer``, ``evaluate_config`` with a run's settings and
seed) is ``peergrade.training.held_out``, and the ``peergrade eval`` command's work
(``run_eval_command``) is ``peergrade.cli.evaluate``; both call ``evaluate`` here.

Episodes (``env:`` set: tools or an environment, docs/environments.md): each held-out answer
is a whole episode (``generation.sample`` with the run's ``env:`` limits), greedy and
sampled as above, scored on its messages as training scores them (``envs.reward_inputs``: the
accuracy reward reads the last message). Two more rates are reported, for the greedy episodes
and (``_sampled``) the k samples: ``tool_call_rate``, the share of episodes that called a tool at
least once, and ``tool_failure_rate``, the share of tool calls that failed (malformed, unknown
tool, bad arguments, raised, timed out; 0 without calls). The rows are then the episode rows
(``components.episode_rows``: the prompt as messages, system prompt first).

Prompts are encoded by ``tasks.prompts.encode_prompts`` and reward columns built by
``rewards.columns_for``, as in training; this module does not train.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peergrade import generation
from peergrade.generation import SamplerSettings
from peergrade.rewards import (
    RewardSpec,
    TrainerState,
    resolve_reward,
    score_rewards,
)


def accuracy_spec(task, reward: str | None = None, options: dict | None = None) -> RewardSpec:
    """Correctness: ``reward`` if given, else the task's first default reward, called with
    ``options`` as keyword arguments (e.g. ``extract="last_number"``); 1.0 = correct."""
    name = reward or task.default_rewards[0][0]
    return RewardSpec(name=name, fn=resolve_reward(name), weight=1.0, kwargs=dict(options or {}))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if not 0 <= c <= n or k > n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_curve(counts: list[int], n: int) -> dict[str, float]:
    """``{"pass@1": ..., ..., "pass@n": ...}``: the unbiased pass@j for j = 1..n, averaged over
    problems, from each problem's count of correct samples among its ``n``."""
    if not counts:
        raise ValueError("pass_at_k_curve needs at least one problem")
    return {
        f"pass@{j}": sum(pass_at_k(n, c, j) for c in counts) / len(counts) for j in range(1, n + 1)
    }


@dataclass(frozen=True)
class EvalOptions:
    """How ``evaluate`` samples and what it reports.

    k: samples per problem (>= 1) for sampled pass@1 and pass@k; settings: the sampler's
    settings (greedy pass: ``settings.greedy()``; sampled: ``settings`` with ``n = k``); seed:
    the greedy pass's seed (the sampled pass uses ``seed + 1``); curve: also pass@j for every
    j = 1..k (keys ``pass@1`` .. ``pass@{k}``); keep_completions: add the key ``completions``,
    one dict per problem with its greedy and sampled answers and whether each is correct;
    extra: more reward specs whose rates are reported (``{name}_rate`` and
    ``{name}_rate_sampled``, e.g. the format reward); train_rewards: a training reward mix
    whose weighted total is averaged over the scored answers (``train_reward`` greedy,
    ``train_reward_sampled``): a run whose held-out scorer is not its training reward
    (``train.eval_reward``) reports what the training reward, e.g. a judge, says of the same
    held-out answers (``monitoring.detectors``' ``reward_vs_eval`` compares the two);
    trainer_state: what the reward functions read (None: outside training, step 0).
    """

    k: int
    settings: SamplerSettings
    seed: int
    curve: bool = False
    keep_completions: bool = False
    extra: tuple[RewardSpec, ...] = ()
    trainer_state: TrainerState | None = None
    train_rewards: tuple[RewardSpec, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"EvalOptions: k must be an int >= 1, got {self.k!r}")
        if not isinstance(self.settings, SamplerSettings):
            raise ValueError(
                f"EvalOptions: settings must be a SamplerSettings, got {type(self.settings).__name__}"
            )
        object.__setattr__(self, "extra", tuple(self.extra or ()))
        object.__setattr__(self, "train_rewards", tuple(self.train_rewards or ()))


@dataclass(frozen=True)
class AnswerSource:
    """Where ``evaluate``'s answers come from (default: single replies from the own kernel).

    make_env: a row -> environment factory (the run's ``env:``): each answer is an episode
    over the episode rows; episodes_from: an external agent's episode function
    (``training.harness.episode_fn``), whose episodes are the answers instead of the engine's;
    engine: another rollout engine (``rollout.engine: vllm``) for single replies and the
    model turns of ``make_env``'s episodes, as the run's training answers were sampled
    (unused with ``episodes_from``).
    """

    make_env: Callable | None = None
    episodes_from: Callable | None = None
    engine: Any = None

    @property
    def episodes(self) -> bool:
        """Whether the answers are episodes (not single replies)."""
        return self.make_env is not None or self.episodes_from is not None


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows,
    prompt_ids,
    acc: RewardSpec,
    options: EvalOptions,
    source: AnswerSource | None = None,
) -> dict[str, Any]:
    """Greedy pass@1, sampled pass@1 (mean over ``options.k`` samples per problem) and
    pass@k of ``model`` on ``rows``, correct where ``acc`` scores 1.0; with ``options.curve``
    the pass@j curve, with ``options.keep_completions`` the answers (``EvalOptions``).

    Every answer comes from ``generation.sample``, as training's do: with ``source.make_env``
    (or an external agent's ``source.episodes_from``) each is an episode over the (episode)
    ``rows`` (``prompt_ids`` unused; adds the tool rates, module doc), else a reply to
    ``prompt_ids`` (from ``source.engine`` when given). For example::

        evaluate(model, tok, rows, ids, accuracy_spec(task),
                 EvalOptions(k=8, settings=SamplerSettings(n=1, max_new_tokens=64), seed=0))
    """
    src = source if source is not None else AnswerSource()
    k, settings, seed = options.k, options.settings, options.seed
    trainer_state = options.trainer_state
    n_rows = len(rows)

    def answers(s: SamplerSettings, seed_: int):
        samples = generation.sample(
            model,
            tokenizer,
            rows,
            s,
            seed=seed_,
            prompt_ids=prompt_ids,
            make_env=src.make_env,
            episodes_from=src.episodes_from,
            engine=None if src.episodes_from else src.engine,
        )
        return samples, samples.reward_inputs(rows, env_reward=True)  # episodes' own rewards

    def correct(inputs, spec, repeat):
        s = score_rewards([spec], *inputs, on_error="zero", trainer_state=trainer_state)
        return (s.per_fn[spec.name].nan_to_num(0.0) >= 1.0 - 1e-6).view(n_rows, repeat)

    greedy, g_in = answers(settings.greedy(), seed)
    g_ok = correct(g_in, acc, 1)
    sampled, s_in = answers(settings.replace(n=k), seed + 1)
    s_ok = correct(s_in, acc, k)
    c = s_ok.sum(dim=1).tolist()
    out: dict[str, Any] = {
        "pass@1_greedy": g_ok.double().mean().item(),
        "pass@1_sampled": s_ok.double().mean().item(),
        f"pass@{k}": sum(pass_at_k(k, int(ci), k) for ci in c) / n_rows,
        "n": n_rows,
        "k": k,
    }
    if options.curve:
        out.update(pass_at_k_curve([int(ci) for ci in c], k))
    # e.g. the format reward's rate on the greedy and the sampled answers
    for spec in options.extra:
        out[f"{spec.name}_rate"] = correct(g_in, spec, 1).double().mean().item()
        out[f"{spec.name}_rate_sampled"] = correct(s_in, spec, k).double().mean().item()
    out |= train_reward_means(options.train_rewards, g_in, s_in, trainer_state)
    out |= tool_rates(greedy.episodes, "") | tool_rates(sampled.episodes, "_sampled")
    if options.keep_completions:
        out["completions"] = [
            {
                "prompt": rows[i]["prompt"],
                "columns": {
                    key: v for key, v in rows[i].items() if key not in ("prompt", "environments")
                },
                "greedy": greedy.completions[i],
                "greedy_correct": bool(g_ok[i, 0]),
                "sampled": sampled.completions[i * k : (i + 1) * k],
                "sampled_correct": [bool(x) for x in s_ok[i].tolist()],
            }
            for i in range(n_rows)
        ]
    return out


def train_reward_means(specs, greedy_inputs, sampled_inputs, trainer_state) -> dict[str, float]:
    """What the training reward mix ``specs`` (``EvalOptions.train_rewards``) says of the same
    held-out answers: its weighted total's mean over the greedy (``train_reward``) and the
    sampled (``train_reward_sampled``) answers it scored (an answer every reward abstained on
    is left out); empty without ``specs``."""
    out: dict[str, float] = {}
    if not specs:
        return out
    for key, inputs in (("train_reward", greedy_inputs), ("train_reward_sampled", sampled_inputs)):
        total = score_rewards(specs, *inputs, on_error="zero", trainer_state=trainer_state).total
        scored = total[~torch.isnan(total)]
        if scored.numel():
            out[key] = scored.double().mean().item()
    return out


def tool_rates(episodes: list, suffix: str) -> dict[str, float]:
    """``tool_call_rate`` (episodes with a tool call) and ``tool_failure_rate`` (failed calls
    per call, 0 without calls) of ``episodes``, keys ending in ``suffix``; none for replies."""
    if not episodes:
        return {}
    eps = episodes
    calls = sum(e.tool_calls for e in eps)
    return {
        f"tool_call_rate{suffix}": sum(e.tool_calls > 0 for e in eps) / max(1, len(eps)),
        f"tool_failure_rate{suffix}": sum(e.tool_failures for e in eps) / calls if calls else 0.0,
    }


TOOL_KEYS = (
    "tool_call_rate",
    "tool_call_rate_sampled",
    "tool_failure_rate",
    "tool_failure_rate_sampled",
)


def asks_for_answer_tags(rows: list[dict]) -> bool:
    """Whether any row's prompt (a string or a list of chat messages) mentions ``<answer>``."""
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            texts = [prompt]
        else:
            texts = [m.get("content", "") for m in prompt if isinstance(m, dict)]
        if any(isinstance(t, str) and "<answer>" in t for t in texts):
            return True
    return False


FORMAT_KEYS = ("format_rate", "format_rate_sampled")  # answer_format_spec's rates in evaluate


def answer_format_spec() -> RewardSpec:
    """The ``format`` reward in mode ``answer_only``, reported as ``format_rate``."""
    return RewardSpec(
        name="format", fn=resolve_reward("format"), weight=1.0, kwargs={"mode": "answer_only"}
    )
