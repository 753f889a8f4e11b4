"""The faster update (issue 17): exact elision of zero-advantage completions, length-bucketed
micro-batches, and the shared-prompt forward all give the gradient of the plain update up to
float summation order."""

from __future__ import annotations

import copy

import pytest
import torch

from peergrade.algo import policy_loss
from peergrade.config import load_config
from peergrade.training.update import (
    Models,
    UpdateInputs,
    by_length,
    elided_rows,
    grpo_update,
    trim,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _batch(vocab: int, prompt_lens, group: int, max_c: int, seed: int = 0):
    """Left-padded prompts (each repeated for its group), right-padded completions of random
    lengths: (input_ids, attention_mask, completion_mask)."""
    g = torch.Generator().manual_seed(seed)
    P, Lp = len(prompt_lens), max(prompt_lens)
    N = P * group
    ids = torch.zeros(N, Lp + max_c, dtype=torch.long)
    am = torch.zeros(N, Lp + max_c, dtype=torch.long)
    cm = torch.zeros(N, max_c)
    for p, n in enumerate(prompt_lens):
        prompt = torch.randint(3, vocab, (n,), generator=g)
        for i in range(p * group, (p + 1) * group):
            ids[i, Lp - n : Lp] = prompt
            am[i, Lp - n : Lp] = 1
            c = int(torch.randint(1, max_c + 1, (1,), generator=g))
            ids[i, Lp : Lp + c] = torch.randint(3, vocab, (c,), generator=g)
            am[i, Lp : Lp + c] = 1
            cm[i, :c] = 1
    return ids, am, cm


class RecordingOptimizer:
    """Stands in for AdamW: records the gradient at every step and leaves the weights alone."""

    def __init__(self, params):
        self.params = list(params)
        self.grads: list[list[torch.Tensor]] = []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]
        )


class ConstantSchedule:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


class RowCounter:
    """Counts the sequences the model is run on (a forward pre-hook)."""

    def __init__(self, model):
        self.rows = 0
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        self.rows += x.shape[0]


def _update(model, tok, batch, adv, cfg):
    policy = copy.deepcopy(model)
    counter = RowCounter(policy.model)
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    models = Models(policy, tok, None, torch.device("cpu"))
    metrics = grpo_update(models, opt, ConstantSchedule(), UpdateInputs(batch, adv), cfg, step=3)
    return opt.grads, metrics, counter.rows


def _cfg(**over):
    base = {
        "model.device": "cpu",
        "rollout.prompts_per_step": 3,
        "rollout.group_size": 4,
        "rollout.max_completion_length": 6,
        "optim.minibatch_size": 6,  # two optimizer steps: the old-policy pass runs too
        "optim.micro_batch_size": 3,
        "optim.max_grad_norm": 0.0,
    }
    base.update(over)
    return load_config(None, list(base.items()))


# ----------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ratio_level", ("token", "sequence"))
def test_policy_loss_on_kept_rows_equals_full_batch(loss_type, ratio_level):
    """Rows with advantage 0 left out, stands_for/batch_tokens given: same loss, same gradient
    on the kept rows, and whole-batch loss metrics."""
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([0.0, 1.5, 0.0, -0.7, 0.0, 2.0])
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    kw = dict(
        loss_type=loss_type,
        ratio_level=ratio_level,
        max_completion_length=T,
        num_tokens=mask.sum() + 7,
        num_sequences=9,
    )
    full, m_full = policy_loss(logp, old, adv, mask, **kw)
    (g_full,) = torch.autograd.grad(full, logp)
    keep = adv != 0
    lp_k = logp.detach()[keep].requires_grad_()
    part, m_part = policy_loss(
        lp_k, old[keep], adv[keep], mask[keep], stands_for=B, batch_tokens=mask.sum(), **kw
    )
    (g_part,) = torch.autograd.grad(part, lp_k)
    torch.testing.assert_close(part, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_part, g_full[keep], rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(g_full[~keep]) == 0  # what was left out had no gradient
    for k in ("loss/policy", "loss/kl", "advantage/mean"):
        assert m_part[k] == pytest.approx(m_full[k], rel=1e-6, abs=1e-7), k


def test_policy_loss_checks_elision_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="stands_for"):
        policy_loss(x, x, torch.ones(2), torch.ones(2, 3), stands_for=1)
    with pytest.raises(ValueError, match="batch_tokens"):
        policy_loss(x, x, torch.ones(2), torch.ones(2, 3), loss_type="bnpo", batch_tokens=5)


def test_elided_rows_only_without_kl():
    adv = torch.tensor([0.0, 1.0, -0.0, 2.0])
    assert elided_rows(adv, kl_on=False).tolist() == [True, False, True, False]
    assert not elided_rows(adv, kl_on=True).any()  # the KL term still pulls them
    assert not elided_rows(adv, kl_on=False, enabled=False).any()


def test_by_length_is_stable_longest_first():
    cm = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    assert by_length(rows, cm).tolist() == [1, 5, 2, 0, 3, 4]
    assert by_length(torch.tensor([3, 0, 4]), cm).tolist() == [3, 0, 4]


# ----------------------------------------------------------------------------- the update


@pytest.mark.parametrize(
    "loss_type,ratio_level,shared",
    [(t, "token", False) for t in LOSS_TYPES]
    + [(t, "sequence", False) for t in LOSS_TYPES if t != "vespo"]  # vespo: token only
    + [(t, "token", True) for t in LOSS_TYPES],
)
def test_elision_gives_the_same_gradients(tiny_qwen2, loss_type, ratio_level, shared):
    """The fast update (elision; with the shared-prompt forward too) against the plain one."""
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6)
    # group 0 scores alike (all 0), group 1 has two completions at its mean, group 2 none
    adv = torch.tensor([0, 0, 0, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    over = {"algo.loss_type": loss_type, "algo.ratio_level": ratio_level}
    plain = {"algo.skip_zero_advantage": False, "model.shared_prompt_forward": False}
    ref, m_ref, rows_ref = _update(model, tok, batch, adv, _cfg(**over, **plain))
    fast = {"model.shared_prompt_forward": shared}
    got, m_got, rows_got = _update(model, tok, batch, adv, _cfg(**over, **fast))
    assert len(got) == len(ref) == 2
    for step_ref, step_got in zip(ref, got):
        for a, b in zip(step_ref, step_got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in got[0])  # the test compares something
    if not shared:  # the zero-advantage rows were never forwarded (old-policy pass, update)
        assert rows_got == rows_ref - 2 * 6
    assert m_got["update/elided_frac"] == pytest.approx(0.5)
    for k in ("loss/policy", "advantage/mean"):
        assert m_got[k] == pytest.approx(m_ref[k], rel=1e-4, abs=1e-6), k


def test_elision_keeps_rows_with_a_kl_term(tiny_qwen2):
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=2)
    adv = torch.tensor([0, 0, 0, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    cfg = _cfg(**{"algo.beta": 0.1, "algo.loss_type": "dapo", "model.shared_prompt_forward": False})
    ref_lp = torch.randn(12, 6) * 0.1 - 1.0
    policy = copy.deepcopy(model)
    counter = RowCounter(policy.model)
    opt = RecordingOptimizer(policy.parameters())
    models = Models(policy, tok, None, torch.device("cpu"))
    m = grpo_update(models, opt, ConstantSchedule(), UpdateInputs(batch, adv, ref_lp), cfg, step=1)
    assert m["update/elided_frac"] == 0.0
    assert counter.rows == 2 * 12  # old-policy pass and update, every row


def test_trim_after_by_length_keeps_every_counted_token():
    ids, am, cm = _batch(50, [2, 6], group=3, max_c=5, seed=4)
    rows = by_length(torch.arange(6), cm)
    for mb in (rows[:3], rows[3:]):
        _, _, c = trim(ids[mb], am[mb], cm[mb])
        assert c.sum() == cm[mb].sum()


# ----------------------------------------------------------------------------- shared prompt


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])
def test_shared_prompt_forward_matches_plain(request, fixture):
    """Each distinct prompt run once, its KV cache expanded to its completions: the same
    log-probs, entropies and gradients (prompt weights included) as the plain forward, with
    prompts of different lengths (left padding) and ragged completions."""
    from peergrade.model.logprobs import token_logprobs

    model, _ = request.getfixturevalue(fixture)
    model = copy.deepcopy(model).train()
    ids, am, cm = _batch(model.config.vocab_size, [3, 7, 5], group=4, max_c=6, seed=5)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    ids, am, cm = ids[perm], am[perm], cm[perm]  # groups need not be adjacent
    w = torch.randn(12, 6, generator=torch.Generator().manual_seed(1))
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(model, ids, am, cm, with_entropy=True, share_prompts=share)
        ((lp * w).sum() + 0.3 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((lp.detach(), ent.detach(), grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    assert lp0.abs().sum() > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_shared_prompt_forward_runs_each_prompt_once(tiny_qwen2):
    from peergrade.model.logprobs import token_logprobs

    model, _ = tiny_qwen2
    model = copy.deepcopy(model)
    counter = RowCounter(model.model)
    ids, am, cm = _batch(model.config.vocab_size, [3, 7, 5], group=4, max_c=6, seed=6)
    with torch.no_grad():
        token_logprobs(model, ids, am, cm, share_prompts=True)
    assert counter.rows == 3 + 12  # 3 prompts once, then 12 completions


def test_bf16_autocast_update_is_close_to_fp32(tiny_qwen2):
    """model.autocast: bf16 forwards, fp32 weights and gradients, the same update direction."""
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=7)
    adv = torch.tensor([0.2, -0.5, 0.3, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    over = {"optim.minibatch_size": 12, "optim.micro_batch_size": 12}
    g32, _, _ = _update(model, tok, batch, adv, _cfg(**over))
    g16, _, _ = _update(model, tok, batch, adv, _cfg(**over, **{"model.autocast": "bf16"}))
    a = torch.cat([g.flatten() for g in g32[0]])
    b = torch.cat([g.flatten() for g in g16[0]])
    assert b.dtype == torch.float32 and not torch.equal(a, b)  # it did run in bf16
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.98


def test_autocast_setting_resolves(tiny_qwen2, monkeypatch):
    from peergrade.training import update

    model, _ = tiny_qwen2
    assert update.use_bf16_autocast("bf16", "cpu", model)
    assert not update.use_bf16_autocast("off", "cpu", model)
    assert not update.use_bf16_autocast("auto", "cpu", model)  # ~0.1M parameters: too small
    monkeypatch.setattr(update, "AUTO_BF16_MIN_PARAMS", 1)
    monkeypatch.setattr(update, "cpu_bf16_pays", lambda: (True, "AMX"))
    assert update.use_bf16_autocast("auto", "cpu", model)
    assert not update.use_bf16_autocast("auto", "cuda", model)  # GPUs: the weights' dtype
    monkeypatch.setattr(update, "cpu_bf16_pays", lambda: (False, "neither"))
    assert not update.use_bf16_autocast("auto", "cpu", model)
    with pytest.raises(ValueError, match="model.autocast"):
        update.use_bf16_autocast("fp8", "cpu", model)


@pytest.mark.parametrize(
    ("flags", "ratio", "on", "why"),
    [
        ({"avx2", "amx_bf16", "avx512_bf16"}, None, True, "AMX"),
        ({"avx2", "avx512f", "avx512_bf16"}, None, True, "AVX512-BF16"),
        ({"avx2", "avx512f"}, None, False, "neither AMX nor AVX512-BF16"),
        (None, 0.5, True, "measured 0.50x"),  # no flags to read: a short measurement decides
        (None, 1.7, False, "measured 1.70x"),
    ],
)
def test_auto_precision_follows_the_cpus_bf16_units(flags, ratio, on, why, monkeypatch):
    """model.autocast auto: bf16 where the CPU has AMX or AVX512-BF16 (a model of 10M+ float32
    parameters), float32 where it has neither, a measurement where its flags are unknown; the
    reason is said."""
    from peergrade.training import update

    monkeypatch.setattr(update, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(update, "_measured_bf16_ratio", lambda: ratio)
    update.cpu_bf16_pays.cache_clear()
    try:
        got, reason = update.auto_bf16("cpu", torch.float32, 34_000_000)
        assert got is on and why in reason, reason
        small = update.auto_bf16("cpu", torch.float32, 750_000)
        assert small[0] is False and "0.75M parameters" in small[1]
        assert update.auto_bf16("cpu", torch.bfloat16, 34_000_000)[0] is False
        assert update.auto_bf16("cuda", torch.float32, 34_000_000)[0] is False
    finally:
        update.cpu_bf16_pays.cache_clear()


def test_bnpo_micro_batch_left_out_entirely(tiny_qwen2):
    """bnpo keeps its micro-batches: [0, 1, 2] is all zero advantages and is never run, yet
    the gradient and the loss metric are the plain update's."""
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=8)
    adv = torch.tensor([0, 0, 0, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    over = {
        "algo.loss_type": "bnpo",
        "optim.minibatch_size": 12,
        "model.shared_prompt_forward": False,
    }
    ref, m_ref, rows_ref = _update(
        model, tok, batch, adv, _cfg(**over, **{"algo.skip_zero_advantage": False})
    )
    got, m_got, rows_got = _update(model, tok, batch, adv, _cfg(**over))
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert rows_got == rows_ref - 6
    assert m_got["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-7)
    assert m_got["advantage/mean"] == pytest.approx(m_ref["advantage/mean"], rel=1e-6)


# ----------------------------------------------------------------------------- issue 37 variants


def _sum_grads(a, b):
    return [[x + y for x, y in zip(sa, sb)] for sa, sb in zip(a, b)]


def test_entropy_bonus_is_linear_and_keeps_zero_advantage_rows(tiny_qwen2):
    """L - c H: the gradient is the policy gradient plus the pure entropy gradient (an update
    with every advantage 0, which is then neither skipped nor elided)."""
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=8)
    adv = torch.tensor([0, 0, 0, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    zero = torch.zeros(12)
    bonus = {"algo.entropy_coef": 0.3}
    g_pg, _, _ = _update(model, tok, batch, adv, _cfg())
    plain = {"model.shared_prompt_forward": False}  # rows counted one forward each
    g_h, m_h, rows_h = _update(model, tok, batch, zero, _cfg(**bonus, **plain))
    g_all, m_all, _ = _update(model, tok, batch, adv, _cfg(**bonus))
    assert m_h["update/elided_frac"] == 0.0 and m_h["update/zero_signal_frac"] == 0.0
    assert rows_h == 2 * 12  # old-policy pass and update, every row
    assert any(g.abs().sum() > 0 for g in g_h[0])
    assert m_all["entropy/coef"] == pytest.approx(0.3)
    for step_sum, step_all in zip(_sum_grads(g_pg, g_h), g_all):
        for a, b in zip(step_sum, step_all):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    # without the bonus, all-zero advantages give exactly zero gradient (skipped)
    g0, m0, _ = _update(model, tok, batch, zero, _cfg())
    assert all(g.abs().sum() == 0 for step in g0 for g in step)


def test_adaptive_entropy_coefficient_moves_per_optimizer_step(tiny_qwen2):
    """use_adaptive_entropy: the first optimizer step applies no bonus (no entropy measured
    yet), then the coefficient rises by entropy_coef_delta per step while entropy <= target."""
    from peergrade.training.update import EntropyControl

    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=9)
    adv = torch.tensor([0.2, 0, -0.2, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    over = {
        "algo.entropy_coef": 0.1,
        "algo.use_adaptive_entropy": True,
        "algo.entropy_target": 100.0,
        "algo.entropy_coef_delta": 0.05,
    }
    cfg = _cfg(**over)
    policy = copy.deepcopy(model)
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    models = Models(policy, tok, None, torch.device("cpu"))
    state = EntropyControl(0.1)
    grpo_update(
        models, opt, ConstantSchedule(), UpdateInputs(batch, adv), cfg, step=3, entropy=state
    )
    assert state.coef == pytest.approx(0.2)  # two optimizer steps, each + 0.05
    assert 0 < state.last_entropy <= 100.0
    g_pg, _, _ = _update(model, tok, batch, adv, _cfg())
    g_h, _, _ = _update(model, tok, batch, torch.zeros(12), _cfg(**{"algo.entropy_coef": 0.15}))
    for a, b in zip(g_pg[0], opt.grads[0]):  # step 1: coefficient 0.1, not applied yet
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for a, b in zip(_sum_grads(g_pg, g_h)[1], opt.grads[1]):  # step 2: 0.15 applied
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_opsm_drops_negative_advantage_rows_far_from_the_sampler(tiny_qwen2):
    """Sampler log-probs 5 nats above the policy's: every negative-advantage completion's mean
    KL is 5 > 0.5, so the update is the one with those advantages set to 0."""
    from peergrade.training.update import frozen_logprobs

    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=10)
    adv = torch.tensor([0.2, 0, -0.2, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    cfg = _cfg(**{"algo.off_policy_mask_threshold": 0.5, "algo.loss_type": "dapo"})
    policy = copy.deepcopy(model)
    behaviour = frozen_logprobs(policy, batch, cfg) + 5.0
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    models = Models(policy, tok, None, torch.device("cpu"))
    exp = UpdateInputs(batch, adv, sampler_logprobs=behaviour)
    m = grpo_update(models, opt, ConstantSchedule(), exp, cfg, 3)
    # over the computed completions: the 8 with a nonzero advantage (4 elided), 4 negative
    assert m["opsm/masked_frac"] == pytest.approx(4 / 8, abs=1e-6)
    g_pos, _, _ = _update(model, tok, batch, adv.clamp(min=0), _cfg(**{"algo.loss_type": "dapo"}))
    for step_ref, step_got in zip(g_pos, opt.grads):
        for a, b in zip(step_ref, step_got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_top_entropy_quantile_trains_on_a_subset(tiny_qwen2):
    model, tok = tiny_qwen2
    batch = _batch(model.config.vocab_size, [3, 5, 4], group=4, max_c=6, seed=11)
    adv = torch.tensor([0.2, 0, -0.2, 0, 0.5, 0, -0.5, 0, 1.0, -1.0, 0.3, -0.3])
    g_all, _, _ = _update(model, tok, batch, adv, _cfg())
    g_one, m_one, _ = _update(model, tok, batch, adv, _cfg(**{"algo.top_entropy_quantile": 1.0}))
    g_sel, m_sel, _ = _update(model, tok, batch, adv, _cfg(**{"algo.top_entropy_quantile": 0.2}))
    assert "entropy/selected_frac" not in m_one  # 1.0 is off
    assert 0.1 < m_sel["entropy/selected_frac"] <= 0.5
    assert m_sel["update/elided_frac"] == 0.0
    for a, b in zip(g_all[0], g_one[0]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    diff = sum(float((a - b).abs().sum()) for a, b in zip(g_all[0], g_sel[0]))
    assert diff > 1e-4


def test_gdpo_advantages_from_the_step_scores(tiny_qwen2):
    """multi_objective_aggregation normalize_then_sum: GRPO.advantages reads each reward
    function's scores and weights from the step's RewardScores."""
    from types import SimpleNamespace

    from peergrade.algo.advantages import gdpo_advantages
    from peergrade.rewards import RewardScores
    from peergrade.training.update import GRPO

    model, tok = tiny_qwen2
    cfg = _cfg(**{"algo.multi_objective_aggregation": "normalize_then_sum"})
    f0 = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0])
    f1 = torch.tensor([0.5, 0.5, 0, 0, 1, 0, 1, 0, 2, 2, 2, 2])
    scores = RewardScores(
        per_fn={"a": f0, "b": f1}, total=f0 + 0.2 * f1, weights={"a": 1.0, "b": 0.2}
    )
    exp = SimpleNamespace(rewards=scores.total, sampled=SimpleNamespace(scores=scores))
    GRPO(Models(model, tok, None, torch.device("cpu")), None, None, cfg).advantages(exp)
    expected = gdpo_advantages(
        torch.stack([f0, f1], dim=1).view(3, 4, 2), torch.tensor([1.0, 0.2])
    ).reshape(-1)
    torch.testing.assert_close(exp.advantages, expected)
    assert exp.advantages.abs().sum() > 0
