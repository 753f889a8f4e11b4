"""KV caches kept between the requests of one training episode (the endpoint's prefix cache).

A harness sends one request per model turn, each holding the whole conversation so far; the
recorder turns it into the episode's token sequence (prompt + sampled turns + template deltas).
Re-prefilling that sequence at every turn is what made the endpoint slow. ``Sessions`` keeps,
per open episode, the keys/values of the tokens its cache has seen (per layer, real tokens only,
no padding) and those tokens (``seen``), so a turn feeds only what the cache has not seen (the
last sampled token and the template delta) and then samples.

``run(jobs)`` answers jobs of one sampling setting (``Job.sampling``) whose ``session`` is set, and runs only their
rows: it assembles a batched cache of just those episodes (``kernel.slab_cache_of``: each row
right-aligned, zero "hole" columns before it, hidden as ``episodes.TurnEngine``'s cache with
holes hides them; every row sees exactly its own tokens at positions 0, 1, 2, ...), feeds each
row what it has not seen, samples token by token in lock-step, and writes each row's real
keys/values back (``kernel.slab_rows``, holes dropped). Open episodes without a request cost
nothing, so agents that are not in lock-step (tools of varied latency) do not pay for each
other. A job whose tokens extend what its episode holds feeds the difference; any other (a new
episode, a split history) starts its episode afresh. New episodes whose first prompt is the same
(the G samples of a dataset row) share one prefill: when no job of a call has an episode held
(a trainer's step begins so) the cache is built as the in-process engine builds it
(``TurnEngine._start``: each distinct prompt prefilled in one row, copied to every episode opening
with it); beside held episodes, one new row feeds the prompt and the others are copies of it.
A job whose row ends is handed back at once (``run``'s ``on_done``) while longer rows are
still sampled; its keys/values are written back when the call ends, before the next call can
take its follow-up. ``forget(session)`` drops an episode (it is over). Draws are the kernel's
keyed uniforms of (seed, job key, position in the turn): a job samples what ``generate`` would,
and what it would alone, up to float rounding.

Each call copies its episodes' keys/values into the batched cache and back (memory traffic of
the size of their caches); it does not bound the memory the open episodes hold. It does not
decide what a turn is (``recorder`` does) or batch requests (``server.Engine``).
"""

from __future__ import annotations

import torch

from peergrade.generation.episodes import TurnEngine
from peergrade.generation.kernel import (
    check_cancel,
    draw_tokens,
    row_states,
    slab_cache_of,
    slab_rows,
    uniforms,
)
from peergrade.generation.record import SamplerSettings


class Sessions:
    def __init__(self, model, tokenizer, eos_ids, max_pos: int):
        self.model, self.tokenizer = model, tokenizer
        self.eos = set(eos_ids)
        self.device = next(model.parameters()).device
        self.eng = TurnEngine(  # each run samples with its jobs' settings (``TurnEngine.use``)
            model=model,
            tokenizer=tokenizer,
            eos_ids=eos_ids,
            settings=SamplerSettings(n=1, max_new_tokens=10**9),
            max_pos=max_pos,
            template_kw={},
            device=self.device,
        )
        self.eng.cache = None
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per layer (K, V)
        self.seen: dict[str, list[int]] = {}  # the tokens each episode's kv holds
        self._gone: set[str] = set()
        self.cancel = None  # the engine's threading.Event: set, a run stops at its next step

    def forget(self, session: str) -> None:
        """Drop ``session``'s kept cache at the next ``run`` (any thread)."""
        self._gone.add(session)

    def _open(self, jobs) -> torch.Tensor:
        """The engine's cache for these jobs' rows (row ``i``: job ``i``), each row fed what it
        has not seen; returns the logits after each row's last token [J, V]. Every job's
        episode leaves the store here (it is written back when the run ends)."""
        e, dev = self.eng, self.device
        held = [self.kv.pop(j.session, None) for j in jobs]
        seen = [self.seen.pop(j.session, []) for j in jobs]
        if all(h is None for h in held):  # each distinct prompt fed in a row of its own, copied
            return e._start(jobs)
        pending, copy, first = [], [], {}
        for r, (j, s) in enumerate(zip(jobs, seen)):
            todo = list(j.prompt_ids[len(s) :])
            copy.append(first.setdefault(tuple(todo), r) if not s else r)
            pending.append(todo if copy[r] == r else [])
        T = max(j.max_tokens for j in jobs)
        cap = max(map(len, pending)) + min(T, 256)
        e.cache, width = slab_cache_of(held, cap + max(map(len, seen)), grow=True)
        n = torch.tensor([len(s) for s in seen], dtype=torch.long, device=dev)
        e.key_ok = torch.arange(width, device=dev)[None, :] >= (width - n)[:, None]
        e.n_real, e.cur = n, width
        logits = e._feed(pending)  # [J, V]
        if copy != list(range(len(jobs))):  # rows that share a new prompt: the row that fed it
            e._keep(copy)
            logits = logits.index_select(0, torch.tensor(copy, device=dev))
        return logits

    def _close(self, jobs, seen: list[list[int]]) -> None:
        """Each job's episode kept: its rows' real keys/values and the tokens they are of."""
        e = self.eng
        for j, s, kv in zip(jobs, seen, slab_rows(e.cache, e.key_ok)):
            self.kv[j.session], self.seen[j.session] = kv, s
        e.cache = e.key_ok = e.n_real = None

    @torch.no_grad()
    def run(self, jobs, on_done=None) -> list[tuple[list[int], list[float], list[float], str]]:
        """(token ids, log-probs, sampler log-probs, finish: eos | stop | length) of each job
        (one sampling setting; distinct sessions). ``on_done(i, result)``, when given, is
        called with job ``i``'s result as soon as its row ends, while longer rows go on (its
        agent can answer it meanwhile; its keys/values are kept when the run ends)."""
        gone, self._gone = self._gone, set()
        for s in gone:
            self.kv.pop(s, None)
            self.seen.pop(s, None)
        # episodes whose kept tokens are not a strict prefix of their job's (a split): afresh
        for j in jobs:
            held = self.seen.get(j.session)
            if held is not None and (
                j.prompt_ids[: len(held)] != held or len(held) >= len(j.prompt_ids)
            ):
                del self.kv[j.session], self.seen[j.session]
        e, j0 = self.eng, jobs[0]
        # the jobs' temperature, top-p, top-k and stop strings; their budgets are their own
        e.use(j0.sampling.replace(max_new_tokens=10**9, max_turns=None, max_tokens_per_turn=None))
        eos = self.eos | set(j0.stop_ids)  # a job's own stop tokens end it as eos does
        T = max(j.max_tokens for j in jobs)
        keys = torch.tensor([j.key for j in jobs], dtype=torch.long, device=self.device)
        u = uniforms(row_states(int(j0.seed), keys, 1), T)  # [J, T]

        was = self.model.training
        self.model.eval()
        try:
            logits = self._open(jobs)
            seen = [list(j.prompt_ids) for j in jobs]
            turns = [[] for _ in jobs]
            logps = [[] for _ in jobs]
            slps = [[] for _ in jobs]  # under the truncated distribution drawn from
            finish = ["length"] * len(jobs)
            live = list(range(len(jobs)))
            for t in range(T):
                check_cancel(self.cancel)
                rows = torch.tensor(live, device=self.device)
                tok, logp, slp = draw_tokens(
                    logits.index_select(0, rows), u[live, t], e.temperature, e.top_p, e.top_k
                )
                nxt = [[] for _ in jobs]
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
                        nxt[i] = [tk]
                        seen[i].append(tk)
                        continue
                    if on_done is not None:
                        on_done(i, (turns[i], logps[i], slps[i], finish[i]))
                live = still
                if not live:
                    break
                logits = e._feed(nxt)
            self._close(jobs, seen)
        finally:
            self.model.train(was)
            e.cache = None
        return [(turns[i], logps[i], slps[i], finish[i]) for i in range(len(jobs))]
