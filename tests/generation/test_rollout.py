"""Tests for peergrade.generation.kernel: exact log-probs, greedy parity with HF, sampling distribution,
truncation, stop strings, determinism, micro-batching and input validation (CPU, tiny models)."""

from __future__ import annotations

import pytest
import torch

from peergrade.generation.kernel import Hooks, Rollout, generate, position_ids_from_mask

PROMPTS = ["hello there", "a", "What is 12+7? Answer:", "xyz"]


def _peaky_model(arch: str, tok, seed: int = 0, **extra):
    """A tiny model with large random weights: its next-token distributions are far from uniform,
    so greedy outputs vary and distribution tests have power."""
    from transformers import AutoModelForCausalLM

    from peergrade.model.tiny import tiny_config

    cfg = tiny_config(
        arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    cfg.initializer_range = 0.3
    for k, v in extra.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


@pytest.fixture(scope="module")
def peaky_qwen2(char_tokenizer):
    return _peaky_model("qwen2", char_tokenizer, seed=0), char_tokenizer


@pytest.fixture(scope="module")
def peaky_llama(char_tokenizer):
    return _peaky_model("llama", char_tokenizer, seed=3), char_tokenizer


def _teacher_forced_logprobs(model, r: Rollout, pad_id: int, temperature: float) -> torch.Tensor:
    """One fresh forward pass over prompt+completion; log-prob of each completion token. [N, C]"""
    ids, attn, cmask = r.training_batch(pad_id)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)
        ).logits.float()  # [N, P+C, V]
    c = cmask.shape[1]
    p = ids.shape[1] - c
    scaled = logits[:, p - 1 : p + c - 1] / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(scaled, -1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
    return lp * cmask


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; bins with expected count < 5 are merged."""
    counts = counts.double()
    expected = probs.double() / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # fold the remainder into the smallest big bin
        j = int(exp[:-1].argmin())
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    # Survival function of chi2(df) = regularised upper incomplete gamma Q(df/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _next_token_probs(model, tok, prompt: str, temperature: float) -> torch.Tensor:
    ids = tok([prompt], return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    return torch.softmax(logits / temperature, -1)  # [V]


# ------------------------------------------------------------------------------------------
# structure
# ------------------------------------------------------------------------------------------


def test_rollout_shapes_and_groups(tiny_qwen2):
    model, tok = tiny_qwen2
    r = generate(model, tok, PROMPTS, n=3, max_new_tokens=7, seed=0)
    n_seq = len(PROMPTS) * 3
    assert len(r.prompt_ids) == n_seq
    assert r.completion_ids.dtype == torch.long and r.completion_ids.shape[0] == n_seq
    assert r.completion_ids.shape[1] <= 7
    assert r.completion_mask.dtype == torch.float32 and r.logprobs.dtype == torch.float32
    assert r.prompt_index.tolist() == [i // 3 for i in range(n_seq)]
    for i in range(n_seq):
        assert r.prompt_ids[i] == tok(PROMPTS[i // 3], add_special_tokens=False)["input_ids"]
    # mask is a prefix of ones; pads and zero log-probs after it
    lengths = r.completion_mask.sum(-1).long()
    col = torch.arange(r.completion_mask.shape[1])
    assert torch.equal(r.completion_mask, (col[None] < lengths[:, None]).float())
    assert torch.all(r.completion_ids[r.completion_mask == 0] == tok.pad_token_id)
    assert torch.all(r.logprobs[r.completion_mask == 0] == 0)
    assert torch.all(r.logprobs[r.completion_mask == 1] < 0)
    for i in range(n_seq):
        L = int(lengths[i])
        if r.finish_reason[i] == "length":
            assert L == 7
        else:
            assert r.finish_reason[i] == "eos"
            assert int(r.completion_ids[i, L - 1]) == tok.eos_token_id
        assert r.completion_text[i] == tok.decode(
            r.completion_ids[i, :L].tolist(), skip_special_tokens=True
        )


def test_training_batch_layout():
    r = Rollout(
        prompt_ids=[[5, 6, 7], [8]],
        completion_ids=torch.tensor([[1, 2], [3, 0]]),
        completion_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        logprobs=torch.zeros(2, 2),
        finish_reason=["length", "eos"],
        completion_text=["", ""],
        prompt_index=torch.tensor([0, 1]),
    )
    ids, attn, cmask = r.training_batch(pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2], [0, 0, 8, 3, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert cmask is r.completion_mask
    assert position_ids_from_mask(attn).tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1]]


# ------------------------------------------------------------------------------------------
# exactness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture,temperature,top_p,top_k",
    [
        ("tiny_qwen2", 1.0, 1.0, 0),
        ("tiny_llama", 0.7, 1.0, 0),
        ("peaky_qwen2", 0.8, 0.9, 0),
        ("peaky_llama", 1.3, 1.0, 5),
        ("peaky_qwen2", 0.0, 1.0, 0),
    ],
)
def test_logprobs_match_teacher_forcing(request, fixture, temperature, top_p, top_k):
    model, tok = request.getfixturevalue(fixture)
    r = generate(
        model,
        tok,
        PROMPTS,
        n=3,
        max_new_tokens=12,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=123,
    )
    ref = _teacher_forced_logprobs(model, r, tok.pad_token_id, temperature)
    assert r.completion_mask.sum() > 0
    torch.testing.assert_close(r.logprobs, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["peaky_qwen2", "peaky_llama"])
def test_greedy_equals_hf_generate(request, fixture):
    model, tok = request.getfixturevalue(fixture)
    max_new = 20
    r = generate(model, tok, PROMPTS, n=1, max_new_tokens=max_new, temperature=0.0)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id
        )
    hf = out[:, enc["input_ids"].shape[1] :]  # [N, <=max_new], pad after EOS
    assert len({tuple(row.tolist()) for row in hf}) > 1  # the model is not degenerate
    for i in range(len(PROMPTS)):
        L = int(r.completion_mask[i].sum())
        assert r.completion_ids[i, :L].tolist() == hf[i, :L].tolist()
        if r.finish_reason[i] == "eos":
            assert torch.all(hf[i, L:] == tok.pad_token_id)
        else:
            assert L == max_new == hf.shape[1]


def test_mixed_length_batch_equals_each_alone(peaky_llama):
    model, tok = peaky_llama
    together = generate(model, tok, PROMPTS, n=2, max_new_tokens=15, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, tok, [p], n=1, max_new_tokens=15, temperature=0.0)
        L = int(alone.completion_mask[0].sum())
        for j in (2 * i, 2 * i + 1):
            assert int(together.completion_mask[j].sum()) == L
            assert together.completion_ids[j, :L].tolist() == alone.completion_ids[0, :L].tolist()
            torch.testing.assert_close(
                together.logprobs[j, :L], alone.logprobs[0, :L], atol=1e-4, rtol=0
            )


def test_eager_attention_and_generic_cache_paths_agree(char_tokenizer, peaky_qwen2):
    """The additive-mask (eager) path and the generic DynamicCache path (taken for models with
    sliding-window layers; here the window is longer than any sequence, so the result must be the
    same as full attention) reproduce the default sdpa fast path."""
    model, tok = peaky_qwen2
    ref = generate(model, tok, PROMPTS, n=2, max_new_tokens=10, seed=7)

    eager = _peaky_model("qwen2", tok, seed=0)
    eager.config._attn_implementation = "eager"
    r1 = generate(eager, tok, PROMPTS, n=2, max_new_tokens=10, seed=7)
    assert torch.equal(r1.completion_ids, ref.completion_ids)
    torch.testing.assert_close(r1.logprobs, ref.logprobs, atol=1e-4, rtol=0)

    slid = _peaky_model(
        "qwen2",
        tok,
        seed=0,
        use_sliding_window=True,
        sliding_window=1000,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert slid.model.has_sliding_layers
    r2 = generate(slid, tok, PROMPTS, n=2, max_new_tokens=10, seed=7)
    assert torch.equal(r2.completion_ids, ref.completion_ids)
    torch.testing.assert_close(r2.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    assert torch.equal(r2.completion_mask, ref.completion_mask)


# ------------------------------------------------------------------------------------------
# sampling distribution
# ------------------------------------------------------------------------------------------

N_DRAWS = 20000


def _first_token_counts(model, tok, prompt, **kw) -> torch.Tensor:
    r = generate(model, tok, [prompt], n=N_DRAWS, max_new_tokens=1, seed=2024, **kw)
    return torch.bincount(r.completion_ids[:, 0], minlength=model.config.vocab_size)


def test_sampling_distribution_chi_square(peaky_qwen2):
    model, tok = peaky_qwen2
    prompt = "The answer is"
    probs = _next_token_probs(model, tok, prompt, temperature=0.9)
    counts = _first_token_counts(model, tok, prompt, temperature=0.9)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # The test has power: the same samples are rejected against a different temperature.
    wrong = _next_token_probs(model, tok, prompt, temperature=1.2)
    assert _chi2_pvalue(counts, wrong) < 1e-6


def test_top_k_truncates_and_renormalises(peaky_qwen2):
    model, tok = peaky_qwen2
    prompt, k = "Count: 1, 2,", 4
    probs = _next_token_probs(model, tok, prompt, temperature=1.0)
    top = torch.topk(probs, k).indices
    trunc = torch.zeros_like(probs)
    trunc[top] = probs[top]
    counts = _first_token_counts(model, tok, prompt, top_k=k)
    assert set(counts.nonzero().squeeze(-1).tolist()) <= set(top.tolist())
    assert _chi2_pvalue(counts[top], trunc[top]) > 1e-3
    # Power check: ignoring the probabilities inside the top-k. They are close (0.26, 0.26, 0.25,
    # 0.23), so at 20,000 draws the uniform is rejected at 1e-3 with ~98% power, at 1e-6 with
    # only ~70% (simulated multinomial draws).
    uniform = torch.ones(k)
    assert _chi2_pvalue(counts[top], uniform) < 1e-3


def test_top_p_keeps_smallest_set_reaching_p(peaky_qwen2):
    model, tok = peaky_qwen2
    prompt = "Count: 1, 2,"
    probs = _next_token_probs(model, tok, prompt, temperature=1.0)
    sp, si = probs.sort(descending=True)
    # choose top_p between two cumulative masses so the kept set size is unambiguous: 3 tokens
    cum = sp.cumsum(0)
    top_p = float((cum[1] + cum[2]) / 2)
    kept = si[:3]
    counts = _first_token_counts(model, tok, prompt, top_p=top_p)
    assert set(counts.nonzero().squeeze(-1).tolist()) == set(kept.tolist())
    assert _chi2_pvalue(counts[kept], probs[kept]) > 1e-3
    # top_k and top_p together: top_p applies to the renormalised top-k distribution
    k = 5
    renorm_cum = sp[:k].cumsum(0) / sp[:k].sum()
    top_p2 = float((renorm_cum[0] + renorm_cum[1]) / 2)  # keeps exactly 2 of the top 5
    counts2 = _first_token_counts(model, tok, prompt, top_k=k, top_p=top_p2)
    assert set(counts2.nonzero().squeeze(-1).tolist()) == set(si[:2].tolist())


# ------------------------------------------------------------------------------------------
# stop strings, eos, determinism, micro-batching
# ------------------------------------------------------------------------------------------


def test_stop_string_cuts_text_and_mask(peaky_qwen2):
    model, tok = peaky_qwen2
    # the first prompt whose greedy completion is long enough to hold a stop string
    for prompt in PROMPTS + ["abc", "Count: 1, 2,", "zzz"]:
        free = generate(model, tok, [prompt], n=1, max_new_tokens=20, temperature=0.0)
        text = free.completion_text[0]
        if len(text) >= 8 and len(text) == int(free.completion_mask[0].sum()):
            break
    else:
        pytest.fail("no prompt with a long enough greedy completion")
    stop = text[4:6]  # a stop string that the greedy completion contains
    first_end = text.find(stop) + len(stop)
    r = generate(
        model, tok, [prompt], n=1, max_new_tokens=20, temperature=0.0, stop=["<never>", stop]
    )
    assert r.finish_reason == ["stop"]
    assert r.completion_text[0] == text[:first_end]
    # char tokenizer: one token per character, so the mask covers exactly first_end tokens
    assert int(r.completion_mask[0].sum()) == first_end
    assert r.completion_ids[0, :first_end].tolist() == free.completion_ids[0, :first_end].tolist()
    assert torch.all(r.completion_ids[0, first_end:] == tok.pad_token_id)
    # a single string is accepted as one stop string
    r2 = generate(model, tok, [prompt], n=1, max_new_tokens=20, temperature=0.0, stop=stop)
    assert r2.completion_text == r.completion_text


def test_eos_ends_sequence_and_ignore_eos(peaky_qwen2):
    model, tok = peaky_qwen2
    free = generate(model, tok, ["abc"], n=1, max_new_tokens=10, temperature=0.0)
    ids = free.completion_ids[0].tolist()
    target = ids[3]  # declare the 4th greedy token an end-of-sequence token
    first = ids.index(target)
    r = generate(
        model, tok, ["abc"], n=1, max_new_tokens=10, temperature=0.0, eos_token_ids=[target]
    )
    assert r.finish_reason == ["eos"]
    assert int(r.completion_mask[0].sum()) == first + 1  # the EOS token counts
    assert r.completion_ids[0, : first + 1].tolist() == ids[: first + 1]
    r2 = generate(
        model,
        tok,
        ["abc"],
        n=1,
        max_new_tokens=10,
        temperature=0.0,
        eos_token_ids=[target],
        ignore_eos=True,
    )
    assert r2.finish_reason == ["length"] and r2.completion_ids[0].tolist() == ids


def test_deterministic_for_seed(tiny_llama):
    model, tok = tiny_llama
    a = generate(model, tok, PROMPTS, n=2, max_new_tokens=10, seed=5)
    b = generate(model, tok, PROMPTS, n=2, max_new_tokens=10, seed=5)
    c = generate(model, tok, PROMPTS, n=2, max_new_tokens=10, seed=6)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # samples of one prompt differ from each other (independent draws)
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])


def test_seed_none_follows_global_rng(tiny_llama):
    model, tok = tiny_llama
    torch.manual_seed(11)
    a = generate(model, tok, PROMPTS[:2], n=2, max_new_tokens=6)
    torch.manual_seed(11)
    b = generate(model, tok, PROMPTS[:2], n=2, max_new_tokens=6)
    assert torch.equal(a.completion_ids, b.completion_ids)


@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_micro_batching_matches_one_batch(peaky_qwen2, batch_size):
    model, tok = peaky_qwen2
    full = generate(model, tok, PROMPTS, n=2, max_new_tokens=12, seed=9, temperature=0.9)
    part = generate(
        model, tok, PROMPTS, n=2, max_new_tokens=12, seed=9, temperature=0.9, batch_size=batch_size
    )
    assert torch.equal(part.completion_ids, full.completion_ids)
    assert torch.equal(part.completion_mask, full.completion_mask)
    torch.testing.assert_close(part.logprobs, full.logprobs, atol=1e-4, rtol=0)
    assert part.finish_reason == full.finish_reason
    assert part.completion_text == full.completion_text


# ------------------------------------------------------------------------------------------
# keyed randomness: a completion's draws depend on (seed, prompt key, sample index, position)
# ------------------------------------------------------------------------------------------

MORE = PROMPTS + ["Count: 1, 2,", "zz top", "The answer is"]
SAMPLING = dict(max_new_tokens=12, seed=17, temperature=0.9, top_p=0.95, top_k=20)


def _by_key(r: Rollout, keys, n: int) -> dict:
    """(prompt key, sample index) -> (tokens, mask, finish reason, text, log-probs)."""
    out = {}
    for i in range(r.completion_ids.shape[0]):
        L = int(r.completion_mask[i].sum())
        out[(keys[i // n], i % n)] = (
            r.completion_ids[i, :L].tolist(),
            r.finish_reason[i],
            r.completion_text[i],
            r.logprobs[i, :L],
        )
    return out


def _assert_same_completions(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:3] == b[k][:3], k  # tokens (so also lengths), finish reason, text
        torch.testing.assert_close(a[k][3], b[k][3], atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", ["peaky_qwen2", "tiny_llama"])
def test_same_tokens_for_any_batch_size_order_and_group_size(request, fixture):
    """generation batch size 1, 3 and all at once, the prompts shuffled (keys travelling with
    them) and a larger group all give every (prompt, sample) the same completion."""
    model, tok = request.getfixturevalue(fixture)
    keys = list(range(len(MORE)))
    ref = _by_key(generate(model, tok, MORE, n=3, **SAMPLING), keys, 3)
    # power: the draws differ between the samples of a prompt and between prompts
    assert len({tuple(c[0]) for c in ref.values()}) > len(ref) // 2
    for bs in (1, 3):
        r = generate(model, tok, MORE, n=3, batch_size=bs, **SAMPLING)
        _assert_same_completions(_by_key(r, keys, 3), ref)
    perm = [4, 0, 6, 2, 5, 1, 3]
    r = generate(model, tok, [MORE[i] for i in perm], n=3, row_keys=perm, batch_size=4, **SAMPLING)
    _assert_same_completions(_by_key(r, perm, 3), ref)
    # a group of 5: its first 3 samples are the group of 3's
    r5 = _by_key(generate(model, tok, MORE, n=5, **SAMPLING), keys, 5)
    _assert_same_completions({k: v for k, v in r5.items() if k[1] < 3}, ref)


def test_rank_shards_with_global_keys_equal_one_process(peaky_qwen2):
    """Two simulated ranks, each generating its half of the prompts with their global indices
    as keys, sample exactly what one process samples for all of them."""
    model, tok = peaky_qwen2
    prompts = MORE[:6]
    full = generate(model, tok, prompts, n=4, **SAMPLING)
    halves = [
        generate(model, tok, prompts[lo : lo + 3], n=4, row_keys=range(lo, lo + 3), **SAMPLING)
        for lo in (0, 3)
    ]
    whole = _by_key(full, range(6), 4)
    _assert_same_completions(
        {**_by_key(halves[0], range(0, 3), 4), **_by_key(halves[1], range(3, 6), 4)}, whole
    )
    # the keys are what makes this work: rank 1 without its offsets samples something else
    local = _by_key(generate(model, tok, prompts[3:], n=4, **SAMPLING), range(3, 6), 4)
    assert any(local[k][0] != whole[k][0] for k in local)


def test_keyed_uniforms_are_splitmix64():
    """The int64 tensor hash equals a pure-Python uint64 splitmix64 (wrap-around products,
    logical shifts), for keys and seeds with the top bit set too."""
    from peergrade.generation.kernel import row_states, uniforms

    mask, golden = 2**64 - 1, 0x9E3779B97F4A7C15

    def mix(z):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return z ^ (z >> 31)

    def draw(state, counter):
        return mix((state + (counter + 1) * golden) & mask)

    keys = [0, 1, 7, 2**40 + 3, 2**63 - 1]
    for seed in (0, 12345, 2**63 + 5, -3):
        root = mix(seed & mask)
        want = [
            [draw(draw(draw(root, key), j), t) >> 40 for t in range(5)]
            for key in keys
            for j in range(3)
        ]
        u = uniforms(row_states(seed, torch.tensor(keys), 3), 5)  # [15, 5]
        assert torch.equal((u * 2**24).long(), torch.tensor(want))


def _processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The sampling distribution after temperature, top-k and top-p, by a plain loop."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))[:top_k]
    mass = sum(float(p[i]) for i in order)
    out, acc = torch.zeros_like(p), 0.0
    for i in order:
        if acc >= top_p * mass:
            break
        out[i] = p[i]
        acc += float(p[i])
    return out / out.sum()


def test_keyed_draws_follow_the_processed_distribution():
    """20,000 draws along each key axis (positions of one sequence, samples of one prompt,
    prompt keys) from a fixed 8-token distribution at temperature 0.8, top-k 6, top-p 0.9:
    chi-square fits the processed probabilities, rejects the unprocessed ones, and successive
    positions / samples are independent (a 4 x 4 grid of consecutive pairs is uniform)."""
    from peergrade.generation.kernel import draw_tokens, row_states, uniforms

    logits = torch.tensor([2.0, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0, -4.0])
    temperature, top_k, top_p, n = 0.8, 6, 0.9, 20000
    probs = _processed_probs(logits, temperature, top_k, top_p)
    kept = probs > 0
    assert 2 < int(kept.sum()) < top_k  # top-p really cuts inside the top-k
    axes = {
        "positions": uniforms(row_states(3, torch.tensor([5]), 1), n)[0],
        "samples": uniforms(row_states(3, torch.tensor([5]), n), 1)[:, 0],
        "keys": uniforms(row_states(3, torch.arange(n), 1), 1)[:, 0],
    }
    for axis, u in axes.items():
        tokens = draw_tokens(logits.expand(n, -1), u, temperature, top_p, top_k)[0]
        counts = torch.bincount(tokens, minlength=len(logits))
        assert counts[~kept].sum() == 0, axis
        assert _chi2_pvalue(counts[kept], probs[kept]) > 1e-3, axis
        plain = torch.softmax(logits / temperature, -1)  # power: no truncation
        assert _chi2_pvalue(counts, plain) < 1e-6, axis
        cells = (u[:-1] * 4).long() * 4 + (u[1:] * 4).long()  # consecutive pairs, 16 cells
        assert _chi2_pvalue(torch.bincount(cells, minlength=16), torch.ones(16)) > 1e-3, axis


def test_check_every_does_not_change_results(peaky_qwen2):
    model, tok = peaky_qwen2
    # Many "EOS" tokens, so rows end early and keep sampling EOS again until the next host check:
    # only the first one may count.
    eos = list(range(30, 100))
    kw = dict(n=3, max_new_tokens=30, seed=4, eos_token_ids=eos)
    a = generate(model, tok, PROMPTS, check_every=1, **kw)
    b = generate(model, tok, PROMPTS, check_every=50, **kw)
    assert a.finish_reason.count("eos") >= 6
    assert a.finish_reason == b.finish_reason
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    for i in range(len(a.finish_reason)):  # the sequence ends at its first EOS
        ids = a.completion_ids[i, : int(a.completion_mask[i].sum())].tolist()
        assert sum(t in eos for t in ids) == (1 if a.finish_reason[i] == "eos" else 0)


def test_restores_train_mode_and_records_no_grad(char_tokenizer):
    from peergrade.model.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen2", char_tokenizer, seed=0)
    model.train()
    r = generate(model, tok, ["hi"], n=2, max_new_tokens=4, seed=0)
    assert model.training
    assert not r.logprobs.requires_grad
    model.eval()
    generate(model, tok, ["hi"], n=1, max_new_tokens=2, seed=0)
    assert not model.training


def test_token_id_prompts_equal_string_prompts(tiny_qwen2):
    model, tok = tiny_qwen2
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    a = generate(model, tok, PROMPTS, n=2, max_new_tokens=5, seed=1)
    b = generate(model, tok, ids, n=2, max_new_tokens=5, seed=1)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_peft_model(char_tokenizer):
    peft = pytest.importorskip("peft")
    from peergrade.model.tiny import build_tiny_model

    base, tok = build_tiny_model("qwen2", char_tokenizer, seed=0)
    base.eval()
    ref = generate(base, tok, PROMPTS, n=2, max_new_tokens=6, seed=3)
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    )
    r = generate(lora, tok, PROMPTS, n=2, max_new_tokens=6, seed=3)  # LoRA B = 0 at init
    assert torch.equal(r.completion_ids, ref.completion_ids)
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts="hello"), "list of strings"),
        (dict(prompts=["ok", ""]), r"prompts\[1\] is empty"),
        (dict(prompts=[[1, 2], [3, 10_000]]), r"prompts\[1\] has token id 10000"),
        (dict(prompts=[[1, 2.5]]), r"prompts\[0\] must be"),
        (dict(n=0), "n must be an int >= 1"),
        (dict(n=2.0), "n must be an int >= 1"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(batch_size=0), "batch_size"),
        (dict(prompts=["x" * 500], max_new_tokens=20), r"prompts\[0\] has 500 tokens.*512"),
        (dict(prompts=["x" * 513]), r"max_position_embeddings=512"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(row_keys=[0, 1]), "2 keys for 1 prompts"),
        (dict(prompts=["a", "b"], row_keys=[3, 3]), r"distinct \(key 3 repeats\)"),
        (dict(row_keys=[-1]), r"row_keys must be in \[0, 2\*\*63\)"),
        (dict(row_keys=torch.tensor([0.5])), "integer tensor"),
        (dict(row_keys=["a"]), "row_keys must be ints"),
    ],
)
def test_bad_input_raises(tiny_qwen2, kwargs, match):
    model, tok = tiny_qwen2
    args = dict(prompts=["hi"], n=1, max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=match):
        generate(model, tok, prompts, **args)


def test_tokenizer_without_pad_or_eos(tiny_qwen2):
    import copy

    model, tok = tiny_qwen2
    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        generate(model, no_pad, ["hi"], n=1, max_new_tokens=2)
    no_eos = copy.deepcopy(tok)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no eos token"):
        generate(model, no_eos, ["hi"], n=1, max_new_tokens=2)


def test_completion_id_lists_keep_only_counted_tokens():
    """Rollout.completion_id_lists: each row's ids up to its counted length (the reward
    contract's completion_ids), never the padding after an early EOS."""
    from peergrade.generation.kernel import Rollout

    ro = Rollout(
        prompt_ids=[[1], [2], [3]],
        completion_ids=torch.tensor([[5, 6, 7], [8, 0, 0], [0, 0, 0]]),
        completion_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        logprobs=torch.zeros(3, 3),
        finish_reason=["length", "eos", "eos"],
        completion_text=["abc", "d", ""],
        prompt_index=torch.tensor([0, 1, 2]),
    )
    assert ro.completion_id_lists() == [[5, 6, 7], [8], []]


@pytest.mark.parametrize("check_every, batch_size", [(1, None), (4, 3)])
def test_on_tokens_hands_on_exactly_the_counted_tokens(peaky_qwen2, check_every, batch_size):
    """The streaming hook sees each sequence's counted tokens in order and nothing after its
    end, however often finished rows are checked and however the batch is split; an eos made
    of a frequent token ends rows early (between host checks they keep running)."""
    model, tok = peaky_qwen2
    free = generate(model, tok, PROMPTS[:2], n=3, max_new_tokens=12, temperature=1.0, seed=1)
    eos = free.completion_ids[0, 2].item()  # a token that turns up: some rows end on it
    seen: dict[int, list[int]] = {}

    def hook(seqs, tokens):
        for q, t in zip(seqs, tokens):
            seen.setdefault(q, []).append(t)

    r = generate(
        model,
        tok,
        PROMPTS[:2],
        n=3,
        max_new_tokens=12,
        temperature=1.0,
        seed=1,
        eos_token_ids=[eos],
        check_every=check_every,
        batch_size=batch_size,
        hooks=Hooks(on_tokens=hook),
    )
    lens = r.completion_mask.sum(1).long().tolist()
    assert "eos" in r.finish_reason and min(lens) < 12
    assert seen == {q: r.completion_ids[q, : lens[q]].tolist() for q in range(6)}


@pytest.mark.parametrize("check_every, batch_size", [(1, None), (4, 3)])
def test_budgets_end_rows_early_and_on_done_reports_each_row_once(
    peaky_qwen2, check_every, batch_size
):
    """Per-prompt ``budgets``: a prompt's rows end at their budget (finish ``length``) with
    the tokens and log-probs they draw without one (their draws are keyed, not batched);
    ``on_done`` hands each row over once, as the returned record has it, and a row that ends
    early is handed over while longer rows are still sampled."""
    model, tok = peaky_qwen2
    kw = dict(
        n=3,
        max_new_tokens=12,
        temperature=1.0,
        seed=1,
        check_every=check_every,
        batch_size=batch_size,
    )
    free = generate(model, tok, PROMPTS[:2], **kw)
    eos = free.completion_ids[0, 2].item()  # a token that turns up: some rows end on it
    free = generate(model, tok, PROMPTS[:2], eos_token_ids=[eos], **kw)
    steps, done = [0], {}

    def on_tokens(seqs, tokens):
        steps[0] += 1

    def on_done(q, row):
        assert q not in done
        done[q] = (steps[0], row)

    r = generate(
        model,
        tok,
        PROMPTS[:2],
        eos_token_ids=[eos],
        budgets=[4, 12],
        hooks=Hooks(on_tokens=on_tokens, on_done=on_done),
        **kw,
    )
    lens = r.completion_mask.sum(1).long().tolist()
    for q in range(6):
        n_free = int(free.completion_mask[q].sum())
        want = min(n_free, 4) if q < 3 else n_free
        assert lens[q] == want
        assert r.completion_ids[q, :want].tolist() == free.completion_ids[q, :want].tolist()
        torch.testing.assert_close(r.logprobs[q, :want], free.logprobs[q, :want])
        cut = q < 3 and n_free > 4
        assert r.finish_reason[q] == ("length" if cut else free.finish_reason[q])
    assert sorted(done) == list(range(6))
    for q, (_, row) in done.items():
        assert row["tokens"] == r.completion_ids[q, : lens[q]].tolist()
        assert row["finish"] == r.finish_reason[q] and row["text"] == r.completion_text[q]
        torch.testing.assert_close(torch.tensor(row["logprobs"]), r.logprobs[q, : lens[q]])
    if batch_size is None:  # one batch: the budgeted rows leave it before the last step
        assert steps[0] > 4 and max(done[q][0] for q in range(3)) <= 4
    with pytest.raises(ValueError, match="budgets"):
        generate(model, tok, PROMPTS[:2], budgets=[4], **kw)
    with pytest.raises(ValueError, match="budgets"):
        generate(model, tok, PROMPTS[:2], budgets=[0, 13], **kw)
