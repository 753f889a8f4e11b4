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

What it deliberately does not do: no logit-level (full-distribution) KL, no teacher sharding
under FSDP (each rank holds the whole teacher).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade.algo.distill import distill_advantages, reverse_kl_reward, token_mean_reward
from peergrade.errors import ModelLoadError
from peergrade.training.experience import Experience
from peergrade.training.teacher_endpoint import EndpointTeacher, connect
from peergrade.training.update import GRPO, frozen_logprobs

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

    def advantages(self, exp: Experience) -> None:
        a = self.cfg.algo
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
