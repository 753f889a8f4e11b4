"""PPO with a learned critic: the baseline GRPO is measured against (``algo.name: ppo``).

What this module does
---------------------
GRPO's baseline is the group mean; PPO's is a *value model* V(s_t) that predicts the return
from every completion prefix. Everything else (rollout, rewards, reference, log-probs, the loop)
is shared with GRPO in ``peergrade.trainer``; this module adds:

* ``ValueModel``: a causal-LM backbone (everything up to the final norm, no ``lm_head``) plus a
  scalar head ``nn.Linear(hidden, 1)`` kept in float32. ``build_critic`` loads it from
  ``algo.critic_path`` or, by default, from the policy's own directory (a second full copy of
  the backbone -- the memory GRPO saves), with its own AdamW (``algo.critic_lr``, default
  ``optim.lr``). The value of completion token j is read at the column that predicts it, the
  same alignment as the log-probs: V_j = head(h_{L-C+j-1}).
* ``token_rewards``: per-token rewards (Ouyang et al. 2022, "InstructGPT"; Ziegler et al. 2019)

      r_t = -beta * (logp_old_t - logp_ref_t)          (k1 KL, when algo.kl_in_reward and beta > 0)
      r_T += R                                          (the sequence reward on the last counted token)

  With ``kl_in_reward: false`` the KL goes into the loss instead (``beta * KL_t`` as in GRPO).
* ``ppo_advantages``: rollout-time values, then GAE (``peergrade.algo.gae``) on the token
  rewards, then whitening over all counted tokens of the batch:
  A <- (A - mean(A)) / (std(A) + 1e-8). Returns R_t = A_t + V_t (before whitening) are the
  critic's targets.
* ``ppo_policy_loss``: PPO's clipped surrogate with a *token-level* advantage
  (``peergrade.algo.policy_loss`` takes one advantage per sequence, as GRPO needs):

      rho_t = exp(logp_t - logp_old_t)
      l_t   = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps_high) A_t) (+ beta * KL_t)
      loss  = sum_t m_t l_t / num_tokens                 (token mean over the minibatch)

* ``ppo_update``: mu passes of minibatch updates; each micro-batch backpropagates
  ``policy_loss + vf_coef * value_loss`` (``peergrade.algo.value_loss``, clipped around the
  rollout-time values, token mean over the minibatch). The two losses share no parameters, so
  the value loss's gradient reaches only the critic and the policy loss's only the policy. Each
  model's gradient norm is clipped to ``optim.max_grad_norm`` separately, then both optimizers
  step. ``ppo_step`` = ``ppo_advantages`` + ``ppo_update``; the trainer calls it in place of
  the GRPO update.
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

import math
from typing import Any

import torch
from torch import nn

from peergrade.algo import gae, kl_divergence, value_loss
from peergrade.models import (
    find_backbone_and_head,
    load_model,
    position_ids_from_mask,
    resolve_dtype,
    resolve_model_path,
)
from peergrade.trainer import (
    MeanMetrics,
    Models,
    build_optimizer,
    frozen_logprobs,
    logprobs_of,
    micro_batches,
    minibatch_schedule,
    trim,
)

__all__ = [
    "ValueModel",
    "Critic",
    "build_critic",
    "token_rewards",
    "whiten",
    "ppo_advantages",
    "ppo_policy_loss",
    "ppo_update",
    "ppo_step",
    "CriticCheckpointState",
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
    gc = cfg.model.gradient_checkpointing
    if gc is None:
        gc = models.device.type == "cuda"
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


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last ``mask == 1`` token (-1 for a row with none).  # [B]"""
    B, T = mask.shape
    cols = torch.arange(T, device=mask.device).expand(B, T)
    return torch.where(mask == 1, cols, torch.full_like(cols, -1)).amax(dim=1)


def token_rewards(
    seq_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: ``-beta * (old_logp - ref_logp)`` on counted tokens (when
    both log-probs are given and beta > 0) plus ``seq_rewards[b]`` on row b's last counted
    token. NaN sequence rewards count as 0; a row with no counted token gets nothing."""
    B, T = mask.shape
    if seq_rewards.shape != (B,):
        raise ValueError(f"seq_rewards: expected shape ({B},), got {tuple(seq_rewards.shape)}")
    valid = mask == 1  # [B, T]
    r = torch.zeros(B, T, dtype=torch.float32, device=mask.device)  # [B, T]
    if beta > 0 and old_logp is not None and ref_logp is not None:
        kl = kl_divergence(old_logp.float(), ref_logp.float(), "k1")  # [B, T]
        r = torch.where(valid, -beta * kl, r)
    last = last_token_index(mask)  # [B]
    rows = torch.nonzero(last >= 0).squeeze(1)  # [B']
    score = torch.nan_to_num(seq_rewards.float().to(mask.device), nan=0.0)  # [B]
    r[rows, last[rows]] += score[rows]
    return r


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over ``mask == 1`` entries (population std); 0 elsewhere."""
    valid = mask == 1
    n = valid.sum().clamp(min=1)
    xm = torch.where(valid, x, torch.zeros_like(x))
    mean = xm.sum() / n
    var = (torch.where(valid, x - mean, torch.zeros_like(x)) ** 2).sum() / n
    return torch.where(valid, (x - mean) / (var.sqrt() + eps), torch.zeros_like(x))


@torch.no_grad()
def critic_values(critic: Critic, batch, idx_all, micro) -> torch.Tensor:
    """Rollout-time values of every sequence, ``[N, C]`` float32 (0 on padding)."""
    input_ids, attention_mask, cmask = batch
    out = torch.zeros(cmask.shape, dtype=torch.float32, device=cmask.device)
    was_training = critic.model.training
    critic.model.eval()
    for mb in micro_batches(idx_all, micro):
        ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
        out[mb, : cm.shape[1]] = critic.model(ii, am, cm.shape[1]) * cm
    critic.model.train(was_training)
    return out


def ppo_advantages(critic: Critic, models: Models, batch, seq_rewards, ref_lp, cfg):
    """Token rewards -> GAE -> whitened advantages. Returns a dict with ``advantages``,
    ``returns``, ``old_values`` (all ``[N, C]``), ``old_logp`` (``[N, C]`` or None when the
    single-update shortcut applies), and scalar ``metrics``."""
    input_ids, attention_mask, cmask = batch
    N = cmask.shape[0]
    a = cfg.algo
    mini = cfg.optim.minibatch_size or N
    micro = min(cfg.optim.micro_batch_size, mini)
    idx = torch.arange(N, device=cmask.device)
    kl_reward = a.kl_in_reward and a.beta > 0 and ref_lp is not None
    single_update = a.num_iterations == 1 and mini == N
    # The sampling policy's log-probs: needed for the KL reward, and as old_logp when the policy
    # moves between minibatches. Otherwise old = logp.detach() inside the update is exact.
    old_lp = (
        frozen_logprobs(models.policy, batch, cfg, idx, micro)
        if kl_reward or not single_update
        else None
    )
    values = critic_values(critic, batch, idx, micro)  # [N, C]
    rewards = token_rewards(
        seq_rewards.to(cmask.device),
        cmask,
        old_logp=old_lp,
        ref_logp=ref_lp,
        beta=a.beta if kl_reward else 0.0,
    )  # [N, C]
    adv, returns = gae(rewards, values, cmask, gamma=a.gamma, lam=a.lam)  # [N, C] each
    valid = cmask == 1
    n = valid.sum().clamp(min=1)
    metrics = {
        "value/rollout_mean": ((values * valid).sum() / n).item(),
        "returns/mean": ((returns * valid).sum() / n).item(),
        "advantage/raw_mean": ((adv * valid).sum() / n).item(),
        "advantage/std": whiten_std(adv, cmask),
    }
    if kl_reward:
        kl = kl_divergence(old_lp, ref_lp, "k1")  # [N, C]
        metrics["reward/kl_penalty_mean"] = (-a.beta * (kl * valid).sum() / n).item()
    return {
        "advantages": whiten(adv, cmask),
        "returns": returns,
        "old_values": values,
        "old_logp": old_lp,
        "metrics": metrics,
    }


def whiten_std(x, mask) -> float:
    valid = mask == 1
    n = valid.sum().clamp(min=1)
    mean = (x * valid).sum() / n
    return (((x - mean) * valid) ** 2).sum().div(n).sqrt().item()


# ----------------------------------------------------------------------------- losses + update


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with token-level advantages ``[B, T]`` (see the module docstring).

    Returns ``(loss, metrics)``: loss = sum over counted tokens / ``num_tokens`` (default: the
    counted tokens here); metrics ``loss/policy``, ``loss/kl``, ``kl/mean`` (when ``ref_logp``
    is given), ``clip/frac``, ``ratio/mean``.
    """
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(
                f"{name}: expected the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}"
            )
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    valid = mask == 1  # [B, T]
    m = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(valid, logp, zero)  # [B, T]
    old = torch.where(valid, old_logp.detach().to(logp.dtype), zero)  # [B, T]
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)  # [B, T]
    rho = torch.exp(lp - old)  # [B, T]
    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps_high
    pg = -torch.minimum(rho * adv, rho.clamp(min=lo, max=hi) * adv)  # [B, T]
    norm = m.sum().clamp(min=1) if num_tokens is None else num_tokens
    loss_pg = (pg * m).sum() / norm
    loss = loss_pg
    kl_mean = 0.0
    loss_kl = zero
    if ref_logp is not None:
        ref = torch.where(valid, ref_logp.detach().to(logp.dtype), zero)
        kl = kl_divergence(lp, ref, kl_estimator)  # [B, T]
        kl_mean = ((kl.detach() * m).sum() / m.sum().clamp(min=1)).item()
        if beta > 0:
            loss_kl = beta * (kl * m).sum() / norm
            loss = loss + loss_kl
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        rd = rho.detach()
        clipped = ((adv < 0) & (rd < lo)) | ((adv > 0) & (rd > hi))
        clip_frac = ((clipped & valid).to(logp.dtype).sum() / n).item()
        ratio_mean = ((rd * m).sum() / n).item()
    return loss, {
        "loss/policy": float(loss_pg.detach()),
        "loss/kl": float(loss_kl.detach()) if torch.is_tensor(loss_kl) else 0.0,
        "kl/mean": kl_mean,
        "clip/frac": clip_frac,
        "ratio/mean": ratio_mean,
    }


def ppo_update(
    models: Models,
    critic: Critic,
    optimizer,
    scheduler,
    batch,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    old_lp: torch.Tensor | None,
    ref_lp: torch.Tensor | None,
    cfg,
    step: int,
) -> dict[str, float]:
    """mu passes of minibatch updates of the policy and the critic; returns averaged metrics.

    advantages, returns, old_values, old_lp, ref_lp: ``[N, C]`` (old_lp may be None only with
    one optimizer step per batch, where the old policy is the current one).
    """
    input_ids, attention_mask, cmask = batch
    N = cmask.shape[0]
    a = cfg.algo
    mini = cfg.optim.minibatch_size or N
    micro = min(cfg.optim.micro_batch_size, mini)
    params = [p for p in models.policy.parameters() if p.requires_grad]
    c_params = critic.parameters()
    # KL in the reward: the loss has no KL term, but kl/mean is still reported.
    loss_beta = 0.0 if a.kl_in_reward else a.beta
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
    metrics = MeanMetrics()
    add = metrics.add

    models.policy.train()
    critic.model.train()
    for mini_idx in minibatch_schedule(cfg, step, N, cmask.device):
        num_tokens = cmask[mini_idx].sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        critic.optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches(mini_idx, micro):
            ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
            Tc = cm.shape[1]
            logp, ent = logprobs_of(models.policy, ii, am, cm, cfg, with_entropy=True)
            old = logp.detach() if old_lp is None else old_lp[mb, :Tc]
            ref = None if ref_lp is None else ref_lp[mb, :Tc]
            pl, m = ppo_policy_loss(
                logp,
                old,
                advantages[mb, :Tc],
                cm,
                clip_eps=a.clip_eps,
                clip_eps_high=a.clip_eps_high,
                ref_logp=ref,
                beta=loss_beta,
                kl_estimator=a.kl_estimator,
                num_tokens=num_tokens,
            )
            v = critic.model(ii, am, Tc)  # [mb, Tc]
            vl, vm = value_loss(
                v, old_values[mb, :Tc], returns[mb, :Tc], cm, clip_eps=a.value_clip_eps
            )
            # value_loss is this micro-batch's token mean: reweight to the minibatch's.
            vl = vl * (cm.sum() / num_tokens)
            (pl + a.vf_coef * vl).backward()
            # Losses here are this micro-batch's share of the minibatch's token mean; the
            # weighted average below times len(mini)/len(mb) sums the shares per minibatch.
            w, share = len(mb), len(mini_idx) / len(mb)
            add("loss/value", vl.item() * share, w)
            for k, val in {**m, **vm}.items():
                add(k, float(val) * (share if k.startswith("loss/") else 1.0), w)
            n_tok = cm.sum().item()
            if n_tok > 0:
                add("entropy/mean", (ent.detach() * cm).sum().item() / n_tok, w)
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        c_gnorm = float(torch.nn.utils.clip_grad_norm_(c_params, max_norm))
        add("grad/norm", gnorm)
        add("grad/critic_norm", c_gnorm)
        nonfinite = not math.isfinite(gnorm + c_gnorm)  # NaN/inf: leave both models as they are
        add("update/nonfinite_frac", float(nonfinite))
        if not nonfinite:
            optimizer.step()
            critic.optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    critic.optimizer.zero_grad(set_to_none=True)
    out = metrics.means()
    out["optim/lr"] = scheduler.get_last_lr()[0]
    return out


def ppo_step(models, critic, optimizer, scheduler, batch, seq_rewards, ref_lp, cfg, step, pa=None):
    """Advantages from the critic (unless given as ``pa``), then the PPO update: what the
    trainer calls per step."""
    if pa is None:
        pa = ppo_advantages(critic, models, batch, seq_rewards, ref_lp, cfg)
    upd = ppo_update(
        models,
        critic,
        optimizer,
        scheduler,
        batch,
        pa["advantages"],
        pa["returns"],
        pa["old_values"],
        pa["old_logp"],
        ref_lp,
        cfg,
        step,
    )
    return {**pa["metrics"], **upd}
