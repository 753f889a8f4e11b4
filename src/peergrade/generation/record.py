"""The one record generation hands on (``Samples``) and the one description of how to sample
(``SamplerSettings``): single replies and multi-turn episodes alike.

``Samples`` holds N answers (groups adjacent: answer i answers prompt ``prompt_index[i]``) as
padded tensors plus what the reward functions and the logs read:

- ``completion_ids`` / ``completion_mask``: every token after the prompt (a reply's generated
  tokens; an episode's sampled turns *and* the environment's answers appended as tokens);
- ``loss_mask``: 1 only on tokens the model sampled (a separate tensor: an environment token is
  attended to and never trained on);
- ``logprobs``: each sampled token's log-prob under the full tempered distribution (what a
  teacher-forced pass at the same temperature recomputes); ``sampler_logprobs``: under the
  distribution actually drawn from (tempered, cut by top-k/top-p, renormalised; 0 when
  greedy): the behaviour policy of the off-policy corrections;
- ``prompts`` / ``completions``: TRL's form (strings for replies, message lists for episodes);
  ``episodes``: the ``envs.Episode`` records (turns, tool calls) when an environment ran;
  ``columns``: reward columns the source adds per answer (an external agent's own result).

It has the few operations the trainer needs: ``take`` (groups of one round), ``concat`` (rounds
joined), ``training_batch`` (teacher-forcing tensors), ``reward_inputs`` and ``portable`` (for a
pipe or another rank). It does not sample (``peergrade.generation.sample``) or score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peergrade.envs.episode import Episode
from peergrade.envs.scoring import environment_rewards, reward_inputs
from peergrade.rewards.registry import columns_for

__all__ = ["CUT_SHORT", "SamplerSettings", "Samples"]

#: finish reasons of an answer cut by a length limit (DAPO's overlong filtering masks them)
CUT_SHORT = ("length", "turn_length", "env_over_budget")


@dataclass(frozen=True)
class SamplerSettings:
    """How to sample, built once (for training, for held-out greedy and sampled passes) and
    handed whole to ``generation.sample``, so no path forwards a setting one by one.

    ``n`` answers per prompt; ``max_new_tokens`` the budget of a reply or of a whole episode
    (every token after the prompt); ``temperature`` (0 = greedy), ``top_p`` in (0, 1], ``top_k``
    (0 = off), ``stop`` strings; ``batch_size`` sequences at once (None: all); episodes only:
    ``max_turns`` and ``max_tokens_per_turn`` (None: no limit), ``env_timeout_s`` (seconds an
    environment's ``reset`` / ``step`` may take; None: no limit); ``ignore_eos`` (replies only):
    every reply runs to ``max_new_tokens``, the worst case ``peergrade memory`` measures."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    batch_size: int | None = None
    max_turns: int | None = None
    max_tokens_per_turn: int | None = None
    env_timeout_s: float | None = None
    ignore_eos: bool = False  # replies run to max_new_tokens (peergrade memory's worst case)

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)

    def greedy(self) -> SamplerSettings:
        """One greedy answer per prompt, every other setting kept (top-k/top-p do not change
        an argmax; stop strings and budgets still apply)."""
        return dataclasses.replace(self, n=1, temperature=0.0)

    def replace(self, **changes) -> SamplerSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def given(
        cls,
        settings: SamplerSettings | None,
        fields: dict,
        where: str,
        *,
        aliases: dict[str, str] | None = None,
        defaults: dict | None = None,
    ) -> SamplerSettings:
        """``settings``, or the record built from its fields passed as keywords (``fields``;
        a function's own name for a field in ``aliases``, its default in ``defaults``), so
        that ``generate``, ``run_episodes`` and the harness runner take the record or its
        fields and hold one record either way. A keyword that is no field is a TypeError
        naming it, as for any function."""
        if settings is not None:
            if fields:
                raise TypeError(
                    f"{where}(): pass a SamplerSettings or its fields as keywords, not both "
                    f"(got settings and {sorted(fields)})"
                )
            if not isinstance(settings, SamplerSettings):
                raise TypeError(f"{where}(): settings must be a SamplerSettings, got {settings!r}")
            return settings
        aliases = aliases or {}
        known = {f.name for f in dataclasses.fields(cls)} - set(aliases.values()) | set(aliases)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}")
        values = {**(defaults or {}), **{aliases.get(k, k): v for k, v in fields.items()}}
        missing = [
            next((a for a, f in aliases.items() if f == name), name)
            for name in ("n", "max_new_tokens")
            if name not in values
        ]
        if missing:
            raise TypeError(f"{where}() missing required keyword argument(s) {missing}")
        return cls(**values)


@dataclass
class Samples:
    """N answers (see the module docstring). Tensors are ``[N, C]`` (C = the longest
    completion), right-padded; ``prompt_ids`` are N unpadded lists.

    ``finish_reason``: a reply's ``"eos"`` | ``"stop"`` | ``"length"``; an episode's also
    ``"turn_length"``, ``"max_turns"``, ``"env_over_budget"``, ``"done"`` or the environment's
    own. ``completion_text``: a reply's decoded text (cut after its stop string), an episode's
    last assistant message."""

    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor  # [N, C] long
    completion_mask: torch.Tensor  # [N, C] float32: the token exists
    logprobs: torch.Tensor  # [N, C] float32: full tempered distribution
    finish_reason: list[str]
    completion_text: list[str]
    prompt_index: torch.Tensor  # [N] long
    sampler_logprobs: torch.Tensor | None = None  # [N, C] float32: the distribution drawn from
    loss_mask: torch.Tensor | None = None  # [N, C] float32: the model sampled it
    prompts: list | None = None  # N prompts in TRL's form (None: unknown, e.g. token ids given)
    completions: list | None = None  # N completions in TRL's form (default: completion_text)
    episodes: list[Episode] | None = None  # N episode records when an environment ran
    columns: dict[str, list] | None = None  # per-answer reward columns the source adds

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask.clone()
        if self.completions is None:
            self.completions = list(self.completion_text)

    # ------------------------------------------------------------------ what was sampled

    def completion_id_lists(self) -> list[list[int]]:
        """The tokens the model sampled, one list per answer (a reply's counted completion;
        an episode's model turns without the environment's answers)."""
        return [
            self.completion_ids[i][self.loss_mask[i] > 0].tolist()
            for i in range(len(self.prompt_ids))
        ]

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the model sampled (an episode's environment tokens are not generated)."""
        return int(self.loss_mask.sum().item())

    @property
    def sampled_lengths(self) -> torch.Tensor:
        """``[N]`` tokens each answer's model sampled."""
        return self.loss_mask.sum(dim=1).long()

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` every token after each prompt (an episode's environment tokens included)."""
        return self.completion_mask.sum(dim=1).long()

    @property
    def truncated(self) -> torch.Tensor:
        """``[N]`` bool: the answer was cut by a length limit (``CUT_SHORT``)."""
        return torch.tensor([f in CUT_SHORT for f in self.finish_reason], dtype=torch.bool)

    def reward_inputs(self, rows: Sequence[dict], *, env_reward: bool = False):
        """``(prompts, completions, columns)`` for ``rewards.score_rewards`` (TRL's contract):
        the dataset columns of ``rows`` repeated per answer and ``completion_ids``; episodes in
        TRL's conversational form with ``environments`` (and, with ``env_reward``, the
        environments' own rewards as the column ``env_reward``)."""
        if self.episodes is not None:
            prompts, completions, columns = reward_inputs(self.episodes, rows)
            if env_reward:
                columns["env_reward"] = environment_rewards(self.episodes)
            return prompts, completions, {**columns, **(self.columns or {})}
        n = len(self.prompt_ids) // max(1, len(rows))
        columns = {**columns_for(list(rows), n), "completion_ids": self.completion_id_lists()}
        return self.prompts, self.completions, {**columns, **(self.columns or {})}

    # ------------------------------------------------------------------ moving answers about

    def take(self, idx: Sequence[int]) -> Samples:
        """The answers ``idx`` (in that order) as their own ``Samples``; ``prompt_index``
        renumbers the prompts they answer 0, 1, ... (a group's members stay adjacent)."""
        idx = list(idx)
        ix = torch.tensor(idx, dtype=torch.long, device=self.completion_ids.device)

        def pick(value):
            if isinstance(value, torch.Tensor):
                return value[ix.to(value.device)]
            if isinstance(value, dict):
                return {k: pick(v) for k, v in value.items()}
            return None if value is None else [value[i] for i in idx]

        fields = {f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)}
        fields["prompt_index"] = torch.unique_consecutive(
            self.prompt_index.to(ix.device)[ix], return_inverse=True
        )[1]
        return Samples(**fields)

    @staticmethod
    def concat(parts: Sequence[Samples], pad_token_id: int) -> Samples:
        """One ``Samples`` of ``parts``' answers in order, completions right-padded to the
        longest (``pad_token_id``; masks and log-probs 0). A single part comes back as it is."""
        if len(parts) == 1:
            return parts[0]
        C = max(p.completion_ids.shape[1] for p in parts)
        dev = parts[0].completion_ids.device

        def cat(name: str, value):
            ts = [getattr(p, name) for p in parts]
            if any(t is None for t in ts):
                return None
            if isinstance(ts[0], dict):
                return {k: [x for t in ts for x in t[k]] for k in ts[0]}
            if not isinstance(ts[0], torch.Tensor):
                return [x for t in ts for x in t]
            pad = torch.nn.functional.pad
            return torch.cat([pad(t.to(dev), (0, C - t.shape[1]), value=value) for t in ts])

        offset, index = 0, []
        for p in parts:
            index.append(p.prompt_index.to(dev) + offset)
            offset += int(p.prompt_index.max()) + 1 if len(p.prompt_index) else 0
        fields = {
            f.name: cat(f.name, pad_token_id if f.name == "completion_ids" else 0.0)
            for f in dataclasses.fields(Samples)
            if f.name != "prompt_index"
        }
        fields["prompt_index"] = torch.cat(index)
        return Samples(**fields)

    def portable(self) -> Samples:
        """A copy that pickles: tensors on the CPU, episodes without their live environment
        (scored already: the environment object is neither needed nor picklable)."""
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            fields[f.name] = v.cpu() if isinstance(v, torch.Tensor) else v
        if self.episodes is not None:
            fields["episodes"] = [dataclasses.replace(e, env=None) for e in self.episodes]
        return Samples(**fields)

    # ------------------------------------------------------------------ the update's tensors

    def training_batch(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forcing inputs: ``(input_ids [N, P+C], attention_mask [N, P+C], completion_mask [N, C])``.

        Prompts are LEFT-padded to ``P`` = longest prompt, completions right-padded to ``C``;
        the last ``C`` columns of ``input_ids`` are the completions, so the log-prob of completion
        token ``j`` comes from the logits at column ``P + j - 1``. ``attention_mask`` (long) is 1 on
        prompt tokens and on completion tokens that exist; what the update trains on is
        ``loss_mask``, which this does not touch. Pass
        ``position_ids_from_mask(attention_mask)`` to the model as well: that reproduces the
        positions used while sampling exactly (it matters for absolute-position models; for RoPE
        models only float rounding differs).
        """
        n_seq, c = self.completion_ids.shape
        p = max(len(ids) for ids in self.prompt_ids)
        device = self.completion_ids.device
        input_ids = torch.full((n_seq, p + c), pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((n_seq, p + c), dtype=torch.long, device=device)
        for i, ids in enumerate(self.prompt_ids):
            input_ids[i, p - len(ids) : p] = torch.tensor(ids, dtype=torch.long, device=device)
            attention_mask[i, p - len(ids) : p] = 1
        input_ids[:, p:] = self.completion_ids
        attention_mask[:, p:] = self.completion_mask.long()
        return input_ids, attention_mask, self.completion_mask

    @staticmethod
    def of_episodes(episodes: Sequence[Episode], pad_token_id: int, n: int) -> Samples:
        """Episodes (``n`` per row, in order) as one ``Samples``: every token after the prompt
        exists (``completion_mask`` 1), the model's own are the ``loss_mask``."""
        c = max(1, max(len(e.completion_ids) for e in episodes))
        N = len(episodes)
        ids = torch.full((N, c), pad_token_id, dtype=torch.long)
        mask, loss, lp, slp = (torch.zeros((N, c), dtype=torch.float32) for _ in range(4))
        for i, e in enumerate(episodes):
            k = len(e.completion_ids)
            if k:
                ids[i, :k] = torch.tensor(e.completion_ids, dtype=torch.long)
                mask[i, :k] = 1.0
                loss[i, :k] = torch.tensor(e.loss_mask, dtype=torch.float32)
                lp[i, :k] = torch.tensor(e.logprobs, dtype=torch.float32)
                slp[i, :k] = torch.tensor(e.sampler_logprobs, dtype=torch.float32)
        return Samples(
            prompt_ids=[list(e.prompt_ids) for e in episodes],
            completion_ids=ids,
            completion_mask=mask,
            logprobs=lp,
            finish_reason=[e.finish_reason for e in episodes],
            completion_text=[_last_assistant(e) for e in episodes],
            prompt_index=torch.arange(N) // n,
            sampler_logprobs=slp,
            loss_mask=loss,
            prompts=[e.messages[: e.num_prompt_messages] for e in episodes],
            completions=[e.completion_messages for e in episodes],
            episodes=list(episodes),
        )


def _last_assistant(e: Episode) -> str:
    said = [m.get("content") or "" for m in e.completion_messages if m.get("role") == "assistant"]
    return said[-1] if said else ""
