"""TRL's names keep TRL's meaning (issue 50): a script that changes only its import trains the
same. Each case builds the loss two ways on the same tensors: TRL 1.16's own
``GRPOTrainer._compute_loss`` (called on a stand-in trainer holding just what that method
reads), and peergrade's ``policy_loss`` with the options ``peergrade.GRPOConfig(...)`` maps the
same fields to (``to_config().algo``) and the update's token normaliser. Loss and gradient
must agree to float64 rounding.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from peergrade import GRPOConfig
from peergrade.algo.losses import policy_loss
from peergrade.training.update import token_normaliser

VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _trl_loss(fields: dict, logp, old, ref, adv, mask, *, num_items, ga=1, spg=1):
    """TRL's ``_compute_loss`` on these tensors, training mode, one process."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    options = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", *VESPO)
    defaults = {f: getattr(TRLConfig, f) for f in ("epsilon", "beta", "loss_type", *options)}
    args = SimpleNamespace(
        use_bias_correction_kl=fields.get("use_bias_correction_kl", True),
        steps_per_generation=spg,
        importance_sampling_level=fields.get("importance_sampling_level", "token"),
        **{f: fields.get(f, defaults[f]) for f in options},
    )
    eps = fields.get("epsilon", defaults["epsilon"])
    eps_high = fields.get("epsilon_high")
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=args.importance_sampling_level,
        beta=fields.get("beta", defaults["beta"]),
        args=args,
        loss_type=fields.get("loss_type", defaults["loss_type"]),
        epsilon_low=eps,
        epsilon_high=eps if eps_high is None else eps_high,  # as TRL's __init__ sets it
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        max_completion_length=logp.shape[1],
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=TRLTrainer.get_gamma_weights,
        accelerator=SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=lambda t: t,
            gather_for_metrics=lambda t: t,
            reduce=lambda t, reduction: t,
        ),
    )
    B, T = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(num_items), dtype=torch.float64),
    }
    return TRLTrainer._compute_loss(trainer, None, inputs)


def _ours(fields: dict, logp, old, ref, adv, mask, *, row_tokens, rows):
    """peergrade's loss for the same rows with the options GRPOConfig maps ``fields`` to."""
    cfg = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=2, **fields)
    a = cfg.to_config().algo
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_type=a.loss_type,
        ratio_level=a.ratio_level,
        clip_eps=a.clip_eps,
        clip_eps_high=a.clip_eps_high,
        ref_logp=ref,
        beta=a.beta,
        kl_estimator=a.kl_estimator,
        max_completion_length=logp.shape[1],
        num_tokens=token_normaliser(a.token_normaliser, row_tokens, rows),
        kl_bias_correction=a.kl_bias_correction,
        cispo_cap=a.cispo_cap,
        delta=a.delta,
        sapo_temperature_pos=a.sapo_temperature_pos,
        sapo_temperature_neg=a.sapo_temperature_neg,
        **{k: getattr(a, k) for k in VESPO},
    )
    return loss


def _tensors(seed: int, B: int = 4, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    mask[:, 0] = 1
    return logp, old, ref, adv, mask


def _both(fields, seed, **kw):
    logp, old, ref, adv, mask = _tensors(seed)
    rows = torch.arange(logp.shape[0])
    theirs = _trl_loss(fields, logp, old, ref, adv, mask, num_items=mask.sum(), **kw)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    ours = _ours(fields, logp, old, ref, adv, mask, row_tokens=mask.sum(1), rows=rows)
    (g_ours,) = torch.autograd.grad(ours, logp)
    return (theirs, g_theirs), (ours, g_ours)


def _assert_same(a, b, rtol=1e-12):
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=rtol / 10)
    torch.testing.assert_close(a[1], b[1], rtol=rtol, atol=rtol / 10)


@pytest.mark.parametrize("bias_correction", [True, False, None])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo"])
def test_kl_bias_correction_is_trls_both_ways(bias_correction, level, loss_type):
    """use_bias_correction_kl True (TRL's default, None here) and False give TRL's loss and
    gradient, off-policy, at the token and the sequence level."""
    fields = {"beta": 0.1, "loss_type": loss_type, "importance_sampling_level": level}
    if bias_correction is not None:
        fields["use_bias_correction_kl"] = bias_correction
    for seed in range(3):
        theirs, ours = _both(fields, seed)
        _assert_same(theirs, ours)


def test_the_issues_kl_gradient_on_policy():
    """beta 0.1, advantage 0, on-policy: TRL's gradient [0.01667, -0.01, -0.03333]; without the
    correction the k3 estimate's own gradient (peergrade's native default)."""
    logp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.2, -1.0]], dtype=torch.float64)
    adv, mask = torch.zeros(1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.long)
    want = {
        True: [0.1 * (lp - r) / 3 for lp, r in zip([-1.0, -0.5, -2.0], [-1.5, -0.2, -1.0])],
        False: (0.1 * (1 - torch.exp(ref - logp.detach())) / 3)[0].tolist(),
    }
    for correction, grad in want.items():
        fields = {"beta": 0.1, "use_bias_correction_kl": correction}
        loss = _ours(
            fields,
            logp,
            logp.detach(),
            ref,
            adv,
            mask,
            row_tokens=mask.sum(1),
            rows=torch.arange(1),
        )
        (g,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(g[0], torch.tensor(grad, dtype=torch.float64))
    assert [round(x, 5) for x in want[True]] == [0.01667, -0.01, -0.03333]


@pytest.mark.parametrize(
    "fields",
    [
        {"loss_type": "dapo", "delta": 1.3, "epsilon_high": 0.28},
        {"loss_type": "grpo", "delta": 1.5, "epsilon": 0.1},
        {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.6},
        {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5},
        {"loss_type": "vespo", "vespo_k_neg": 2.0, "vespo_lambda_neg": 0.5, "beta": 0.2},
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.05},
        {"loss_type": "bnpo", "epsilon": 0.1, "epsilon_high": 0.4, "beta": 0.3},
    ],
)
def test_the_loss_options_are_trls(fields):
    """The other loss fields of GRPOConfig (delta, SAPO's temperatures, VESPO's shape and decay,
    epsilon, epsilon_high, importance_sampling_level, beta) give TRL's loss and gradient."""
    # TRL forms SAPO's tau with torch.where over Python floats: a float32 tensor, so its
    # temperatures carry float32 rounding (1e-8 relative) into a float64 loss
    rtol = 1e-6 if fields["loss_type"] == "sapo" else 1e-12
    for seed in range(3):
        theirs, ours = _both(fields, seed)
        _assert_same(theirs, ours, rtol)


@pytest.mark.parametrize("eps_high", [None, 0.28, 5.0])
def test_cispo_caps_the_weight_at_epsilon_high_as_trl_does(eps_high):
    """CISPO through GRPOConfig: the weight is capped at epsilon_high itself (epsilon when
    None), as in TRL, not at 1 + epsilon_high."""
    fields = {"loss_type": "cispo", "epsilon_high": eps_high, "beta": 0.0}
    for seed in range(3):
        theirs, ours = _both(fields, seed)
        _assert_same(theirs, ours)
    algo = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=2, **fields)
    assert algo.to_config().algo.cispo_cap == (0.2 if eps_high is None else eps_high)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_token_mean_normaliser_over_several_optimizer_steps_is_trls(loss_type):
    """steps_per_generation 4 > gradient_accumulation_steps 2: one generated batch of 8 rows
    makes two optimizer steps of two micro-batches each. TRL divides each micro-batch's sum by
    the batch's tokens per optimizer step; so does GRPOConfig's token_normaliser (batch_mean).
    Per optimizer step the summed micro-batch gradients equal peergrade's minibatch gradient."""
    g = torch.Generator().manual_seed(5)
    B, T = 8, 7
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 1, 2, 7, 3, 6, 2, 1])  # unequal steps: the two rules differ
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    fields = {"loss_type": loss_type, "beta": 0.04, "epsilon_high": 0.28}
    for step_rows in (torch.arange(0, 4), torch.arange(4, 8)):
        theirs = sum(
            _trl_loss(
                fields,
                logp[mb],
                old[mb],
                ref[mb],
                adv[mb],
                mask[mb],
                num_items=mask.sum(),
                ga=2,
                spg=4,
            )
            for mb in step_rows.split(2)
        )
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        r = step_rows
        ours = _ours(
            fields, logp[r], old[r], ref[r], adv[r], mask[r], row_tokens=mask.sum(1), rows=r
        )
        (g_ours,) = torch.autograd.grad(ours, logp)
        _assert_same((theirs, g_theirs), (ours, g_ours))
        own = token_normaliser("minibatch", mask.sum(1), r)
        assert own != token_normaliser("batch_mean", mask.sum(1), r)  # the case tells them apart


def test_native_defaults_are_explicit_and_documented():
    """A native config keeps peergrade's own defaults (the DeepSeekMath KL term, the paper's
    CISPO cap, each minibatch's own token count); GRPOConfig sets TRL's."""
    from peergrade.config import Config

    native = Config().algo
    assert (native.kl_bias_correction, native.cispo_cap, native.token_normaliser) == (
        False,
        None,
        "minibatch",
    )
    trl = GRPOConfig(max_steps=1, per_device_train_batch_size=4, num_generations=2).to_config()
    assert (trl.algo.kl_bias_correction, trl.algo.token_normaliser) == (True, "batch_mean")
