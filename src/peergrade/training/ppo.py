"""PPO with a learned critic: the baseline GRPO is measured against (``algo.name: ppo``).

What this module does
---------------------
GRPO's baseline is the group mean; PPO's is a *value model* V(s_t) that predicts the return
from every completion prefix. Everything else (rollout, rewards, reference, log-probs, the
update skeleton, the step) is shared with GRPO (``peergrade.training.update``, ``peergrade.training.trainer``);
the math is in ``peergrade.algo``. This module adds what is truly PPO's:

* ``ValueModel``: a causal-LM backbone (everything up to the final norm, no ``lm_head``) plus a
  scalar head ``nn.Linear(hidden, 1)`` kept in float32. ``build_critic`` loads it from
  ``algo.critic_path`` or, by default, from the policy's own directory (a second full copy of
  the backbone -- the memory GRPO saves), with its own AdamW (``algo.critic_lr``, default
  ``optim.lr``). The value of completion token j is read at the column that predicts it, the
  same alignment as the log-probs: V_j = head(h_{L-C+j-1}).
* ``ppo_advantages``: rollout-time values, per-token rewards (``algo.token_rewards``: the
  sequence reward on the last token, minus beta * k1 KL per token when ``algo.kl_in_reward``),
  GAE (``algo.gae``), then whitening over all counted tokens (``algo.whiten``). Returns
  R_t = A_t + V_t (before whitening) are the critic's targets.
* ``ppo_update``: the shared update skeleton (``update.run_update``) where each micro-batch
  backpropagates ``policy_loss + vf_coef * value_loss``: ``algo.policy_loss`` with per-token
  advantages ``[B, T]`` and ``loss_type="dapo"`` (token mean over the minibatch), and
  ``algo.value_loss`` (clipped around the rollout-time values, token mean over the minibatch).
  The two losses share no parameters, so the value loss's gradient reaches only the critic and
  the policy loss's only the policy. Each network's gradient norm is clipped to
  ``optim.max_grad_norm`` separately, then both optimizers step.
* ``PPO``: the two behind the trainer's ``update.Algorithm`` interface, on an ``Experience``
  (its advantages, returns, rollout-time values and old log-probs are ``[N, C]``).
* ``CriticCheckpointState``: wraps the policy optimizer so that a checkpoint's
  ``training_state.pt`` also holds the critic's weights and optimizer (exact resume).

What it deliberately does not do
--------------------------------
No separate reward model (the verifiable rewards are the "reward model"), no adaptive KL
controller, no value-head-on-the-policy sharing (the critic is a separate network, as in
InstructGPT and OpenRLHF, which is what makes PPO cost more memory than GRPO), no LoRA on the
critic (it is always fully fine-tuned), no entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from peergrade import distributed as dist
from peergrade.algo import (
    ClippedLoss,
    LossCounts,
    LossOptions,
    gae,
    kl_divergence,
    policy_loss,
    value_loss,
)
from peergrade.algo.advantages import token_rewards
from peergrade.model.load import (
    find_backbone_and_head,
    load_model,
    position_ids_from_mask,
    resolve_dtype,
    resolve_model_path,
)
from peergrade.training.experience import Experience
from peergrade.training.update import (
    Models,
    Trainee,
    UpdateInputs,
    build_optimizer,
    frozen_logprobs,
    logprobs_of,
    micro_batches,
    run_update,
    trim,
)

__all__ = [
    "ValueModel",
    "Critic",
    "build_critic",
    "ppo_advantages",
    "ppo_update",
    "CriticCheckpointState",
    "PPO",
]


# ----------------------------------------------------------------------------- the critic


class ValueModel(nn.Module):
    """A causal-LM backbone with a scalar value head. ``forward`` returns ``[B, C]`` values."""

    def __init__(self, backbone: nn.Module, hidden_size: int, *, init_std: float = 0.02):
        super().__init__()
        self.backbone = backbone
        p = next(backbone.parameters())
        self.value_head = nn.Linear(hidden_size, 1, device=p.device, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, std=init_std)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, completion_len: int) -> torch.Tensor:
        """Values of the last ``completion_len`` tokens: V_j from the hidden state that predicts
        token j (column L-C+j-1), like ``token_logprobs``.  # [B, C] float32"""
        B, L = input_ids.shape
        C = int(completion_len)
        if not 0 < C < L:
            raise ValueError(f"completion_len={C} with L={L} columns: need 0 < C < L")
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        h = hidden[:, L - C - 1 : L - 1].float()  # [B, C, H]
        return self.value_head(h).squeeze(-1)  # [B, C]


class Critic:
    """The value model and its optimizer (its own AdamW, constant learning rate)."""

    def __init__(self, model: ValueModel, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def build_value_model(
    path: str, *, dtype: str, device, gradient_checkpointing: bool, vocab_size: int | None = None
) -> ValueModel:
    """Load the causal LM in ``path``, keep its backbone (drop ``lm_head``), add a value head."""
    lm = load_model(
        path, dtype=dtype, device=str(device), gradient_checkpointing=gradient_checkpointing
    )
    cfg = lm.config
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(
            f"critic model {path!r} has vocab_size {cfg.vocab_size}, smaller than the policy's "
            f"{vocab_size}: the critic reads the policy's token ids, so it must share its "
            "tokenizer (set algo.critic_path to a model with the same vocabulary)"
        )
    backbone, _ = find_backbone_and_head(lm)
    hidden = getattr(cfg, "hidden_size", None) or cfg.get_text_config().hidden_size
    vm = ValueModel(backbone, hidden)
    del lm  # the lm_head (untied) goes with it; a tied head is the embedding, kept by the backbone
    return vm


def build_critic(cfg, models: Models) -> Critic:
    """The critic for ``cfg`` (``algo.critic_path`` or a copy of the policy), on the policy's
    device and dtype, with its AdamW."""
    a = cfg.algo
    path = resolve_model_path(a.critic_path or cfg.model.path)
    dtype = resolve_dtype(cfg.model.dtype, models.device)
    gc = cfg.gradient_checkpointing_on(models.device.type)
    vocab = getattr(models.policy.config, "vocab_size", None)
    vm = build_value_model(
        path, dtype=dtype, device=models.device, gradient_checkpointing=gc, vocab_size=vocab
    )
    vm.train()
    opt = build_optimizer((p for p in vm.parameters() if p.requires_grad), cfg.optim, a.critic_lr)
    return Critic(vm, opt)


class CriticCheckpointState:
    """Quacks like the policy optimizer for ``checkpoint.save_checkpoint`` /
    ``optimizer.load_state_dict``; its state also carries the critic (weights + AdamW)."""

    def __init__(self, optimizer: torch.optim.Optimizer, critic: Critic):
        self.optimizer = optimizer
        self.critic = critic

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.optimizer.state_dict(), "critic": self.critic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "critic" not in state:
            raise ValueError(
                "this checkpoint has no critic state (it was saved by a GRPO run): resume it "
                "with algo.name=grpo"
            )
        self.optimizer.load_state_dict(state["policy"])
        self.critic.load_state_dict(state["critic"])


# ----------------------------------------------------------------------------- advantages


@torch.no_grad()
def critic_values(critic: Critic, batch, micro: int) -> torch.Tensor:
    """Rollout-time values of every sequence, ``[N, C]`` float32 (0 on padding)."""
    input_ids, attention_mask, cmask = batch
    out = torch.zeros(cmask.shape, dtype=torch.float32, device=cmask.device)
    was_training = critic.model.training
    critic.model.eval()
    for mb in micro_batches(torch.arange(cmask.shape[0], device=cmask.device), micro):
        ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
        out[mb, : cm.shape[1]] = critic.model(ii, am, cm.shape[1]) * cm
    critic.model.train(was_training)
    return out


def ppo_advantages(critic: Critic, models: Models, batch, seq_rewards, ref_lp, cfg):
    """Token rewards -> GAE -> whitened advantages. Returns a dict with ``advantages``,
    ``returns``, ``old_values`` (all ``[N, C]``), ``old_logp`` (``[N, C]`` or None when the
    single-update shortcut applies), and scalar ``metrics``."""
    input_ids, attention_mask, cmask = batch
    a = cfg.algo
    kl_reward = a.kl_in_reward and cfg.uses_reference and ref_lp is not None
    single_update = cfg.updates_per_step == 1
    # The sampling policy's log-probs: needed for the KL reward, and as old_logp when the policy
    # moves between minibatches. Otherwise old = logp.detach() inside the update is exact.
    old_lp = frozen_logprobs(models.policy, batch, cfg) if kl_reward or not single_update else None
    values = critic_values(critic, batch, cfg.micro_batch_size)  # [N, C]
    rewards = token_rewards(
        seq_rewards.to(cmask.device),
        cmask,
        old_logp=old_lp,
        ref_logp=ref_lp,
        beta=a.beta if kl_reward else 0.0,
    )  # [N, C]
    adv, returns = gae(rewards, values, cmask, gamma=a.gamma, lam=a.lam)  # [N, C] each
    # Token means and the whitening statistics span every rank's tokens (distributed: identity
    # in one process).
    metrics = {
        "value/rollout_mean": dist.masked_mean(values, cmask),
        "returns/mean": dist.masked_mean(returns, cmask),
        "advantage/raw_mean": dist.masked_mean(adv, cmask),
        "advantage/std": dist.masked_std(adv, cmask),
    }
    if kl_reward:
        kl = kl_divergence(old_lp, ref_lp, "k1")  # [N, C]
        metrics["reward/kl_penalty_mean"] = dist.masked_mean(kl, cmask, -a.beta)
    return {
        "advantages": dist.whiten(adv, cmask),
        "returns": returns,
        "old_values": values,
        "old_logp": old_lp,
        "metrics": metrics,
    }


# ----------------------------------------------------------------------------- the update


def ppo_update(
    models: Models,
    critic: Critic,
    optimizer,
    scheduler,
    exp: Experience | UpdateInputs,
    cfg,
    step: int,
) -> dict[str, float]:
    """mu passes of minibatch updates of the policy and the critic on ``exp``; returns averaged
    metrics.

    ``exp.advantages``, ``returns``, ``values`` (rollout-time), ``old_logprobs`` and
    ``ref_logprobs``: ``[N, C]`` (``old_logprobs`` may be None only with one optimizer step per
    batch, where the old policy is the current one; ``ref_logprobs`` None without a reference).
    """
    a = cfg.algo
    advantages, returns, old_values = exp.advantages, exp.returns, exp.values
    old_lp, ref_lp = exp.old_logprobs, exp.ref_logprobs
    options = LossOptions(
        ClippedLoss("dapo"),  # token mean over the minibatch
        clip_eps=a.clip_eps,
        clip_eps_high=a.clip_eps_high,
        # KL in the reward: the loss has no KL term, but kl/mean is still reported.
        beta=0.0 if a.kl_in_reward else a.beta,
        kl_estimator=a.kl_estimator,
        kl_bias_correction=a.kl_bias_correction,
    )

    def micro_loss(mb, mini_idx, trimmed, num_tokens, metrics) -> torch.Tensor:
        ii, am, cm = trimmed
        Tc = cm.shape[1]
        logp, ent = logprobs_of(models.policy, ii, am, cm, cfg, with_entropy=True)
        pl, m = policy_loss(
            logp,
            logp.detach() if old_lp is None else old_lp[mb, :Tc],
            advantages[mb, :Tc],
            cm,
            options,
            ref_logp=None if ref_lp is None else ref_lp[mb, :Tc],
            counts=LossCounts(num_tokens=num_tokens),
        )
        v = critic.model(ii, am, Tc)  # [mb, Tc]
        vl, vm = value_loss(v, old_values[mb, :Tc], returns[mb, :Tc], cm, clip_eps=a.value_clip_eps)
        # value_loss is this micro-batch's token mean: reweight to the minibatch's.
        vl = vl * (cm.sum() / num_tokens)
        # Losses here are this micro-batch's share of the minibatch's token mean; the weighted
        # average times len(mini)/len(mb) sums the shares per minibatch.
        w, share = len(mb), len(mini_idx) / len(mb)
        metrics.add("loss/value", vl.item() * share, w)
        for k, val in {**m, **vm}.items():
            metrics.add(k, float(val) * (share if k.startswith("loss/") else 1.0), w)
        metrics.add_entropy(ent, cm)
        return pl + a.vf_coef * vl

    policy_params = [p for p in models.policy.parameters() if p.requires_grad]
    trainees = [
        Trainee(policy_params, optimizer, scheduler),
        Trainee(critic.parameters(), critic.optimizer, None, "grad/critic_norm"),
    ]
    models.policy.train()
    critic.model.train()
    metrics = run_update(exp.batch, cfg, step, trainees, micro_loss)
    return {**metrics.means(), "optim/lr": scheduler.get_last_lr()[0]}


# ----------------------------------------------------------------------------- the interface


@dataclass
class PPO:
    """``update.Algorithm`` for PPO: critic + GAE advantages, then ``ppo_update``."""

    models: Models
    critic: Critic
    optimizer: Any
    scheduler: Any
    cfg: Any

    def advantages(self, exp: Experience) -> None:
        out = ppo_advantages(
            self.critic, self.models, exp.batch, exp.rewards, exp.ref_logprobs, self.cfg
        )
        exp.advantages, exp.returns = out["advantages"], out["returns"]
        exp.values, exp.old_logprobs = out["old_values"], out["old_logp"]
        exp.metrics = out["metrics"]

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        return ppo_update(
            self.models, self.critic, self.optimizer, self.scheduler, exp, self.cfg, step
        )
