"""The chunked log-prob engine: per-token log-probs (and entropies) of completion tokens,
computed without ever materialising the ``[B, L, V]`` logits.

``token_logprobs(model, input_ids, attention_mask, completion_mask, ...)`` is what the update,
the reference pass and the PPO ratio all call; ``naive_token_logprobs`` is the plain reference
(full logits), kept for tests and the memory benchmark.

The log-prob computation
------------------------
For a sequence ``x`` of length ``L`` whose last ``C`` tokens are the completion, the log-prob of
completion token ``j`` (column ``L-C+j``) comes from the logits at column ``L-C+j-1``::

    z     = (h_{L-C+j-1} W^T + b) / temperature           # [V], float32
    logp  = z[x_{L-C+j}] - logsumexp(z)
    H     = -sum_v softmax(z)_v log softmax(z)_v           # entropy of the tempered distribution

The backbone (everything up to and including the final norm) runs once on ``[B, L]`` with
``position_ids = clamp(cumsum(attention_mask) - 1, min=0)`` so left padding does not shift the
positions. Only the hidden states of positions whose ``completion_mask == 1`` are gathered
(``[M, H]``), and ``lm_head`` + temperature + log-softmax run over chunks of ``chunk_size`` of
those positions inside ``_ChunkedLogProbs``, a ``torch.autograd.Function`` that keeps only the
selected log-prob, the entropy and the per-position logsumexp, plus, when a backward will follow,
the last chunk's log-softmax. Its backward starts from that kept chunk, recomputes every other
chunk's logits, and uses

    d logp / d z   = onehot(target) - p                       (p = softmax(z))
    d H    / d z_k = -p_k (log p_k + H)

so the gradient w.r.t. the hidden states, ``lm_head.weight`` and the bias is formed one chunk at a
time as well. Peak extra memory is about two ``[chunk_size, V]`` float32 buffers instead of
several ``[B, C, V]`` ones (the kept chunk is one of the two the backward holds anyway). With a
single chunk (at most ``chunk_size`` completion tokens) lm_head's matmul runs three times per
forward + backward, as in a plain autograd forward, not four (bench/head_backward.py, 34M
model, 1,024 completion tokens: the head's CPU time 0.75-0.79x, an update micro-batch's
0.87-0.91x). The matmul runs in the weight's dtype and the logits are upcast to
float32 per chunk (which is also what the naive path does with a bf16 model's logits). Tied
embeddings need nothing special: ``lm_head.weight`` is passed to the Function as a tensor, and
autograd adds its gradient to the embedding's.

The shared prompt (``share_prompts=True``)
------------------------------------------
The G completions of a group share their prompt, so the backbone's work on the prompt columns
is the same for all G rows. With ``share_prompts`` the distinct prompts of the batch (rows whose
first ``L-C`` columns of ids and mask are equal) run once with ``use_cache=True``; the KV cache
stays in the autograd graph and is expanded (``index_select``) to the B rows, then only the C
completion columns run against it. The hidden state that predicts completion token 0 is the
prompt's last one, expanded the same way. Gradients reach the prompt through the cache and that
hidden state (``index_select``'s backward sums the G rows' contributions), so values and
gradients equal the plain forward's up to float summation order. Used when every row shares its
prompt with another row, the model's layers all use full attention and gradient checkpointing
is off (HF turns the cache off under checkpointing); otherwise the plain forward runs.

An ``lm_head`` that is not a plain ``nn.Linear`` (e.g. LoRA applied to ``lm_head``) falls back to
calling the module per chunk under ``torch.utils.checkpoint``, which also recomputes per chunk in
the backward.

What it deliberately does not do
--------------------------------
* It does not read the training config: everything comes in as plain arguments.
* Models whose logits are post-processed after ``lm_head`` (Gemma-2 logit soft-capping, Cohere's
  ``logit_scale``) are refused (``find_backbone_and_head``) rather than silently computed wrong.
* No loading (``peergrade.model.load``), no loss (``peergrade.algo``).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn

from peergrade.model.load import find_backbone_and_head, position_ids_from_mask

__all__ = [
    "token_logprobs",
    "naive_token_logprobs",
    "topk_token_logprobs",
    "gathered_token_logprobs",
]


def _check_inputs(input_ids, attention_mask, completion_mask, temperature, chunk_size=1):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L]; got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    B, L = input_ids.shape
    if completion_mask.dim() != 2 or completion_mask.shape[0] != B:
        raise ValueError(
            f"completion_mask must be [B, C] with B={B}; got shape {tuple(completion_mask.shape)}"
        )
    C = completion_mask.shape[1]
    if not 0 < C < L:
        raise ValueError(
            f"completion_mask covers C={C} columns of L={L}: need 0 < C < L (the first "
            "completion token is predicted from the token before it)"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: expected a positive number")
    if int(chunk_size) != chunk_size or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive integer")
    return B, L, C


def _acc_dtype(weight) -> torch.dtype:
    """float32, or float64 for a float64 weight (so gradcheck can run in double precision)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _chunk_logits(h, weight, bias, temperature):
    """float32 logits / temperature of one chunk; the matmul runs in the weight's dtype."""
    acc = _acc_dtype(weight)
    z = (h.to(weight.dtype) @ weight.t()).to(acc)  # [c, V]
    if bias is not None:
        z = z + bias.to(acc)
    if temperature != 1.0:
        z = z / temperature
    return z


class _ChunkedLogProbs(torch.autograd.Function):
    """logp (and entropy) of ``targets`` under ``softmax((hidden W^T + b) / T)``, chunk by chunk.

    forward(hidden [M, H], weight [V, H], bias [V] | None, targets [M], temperature, chunk_size,
    with_entropy, keep_last) -> logp [M] (float32), plus entropy [M] when with_entropy.

    keep_last: the forward keeps its last chunk's log-softmax ``[c, V]`` for the backward, which
    takes that chunk first and so never recomputes its logits (one lm_head matmul and one
    log-softmax fewer per backward: every one of them with a single chunk, M <= chunk_size).
    No peak grows: the backward holds two ``[c, V]`` buffers either way (the kept one and the
    softmax), freed before the next chunk. Only when a backward will follow (``token_logprobs``
    sets it under grad mode); a second backward (``retain_graph``) recomputes it.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, keep_last=False
    ):
        M, acc = hidden.shape[0], _acc_dtype(weight)
        logp = torch.empty(M, dtype=acc, device=hidden.device)  # [M]
        lse = torch.empty(M, dtype=acc, device=hidden.device)  # [M]
        ent = torch.empty(M, dtype=acc, device=hidden.device) if with_entropy else None
        ctx.kept = None  # the last chunk's log p [c, V] (keep_last)
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            for s in range(0, M, chunk_size):
                e = min(s + chunk_size, M)
                z = _chunk_logits(hidden[s:e], weight, bias, temperature)  # [c, V]
                lse_c = torch.logsumexp(z, dim=-1)  # [c]
                lse[s:e] = lse_c
                z.sub_(lse_c[:, None])  # z is now log p   # [c, V]
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1)
                if with_entropy:
                    ent[s:e] = -(z.exp().mul_(z)).sum(-1)  # -sum p log p, one extra buffer
                if keep_last and e == M:
                    ctx.kept = z
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, ent
        return logp

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        T, cs = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        kept, ctx.kept = ctx.kept, None  # used once: a retained graph's next backward recomputes
        if grad_logp is None and grad_ent is None:
            return (None,) * 8
        M, acc = hidden.shape[0], _acc_dtype(weight)
        grads = _HeadGrads(
            torch.empty_like(hidden) if need_h else None,
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None,
            torch.zeros(bias.shape, dtype=acc, device=bias.device)
            if need_b and bias is not None
            else None,
        )
        starts = list(range(0, M, cs))
        if kept is not None:  # the kept last chunk first, then the rest in order
            starts = starts[-1:] + starts[:-1]
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            for s in starts:
                e = min(s + cs, M)
                if kept is not None and e == M:
                    logp_full, kept = kept, None  # log p, from the forward
                else:
                    logp_full = _chunk_logits(hidden[s:e], weight, bias, T)  # [c, V]
                    logp_full.sub_(lse[s:e, None])  # log p
                g = _logit_grad(logp_full, s, e, targets, ent, grad_logp, grad_ent)
                del logp_full
                _add_chunk_grads(grads, g, hidden[s:e], weight, s, T)
                del g
        grad_w = grads.w.to(weight.dtype) if grads.w is not None else None
        grad_b = grads.b.to(bias.dtype) if grads.b is not None else None
        return grads.h, grad_w, grad_b, None, None, None, None, None


class _HeadGrads(NamedTuple):
    """The chunked backward's outputs, filled chunk by chunk (None: not needed)."""

    h: torch.Tensor | None  # [M, H]
    w: torch.Tensor | None  # [V, H], float32 accumulator
    b: torch.Tensor | None  # [V], float32 accumulator


def _logit_grad(logp_full, s, e, targets, ent, grad_logp, grad_ent):
    """dL/dz of chunk [s, e) from its log p ``[c, V]`` (overwritten), before the temperature:
    ``g = -p * (g_logp + g_ent * (log p + H)) + g_logp * onehot(target)``, built in place (at
    most two ``[c, V]`` buffers, log p and p, live at once)."""
    if grad_ent is not None:
        p = logp_full.exp()  # [c, V]
        g = logp_full.add_(ent[s:e, None]).mul_(grad_ent[s:e, None])
        if grad_logp is not None:
            g.add_(grad_logp[s:e, None])
        g.mul_(p).neg_()
        del p
    else:
        g = logp_full.exp_().mul_(-grad_logp[s:e, None])  # -p * g_logp
    if grad_logp is not None:
        rows = torch.arange(e - s, device=g.device)
        g[rows, targets[s:e]] += grad_logp[s:e]
    return g


def _add_chunk_grads(grads: _HeadGrads, g, h, weight, s: int, T: float) -> None:
    """Chunk [s, s + c)'s share of the hidden, weight and bias gradients from its dL/dz ``g``."""
    if T != 1.0:
        g.div_(T)  # z = raw / T
    h_c = h.to(weight.dtype)  # [c, H]
    g_w = g.to(weight.dtype)  # [c, V]
    if grads.h is not None:
        grads.h[s : s + h.shape[0]] = (g_w @ weight).to(grads.h.dtype)
    if grads.w is not None:
        if g_w.dtype == grads.w.dtype:  # accumulate in place: no [V, H] product buffer
            grads.w.addmm_(g_w.t(), h_c)
        else:  # one [V, H] product in the weight's dtype, added with upcast
            grads.w.add_(g_w.t() @ h_c)
    if grads.b is not None:
        grads.b.add_(g.sum(0))


def _module_chunk(head, h, targets, temperature, with_entropy):
    """Fallback for a non-Linear lm_head: logp (and entropy) of one chunk via the module."""
    z = head(h).float()  # [c, V]
    if temperature != 1.0:
        z = z / temperature
    logp_full = torch.log_softmax(z, dim=-1)
    logp = logp_full.gather(1, targets[:, None]).squeeze(1)
    if with_entropy:
        return logp, -(logp_full.exp() * logp_full).sum(-1)
    return logp, torch.zeros_like(logp)


def _backbone_hidden(model, input_ids, attention_mask):
    backbone, head = find_backbone_and_head(model)
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden, head  # [B, L, H]


def _full_attention_only(model) -> bool:
    cfg = getattr(model, "config", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not getattr(cfg, "use_sliding_window", False)


def _checkpointing(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # v6 renames it
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def _shared_prompt_hidden(model, input_ids, attention_mask, C: int):
    """The hidden states that predict the C completion columns, ``[B, C, H]``, with each
    distinct prompt run once (module docstring), or None when no prompt is shared or the model
    cannot share (sliding-window layers, gradient checkpointing)."""
    B, L = input_ids.shape
    if _checkpointing(model) and torch.is_grad_enabled():
        return None
    if not _full_attention_only(model):
        return None
    Lp = L - C
    key = torch.cat([input_ids[:, :Lp], attention_mask[:, :Lp].to(input_ids.dtype)], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)  # [U, 2 Lp], [B]
    if uniq.shape[0] == B:
        return None  # nothing shared: the plain forward is cheaper
    backbone, _ = find_backbone_and_head(model)
    p_ids, p_mask = uniq[:, :Lp], uniq[:, Lp:].to(attention_mask.dtype)  # [U, Lp]
    real = p_mask.sum(dim=0) > 0
    first = int(real.nonzero().min()) if real.any() else 0  # all-padding columns of the uniques
    p_ids, p_mask = p_ids[:, first:], p_mask[:, first:]
    out = backbone(
        input_ids=p_ids,
        attention_mask=p_mask,
        position_ids=position_ids_from_mask(p_mask),
        use_cache=True,
    )
    cache = getattr(out, "cache", None)
    cache = out.past_key_values if cache is None else cache
    cache.batch_select_indices(inverse)  # [U, ...] -> [B, ...], in the graph
    kw = "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"
    mask = torch.cat([p_mask[inverse], attention_mask[:, Lp:]], dim=1)  # [B, Lp' + C]
    pos = position_ids_from_mask(mask)[:, -C:]  # [B, C]
    out_c = backbone(
        input_ids=input_ids[:, Lp:],
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        **{kw: cache},
    )
    last = out.last_hidden_state[:, -1:].index_select(0, inverse)  # [B, 1, H]
    return torch.cat([last, out_c.last_hidden_state[:, :-1]], dim=1)  # [B, C, H]


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    share_prompts: bool = False,
):
    """Per-token log-probs of the completion, chunked over positions (see the module docstring).

    input_ids, attention_mask: [B, L] (left padding allowed; ``attention_mask == 1`` = real token).
    completion_mask: [B, C] over the LAST C columns of input_ids; ``completion_mask == 1`` marks the
    tokens whose log-prob is wanted. Returns logp [B, C] float32 (0 where completion_mask == 0),
    or (logp, entropy), both [B, C], when with_entropy. Both are differentiable.

    chunk_size: positions per lm_head chunk. Each chunk holds about two [chunk_size, V] float32
    buffers: with V = 151936, 1024 positions are ~0.6 GB each.

    share_prompts: run each distinct prompt once (rows with equal prompt columns), the
    completions against its expanded KV cache (module docstring); same values and gradients.
    """
    B, L, C = _check_inputs(input_ids, attention_mask, completion_mask, temperature, chunk_size)
    sel = completion_mask.bool()  # [B, C]
    h_pred = _shared_prompt_hidden(model, input_ids, attention_mask, C) if share_prompts else None
    if h_pred is None:
        hidden, head = _backbone_hidden(model, input_ids, attention_mask)  # [B, L, H]
        h_pred = hidden[:, L - C - 1 : L - 1]  # [B, C, H]
    else:
        head = find_backbone_and_head(model)[1]
    h_sel = h_pred[sel]  # [M, H]
    targets = input_ids[:, L - C :][sel].long()  # [M]
    if isinstance(head, nn.Linear):
        out = _ChunkedLogProbs.apply(
            h_sel,
            head.weight,
            head.bias,
            targets,
            float(temperature),
            int(chunk_size),
            with_entropy,
            torch.is_grad_enabled() and (h_sel.requires_grad or head.weight.requires_grad),
        )
        logp_sel, ent_sel = out if with_entropy else (out, None)
    else:
        from torch.utils.checkpoint import checkpoint

        parts = [
            checkpoint(
                _module_chunk,
                head,
                h_sel[s : s + chunk_size],
                targets[s : s + chunk_size],
                float(temperature),
                with_entropy,
                use_reentrant=False,
            )
            for s in range(0, h_sel.shape[0], chunk_size)
        ]
        if parts:
            logp_sel = torch.cat([a for a, _ in parts])  # [M]
            ent_sel = torch.cat([b for _, b in parts])  # [M]
        else:  # no position selected at all
            logp_sel = ent_sel = h_sel.new_zeros(0, dtype=torch.float32)
    zeros = torch.zeros(B, C, dtype=torch.float32, device=input_ids.device)
    logp = zeros.masked_scatter(sel, logp_sel)  # [B, C]
    if with_entropy:
        return logp, zeros.masked_scatter(sel, ent_sel)
    return logp


def _predicting_hidden(model, input_ids, attention_mask, completion_mask, share_prompts):
    """``(h_sel [M, H], head)``: the hidden states that predict the counted completion tokens
    (``completion_mask == 1``, row-major), as ``token_logprobs`` computes them."""
    L, C = input_ids.shape[1], completion_mask.shape[1]
    h_pred = _shared_prompt_hidden(model, input_ids, attention_mask, C) if share_prompts else None
    if h_pred is None:
        hidden, head = _backbone_hidden(model, input_ids, attention_mask)  # [B, L, H]
        h_pred = hidden[:, L - C - 1 : L - 1]  # [B, C, H]
    else:
        head = find_backbone_and_head(model)[1]
    return h_pred[completion_mask.bool()], head  # [M, H]


def _chunk_log_softmax(head, h, temperature):
    """float32 log-softmax of one chunk's logits / temperature, ``[c, V]``."""
    if isinstance(head, nn.Linear):
        z = _chunk_logits(h, head.weight, head.bias, temperature)
    else:
        z = head(h).float()
        if temperature != 1.0:
            z = z / temperature
    return torch.log_softmax(z, dim=-1)


@torch.no_grad()
def topk_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens at every counted completion position, no grad:
    ``(logp [B, C, k] float32, ids [B, C, k] int64)``, best first, from the log-softmax of the
    logits / temperature over the whole vocabulary (the value at column j is the distribution
    that predicts completion token j, as in ``token_logprobs``); 0 and id 0 where
    ``completion_mask == 0``. The head runs over ``chunk_size`` positions at a time, never the
    whole ``[B, C, V]``. On-policy distillation's teacher (``algo.teacher_divergence: top_k``)."""
    B, L, C = _check_inputs(input_ids, attention_mask, completion_mask, temperature, chunk_size)
    if int(k) != k or k < 1:
        raise ValueError(f"topk_token_logprobs: k must be a positive integer, got {k!r}")
    h_sel, head = _predicting_hidden(
        model, input_ids, attention_mask, completion_mask, share_prompts
    )
    M, dev = h_sel.shape[0], input_ids.device
    vals = torch.zeros(M, k, dtype=torch.float32, device=dev)  # [M, k]
    ids = torch.zeros(M, k, dtype=torch.long, device=dev)  # [M, k]
    with torch.autocast(dev.type, enabled=False):
        for s in range(0, M, chunk_size):
            lp = _chunk_log_softmax(head, h_sel[s : s + chunk_size], float(temperature))  # [c, V]
            if k > lp.shape[-1]:
                raise ValueError(
                    f"topk_token_logprobs: k={k} is more than the model's {lp.shape[-1]} logits"
                )
            v, i = lp.topk(k, dim=-1)
            vals[s : s + chunk_size], ids[s : s + chunk_size] = v.float(), i
    sel = completion_mask.bool()
    out_v = torch.zeros(B, C, k, dtype=torch.float32, device=dev)
    out_i = torch.zeros(B, C, k, dtype=torch.long, device=dev)
    out_v[sel], out_i[sel] = vals, ids
    return out_v, out_i


def _gather_chunk(head, h, ids, temperature):
    with torch.autocast(h.device.type, enabled=False):  # the head in the weight's dtype
        return _chunk_log_softmax(head, h, temperature).gather(1, ids)  # [c, k]


def gathered_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    share_prompts: bool = False,
) -> torch.Tensor:
    """``[B, C, k]`` float32, differentiable: the log-probs (log-softmax of the logits /
    temperature over the whole vocabulary) of the given token ids ``ids [B, C, k]`` at every
    counted completion position (the distribution that predicts completion token j); 0 where
    ``completion_mask == 0``. Each chunk of ``chunk_size`` positions runs under
    ``torch.utils.checkpoint``: the forward keeps only the ``[c, k]`` values and the backward
    recomputes the chunk's ``[c, V]`` log-softmax, so no ``[B, C, V]`` tensor ever exists.
    On-policy distillation's student side of the top-k divergence."""
    from torch.utils.checkpoint import checkpoint

    B, L, C = _check_inputs(input_ids, attention_mask, completion_mask, temperature, chunk_size)
    if ids.dim() != 3 or ids.shape[:2] != completion_mask.shape:
        raise ValueError(
            f"gathered_token_logprobs: ids must be [B, C, k] = [{B}, {C}, k]; got {tuple(ids.shape)}"
        )
    sel = completion_mask.bool()
    h_sel, head = _predicting_hidden(
        model, input_ids, attention_mask, completion_mask, share_prompts
    )
    ids_sel = ids[sel].long()  # [M, k]
    parts = [
        checkpoint(
            _gather_chunk,
            head,
            h_sel[s : s + chunk_size],
            ids_sel[s : s + chunk_size],
            float(temperature),
            use_reentrant=False,
        )
        for s in range(0, h_sel.shape[0], chunk_size)
    ]
    out = torch.zeros(B, C, ids.shape[2], dtype=torch.float32, device=input_ids.device)
    if not parts:
        return out
    return out.masked_scatter(sel[..., None].expand_as(out), torch.cat(parts).float())


class PositionScores(NamedTuple):
    """``position_logprobs``' answer, one entry per position scored."""

    chosen: list[float]  # the log-prob of the token there
    top: list[list[tuple[int, float]]] | None  # the k most likely (token id, log-prob), best first
    ranks: list[int]  # the token's rank there: 1 + how many tokens are more likely


@torch.no_grad()
def position_logprobs(
    model, ids: list[int], start: int, k: int = 0, temperature: float = 1.0, chunk_size: int = 256
) -> PositionScores:
    """What a serving endpoint reports about tokens it did not sample, or about their rivals:
    for each position ``p`` in ``[start, len(ids))`` (``start >= 1``), the log-prob of
    ``ids[p]`` given ``ids[:p]`` and, for ``k > 0``, the ``k`` most likely tokens there as
    ``(token id, log-prob)``, best first (None for ``k == 0``), and the token's rank (1 + the
    number of tokens more likely there, as vLLM ranks them). ``temperature`` > 0 divides the
    logits; 0 leaves them as they are (greedy). One backbone pass over ``ids``; the head runs
    over ``chunk_size`` positions at a time (never the whole ``[L, V]`` logits), except for a
    model whose logits are post-processed after its head (``find_backbone_and_head`` refuses
    it), whose own forward gives them. The model is used in the mode it is in."""
    if not 1 <= start <= len(ids):
        raise ValueError(f"position_logprobs: start must be in [1, {len(ids)}], got {start}")
    x = torch.tensor([ids], device=next(model.parameters()).device)
    try:
        find_backbone_and_head(model)
    except ValueError:  # soft-capped logits and the like: the model's own forward
        h, head = model(input_ids=x).logits[0, start - 1 : len(ids) - 1], nn.Identity()
    else:
        hidden, head = _backbone_hidden(model, x, torch.ones_like(x))
        h = hidden[0, start - 1 : len(ids) - 1]  # [P, H]: the state that predicts each position
    targets = x[0, start:]
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    ranks: list[int] = []
    for s in range(0, h.shape[0], chunk_size):
        z = head(h[s : s + chunk_size]).float()  # [c, V]
        if temperature > 0:
            z = z / temperature
        lp = torch.log_softmax(z, -1)
        at = lp.gather(1, targets[s : s + chunk_size, None])  # [c, 1]
        chosen += at[:, 0].tolist()
        ranks += ((lp > at).sum(-1) + 1).tolist()
        if k > 0:
            v, ix = lp.topk(min(k, lp.shape[-1]), -1)
            top += [list(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())]
    return PositionScores(chosen, top if k > 0 else None, ranks)


def naive_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
):
    """Reference for ``token_logprobs``: the full model forward, full ``[B, C, V]`` float32
    logits, log_softmax, gather. Same signature and outputs; ``chunk_size`` is ignored.

    This is what most trainers do (with ``logits_to_keep = C + 1``); it is kept for tests and the
    memory benchmark, not for training.
    """
    B, L, C = _check_inputs(input_ids, attention_mask, completion_mask, temperature)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=C + 1,
    )
    logits = out.logits[:, -(C + 1) : -1].float()  # [B, C, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp_full = torch.log_softmax(logits, dim=-1)  # [B, C, V]
    logp = logp_full.gather(-1, input_ids[:, L - C :, None]).squeeze(-1)  # [B, C]
    mask = completion_mask.to(logp.dtype)
    if with_entropy:
        ent = -(logp_full.exp() * logp_full).sum(-1)  # [B, C]
        return logp * mask, ent * mask
    return logp * mask
