"""Generation: everything that samples from the policy, behind one function.

``sample(model, tokenizer, rows, settings, ...) -> Samples`` answers each row ``settings.n``
times: single replies through the batched KV-cache kernel (``kernel.generate``), or, with
``make_env``, multi-turn episodes through the episode engine (``episodes.run_episodes``). Both
come back as one record (``record.Samples``) with the same fields, so training, held-out
evaluation, ``peergrade eval``, ``peergrade memory`` and the audit read one thing.
``SamplerSettings`` (``record``) says how to sample, built once per purpose.

Modules: ``kernel`` (keyed draws, the slab KV cache, EOS/stop, checks), ``vllm_engine``
(vLLM in this process, another engine for replies and episodes' turns: ``sample(..., engine=)``),
``episodes`` (the episode engine), ``record`` (``Samples``, ``SamplerSettings``), ``sessions``
(external agents' episodes, batched: the engine behind the endpoint, which is
``peergrade.serving`` and samples through this package).

It does not score (``rewards``), build the update's batch beyond the teacher-forcing tensors,
or know the config: the trainer builds the settings (``training.sampling.settings_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from peergrade.generation.episodes import run_episodes
from peergrade.generation.kernel import generate
from peergrade.generation.record import CUT_SHORT, SamplerSettings, Samples

__all__ = ["CUT_SHORT", "SamplerSettings", "Samples", "sample"]


def sample(
    model,
    tokenizer,
    rows: Sequence[Any],
    settings: SamplerSettings,
    *,
    seed: int | None,
    row_keys: Sequence[int] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    make_env: Callable[[Any], Any] | None = None,
    episodes_from: Callable[..., list] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    engine: Any = None,
) -> Samples:
    """``settings.n`` answers to each of ``rows`` (groups adjacent), keyed by (``seed``, the
    row's key in ``row_keys`` (default its index), sample index, token index).

    Replies: ``prompt_ids`` are the rows' encoded prompts (chat template applied) and each
    row's ``prompt`` is what the reward functions see. Episodes (``make_env``: ``row ->
    environment``): the environment's ``reset`` opens each episode, ``prompt_ids`` are unused
    and ``settings.max_new_tokens`` is the budget of a whole episode. ``episodes_from`` is
    another episode source called as ``run_episodes`` is, ``(model, tokenizer, rows, make_env,
    settings, seed=, row_keys=, eos_token_ids=)`` (an external agent through the endpoint:
    ``training.harness.episode_fn``): its episodes come back as the same record.

    ``engine``: another rollout engine (``vllm_engine.VllmEngine``) for single replies and the
    model turns of ``make_env``'s episodes (same record, its own sampled log-probs as the
    behaviour log-probs); None = the own kernel. Not with ``episodes_from`` (the external
    agent's turns are the endpoint's)."""
    keys = dict(seed=seed, row_keys=row_keys, eos_token_ids=eos_token_ids)
    if engine is not None and episodes_from is not None:
        raise ValueError(
            "sample(): an external agent's episodes (episodes_from) sample through the "
            "endpoint's own kernel (engine=None)"
        )
    if make_env is not None or episodes_from is not None:
        if episodes_from is not None:
            episodes = episodes_from(model, tokenizer, rows, make_env, settings, **keys)
        else:
            episodes = run_episodes(
                model, tokenizer, rows, make_env, settings, **keys, engine=engine
            )
        return Samples.of_episodes(episodes, tokenizer.pad_token_id, settings.n)
    if prompt_ids is None:
        raise ValueError("sample(): single replies need prompt_ids (the rows' encoded prompts)")
    if engine is not None:
        out = engine.sample(model, tokenizer, prompt_ids, settings, **keys)
    else:
        out = generate(model, tokenizer, prompt_ids, settings, **keys)
    out.prompts = [row["prompt"] for row in rows for _ in range(settings.n)]
    return out
