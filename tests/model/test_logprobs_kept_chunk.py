"""The chunked log-prob backward reuses the forward's last chunk (``keep_last``).

With ``keep_last`` the forward keeps its last chunk's log-softmax and the backward starts from
it instead of recomputing that chunk's logits: one lm_head matmul fewer per backward. These
tests check that it is the same computation (bit for bit with one chunk, where nothing is
reordered; to float summation order with several, where the kept chunk is taken first), that
``token_logprobs`` turns it on exactly when a backward can follow, and that the head's logits
are computed once, not twice, for a one-chunk forward + backward.
"""

from __future__ import annotations

import pytest
import torch

from peergrade.model import logprobs as lp_mod
from peergrade.model.logprobs import _ChunkedLogProbs, token_logprobs


def _inputs(M=9, H=6, V=13, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, generator=g, requires_grad=True)
    b = torch.randn(V, dtype=dtype, generator=g, requires_grad=True)
    t = torch.randint(0, V, (M,), generator=g)
    return h, w, b, t


def _run(keep: bool, chunk: int, with_entropy: bool, T: float = 0.7):
    h, w, b, t = _inputs()
    out = _ChunkedLogProbs.apply(h, w, b, t, T, chunk, with_entropy, keep)
    logp, ent = out if with_entropy else (out, None)
    scale = torch.linspace(0.5, 1.5, logp.numel())
    loss = -(logp * scale).sum() - (0.1 * ent.sum() if ent is not None else 0.0)
    loss.backward()
    return [logp.detach(), h.grad, w.grad, b.grad] + ([ent.detach()] if ent is not None else [])


@pytest.mark.parametrize("with_entropy", [False, True])
def test_one_chunk_is_bit_identical(with_entropy):
    """One chunk (M <= chunk_size): the kept log p is the one the backward would recompute."""
    for a, b in zip(_run(False, 64, with_entropy), _run(True, 64, with_entropy), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_several_chunks_match(with_entropy):
    """Several chunks: values bit for bit, gradients to float summation order (the kept last
    chunk is accumulated first); the hidden-state gradient is per row, so bit for bit too."""
    old, new = _run(False, 4, with_entropy), _run(True, 4, with_entropy)
    assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
    for a, b in zip(old[2:], new[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64_kept():
    h, w, b, t = _inputs(M=7, H=5, V=11, dtype=torch.float64)

    def f(h, w, b):
        return _ChunkedLogProbs.apply(h, w, b, t, 0.6, 3, True, True)

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_retained_graph_second_backward_recomputes():
    """The kept chunk is used once; a second backward through a retained graph recomputes it
    and gets the same gradient."""
    h, w, b, t = _inputs()
    logp = _ChunkedLogProbs.apply(h, w, b, t, 1.0, 64, False, True)
    logp.sum().backward(retain_graph=True)
    first = h.grad.clone()
    h.grad = None
    logp.sum().backward()
    assert torch.equal(first, h.grad)


def _counting_logits(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = lp_mod._chunk_logits

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(lp_mod, "_chunk_logits", counted)
    return calls


def test_token_logprobs_one_chunk_computes_logits_once(tiny_qwen2, monkeypatch):
    """Forward + backward of a one-chunk micro-batch runs lm_head's logits once (the plain
    recomputing backward ran them twice); a pass without grad keeps nothing."""
    model = tiny_qwen2[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (3, 10), generator=g)
    am = torch.ones_like(ids)
    cm = torch.ones(3, 4, dtype=torch.long)
    calls = _counting_logits(monkeypatch)
    token_logprobs(model, ids, am, cm, chunk_size=64).sum().backward()
    model.zero_grad(set_to_none=True)  # the model is shared by the session
    assert len(calls) == 1
    kept = []
    monkeypatch.setattr(
        _ChunkedLogProbs, "apply", lambda *a: kept.append(a[-1]) or torch.zeros(a[0].shape[0])
    )
    with torch.no_grad():
        token_logprobs(model, ids, am, cm, chunk_size=64)
    assert kept == [False]
