"""token_logprobs (chunked, custom autograd) against naive_token_logprobs (full logits).

The reference is the plain full-vocabulary computation through the model's own forward; the
chunked path must match it in value, entropy and every parameter's gradient (1e-5 in float32),
for left padding, ragged completion masks, temperature != 1 and chunk sizes that do not divide
the number of selected positions. The autograd function alone is also checked with gradcheck in
float64, and a saved-tensor hook checks that no [B, C, V]-sized tensor is kept for the backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from peergrade.model.load import apply_lora, position_ids_from_mask
from peergrade.model.logprobs import _ChunkedLogProbs, naive_token_logprobs, token_logprobs

TOL = 1e-5


def make_batch(vocab: int, *, B=4, L=14, C=8, seed=0):
    """Left-padded input_ids / attention_mask [B, L] and a ragged completion_mask [B, C]."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (B, L), generator=g)
    attention_mask = torch.ones(B, L, dtype=torch.long)
    pads = [3, 0, 1, 5][:B] + [0] * max(0, B - 4)
    for b, n in enumerate(pads):
        attention_mask[b, :n] = 0
        input_ids[b, :n] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 5:] = 0  # ended early (eos then padding)
    completion_mask[1, 2] = 0  # a hole (e.g. a tool-output token)
    if B > 2:
        completion_mask[2, :] = 0  # nothing counts in this row
        completion_mask[2, 0] = 1
    return input_ids, attention_mask, completion_mask


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(g_a, g_b, tol=TOL):
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        err = (g_a[n] - g_b[n]).abs().max().item()
        assert err <= tol * max(1.0, g_b[n].abs().max().item()), f"grad of {n}: max err {err}"


def loss_of(logp, ent, completion_mask):
    m = completion_mask.float()
    loss = -(logp * m * torch.linspace(0.5, 1.5, m.numel()).view_as(m)).sum() / m.sum()
    if ent is not None:
        loss = loss - 0.1 * (ent * m).sum() / m.sum()
    return loss


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])
@pytest.mark.parametrize(
    "temperature,chunk_size,with_entropy",
    [(1.0, 4096, False), (0.7, 5, True), (1.3, 1, True), (1.0, 3, False)],
)
def test_matches_naive_values_and_grads(request, fixture, temperature, chunk_size, with_entropy):
    model, _ = request.getfixturevalue(fixture)
    inp = make_batch(model.config.vocab_size)
    kw = dict(temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
    out_c = token_logprobs(model, *inp, **kw)
    out_n = naive_token_logprobs(model, *inp, **kw)
    lp_c, ent_c = out_c if with_entropy else (out_c, None)
    lp_n, ent_n = out_n if with_entropy else (out_n, None)
    assert lp_c.shape == inp[2].shape and lp_c.dtype == torch.float32
    torch.testing.assert_close(lp_c, lp_n, atol=TOL, rtol=0)
    # not masked, so not trivially zero: real log-probs of a 100-token vocabulary
    assert (lp_c[inp[2] == 1] < -1.0).all()
    assert (lp_c[inp[2] == 0] == 0).all()
    if with_entropy:
        torch.testing.assert_close(ent_c, ent_n, atol=TOL, rtol=0)
        assert (ent_c[inp[2] == 1] > 1.0).all() and (ent_c[inp[2] == 0] == 0).all()
    g_c = grads(model, loss_of(lp_c, ent_c, inp[2]))
    g_n = grads(model, loss_of(lp_n, ent_n, inp[2]))
    assert "model.embed_tokens.weight" in g_c  # tied: lm_head's grad lands here
    assert_grads_close(g_c, g_n)


def test_entropy_only_gradient(tiny_qwen2):
    """Backward through the entropy alone (grad of logp is None inside the Function)."""
    model, _ = tiny_qwen2
    inp = make_batch(model.config.vocab_size)
    _, ent_c = token_logprobs(model, *inp, chunk_size=4, with_entropy=True, temperature=0.9)
    _, ent_n = naive_token_logprobs(model, *inp, with_entropy=True, temperature=0.9)
    assert_grads_close(grads(model, ent_c.sum()), grads(model, ent_n.sum()))


def test_untied_head_with_bias():
    """Untied lm_head with a bias: head weight, bias and embedding get their own gradients."""
    from peergrade.model.tiny import build_tiny_model

    model, _ = build_tiny_model("llama", seed=3, tie_word_embeddings=False)
    old = model.lm_head
    model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_(0, 0.5)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    inp = make_batch(model.config.vocab_size, seed=1)
    lp_c = token_logprobs(model, *inp, chunk_size=7, temperature=0.8)
    lp_n = naive_token_logprobs(model, *inp, temperature=0.8)
    torch.testing.assert_close(lp_c, lp_n, atol=TOL, rtol=0)
    g_c, g_n = grads(model, lp_c.sum()), grads(model, lp_n.sum())
    assert {"lm_head.bias", "lm_head.weight", "model.embed_tokens.weight"} <= g_c.keys()
    assert_grads_close(g_c, g_n)


def test_chunked_function_gradcheck_float64():
    """The autograd Function alone, in float64, against finite differences (with bias, T != 1)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)

    def f(h, w, b):
        return _ChunkedLogProbs.apply(h, w, b, t, 0.6, 3, True)

    assert torch.autograd.gradcheck(f, (h, w, b))
    # and the values against a hand-written log-softmax
    lp, ent = f(h, w, b)
    z = (h @ w.T + b) / 0.6
    ref = z.gather(1, t[:, None]).squeeze(1) - z.logsumexp(1)
    p = z.softmax(1)
    torch.testing.assert_close(lp, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, -(p * p.log()).sum(1), atol=1e-12, rtol=0)


def test_no_full_logits_saved_for_backward():
    """No tensor of [B, C, V] size is kept for the backward by the chunked path (the naive one
    does keep one: that shows the hook sees it)."""
    from transformers import AutoModelForCausalLM

    from peergrade.model.tiny import tiny_config

    tok_vocab = 5000

    cfg = tiny_config("qwen2", vocab_size=tok_vocab, hidden_size=16, num_layers=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    inp = make_batch(tok_vocab, B=4, L=14, C=10)
    full = 4 * 10 * tok_vocab

    def max_saved(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(model, *inp, chunk_size=4, with_entropy=True)
        return max(sizes)

    assert max_saved(naive_token_logprobs) >= full
    assert max_saved(token_logprobs) < full / 2  # the biggest is the [V, H] weight itself


def test_all_masked_and_bad_arguments(tiny_qwen2):
    model, _ = tiny_qwen2
    ids, am, cm = make_batch(model.config.vocab_size)
    lp = token_logprobs(model, ids, am, torch.zeros_like(cm))
    assert lp.shape == cm.shape and (lp == 0).all()
    with pytest.raises(ValueError, match="need 0 < C < L"):
        token_logprobs(model, ids, am, torch.ones(ids.shape[0], ids.shape[1]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        token_logprobs(model, ids, am[:, 1:], cm)
    with pytest.raises(ValueError, match=r"completion_mask must be \[B, C\]"):
        token_logprobs(model, ids, am, cm[:2])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, am, cm, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(model, ids, am, cm, chunk_size=0)


def test_position_ids_ignore_left_padding():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(position_ids_from_mask(am), expected)


def test_left_padding_does_not_change_logprobs(tiny_llama):
    """The same sequence with and without extra left padding gets the same log-probs."""
    model, _ = tiny_llama
    ids, am, cm = make_batch(model.config.vocab_size, B=2)
    pad = 4
    ids2 = torch.cat([torch.zeros(2, pad, dtype=ids.dtype), ids], 1)
    am2 = torch.cat([torch.zeros(2, pad, dtype=am.dtype), am], 1)
    with torch.no_grad():
        a = token_logprobs(model, ids, am, cm)
        b = token_logprobs(model, ids2, am2, cm)
    torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_bfloat16_model_close_to_naive(tiny_qwen2):
    model = copy.deepcopy(tiny_qwen2[0]).to(torch.bfloat16)
    inp = make_batch(model.config.vocab_size)
    with torch.no_grad():
        a = token_logprobs(model, *inp, chunk_size=5)
        b = naive_token_logprobs(model, *inp)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_peft_model_matches_naive(tiny_qwen2, targets):
    """A LoRA-wrapped model (including LoRA on lm_head, which takes the per-chunk module
    fallback) gives the naive values and LoRA-parameter gradients."""
    pytest.importorskip("peft")
    model = apply_lora(copy.deepcopy(tiny_qwen2[0]), r=4, alpha=8, target_modules=targets)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    inp = make_batch(model.config.vocab_size)
    lp_c, e_c = token_logprobs(model, *inp, chunk_size=6, temperature=0.9, with_entropy=True)
    lp_n, e_n = naive_token_logprobs(model, *inp, temperature=0.9, with_entropy=True)
    torch.testing.assert_close(lp_c, lp_n, atol=TOL, rtol=0)
    torch.testing.assert_close(e_c, e_n, atol=TOL, rtol=0)
    g_c = grads(model, loss_of(lp_c, e_c, inp[2]))
    g_n = grads(model, loss_of(lp_n, e_n, inp[2]))
    assert g_c and all("lora_" in n for n in g_c)
    assert_grads_close(g_c, g_n)


@pytest.mark.parametrize("temperature, chunk_size, k", [(1.0, 256, 3), (0.7, 2, 1), (0.0, 3, 0)])
def test_position_logprobs_match_the_full_logits(tiny_qwen2, temperature, chunk_size, k):
    """``position_logprobs``: each position's token log-prob, rank and top-k tokens from
    ``start`` on, chunked, equal those of the full logits (``temperature`` 0: untempered)."""
    from peergrade.model.logprobs import position_logprobs

    model = tiny_qwen2[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, model.config.vocab_size, (11,), generator=g).tolist()
    with torch.no_grad():
        z = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(z / (temperature or 1.0), -1)[3:]  # positions 4.. (start=4)
    chosen, top, ranks = position_logprobs(model, ids, 4, k, temperature, chunk_size=chunk_size)
    ref = lp.gather(1, torch.tensor(ids[4:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(chosen), ref, atol=TOL, rtol=0)
    # rank: 1 + the tokens more likely there (by the full logits' sort)
    order = lp.argsort(-1, descending=True)
    want = [row.tolist().index(t) + 1 for row, t in zip(order, ids[4:])]
    assert ranks == want and max(ranks) > 1
    if k == 0:
        assert top is None
        return
    v, ix = lp.topk(k, -1)
    assert [[t for t, _ in row] for row in top] == ix.tolist()
    torch.testing.assert_close(torch.tensor([[x for _, x in r] for r in top]), v, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="start"):
        position_logprobs(model, ids, 0)
