"""The shared update (peergrade.training.update): gradient accumulation over micro-batches optimises the
minibatch's loss for every loss type, and the logged losses are what their names say."""

from __future__ import annotations

import copy

import pytest
import torch

from peergrade.algo import policy_loss
from peergrade.config import load_config
from peergrade.model.logprobs import token_logprobs
from peergrade.training.update import (
    Models,
    UpdateInputs,
    build_optimizer,
    build_scheduler,
    grpo_update,
)


def _batch(tok, N=8, P=5, C=4, seed=0):
    """Left-padded prompts, ragged completions: (input_ids, attention_mask, cmask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(tok), (N, P + C), generator=g)
    am = torch.ones(N, P + C, dtype=torch.long)
    cm = torch.ones(N, C)
    for i in range(N):
        pad = i % 3
        ids[i, :pad] = tok.pad_token_id
        am[i, :pad] = 0
        stop = C - i % 3  # ragged: micro-batches of two hold 7, 6, 5 and 7 tokens
        cm[i, stop:] = 0
        am[i, P + stop :] = 0
    return ids, am, cm


def _cfg(tiny_model_dir, **over):
    base = {
        "model.path": str(tiny_model_dir),
        "model.device": "cpu",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 2,
        "rollout.max_completion_length": 4,
        "optim.lr": 1e-3,
        "optim.max_grad_norm": 0.0,  # compare raw steps: no clipping
    }
    base.update(over)
    return load_config(None, list(base.items()))


def _step(model, tok, cfg, batch, adv, ref_lp=None):
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, cfg)
    m = grpo_update(
        Models(model, tok, None, torch.device("cpu")),
        opt,
        sched,
        UpdateInputs(batch, adv, ref_lp),
        cfg,
        1,
    )
    return model, m


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_micro_batches_take_the_whole_batch_step(tiny_qwen2, tiny_model_dir, loss_type):
    """One optimizer step over 8 completions: in one micro-batch, or accumulated over four of
    two. SGD would show any mis-weighting directly; AdamW's first step is sign-like, so the
    gradients themselves are compared (through a zero-lr copy) as well as the weights."""
    model, tok = tiny_qwen2
    batch = _batch(tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.3])
    grads: dict[int, list] = {}
    for micro in (8, 2):
        cfg = _cfg(tiny_model_dir, **{"algo.loss_type": loss_type, "optim.micro_batch_size": micro})
        m = copy.deepcopy(model)
        m.zero_grad(set_to_none=True)

        class Capture(torch.optim.Optimizer):  # records the accumulated gradient, steps nothing
            def step(self, closure=None, key=micro):
                grads[key] = [p.grad.clone() for g in self.param_groups for p in g["params"]]

        params = [p for p in m.parameters() if p.requires_grad]
        opt = Capture(params, {"lr": 0.0})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        models = Models(m, tok, None, torch.device("cpu"))
        grpo_update(models, opt, sched, UpdateInputs(batch, adv), cfg, 1)
    if loss_type == "bnpo":  # bnpo is a token mean per micro-batch: size-weighted, not equal
        assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(grads[8], grads[2]))
        return
    for a, b in zip(grads[8], grads[2]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[8])


def test_logged_policy_loss_is_the_surrogate_and_kl_is_separate(tiny_qwen2, tiny_model_dir):
    """With beta > 0, ``loss/policy`` is the clipped surrogate alone and ``loss/kl`` the KL part
    (they used to be averaged together into loss/policy)."""
    model, tok = tiny_qwen2
    ii, am, cm = _batch(tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.3])
    ref_lp = torch.full(cm.shape, -3.0) * cm
    cfg = _cfg(tiny_model_dir, **{"algo.beta": 0.1, "optim.micro_batch_size": 8})
    with torch.no_grad():
        logp = token_logprobs(model, ii, am, cm)
    _, want = policy_loss(logp, logp, adv, cm, ref_logp=ref_lp, beta=0.1)
    _, got = _step(model, tok, cfg, (ii, am, cm), adv, ref_lp)
    for key in ("loss/policy", "loss/kl", "kl/mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert got["loss/kl"] > 0
