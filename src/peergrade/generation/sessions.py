"""KV cache rows kept between the requests of one training episode (the endpoint's prefix cache).

A harness sends one request per model turn, each holding the whole conversation so far; the
recorder turns it into the episode's token sequence (prompt + sampled turns + template deltas).
Re-prefilling that sequence at every turn is what made the endpoint slow. ``Sessions`` keeps one
row per open episode in one batched KV cache (``episodes.TurnEngine``'s cache with "holes": rows
advance in lock-step, a row that feeds fewer tokens than another gets masked-out columns, and
every row sees exactly its own tokens at positions 0, 1, 2, ...), so a turn feeds only what the
cache has not seen (the last sampled token and the template delta) and then samples.

``run(jobs)`` answers jobs of one sampling setting whose ``session`` is set: a job whose tokens
extend what its row holds feeds the difference; any other (a new episode, a split history) gets
a fresh row. Every open row takes part in each forward pass (idle rows feed holes), so this pays
when most open episodes have a request queued, as under a trainer's harness. When no row is open
(a trainer's step begins so), the cache is built as the in-process engine builds it: each
distinct prompt prefilled in one row of its own, that row then copied to every episode opening
with it (the G samples of a dataset row), so the prefill costs the distinct prompts only. ``forget(session)``
drops a row (the episode is over). Draws are the kernel's keyed uniforms of (seed, job key,
position in the turn): a job samples what ``generate`` would, up to float rounding.

It does not decide what a turn is (``recorder`` does) or batch requests (``server.Engine``).
"""

from __future__ import annotations

import torch

from peergrade.generation.episodes import TurnEngine
from peergrade.generation.kernel import draw_tokens, row_states, uniforms


class Sessions:
    def __init__(self, model, tokenizer, eos_ids, max_pos: int):
        self.model, self.tokenizer = model, tokenizer
        self.eos = set(eos_ids)
        self.device = next(model.parameters()).device
        self.eng = TurnEngine(
            model=model, tokenizer=tokenizer, eos_ids=eos_ids, budget=10**9, max_turns=None,
            max_tokens_per_turn=10**9, max_pos=max_pos, temperature=1.0, top_p=1.0, top_k=0,
            stop=(), template_kw={}, device=self.device,
        )  # fmt: skip
        self.eng.cache = None
        self.rows: list[str] = []  # the session of each cache row
        self.seen: list[list[int]] = []  # the tokens each row holds
        self._gone: set[str] = set()

    def forget(self, session: str) -> None:
        """Drop ``session``'s row at the next ``run`` (any thread)."""
        self._gone.add(session)

    def _drop(self, sessions: set[str]) -> None:
        keep = [i for i, s in enumerate(self.rows) if s not in sessions]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.seen = [], []
            self.eng.cache = None
            return
        self.eng._keep(keep)
        self.rows = [self.rows[i] for i in keep]
        self.seen = [self.seen[i] for i in keep]

    def _add(self, sessions: list[str]) -> None:
        """New rows beside the open ones, empty (all their columns so far are holes)."""
        e, k = self.eng, len(sessions)
        b = len(self.rows)
        e._keep(list(range(b)) + [0] * k)  # copies of row 0's buffers, hidden below
        e.key_ok[b:] = False
        e.n_real[b:] = 0
        self.rows += sessions
        self.seen += [[] for _ in sessions]

    def _pending(self, jobs, row_of: list[int]) -> tuple[list[list[int]], list[int] | None]:
        """Per cache row, the tokens it has not seen yet; new rows whose whole prompt is the
        same (the G episodes of one dataset row open alike) share one prefill, as the
        in-process engine's: one of them feeds it, the others feed nothing and are copies of
        it afterwards (``copy``: the row each row is taken from; None when none is shared)."""
        pending = [[] for _ in self.rows]
        copy = list(range(len(self.rows)))
        first: dict[tuple[int, ...], int] = {}
        for j, r in zip(jobs, row_of):
            todo = list(j.prompt_ids[len(self.seen[r]) :])
            if not self.seen[r]:  # a new row: all holes so far, like every other new row
                copy[r] = first.setdefault(tuple(todo), r)
            pending[r] = todo if copy[r] == r else []
            self.seen[r] = list(j.prompt_ids)
        shared = any(c != r for r, c in enumerate(copy))
        return pending, (copy if shared else None)

    @torch.no_grad()
    def run(self, jobs) -> list[tuple[list[int], list[float], str]]:
        """(token ids, log-probs, finish: eos | stop | length) of each job (one setting)."""
        gone, self._gone = self._gone, set()
        self._drop(gone)
        # rows whose cached tokens are not a prefix of their job's (a split): start afresh
        stale = set()
        for j in jobs:
            if j.session in self.rows:
                r = self.rows.index(j.session)
                held = self.seen[r]
                if j.prompt_ids[: len(held)] != held or len(held) >= len(j.prompt_ids):
                    stale.add(j.session)
        self._drop(stale)
        fresh = not self.rows  # every job opens a row (a trainer's step starts so)
        if not fresh:
            self._add([j.session for j in jobs if j.session not in self.rows])
        e, j0 = self.eng, jobs[0]
        e.temperature, e.top_p, e.top_k, e.stop = j0.temperature, j0.top_p, j0.top_k, j0.stop
        e.stop_window = max(len(x) for x in j0.stop) + 8 if j0.stop else 0
        eos = self.eos | set(j0.stop_ids)  # a job's own stop tokens end it as eos does
        row_of = list(range(len(jobs))) if fresh else [self.rows.index(j.session) for j in jobs]
        T = max(j.max_tokens for j in jobs)
        keys = torch.tensor([j.key for j in jobs], dtype=torch.long, device=self.device)
        u = uniforms(row_states(int(j0.seed), keys, 1), T)  # [J, T]

        was = self.model.training
        self.model.eval()
        try:
            if fresh:  # a new cache, each distinct prompt fed in a row of its own, then copied
                logits = e._start(jobs)  # [J, V]
                self.rows = [j.session for j in jobs]
                self.seen = [list(j.prompt_ids) for j in jobs]
            else:
                pending, copy = self._pending(jobs, row_of)
                logits = e._feed(pending)  # [B, V]
                if copy is not None:  # rows that share a new prompt: the row that fed it
                    e._keep(copy)
                    logits = logits.index_select(0, torch.tensor(copy, device=self.device))
            turns = [[] for _ in jobs]
            logps = [[] for _ in jobs]
            slps = [[] for _ in jobs]  # under the truncated distribution drawn from
            finish = ["length"] * len(jobs)
            live = list(range(len(jobs)))
            for t in range(T):
                rows = torch.tensor([row_of[i] for i in live], device=self.device)
                tok, logp, slp = draw_tokens(
                    logits.index_select(0, rows), u[live, t], e.temperature, e.top_p, e.top_k
                )
                nxt = [[] for _ in self.rows]
                still = []
                for i, tk, lp, sp in zip(live, tok.tolist(), logp.tolist(), slp.tolist()):
                    turns[i].append(tk)
                    logps[i].append(lp)
                    slps[i].append(sp)
                    if tk in eos:
                        finish[i] = "eos"
                    elif e.stop and e._stopped(turns[i]):
                        finish[i] = "stop"
                    elif len(turns[i]) < jobs[i].max_tokens:
                        still.append(i)
                        nxt[row_of[i]] = [tk]
                        self.seen[row_of[i]].append(tk)
                live = still
                if not live:
                    break
                logits = e._feed(nxt)
        finally:
            self.model.train(was)
        return [(turns[i], logps[i], slps[i], finish[i]) for i in range(len(jobs))]
