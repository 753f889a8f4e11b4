"""Run multi-turn episodes: the model samples a turn, the environment answers, repeat.

``run_episodes(model, tokenizer, rows, make_env, n=G, max_completion_length=T, ...)`` runs ``n``
episodes per row (episode ``i`` answers row ``i // n``) and returns one ``Episode`` each: the token
ids (prompt + every turn), a loss mask that is 1 only on tokens the model sampled, the sampler's
log-probs of those tokens, the message list, and why and after how many turns it ended.

How (token in, token out):

- The prompt is the environment's opening messages rendered by the chat template with the
  generation prompt. A model turn is sampled token by token and ends at an eos token, or at a
  stop string (``stop``) as a single reply does in ``rollout.generate``: in the decoded text of
  the turn's last few tokens, special tokens skipped; the token in which it completes is kept,
  and the assistant message's text is cut right after the stop string. Such a turn has no
  end-of-turn token of its own, so the environment's answer is appended after the template's
  end-of-turn token (``template.turn_delta(close_turn=True)``), masked out like the answer.
- The assistant message given to the environment is the turn's text, but the episode's tokens
  are the sampled ids themselves: nothing sampled is ever decoded and re-encoded. What the
  environment answers is appended as a chat-template token delta (``template.turn_delta``).
- All episodes of a micro-batch share one batched KV cache that lives across turns, so a turn
  costs only its new tokens. Rows advance in lock-step; a row whose turn ended early, and the
  left padding of deltas of different lengths, leave masked-out "holes" in its cache row (its
  keys are hidden from every later query, its positions skip them), so each episode sees exactly
  its own token sequence at positions 0, 1, 2, ...
- Sampling and its log-probs are the kernel's (``draw_tokens``: temperature, top-k, top-p;
  float32 log-probs of the full tempered distribution and, as ``sampler_logprobs``, of the
  truncated one drawn from). Uniform draws are the kernel's keyed ones: a
  function of (seed, the row's key, the episode's sample index, the sampled token's index), so
  results do not depend on the micro-batch size, the rows' order or the rank.

Budgets: ``max_completion_length`` counts every token after the prompt (sampled and appended). A
model turn stops at the budget (``"length"``) or at ``max_tokens_per_turn`` (``"turn_length"``);
either ends the episode, since its turn has no end-of-turn token to continue from (the cut turn
is in the message list and counts in ``num_turns``; the environment is not asked about it). An answer
that does not fit the remaining budget is dropped and ends the episode (``"env_over_budget"``;
TRL's rule); an answer that fits exactly is kept (then ``"length"``). ``max_turns`` caps the
model turns (``"max_turns"``); an environment that says done ends it with its own reason
(default ``"done"``).

Episodes of a micro-batch whose prompts are the same token ids (the ``n`` episodes of a row,
unless ``reset`` differs per episode) share one prefill, copied in the cache as ``rollout``
does for a group.

Another engine (``run_episodes(engine=)``: vLLM) may sample the model turns instead: each turn
is one request per episode on its token ids so far, which that engine's prefix cache serves;
everything else (the environments, the template deltas, budgets, stop rules, masks) stays here.

Not done here: models whose layers are not all full attention (sliding windows) or whose attention is not sdpa/eager, and any
training (``generation.Samples.of_episodes`` gives the update's tensors).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from peergrade.envs.episode import Episode
from peergrade.envs.protocol import Step, check_environment, maybe_await, run_sync
from peergrade.envs.template import check_template, render, turn_delta
from peergrade.errors import (
    PeergradeError,
    UserCodeError,
    describe_exit,
    users_own_stop,
    where_raised,
)
from peergrade.generation.kernel import (
    check_int,
    check_row_keys,
    check_sampling,
    cut_after_stop,
    draw_tokens,
    eos_ids,
    eval_mode,
    forward_signature,
    model_config,
    row_states,
    seed_of,
    slab_cache,
    slab_cache_ok,
    uniforms,
)
from peergrade.generation.record import SamplerSettings
from peergrade.limits import TimeLimitExceeded, in_thread, steps_within


def _as_step(value: Any, where: str) -> Step:
    if isinstance(value, Step):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3):  # (messages, done[, reward])
        return Step(list(value[0] or []), bool(value[1]), value[2] if len(value) == 3 else None)
    raise TypeError(
        f"{where}: step() must return a Step or (messages, done[, reward]), got {value!r}"
    )


def _as_messages(value: Any, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m for m in value)
    ):
        return [dict(m) for m in value]
    raise TypeError(
        f"{where}: reset() must return a non-empty list of chat messages or a string, got {value!r}"
    )


#: the roles of environment messages the template must render token-exactly
CHECKED_ROLES = ("tool", "user")


def run_episodes(
    model,
    tokenizer,
    rows: Sequence[Any],
    make_env: Callable[[Any], Any],
    settings: SamplerSettings | None = None,
    *,
    seed: int | None = None,
    row_keys: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    engine: Any = None,
    **fields,
) -> list[Episode]:
    """Run ``settings.n`` episodes per row; see the module docstring for the rules.

    Args:
        model, tokenizer: a Hugging Face causal LM (full attention, sdpa or eager) and its
            tokenizer with a chat template (checked first with ``template.check_template``).
        rows: dataset rows, each handed to ``make_env(row)`` and then to the environment's ``reset``.
        make_env: ``row -> environment`` (native protocol, ``protocol.Environment``); called once
            per episode.
        settings: how to sample (``SamplerSettings``), or its fields as keywords (``fields``,
            ``max_completion_length`` for ``max_new_tokens``; ``n`` defaults to 1):
            ``n`` episodes per row (the GRPO group size); ``max_new_tokens``: token budget of a
            whole episode after the prompt; ``max_turns``: most model turns per episode (None:
            no limit); ``max_tokens_per_turn``: most tokens per model turn (None: the
            remaining budget); ``temperature``, ``top_p``, ``top_k`` as in
            ``kernel.generate``; ``stop`` strings (a single string is one): a model turn ends
            at the first one, as a single reply does in ``kernel.generate`` (see the module
            docstring); ``batch_size``: episodes run at once (bounds memory; None: all);
            ``env_timeout_s``: seconds one environment's ``reset`` or ``step`` may take (None:
            no limit); past it the episode engine raises ``UserCodeError`` naming the class,
            the method, the row and the limit. The environments' calls of a turn run at once
            (sync ones on threads of their own), so a hanging one ends the turn after about
            this limit (``_call_all``).
        seed, row_keys: the draws' keys, as in ``kernel.generate`` (``row_keys``: one distinct
            key per row, default its index).
        eos_token_ids: tokens that end a turn; default the tokenizer's and the model's eos.
        chat_template, template_kwargs: an override template and extra template variables.
        engine: another rollout engine whose ``turn_sampler(model, tokenizer, settings, eos)``
            samples the model turns (``vllm_engine.VllmEngine``: each turn one request on the
            episode's token ids so far); None = the own kernel. The episode loop, the
            environments, the template deltas, the budgets and the masks are this module's
            either way (``TurnEngine``).
    """
    aliases = {"max_completion_length": "max_new_tokens"}
    settings = SamplerSettings.given(
        settings, fields, "run_episodes", aliases=aliases, defaults={"n": 1}
    )
    cfg = model_config(model)
    settings = _check_arguments(cfg, tokenizer, settings)
    eos = eos_ids(model, tokenizer, eos_token_ids or None)
    tkw = dict(chat_template=chat_template, template_kwargs=template_kwargs)
    check_template(tokenizer, eos_ids=eos, roles=CHECKED_ROLES, **tkw)
    max_pos = getattr(cfg, "max_position_embeddings", None) or 10**12
    n = settings.n
    episodes = _open(rows, n, make_env, tokenizer, tkw, max_pos, settings.env_timeout_s)

    device = next(model.parameters()).device
    keys = check_row_keys(row_keys, len(rows)).to(device)
    states = row_states(seed_of(seed), keys, n)  # [E]
    turns = None if engine is None else engine.turn_sampler(model, tokenizer, settings, eos)
    # the own kernel's uniforms [E, budget]; another engine seeds its requests from the states
    draws = states if turns is not None else uniforms(states, settings.max_new_tokens)

    runner = TurnEngine(
        model=model,
        tokenizer=tokenizer,
        eos_ids=eos,
        settings=settings,
        max_pos=max_pos,
        template_kw=tkw,
        device=device,
        turns=turns,
    )
    step = settings.batch_size or len(episodes)
    try:
        with eval_mode(model):
            for start in range(0, len(episodes), step):
                idx = list(range(start, min(start + step, len(episodes))))
                runner.run([episodes[i] for i in idx], draws[idx])
    finally:  # the batch's timed-out tool calls: one warning line per tool (envs.tools)
        report = getattr(make_env, "end_batch", None)
        if callable(report):
            report()
    return episodes


def _check_arguments(cfg, tokenizer, settings: SamplerSettings) -> SamplerSettings:
    """``run_episodes``' settings checked, with ``top_k`` an int and ``temperature`` /
    ``top_p`` floats."""
    n = check_int("n", settings.n, 1, "run_episodes")
    budget = check_int("max_completion_length", settings.max_new_tokens, 1, "run_episodes")
    for name in ("max_turns", "max_tokens_per_turn", "batch_size"):
        value = getattr(settings, name)
        if value is not None:
            check_int(name, value, 1, "run_episodes")
    top_k = check_sampling("run_episodes", settings.temperature, settings.top_p, settings.top_k)
    stop = settings.stop
    if any(not isinstance(x, str) or x == "" for x in stop):
        raise ValueError(f"run_episodes(): stop must be non-empty strings, got {stop!r}")
    if not slab_cache_ok(cfg):
        raise NotImplementedError(
            "run_episodes(): only models whose layers are all full attention with the sdpa or eager "
            f"attention implementation are supported (got {getattr(cfg, '_attn_implementation', None)!r}, "
            f"layer types {sorted(set(getattr(cfg, 'layer_types', None) or ['full_attention']))})"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "run_episodes(): tokenizer has no pad token; set tokenizer.pad_token first"
        )
    return settings.replace(
        n=n,
        max_new_tokens=budget,
        top_k=top_k,
        temperature=float(settings.temperature),
        top_p=float(settings.top_p),
    )


def _open(rows, n, make_env, tokenizer, tkw: dict, max_pos: int, limit_s) -> list[Episode]:
    """Every episode started: one environment each, reset concurrently (resets may be async),
    its opening messages rendered with the generation prompt."""
    envs = []
    for i in range(len(rows) * n):
        env = make_env(rows[i // n])
        check_environment(env, f"make_env(rows[{i // n}])")
        envs.append(env)
    opened = _call_all([(e, "reset", rows[i // n], i // n) for i, e in enumerate(envs)], limit_s)
    episodes = []
    for i, (env, msgs) in enumerate(zip(envs, opened)):
        msgs = _as_messages(msgs, f"{type(env).__name__} (rows[{i // n}])")
        ids = render(
            tokenizer, msgs, add_generation_prompt=True, tools=getattr(env, "tools", None), **tkw
        )
        if len(ids) >= max_pos:
            raise ValueError(
                f"run_episodes(): the prompt of rows[{i // n}] has {len(ids)} tokens, "
                f"the model's context is {max_pos}"
            )
        episodes.append(Episode(i // n, ids, msgs, len(msgs), env))
    return episodes


class TurnEngine:
    """Runs one micro-batch of episodes to the end with one batched KV cache (see module doc).

    ``turns``: another engine's turn sampler (``run_episodes(engine=)``), called once per turn
    as ``turns(episodes, limits, states, offsets) -> (turns, ended)``: per live episode its
    token limit for the turn, its stream state and the tokens it has sampled so far (the turn's
    key), and back, as ``_sample_turn`` gives them, each turn's ``(tokens, log-probs, sampler
    log-probs)`` and how it ended (``"eos"``, ``"stop"``, None: a length limit). The sampler
    reads each episode's ``prompt_ids + completion_ids`` (every appended answer included), so
    no KV cache is kept here then."""

    def __init__(
        self,
        *,
        model,
        tokenizer,
        eos_ids,
        settings: SamplerSettings,
        max_pos,
        template_kw,
        device,
        turns: Callable | None = None,
    ):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.turns = turns
        self.eos = set(eos_ids)
        self.max_pos = max_pos
        self.template_kw = template_kw
        self.use(settings)
        sig = forward_signature(model)
        self.cache_kw = "cache" if "cache" in sig else "past_key_values"
        self.logits_to_keep = "logits_to_keep" in sig
        cfg = model_config(model)
        self.bool_mask = (getattr(cfg, "_attn_implementation", None) or "eager") == "sdpa"
        self.num_layers = cfg.num_hidden_layers
        float_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        self.dtype = next(
            (p.dtype for p in model.parameters() if p.dtype in float_dtypes), torch.float32
        )

    def use(self, settings: SamplerSettings) -> None:
        """Sample with ``settings`` (checked) from now on: its budgets (``max_new_tokens`` for
        a whole episode, ``max_turns``, ``max_tokens_per_turn``), draws and stop strings."""
        self.settings = settings
        self.budget, self.max_turns = settings.max_new_tokens, settings.max_turns
        self.turn_cap = settings.max_tokens_per_turn or self.budget
        self.temperature, self.top_p, self.top_k = (
            settings.temperature,
            settings.top_p,
            settings.top_k,
        )
        self.stop = settings.stop
        self.env_timeout_s = settings.env_timeout_s
        # decoded tail searched for a stop string: as rollout.generate's window
        self.stop_window = max(len(x) for x in self.stop) + 8 if self.stop else 0

    # ---- the batched cache with holes ----

    def _feed(self, pending: list[list[int]]) -> torch.Tensor:
        """Append each row's pending tokens (left-padded to a common width; the pads become
        hidden holes) to the cache; returns the logits after each row's last token [B, V]."""
        dev = self.device
        b, d = len(pending), max(len(p) for p in pending)
        ids = torch.full((b, d), self.tokenizer.pad_token_id, dtype=torch.long)
        real = torch.zeros((b, d), dtype=torch.bool)
        for r, p in enumerate(pending):
            if p:
                ids[r, d - len(p) :] = torch.tensor(p, dtype=torch.long)
                real[r, d - len(p) :] = True
        ids, real = ids.to(dev), real.to(dev)
        # A real token's position is the number of real tokens before it in its episode.
        pos = (self.n_real[:, None] + real.long().cumsum(1) - 1).clamp_(min=0)  # [B, D]
        self.key_ok = torch.cat([self.key_ok, real], 1)  # [B, K]
        k = self.cur + d
        q_at = torch.arange(self.cur, k, device=dev)  # [D] cache index of each query
        k_at = torch.arange(k, device=dev)  # [K]
        causal = k_at[None, :] <= q_at[:, None]  # [D, K]
        # A pad query sees itself only, so no attention row is empty (its output is never used).
        allowed = (self.key_ok[:, None, :] & causal[None]) | (k_at[None, :] == q_at[:, None])[None]
        if self.bool_mask:
            mask = allowed[:, None]  # [B, 1, D, K]
        else:
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            mask = mask[:, None]
        kwargs = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            self.cache_kw: self.cache,
            "use_cache": True,
        }
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(**kwargs).logits[:, -1, :].float()  # [B, V]
        self.n_real = self.n_real + real.sum(1)
        self.cur = k
        return logits

    def _keep(self, keep: list[int]) -> None:
        """Keep these cache rows, in this order (an index may repeat: a shared prefill)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.key_ok = self.key_ok.index_select(0, index)
        self.n_real = self.n_real.index_select(0, index)

    # ---- one micro-batch ----

    def run(self, episodes: list[Episode], uniforms: torch.Tensor) -> None:
        """``uniforms``: the own kernel's draws [B, budget]; with ``turns``, the episodes'
        stream states [B]."""
        own = self.turns is None
        logits = self._start(episodes) if own else None
        rows = list(range(len(episodes)))  # episode index of each cache row
        pending: list[list[int]] = [[] for _ in episodes]
        sampled = [0] * len(episodes)  # tokens sampled so far: the index into the uniforms
        while rows:
            eps = [episodes[r] for r in rows]
            if not own:
                turns, ended, pending = self._engine_turn(rows, eps, uniforms, sampled)
            else:
                if any(pending):  # every turn but the first: the last tokens and the deltas
                    logits = self._feed(pending)
                turns, ended, pending = self._sample_turn(rows, eps, logits, uniforms, sampled)
            asks = self._record(eps, turns, ended)
            steps = self._step_all([(eps[j], m) for j, m in asks])
            self._answer(eps, asks, steps, ended, pending)
            keep = [j for j, e in enumerate(eps) if not e.finish_reason]
            if len(keep) < len(rows):
                if keep and own:
                    self._keep(keep)
                rows = [rows[j] for j in keep]
                pending = [pending[j] for j in keep]

    def _start(self, episodes: list[Episode]) -> torch.Tensor:
        """A fresh cache with each distinct prompt prefilled once (the episodes of a row usually
        share it), its row copied to every episode that starts with it; the last logits [E, V]."""
        longest = max(len(e.prompt_ids) for e in episodes)
        self.cache = slab_cache(self.num_layers, longest + min(self.budget, 256), grow=True)
        first: dict[tuple[int, ...], int] = {}
        for e in episodes:
            first.setdefault(tuple(e.prompt_ids), len(first))
        self.key_ok = torch.zeros((len(first), 0), dtype=torch.bool, device=self.device)
        self.n_real = torch.zeros(len(first), dtype=torch.long, device=self.device)
        self.cur = 0
        logits = self._feed([list(p) for p in first])
        expand = [first[tuple(e.prompt_ids)] for e in episodes]
        self._keep(expand)
        return logits.index_select(0, torch.tensor(expand, device=self.device))

    def _sample_turn(self, rows, eps, logits, uniforms, sampled):
        """One model turn for every row, in lock-step (rows done early feed holes). Returns
        ``(turns, ended, pending)``: per row the ``(tokens, log-probs, sampler log-probs)`` of
        its turn, how it ended (``"eos"``, ``"stop"`` or None: a length limit), and the tokens
        sampled at the last step, not in the cache yet (they lead the next feed)."""
        limits = self._limits(eps)
        turns = [([], [], []) for _ in rows]
        live = [True] * len(rows)
        ended: list[str | None] = [None] * len(rows)
        while True:
            u = uniforms[rows, [sampled[r] for r in rows]]  # [B]
            tok, logp, slp = draw_tokens(logits, u, self.temperature, self.top_p, self.top_k)
            nxt: list[list[int]] = []
            for j, (r, t, lp, sp) in enumerate(
                zip(rows, tok.tolist(), logp.tolist(), slp.tolist())
            ):
                if not live[j]:
                    nxt.append([])
                    continue
                for part, value in zip(turns[j], (t, lp, sp)):
                    part.append(value)
                sampled[r] += 1
                if t in self.eos:
                    live[j], ended[j] = False, "eos"
                elif self.stop and self._stopped(turns[j][0]):
                    live[j], ended[j] = False, "stop"
                elif len(turns[j][0]) >= limits[j]:
                    live[j] = False
                nxt.append([t])
            if not any(live):
                return turns, ended, nxt
            logits = self._feed(nxt)

    def _limits(self, eps) -> list[int]:
        """The most tokens each episode's next turn may sample (turn cap, budget, context)."""
        return [
            min(
                self.turn_cap,
                self.budget - len(e.completion_ids),
                self.max_pos - len(e.prompt_ids) - len(e.completion_ids),
            )
            for e in eps
        ]

    def _engine_turn(self, rows, eps, states, sampled):
        """One model turn for every row from the other engine (``turns``), as ``_sample_turn``
        returns it; nothing is pending (the engine reads each episode's ids whole)."""
        turns, ended = self.turns(
            eps, self._limits(eps), [int(states[r]) for r in rows], [sampled[r] for r in rows]
        )
        for r, (tokens, _, _) in zip(rows, turns):
            sampled[r] += len(tokens)
        return turns, ended, [[] for _ in rows]

    def _record(self, eps, turns, ended) -> list[tuple[int, dict]]:
        """The turns appended to their episodes; returns ``(row, assistant message)`` of those to
        ask the environment about (ended by eos or a stop string). A turn cut by a length limit
        is part of the conversation the reward judges, and ends its episode unasked."""
        asks = []
        for j, e in enumerate(eps):
            tokens, logps, slps = turns[j]
            e.completion_ids += tokens
            e.loss_mask += [1] * len(tokens)
            e.logprobs += logps
            e.sampler_logprobs += slps
            e.num_turns += 1
            if ended[j] is None:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                e.messages.append({"role": "assistant", "content": text})
                tight = self.budget - len(e.completion_ids) <= 0 or (
                    self.max_pos - len(e.prompt_ids) - len(e.completion_ids) <= 0
                )
                e.finish_reason = "length" if tight else "turn_length"
                continue
            if ended[j] == "stop":
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                text = cut_after_stop(text, self.stop)
            else:
                text = self.tokenizer.decode(tokens[:-1], skip_special_tokens=True)
            asks.append((j, {"role": "assistant", "content": text}))
        return asks

    def _answer(self, eps, asks, steps, ended, pending) -> None:
        """The environments' answers: an episode ends (done, ``max_turns``, an answer over the
        budget) or its answer is appended as template tokens (loss mask 0) to ``pending``."""
        for (j, msg), st in zip(asks, steps):
            e = eps[j]
            e.messages.append(msg)
            e.tool_calls += st.tool_calls
            e.tool_failures += st.tool_failures
            e.tool_truncated += st.tool_truncated
            if st.reward is not None:
                e.reward = (e.reward or 0.0) + float(st.reward)
            e.turn_rewards.append(None if st.reward is None else float(st.reward))
            e.turn_states.append(st.state)  # per-turn credit: Episode.turn_observations
            if st.done:
                e.messages += st.messages
                e.finish_reason = st.finish_reason or "done"
                continue
            if self.max_turns is not None and e.num_turns >= self.max_turns:
                e.finish_reason = "max_turns"
                continue
            delta = turn_delta(
                self.tokenizer,
                e.messages,
                st.messages,
                eos_ids=sorted(self.eos),
                tools=getattr(e.env, "tools", None),
                close_turn=ended[j] == "stop",
                **self.template_kw,
            )
            total = len(e.completion_ids) + len(delta)
            if total > self.budget or len(e.prompt_ids) + total > self.max_pos:
                e.finish_reason = "env_over_budget"
                continue
            e.messages += st.messages
            e.completion_ids += delta
            e.loss_mask += [0] * len(delta)
            e.logprobs += [0.0] * len(delta)
            e.sampler_logprobs += [0.0] * len(delta)
            pending[j] = pending[j] + delta
            if total == self.budget or len(e.prompt_ids) + total == self.max_pos:
                e.finish_reason = "length"  # the answer fits exactly; no room for a turn

    def _stopped(self, turn: list[int]) -> bool:
        """Whether the decoded tail of a turn holds a stop string (``rollout.generate``'s test)."""
        tail = self.tokenizer.decode(turn[-self.stop_window :], skip_special_tokens=True)
        return any(x in tail for x in self.stop)

    def _step_all(self, asks: list[tuple[Episode, dict]]) -> list[Step]:
        results = _call_all([(e.env, "step", m, e.row_index) for e, m in asks], self.env_timeout_s)
        return [
            _as_step(r, f"{type(e.env).__name__}.step (rows[{e.row_index}])")
            for (e, _), r in zip(asks, results)
        ]


def _call_all(calls: list[tuple[Any, str, Any, int]], limit_s: float | None = None) -> list[Any]:
    """``env.method(arg)`` for every (env, method, arg, row) at once, each within ``limit_s``
    seconds: a sync method on a thread of its own (``limits.in_thread``: started in row order,
    stopped past the limit), an async one on the event loop under ``asyncio.wait_for``, each of
    its steps under ``limits.call_within`` (``steps_within``: one that blocks the loop, never
    awaiting, is interrupted too). So a batch of calls takes about its slowest call, and one
    that hangs ends the batch after about ``limit_s``, not one limit per episode. An
    environment whose ``step`` bounds itself (``bounds_own_step``: the tool wrapper, whose
    every tool call has its own limit) is not limited again there. An exception or an overrun
    is re-raised naming the environment class, the method and the row (and how many others
    overran). Environments of a batch run at once: one that draws from a shared global random
    generator gets its draws in an order that may vary (seed an own ``random.Random`` per row)."""
    if not calls:
        return []

    async def one(env, method, arg):
        import asyncio

        limit = None if method == "step" and getattr(env, "bounds_own_step", False) else limit_s
        try:
            fn = getattr(env, method)
            if inspect.iscoroutinefunction(fn):
                value = fn(arg)
            else:
                value = await in_thread(lambda: fn(arg), limit, name=method)
            if not inspect.isawaitable(value) or limit is None or math.isinf(limit):
                return await maybe_await(value)
            try:
                return await asyncio.wait_for(steps_within(value, limit, name=method), limit)
            except asyncio.TimeoutError:
                raise TimeLimitExceeded(method, limit) from None
        except Exception as e:
            return e
        except BaseException as e:  # the user's sys.exit() / KeyboardInterrupt: its failure
            if users_own_stop(e):
                return _Exited(describe_exit(e) + where_raised(e))
            raise

    async def go():
        import asyncio

        return await asyncio.gather(*(one(e, m, a) for e, m, a, _ in calls), return_exceptions=True)

    results = run_sync(go())
    late = [r for r in results if isinstance(r, TimeLimitExceeded)]
    for (env, method, _, row), r in zip(calls, results):
        if isinstance(
            r, PeergradeError
        ):  # the user's input, already named (a row without a prompt)
            raise r
        if isinstance(r, BaseException):
            # one line naming the user's class (a TRL environment_factory class, not our
            # wrapper), the method, the row and what it raised, with its file and line
            cls = type(getattr(env, "instance", None) or env).__name__
            if isinstance(r, _Exited):
                what = str(r)
            elif isinstance(r, TimeLimitExceeded):
                what = f"did not return within {r.limit_s:g}s (env.timeout_s; null = no limit)"
                if len(late) > 1:
                    what += f"; {len(late) - 1} more of the batch's {len(calls)} calls too"
            else:
                what = f"raised {type(r).__name__}: {r}{where_raised(r)}"
            raise UserCodeError(f"environment {cls}.{method} (rows[{row}]) {what}") from r
    return results


class _Exited(Exception):
    """An environment method's ``sys.exit()`` / ``KeyboardInterrupt``, as a value."""
