"""On-policy distillation's teacher behind an OpenAI-compatible endpoint (``algo.teacher_url``):
the student's prompt + completion token ids are sent as the prompt of ``/v1/completions`` with
vLLM's ``prompt_logprobs: 0`` (``peergrade serve`` and vLLM answer it), and the teacher's
log-prob of each sampled token is read back, so a bigger teacher can sit on another device.

The request per batch of rows: ``{"model", "prompt": [ids, ...], "max_tokens": 1,
"temperature": 0, "prompt_logprobs": 0}`` (one token is sampled and thrown away: vLLM refuses
``max_tokens: 0``). Each choice's ``prompt_logprobs`` is ``[null, {"<id>": {"logprob", ...}},
...]``: position p holds ``log p(ids[p] | ids[:p])`` at temperature 1 (the model's own
distribution), so the teacher's temperature must be 1 (``config.validate``).

Start-up (``connect``), before any step: ``GET /models`` (the endpoint answers, and serves
``algo.teacher_model``; null = the one model it lists), then a probe of the student's
vocabulary: token ids spread over it (and its special tokens) are scored, and the string the
endpoint decodes for each must be the student's; a teacher with fewer tokens refuses the ids.
Either way the run stops naming the difference.

Failures: each request has ``algo.teacher_timeout`` seconds and is tried ``TRIES`` times in all
(connection errors, timeouts and 5xx answers; a 4xx is not retried), then the step stops with
``TeacherEndpointError`` naming the URL and the last error.

``topk(batch, k)`` (``algo.teacher_divergence: top_k``) asks ``prompt_logprobs: k`` instead
and reads, at each sampled position, the k entries of rank 1..k (vLLM adds the position's own
token beside them when it ranks lower): the teacher's k most likely tokens there and their
log-probs. vLLM caps k at its ``max_logprobs`` (20 by default), as ``peergrade serve`` does.

What it deliberately does not do: no streaming, no concurrency across requests; the teacher's
chat template plays no part (token ids only).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import torch

from peergrade.errors import ModelLoadError, PeergradeError

TRIES = 3  # attempts per request in all
BACKOFF_S = 0.5  # seconds before the second attempt, doubled before each later one
ROWS_PER_REQUEST = 32  # prompts per /v1/completions request (vLLM and peergrade take lists)
PROBE_TOKENS = 256  # token ids of the tokenizer probe, spread over the student's vocabulary


class TeacherEndpointError(PeergradeError, RuntimeError):
    """The teacher endpoint did not answer (or answered an error) after every attempt."""


@dataclass
class EndpointTeacher:
    """A teacher behind ``url`` (the OpenAI base URL, ending in ``/v1`` as clients take it)
    serving ``model``; ``logprobs(batch)`` scores the student's sampled tokens."""

    url: str
    model: str
    timeout: float = 120.0
    api_key: str | None = None
    requests: int = field(default=0, init=False)  # requests answered (for tests and metrics)

    def _call(self, method: str, route: str, body: dict | None = None) -> dict:
        """One request with ``TRIES`` attempts; the answer's JSON."""
        url = self.url.rstrip("/") + route
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(TRIES):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    out = json.loads(resp.read())
                self.requests += 1
                return out
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
                if e.code < 500:  # the request itself is wrong: another try changes nothing
                    break
            except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
                last = f"{type(e).__name__}: {e}"
        raise TeacherEndpointError(
            f"algo.teacher_url {self.url!r}: {method} {url} failed ({last}) after "
            f"{attempt + 1} attempt(s) of at most {self.timeout:g} s each"
        )

    def prompt_logprobs(self, prompts: list[list[int]], k: int = 0) -> list[list]:
        """Each prompt's ``prompt_logprobs`` list as the endpoint answers it (``[None, {..},
        ...]``), in the order given; ``k``: vLLM's ``prompt_logprobs`` (the k most likely
        tokens at each position beside the prompt's own)."""
        out: list[list] = []
        for s in range(0, len(prompts), ROWS_PER_REQUEST):
            part = prompts[s : s + ROWS_PER_REQUEST]
            body = {
                "model": self.model,
                "prompt": part,
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": k,
            }
            r = self._call("POST", "/completions", body)
            choices = sorted(r.get("choices") or [], key=lambda c: c.get("index", 0))
            got = [c.get("prompt_logprobs") for c in choices]
            if len(got) != len(part) or any(
                g is None or len(g) != len(p) for g, p in zip(got, part)
            ):
                raise TeacherEndpointError(
                    f"algo.teacher_url {self.url!r}: /completions answered no prompt_logprobs of "
                    f"the {len(part)} prompts' lengths (does the server return vLLM's "
                    "prompt_logprobs?)"
                )
            out += got
        return out

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        """``[N, C]`` float32: the teacher's log-prob of every sampled token of ``batch``
        (``(input_ids [N, P + C], attention_mask, completion mask [N, C])``), 0 where the
        completion mask is 0. Row n is sent as its attended tokens (padding dropped)."""
        ids, am, cmask = batch
        N, C = cmask.shape
        P = ids.shape[1] - C
        rows = [ids[n][am[n] == 1].tolist() for n in range(N)]
        scored = self.prompt_logprobs(rows)
        out = torch.zeros(N, C, dtype=torch.float32)
        pos = am.long().cumsum(1) - 1  # [N, P + C]: each column's index among the sent tokens
        for n, lp in enumerate(scored):
            for c in torch.nonzero(cmask[n] == 1).flatten().tolist():
                j = int(pos[n, P + c])
                out[n, c] = float(lp[j][str(rows[n][j])]["logprob"])
        return out.to(cmask.device)

    @torch.no_grad()
    def topk(self, batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp [N, C, k] float32, ids [N, C, k] int64)``: the teacher's k most likely next
        tokens at every sampled position of ``batch`` (as ``logprobs``), best first, read from
        ``prompt_logprobs: k`` (the entries of rank 1..k); 0 where the completion mask is 0."""
        ids, am, cmask = batch
        N, C = cmask.shape
        P = ids.shape[1] - C
        rows = [ids[n][am[n] == 1].tolist() for n in range(N)]
        scored = self.prompt_logprobs(rows, k)
        vals = torch.zeros(N, C, k, dtype=torch.float32)
        top = torch.zeros(N, C, k, dtype=torch.long)
        pos = am.long().cumsum(1) - 1  # [N, P + C]: each column's index among the sent tokens
        for n, lp in enumerate(scored):
            for c in torch.nonzero(cmask[n] == 1).flatten().tolist():
                entry = lp[int(pos[n, P + c])]
                best = sorted(
                    ((int(e["rank"]), int(t), float(e["logprob"])) for t, e in entry.items()),
                )[:k]
                if len(best) < k or best[-1][0] > k:
                    raise TeacherEndpointError(
                        f"algo.teacher_url {self.url!r}: prompt_logprobs {k} answered "
                        f"{sum(r <= k for r, _, _ in best)} tokens of rank <= {k} at a position "
                        "(does the server return vLLM's ranked prompt_logprobs?)"
                    )
                top[n, c] = torch.tensor([t for _, t, _ in best])
                vals[n, c] = torch.tensor([v for _, _, v in best])
        return vals.to(cmask.device), top.to(cmask.device)


def probe_ids(tokenizer) -> list[int]:
    """Token ids that test the endpoint's vocabulary against the student's: a spread of
    ``PROBE_TOKENS`` over it, the special tokens and the last id, after a first token (whose
    log-prob no endpoint gives)."""
    n = len(tokenizer)
    spread = list(range(0, n, max(1, n // PROBE_TOKENS)))
    specials = [i for i in tokenizer.all_special_ids if i is not None and 0 <= i < n]
    return [spread[0], *dict.fromkeys([*spread, *specials, n - 1])]


def decoded_difference(tokenizer, ids: list[int], scored: list) -> str | None:
    """How the endpoint's decoding of ``ids`` (its ``prompt_logprobs`` answer ``scored``)
    differs from the student's, in words, or None when every decoded token agrees."""
    bad = []
    for t, entry in zip(ids[1:], scored[1:]):
        got = (entry or {}).get(str(t), {}).get("decoded_token")
        want = tokenizer.decode([t], skip_special_tokens=False)
        if got is not None and got != want:
            bad.append(f"id {t}: {want!r} (student) vs {got!r} (teacher)")
    if not bad:
        return None
    return f"{len(bad)} of {len(ids) - 1} probed token ids decode differently: " + ", ".join(
        bad[:3]
    )


def connect(cfg, tokenizer) -> EndpointTeacher:
    """The endpoint teacher of ``cfg.algo`` after checking, before any step, that it answers,
    serves the model and reads the student's token ids as the student's tokenizer does."""
    a = cfg.algo
    key = None
    if a.teacher_api_key_env:
        key = os.environ.get(a.teacher_api_key_env)
        if not key:
            raise ModelLoadError(
                f"algo.teacher_api_key_env: the environment variable {a.teacher_api_key_env!r} "
                "holding the teacher endpoint's API key is not set"
            )
    t = EndpointTeacher(a.teacher_url, a.teacher_model or "", a.teacher_timeout, key)
    served = [m.get("id") for m in t._call("GET", "/models").get("data", [])]
    if not t.model:
        if len(served) != 1:
            raise ModelLoadError(
                f"algo.teacher_url {t.url!r} serves {served}: set algo.teacher_model to one"
            )
        t.model = served[0]
    elif served and t.model not in served:
        raise ModelLoadError(
            f"algo.teacher_model {t.model!r} is not served by {t.url!r} (it lists {served})"
        )
    ids = probe_ids(tokenizer)
    try:
        scored = t.prompt_logprobs([ids])[0]
    except TeacherEndpointError as e:
        raise ModelLoadError(
            f"algo.teacher_url {t.url!r}: the teacher refused the student's token ids (up to id "
            f"{max(ids)}, the student's vocabulary has {len(tokenizer)} tokens): {e}"
        ) from e
    why = decoded_difference(tokenizer, ids, scored)
    if why is not None:
        raise ModelLoadError(
            f"algo.teacher_url {t.url!r}: the teacher's tokenizer does not match the student's "
            f"({why}); on-policy distillation scores the student's token ids with the teacher, "
            "so both must share one tokenizer"
        )
    return t
