"""The typed step: ``collect`` -> ``Experience`` -> ``learn``. The loss mask travels apart from
the attention mask (a token can be attended to and not trained on), and the sampler's own
log-probs are those of the distribution it drew from (temperature, top-k, top-p)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from peergrade.config import load_config
from peergrade.generation.kernel import generate
from peergrade.training import trainer
from peergrade.training.experience import Experience
from peergrade.training.update import GRPO, Models
from test_update_fast import ConstantSchedule, RecordingOptimizer

# ----------------------------------------------------------------------------- the loss mask


def _grads(model, tok, loss_mask: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of one GRPO update (dr_grpo: a constant normaliser, so the loss is a sum
    of per-token terms) on two fixed sequences, every token attended to."""
    cfg = load_config(
        None,
        [
            ("model.device", "cpu"),
            ("rollout.prompts_per_step", 1),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("algo.loss_type", "dr_grpo"),
            ("optim.max_grad_norm", 0.0),
        ],
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12, 13, 14, 15]])  # 3 + 4 columns
    exp = Experience(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        rewards=torch.tensor([1.0, 0.0]),
        truncated=torch.tensor([True, True]),
        policy_version=1,
        advantages=torch.tensor([1.0, -1.0]),
    )
    policy = copy.deepcopy(model)
    opt = RecordingOptimizer(p for p in policy.parameters() if p.requires_grad)
    algo = GRPO(Models(policy, tok, None, torch.device("cpu")), opt, ConstantSchedule(), cfg)
    algo.update(exp, step=1)
    (grads,) = opt.grads
    return grads


def test_attended_untrained_token_is_in_the_context_and_out_of_the_loss(tiny_qwen2):
    """Row 0's token 1 attended to but not trained on (loss mask [1, 0, 1, 1]) plus that token
    alone (loss mask [0, 1, 0, 0]) trains exactly like every token: the per-token terms add up
    only if the masked token's successors still saw it (attention) and its own term was left
    out (loss). A loss mask derived from the attention mask trains the token twice; an
    attention mask derived from the loss mask changes its successors' log-probs."""
    model, tok = tiny_qwen2
    ones = torch.ones(2, 4)
    gap = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    only = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    g_gap, g_only, g_all = (
        _grads(model, tok, gap),
        _grads(model, tok, only),
        _grads(model, tok, ones),
    )
    assert any(g.abs().max() > 1e-4 for g in g_only)  # the token's own term is not negligible
    for a, b, full in zip(g_gap, g_only, g_all):
        torch.testing.assert_close(a + b, full, rtol=1e-5, atol=1e-7)
    # and leaving the token out does change the update
    assert any(not torch.allclose(a, full, atol=1e-6) for a, full in zip(g_gap, g_all))


def test_collect_keeps_the_loss_mask_apart(tiny_model_dir, monkeypatch):
    """A token the rollout marks as not trained on stays attended to in the Experience."""
    cfg = load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("rollout.top_k", 5),
            ("train.threads", 1),
        ],
    )
    run = trainer.setup(cfg)
    real_sample = trainer.sample

    def sample_with_a_gap(run, rows, step, row_keys):
        ro = real_sample(run, rows, step, row_keys)
        ro.loss_mask[:, 0] = 0.0  # e.g. an environment's answer: in the context, not trained
        return ro

    monkeypatch.setattr(trainer, "sample", sample_with_a_gap)
    rows = list(itertools.islice(run.task.train_rows(0), 2))
    exp = trainer.collect(run, 1, rows)
    ro = exp.sampled.samples
    N, C = exp.loss_mask.shape
    L = exp.input_ids.shape[1]
    assert exp.loss_mask is not exp.attention_mask and exp.attention_mask.shape == (N, L)
    assert ro.loss_mask is not ro.completion_mask
    assert (exp.loss_mask[:, 0] == 0).all()
    assert (exp.attention_mask[:, L - C] == 1).all()  # the first completion token is attended
    assert torch.equal(exp.loss_mask[:, 1:], ro.completion_mask[:, 1:])
    assert exp.policy_version == 0 and exp.advantages.shape == (N,)  # sampled by the start
    assert exp.sampler_logprobs.shape == (N, C) and exp.ref_logprobs is None
    metrics = trainer.learn(run, exp, 1)
    assert "advantage/std" in metrics and "loss/policy" in metrics


# ----------------------------------------------------------------------------- sampler log-probs


def _processed_logprobs(logits: torch.Tensor, tokens: torch.Tensor, T: float, top_k: int, top_p):
    """log p(token) under softmax(logits / T) cut to the top_k most probable, then to the
    smallest prefix (by probability) whose renormalised mass reaches top_p, renormalised."""
    probs = torch.softmax(logits.double() / T, dim=-1)  # [n, V]
    out = []
    for p, tok in zip(probs, tokens.tolist()):
        order = torch.argsort(p, descending=True)[:top_k]
        kept = p[order] / p[order].sum()
        before = torch.cumsum(kept, 0) - kept  # mass strictly before each candidate
        kept = kept * (before < top_p)
        kept = kept / kept.sum()
        where = (order == tok).nonzero()
        assert len(where) == 1 and kept[where[0, 0]] > 0, "a token outside the kept set"
        out.append(kept[where[0, 0]].log().item())
    return torch.tensor(out)


@pytest.mark.parametrize("top_k,top_p", [(5, 0.8), (0, 0.7), (3, 1.0)])
def test_sampler_logprobs_are_the_truncated_distributions(tiny_qwen2, top_k, top_p):
    model, tok = tiny_qwen2
    T = 0.7
    prompts = [[5, 6, 7], [8, 9]]
    ro = generate(
        model, tok, prompts, n=3, max_new_tokens=6, temperature=T, top_p=top_p, top_k=top_k, seed=3
    )
    ids, attn, _ = ro.training_batch(tok.pad_token_id)
    C = ro.completion_ids.shape[1]
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    L = ids.shape[1]
    pred = logits[:, L - C - 1 : L - 1]  # [N, C, V]: the logits that predict each token
    m = ro.completion_mask.bool()
    vocab = pred.shape[-1]
    want = _processed_logprobs(pred[m], ro.completion_ids[m], T, top_k or vocab, top_p)
    torch.testing.assert_close(ro.sampler_logprobs[m].double(), want.double(), atol=1e-5, rtol=0)
    assert (ro.sampler_logprobs[~m] == 0).all()
    # truncation matters: the full tempered distribution's log-probs are lower
    assert (ro.sampler_logprobs[m] >= ro.logprobs[m] - 1e-6).all()
    assert (ro.sampler_logprobs[m] > ro.logprobs[m] + 1e-3).any()


def test_sampler_logprobs_without_truncation_and_greedy(tiny_qwen2):
    model, tok = tiny_qwen2
    ro = generate(model, tok, [[5, 6, 7]], n=2, max_new_tokens=5, temperature=0.7, seed=1)
    assert torch.equal(ro.sampler_logprobs, ro.logprobs)  # nothing cut: the same distribution
    greedy = generate(model, tok, [[5, 6, 7]], n=1, max_new_tokens=5, temperature=0.0)
    assert (greedy.sampler_logprobs == 0).all()  # the argmax is drawn with probability 1


def test_ppo_fills_its_fields_of_the_experience(tiny_model_dir):
    """PPO's advantages are per token, with the critic's values and returns beside them."""
    cfg = load_config(
        None,
        [
            ("model.path", str(tiny_model_dir)),
            ("algo.name", "ppo"),
            ("algo.beta", 0.05),
            ("optim.minibatch_size", 2),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 2),
            ("rollout.max_completion_length", 4),
            ("train.threads", 1),
        ],
    )
    run = trainer.setup(cfg)
    rows = list(itertools.islice(run.task.train_rows(0), 2))
    exp = trainer.collect(run, 1, rows)
    N, C = exp.loss_mask.shape
    for t in (exp.advantages, exp.values, exp.returns, exp.old_logprobs, exp.ref_logprobs):
        assert t.shape == (N, C)
    assert "value/rollout_mean" in exp.metrics
    metrics = trainer.learn(run, exp, 1)
    assert "loss/value" in metrics and "value/rollout_mean" in metrics
