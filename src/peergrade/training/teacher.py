"""On-policy distillation's teacher (``algo.teacher_path``): a second causal LM, loaded once,
frozen and in eval mode, that scores the student's own sampled tokens; and ``Distill``, GRPO
whose advantages are per token: ``algo.teacher_coef * (log p_teacher - log p_student)`` on each
sampled token (``peergrade.algo.distill``), plus ``algo.teacher_verifier_weight`` times GRPO's
group-relative verifier advantage. The update is GRPO's (``policy_loss`` takes ``[N, C]``
advantages), so there is no second update path.

Both log-probs come from the same chunked engine as the reference (``frozen_logprobs``: the
sampling temperature applied to both models' logits, as TRL's GKD does), the student's from the
policy's weights that sampled the step (no grad), so the reward is exact, not the sampler's
numerics. The tokenizers must match: the teacher reads the student's token ids, so a
different vocabulary or different special tokens stop the run at start-up, naming the
difference.

The teacher may instead sit behind an OpenAI-compatible endpoint (``algo.teacher_url``:
``training.teacher_endpoint``), which scores the same token ids with vLLM's ``prompt_logprobs``
(temperature 1); its tokenizer is probed through the endpoint at start-up.

With ``algo.teacher_divergence: top_k`` the signal is dense instead: the teacher's
``teacher_loss_top_k`` most likely tokens and their log-probs at every sampled position
(``teacher_topk``, once per step, ``[N, C, k]``), and in the update a loss term,
``teacher_coef`` x the token mean of the generalized JSD (TRL's ``beta``) between the
student's and the teacher's distributions over those tokens plus the tail
(``algo.distill.topk_divergence``; ``DistillLoss``); the advantages are
``teacher_verifier_weight`` x GRPO's, and no completion is elided (each carries the term).

What it deliberately does not do: no full-vocabulary divergence beyond k = V (the teacher's
top-k is what is stored per step), no teacher sharding under FSDP (each rank holds the whole
teacher).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade.algo.distill import (
    distill_advantages,
    reverse_kl_reward,
    token_mean_reward,
    topk_divergence,
)
from peergrade.errors import ModelLoadError
from peergrade.model.logprobs import gathered_token_logprobs, topk_token_logprobs
from peergrade.training.experience import Experience
from peergrade.training.teacher_endpoint import EndpointTeacher, connect
from peergrade.training.update import (
    GRPO,
    GrpoLoss,
    autocast,
    by_length,
    frozen_logprobs,
    grpo_update,
    micro_batches,
    trim,
)

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between the two tokenizers (vocabulary, special token ids), in words, or
    None when the teacher reads the student's token ids as the student does."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:3]
        only_t = sorted(set(tv) - set(sv))[:3]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:3]
        parts = [f"vocabulary sizes {len(sv)} (student) and {len(tv)} (teacher)"]
        if only_s:
            parts.append(f"tokens only the student has: {only_s}")
        if only_t:
            parts.append(f"tokens only the teacher has: {only_t}")
        if moved:
            parts.append(
                "tokens with other ids: " + ", ".join(f"{k!r} ({sv[k]} vs {tv[k]})" for k in moved)
            )
        return "; ".join(parts)
    for name in SPECIAL_TOKENS:
        s, t = getattr(student, name, None), getattr(teacher, name, None)
        if s != t:
            return f"{name} is {s} for the student and {t} for the teacher"
    return None


def check_tokenizers(student, teacher, path: str) -> None:
    """``ModelLoadError`` naming the difference unless the tokenizers match."""
    why = tokenizer_difference(student, teacher)
    if why is not None:
        raise ModelLoadError(
            f"algo.teacher_path {path!r}: the teacher's tokenizer does not match the student's "
            f"({why}); on-policy distillation scores the student's token ids with the teacher, "
            "so both must share one tokenizer"
        )


def load_teacher(cfg, models) -> Any:
    """The frozen teacher of ``cfg.algo.teacher_path`` on the policy's device, in eval mode,
    after its tokenizer was checked against the student's; with ``cfg.algo.teacher_url``, the
    endpoint teacher (``teacher_endpoint.connect``: it answers, and reads the student's ids)."""
    if cfg.algo.teacher_url is not None:
        return connect(cfg, models.tokenizer)
    from peergrade.model.load import load_model, load_tokenizer, resolve_dtype, resolve_model_path

    path = resolve_model_path(cfg.algo.teacher_path)
    check_tokenizers(models.tokenizer, load_tokenizer(path), path)
    dtype = resolve_dtype(cfg.model.dtype, models.device)
    teacher = load_model(path, dtype=dtype, device=str(models.device))
    n = len(models.tokenizer)
    rows = teacher.get_input_embeddings().weight.shape[0]
    if rows < n:
        raise ModelLoadError(
            f"algo.teacher_path {path!r}: the teacher has {rows} embedding rows, fewer than the "
            f"student's tokenizer's {n} tokens"
        )
    k = cfg.algo.teacher_loss_top_k
    if cfg.algo.teacher_divergence == "top_k" and k > rows:
        raise ModelLoadError(
            f"algo.teacher_loss_top_k={k}: the teacher {path!r} has {rows} tokens; expected at "
            f"most {rows} (k = {rows} is the full-vocabulary divergence)"
        )
    return teacher.eval().requires_grad_(False)


@torch.no_grad()
def student_teacher_logprobs(models, teacher, batch, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, C], [N, C])``: the student's (the policy now, no grad, eval mode) and the
    teacher's log-probs of every sampled token (0 on padding)."""
    was_training = models.policy.training
    models.policy.eval()
    try:
        student = frozen_logprobs(models.policy, batch, cfg)  # [N, C]
    finally:
        models.policy.train(was_training)
    if isinstance(teacher, EndpointTeacher):  # temperature 1 (config.validate)
        return student, teacher.logprobs(batch)  # [N, C]
    return student, frozen_logprobs(teacher, batch, teacher_cfg(cfg))  # [N, C]


def teacher_cfg(cfg):
    """``cfg`` with the teacher's temperature (``algo.teacher_temperature``; null = the
    sampling temperature) where the log-prob passes read it; ``cfg`` itself when they agree."""
    t = cfg.algo.teacher_temperature
    if t is None or t == cfg.rollout.temperature:
        return cfg
    out = copy.copy(cfg)
    out.rollout = dataclasses.replace(cfg.rollout, temperature=t)
    return out


@dataclass
class Distill(GRPO):
    """GRPO with on-policy distillation's per-token advantages (``[N, C]``)."""

    teacher: Any = None

    topk: tuple | None = None  # (logp, ids) [N, C, k]: the teacher's top-k of this step's batch

    def advantages(self, exp: Experience) -> None:
        a = self.cfg.algo
        if a.teacher_divergence == "top_k":
            self.topk_advantages(exp)
            return
        super().advantages(exp)  # the verifier's group-relative advantage [N], and metrics
        verifier = exp.advantages
        student, teacher = student_teacher_logprobs(self.models, self.teacher, exp.batch, self.cfg)
        cmask = exp.batch[2]  # [N, C]
        baseline = 0.0
        if a.teacher_baseline == "token_mean":  # over every rank's tokens (tinker's centring)
            total, count = token_mean_reward(reverse_kl_reward(student, teacher, cmask), cmask)
            sums = dist.all_sum(torch.tensor([total, float(count)], dtype=torch.float64))
            baseline = float(sums[0] / sums[1].clamp(min=1.0))
        elif a.teacher_baseline != "none":
            raise ValueError(
                f"algo.teacher_baseline: expected token_mean or none, got {a.teacher_baseline!r}"
            )
        adv = distill_advantages(
            student,
            teacher,
            cmask,
            coef=a.teacher_coef,
            baseline=baseline,
            discount=a.teacher_discount,
            verifier_advantages=verifier,
            verifier_weight=a.teacher_verifier_weight,
        )  # [N, C]
        on = cmask == 1
        n = max(int(on.sum()), 1)
        reverse_kl = float((student - teacher)[on].sum()) / n  # the sampled-token estimate
        exp.advantages = adv
        exp.metrics = {
            **exp.metrics,
            "distill/reverse_kl": reverse_kl,
            "distill/teacher_logp": float(teacher[on].sum()) / n,
            "distill/student_logp": float(student[on].sum()) / n,
            "advantage/std": float(adv[on].std()) if int(on.sum()) > 1 else 0.0,
        }

    def topk_advantages(self, exp: Experience) -> None:
        """``algo.teacher_divergence: top_k``: the advantages are ``teacher_verifier_weight``
        x GRPO's (``[N]``; 0 = pure distillation), and the teacher's top-k of the batch is kept
        for this step's update (``DistillLoss``)."""
        super().advantages(exp)  # GRPO's [N] and its metrics
        exp.advantages = exp.advantages * self.cfg.algo.teacher_verifier_weight  # [N]
        vals, ids = teacher_topk(self.teacher, exp.batch, self.cfg)  # [N, C, k] each
        self.topk = (vals, ids)
        exp.metrics = {**exp.metrics, **_topk_metrics(vals, exp.batch[2])}

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        if self.cfg.algo.teacher_divergence != "top_k":
            return super().update(exp, step)
        cmask = exp.batch[2]
        if self.topk is None or self.topk[1].shape[:2] != cmask.shape:
            raise RuntimeError(
                "on-policy distillation (top_k): update() needs advantages() on the same "
                "experience first (the teacher's top-k of its batch)"
            )
        entropy = self.entropy_control()
        loss = DistillLoss(self.models, exp, self.cfg, entropy, self.topk)
        self.topk = None
        return grpo_update(
            self.models, self.optimizer, self.scheduler, exp, self.cfg, step, entropy, loss
        )


@torch.no_grad()
def teacher_topk(teacher, batch, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [N, C, k] float32, ids [N, C, k] int64)``: the teacher's ``teacher_loss_top_k``
    most likely next tokens at every counted position of ``batch`` (0 elsewhere), at the
    teacher's temperature (``teacher_cfg``), one micro-batch at a time (longest first); from
    an endpoint teacher, its ``prompt_logprobs: k`` (``EndpointTeacher.topk``)."""
    input_ids, attention_mask, cmask = batch
    tcfg, k = teacher_cfg(cfg), cfg.algo.teacher_loss_top_k
    if isinstance(teacher, EndpointTeacher):  # temperature 1 (config.validate)
        return teacher.topk(batch, k)
    N, C = cmask.shape
    vals = torch.zeros(N, C, k, dtype=torch.float32, device=cmask.device)
    ids = torch.zeros(N, C, k, dtype=torch.long, device=cmask.device)
    rows = torch.arange(N, device=cmask.device)
    for mb in micro_batches(by_length(rows, cmask), cfg.micro_batch_size):
        ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
        with autocast(cfg, ii.device, teacher):
            v, i = topk_token_logprobs(
                teacher,
                ii,
                am,
                cm,
                k,
                temperature=tcfg.rollout.temperature,
                chunk_size=cfg.model.logprob_chunk_size,
                share_prompts=cfg.model.shared_prompt_forward,
            )
        vals[mb, : cm.shape[1]], ids[mb, : cm.shape[1]] = v, i
    return vals, ids


class DistillLoss(GrpoLoss):
    """``GrpoLoss`` plus on-policy distillation's dense term (``algo.teacher_divergence:
    top_k``): each micro-batch adds ``teacher_coef * sum_t D_t / num_tokens``, ``D_t`` the
    generalized JSD at counted position t between the student's log-probs of the teacher's
    top-k tokens there (``gathered_token_logprobs``, with gradient, at the sampling
    temperature) and the teacher's (``teacher_topk``), ``num_tokens`` the minibatch's
    normaliser, so the minibatch's term is the token mean. No completion is left out: a zero
    advantage does not make the divergence's gradient 0. The policy loss's own forward is
    skipped for a micro-batch whose policy loss is exactly 0 (``GrpoLoss.no_signal``)."""

    elide = False

    def __init__(self, models, exp, cfg, entropy, topk: tuple[torch.Tensor, torch.Tensor]):
        super().__init__(models, exp, cfg, entropy)
        self.t_logp, self.t_ids = topk  # [N, C, k] each

    def no_signal(self, idx) -> bool:
        return False  # the divergence's gradient is not 0

    def micro_loss(self, mb, mini_idx, trimmed, num_tokens, metrics) -> torch.Tensor | None:
        a = self.a
        if GrpoLoss.no_signal(self, mb):  # the policy loss is exactly 0 (no advantage, no KL)
            loss = None
            for key in ("loss/policy", "advantage/mean"):
                metrics.add(key, 0.0, len(mb))
        else:
            loss = super().micro_loss(mb, mini_idx, trimmed, num_tokens, metrics)
        ii, am, cm = trimmed
        Tc = cm.shape[1]
        with autocast(self.cfg, ii.device, self.models.policy):
            student = gathered_token_logprobs(
                self.models.policy,
                ii,
                am,
                cm,
                self.t_ids[mb, :Tc],
                temperature=self.cfg.rollout.temperature,
                chunk_size=self.cfg.model.logprob_chunk_size,
                share_prompts=self.cfg.model.shared_prompt_forward,
            )  # [b, Tc, k]
        on = cm == 1  # [b, Tc]
        d = topk_divergence(
            student[on],
            self.t_logp[mb, :Tc][on],
            beta=a.teacher_beta,
            add_tail=a.teacher_loss_add_tail,
        )  # [M]
        if d.numel() == 0:  # no counted token here: no divergence, no gradient from it
            return loss
        term = a.teacher_coef * d.sum() / num_tokens
        metrics.add("distill/divergence", float(d.detach().mean()), d.numel())
        return term if loss is None else loss + term


def _topk_metrics(vals: torch.Tensor, cmask: torch.Tensor) -> dict[str, float]:
    """``distill/teacher_topk_mass``: the token mean of the teacher's probability on its k
    tokens (1 = the divergence sees the whole distribution)."""
    on = cmask == 1
    mass = torch.logsumexp(vals[on], dim=-1).exp()  # [M]
    return {"distill/teacher_topk_mass": float(mass.mean()) if mass.numel() else 0.0}
