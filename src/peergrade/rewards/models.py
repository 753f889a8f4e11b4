"""Reward models as reward functions: a local ``AutoModelForSequenceClassification`` directory.

What this module does
---------------------
A reward item whose name is a local directory (``--reward path/to/rm`` or
``rewards: [{name: path/to/rm}]``) is a reward model, scored the way TRL's GRPOTrainer scores
``reward_funcs="path/to/rm"``:

* the text is ``prompt + completion`` for plain-text prompts, and the chat template applied to
  the prompt messages followed by the completion message(s) (no generation prompt) for
  conversational ones;
* tokenised without special tokens, right-padded, in micro-batches of ``batch_size`` (a reward
  item kwarg, default 32), and scored under ``torch.inference_mode`` in eval mode;
* the score of a sequence is ``logits[:, 0]`` (the model must have ``num_labels == 1``); the
  model reads it at the last non-pad token, so ``config.pad_token_id`` is set to the
  tokenizer's pad id (eos when the tokenizer has no pad), as TRL does.

The model sits on the training device in the training dtype, frozen. ``load_reward_model``
checks the directory first: a causal LM, a config of another kind, ``num_labels != 1``, missing
weights or tokenizer files are a ``ModelLoadError`` that names the path and what was expected
(TRL would silently put a random score head on a causal LM). ``reward_or_model`` is the seam
the trainer uses: it turns a reward item's name into a loaded ``RewardModel`` when it names a
directory, and leaves every other name to ``peergrade.rewards`` (built-in names win over a
directory of the same name). ``reward_model_memory`` sizes one for ``peergrade memory``.

What it deliberately does not do
--------------------------------
No hub downloads, no truncation (as in TRL: a sequence longer than the model's positions is
the user's to avoid), no training of the reward model, no multi-label heads. The rewards
package never imports this module: reward functions stay free of model code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from peergrade.model.load import (
    TOKENIZER_FILES,
    WEIGHT_GLOBS,
    ModelLoadError,
    load_tokenizer,
)
from peergrade.rewards.registry import is_conversational

__all__ = [
    "RewardModel",
    "is_reward_model_name",
    "load_reward_model",
    "reward_or_model",
    "reward_texts",
    "reward_model_memory",
]

DEFAULT_BATCH_SIZE = 32
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_reward_model_name(name) -> bool:
    """Whether a reward item's ``name`` names a reward-model directory: an existing directory
    that is not a built-in reward name and not ``module:function`` / ``file.py:function``."""
    from peergrade.rewards import BUILTIN_REWARDS

    if not isinstance(name, str) or not name.strip():
        return False
    name = name.strip()
    if name in BUILTIN_REWARDS or ":" in name:
        return False
    return Path(name).expanduser().is_dir()


def _completion_messages(completion) -> list[dict]:
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return list(completion)


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def reward_texts(prompts, completions, tokenizer) -> list[str]:
    """The texts a reward model scores (TRL's rule): the chat template over prompt + completion
    messages when the first prompt is a message list, else ``prompt + completion``."""
    if len(prompts) and is_conversational(prompts[0]):
        out = []
        for p, c in zip(prompts, completions):
            text = tokenizer.apply_chat_template(list(p) + _completion_messages(c), tokenize=False)
            out.append(text if isinstance(text, str) else text[0])
        return out
    return [str(p) + _completion_text(c) for p, c in zip(prompts, completions)]


class RewardModel:
    """A sequence-classification model called like a TRL reward function.

    ``rm(prompts=..., completions=..., **columns)`` -> one float per completion (columns are
    ignored). ``__name__`` is the directory's name, as TRL names a model reward.
    """

    #: the start-up reward audit leaves it out: every exploit would be a forward pass of the
    #: model (``peergrade audit`` still takes it when asked)
    skip_startup_audit = True

    def __init__(self, model, tokenizer, *, name: str, path: str, batch_size: int):
        self.model = model
        self.tokenizer = tokenizer
        self.__name__ = name
        self.path = path
        self.batch_size = batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r})"

    def __call__(self, prompts, completions, batch_size: int | None = None, **columns):
        bs = int(batch_size or self.batch_size)
        if bs < 1:
            raise ValueError(f"reward model {self.path!r}: batch_size={bs}, expected >= 1")
        texts = reward_texts(prompts, completions, self.tokenizer)
        scores: list[float] = []
        with torch.inference_mode():
            for s in range(0, len(texts), bs):
                enc = self.tokenizer(
                    texts[s : s + bs],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                enc = {k: v.to(self.device) for k, v in enc.items()}
                logits = self.model(**enc).logits  # [b, 1]
                scores.extend(logits[:, 0].float().tolist())
        return scores


def _check_classifier_dir(path) -> tuple[Path, dict]:
    p = Path(path).expanduser()
    what = f"reward model {str(p)!r}"
    if not p.is_dir():
        raise ModelLoadError(f"{what} is not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"{what} has no config.json: a reward given as a directory must be a Hugging Face "
            "AutoModelForSequenceClassification directory (save_pretrained layout)"
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{str(cfg_file)!r} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelLoadError(
            f"{what} is not a sequence-classification model: config.json has "
            f"architectures={archs!r}, model_type={raw.get('model_type')!r}; expected e.g. "
            "'Qwen2ForSequenceClassification' with num_labels=1 (a reward given as a "
            "directory is scored by AutoModelForSequenceClassification, as TRL does)"
        )
    num_labels = len(raw.get("id2label") or {}) or raw.get("num_labels", 2)
    if num_labels != 1:
        raise ModelLoadError(
            f"{what} has {num_labels} labels: a reward model needs num_labels=1 (one score per "
            "sequence)"
        )
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        raise ModelLoadError(
            f"{what} has no weights file: expected *.safetensors or pytorch_model*.bin"
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{what} has no tokenizer files: expected one of {', '.join(TOKENIZER_FILES)} "
            "(save the reward model's tokenizer next to it)"
        )
    return p, raw


def load_reward_model(
    path,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> RewardModel:
    """The sequence classifier in ``path`` as a frozen, eval-mode ``RewardModel`` on ``device``."""
    p, _ = _check_classifier_dir(path)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)}")
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(p)  # pad falls back to eos (with a warning), as in TRL
    tok.padding_side = "right"  # TRL pads reward inputs on the right
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(p), dtype=_DTYPES[dtype], local_files_only=True
        )
    except Exception as e:
        raise ModelLoadError(f"could not load the reward model in {str(p)!r}: {e}") from e
    # the classifier reads the score at the last token that is not the pad token
    model.config.pad_token_id = tok.pad_token_id
    model.eval().requires_grad_(False).to(device)
    name = p.resolve().name
    return RewardModel(model, tok, name=name, path=str(p), batch_size=batch_size)


def reward_or_model(name, *, device, dtype: str):
    """A reward item's ``name`` -> a loaded ``RewardModel`` when it names a directory, else
    ``name`` unchanged (``peergrade.rewards`` resolves it)."""
    if is_reward_model_name(name):
        return load_reward_model(name.strip(), device=device, dtype=dtype)
    return name


def reward_model_memory(
    path, *, dtype: str, seq_len: int, batch_size: int = DEFAULT_BATCH_SIZE, device="cpu"
) -> dict[str, int]:
    """Bytes a reward model adds to training: ``weights`` (resident all run, exact parameter
    count from its config on the meta device) and ``activations`` (one no-grad micro-batch
    forward at ``seq_len`` tokens: the hidden states, one layer's MLP intermediates and, on
    CPU, the math-kernel attention probabilities). ``seq_len`` is the policy's prompt +
    completion length; the reward model's own tokenizer may count the text differently."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    p, _ = _check_classifier_dir(path)
    cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
    with torch.device("meta"):
        n_params = sum(
            t.numel() for t in AutoModelForSequenceClassification.from_config(cfg).parameters()
        )
    b = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    H = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * H)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    per_token = 4 * H + 3 * inter + (heads * seq_len if device == "cpu" else 0)
    return {"weights": n_params * b, "activations": batch_size * seq_len * per_token * b}
