"""``peergrade export RUN_OR_CKPT OUT [--merge-lora]``: a checkpoint as a standalone HF directory.

What this module does
---------------------
* Finds the checkpoint: a run directory means its latest complete ``checkpoints/step-N``; a
  checkpoint directory (one holding ``trainer_state.json``) means itself. Anything else is a
  ``RunDirError`` naming the path and what was expected.
* Verifies it first: every file it exports against the size and sha256 its ``manifest.json``
  records (``checkpoint.verify_checkpoint``; the optimizer state is not read). A damaged
  checkpoint, or a run whose newest checkpoint is damaged, is refused in one line naming the
  file, what was expected and what was found; a checkpoint saved before manifests existed is
  exported with a note that it could not be verified.
* A full-model checkpoint is written as ``config.json`` + ``generation_config.json`` + the
  weight files (copied byte for byte) + the tokenizer: loadable with plain
  ``AutoModelForCausalLM`` / ``AutoTokenizer``, and by any tool that loads through them.
* A LoRA checkpoint (``adapter_config.json``) is written as the adapter + the tokenizer, loadable
  with peft's ``AutoPeftModelForCausalLM``; its ``base_model_name_or_path`` is made absolute so
  the directory loads from anywhere. With ``merge_lora`` the adapter is merged into the base
  weights (``merge_and_unload``) and a full model is written instead.
* The tokenizer goes through ``models.save_tokenizer`` and is then checked: ``AutoTokenizer``
  on the written directory must give the same ids as peergrade's loader on the run's own
  prompts, else the export fails (nothing is left at OUT).

Training state (optimizer, RNG, ``trainer_state.json``) is left out; the run's resolved
``config.yaml`` travels as ``peergrade_config.yaml`` for provenance. OUT is written to a
temporary sibling and renamed, so an interrupted export leaves nothing half-written, and an
existing non-empty OUT is refused.

It does not quantise, convert to GGUF, or push anywhere.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from peergrade.errors import require
from peergrade.training.checkpoint import RunDirError, apply_umask, resolve_model_dir

__all__ = ["ExportError", "find_checkpoint", "export_checkpoint"]

# Files of a full-model save_pretrained directory that are copied unchanged.
MODEL_FILE_GLOBS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
)
ADAPTER_FILE_GLOBS = ("adapter_model.safetensors", "adapter_model.bin")


class ExportError(RunDirError):
    """A checkpoint that cannot be exported as asked (e.g. --merge-lora on a full model)."""


def find_checkpoint(path, say=None) -> Path:
    """The checkpoint directory that ``path`` (a run dir or a checkpoint dir) names, verified:
    the one resolver of a run to its checkpoint (``checkpoint.resolve_model_dir``), plus the
    errors of a path that is neither. ``say``: the note for a checkpoint without a manifest."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RunDirError(f"export: {str(p)!r} does not exist")
    if not p.is_dir():
        raise RunDirError(f"export: {str(p)!r} is a file; expected a run or checkpoint directory")
    resolved = Path(resolve_model_dir(str(p), verify=True, say=say))
    if (resolved / "trainer_state.json").is_file():
        return resolved
    raise RunDirError(
        f"export: {str(p)!r} is neither a peergrade run directory (config.yaml + checkpoints/) "
        "nor a checkpoint directory (checkpoints/step-N with trainer_state.json)"
    )


def _probe_texts(ckpt: Path, tokenizer) -> list[str]:
    """Texts to compare AutoTokenizer with our loader on: a chat-rendered exchange and prompts
    of the run's own task (when its config can be read), plus every printable character."""
    texts = ["Q:12+34\nA:46", " leading and  double  spaces\n\nand newlines\t!"]
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": "What is 12 + 34?"}]
        texts.append(
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        )
    cfg_file = ckpt / "config.yaml"
    if cfg_file.is_file():
        try:
            from peergrade.config import load_run_config
            from peergrade.tasks import load_task, render_prompt

            cfg = load_run_config(str(cfg_file))
            d = cfg.data
            if d.path is not None:
                task = load_task(
                    "file", path=d.path, eval_path=d.eval_path, columns=d.columns, **d.task_options
                )
                it = task.train_rows(0)
                rows = [next(it) for _ in range(8)]
            else:
                task = load_task(d.task, **d.task_options)
                rows = task.eval_rows(8)
            texts += [
                render_prompt(
                    r["prompt"],
                    tokenizer,
                    system_prompt=d.system_prompt or task.system_prompt,
                    use_chat_template=d.use_chat_template,
                )
                + str(r.get("answer", ""))
                for r in rows
            ]
        except Exception:  # provenance only: an unreadable config just means fewer probes
            pass
    texts.append("".join(chr(i) for i in range(32, 127)) + "\n")
    return texts


def _copy_globs(src: Path, dst: Path, globs) -> list[str]:
    copied = []
    for g in globs:
        for f in sorted(src.glob(g)):
            if f.is_file() and not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
                copied.append(f.name)
    return copied


def _base_model_path(ckpt: Path, adapter_cfg: dict) -> str:
    """The adapter's base model as an absolute path that exists, or a clear error."""
    base = adapter_cfg.get("base_model_name_or_path")
    candidates = []
    if base:
        candidates.append(Path(base).expanduser())
    cfg_file = ckpt / "config.yaml"
    if cfg_file.is_file():  # the run's own model.path, resolved the way the trainer did
        from peergrade.config import load_run_config
        from peergrade.model.load import resolve_model_path

        with contextlib.suppress(Exception):  # an unreadable config: the adapter's own path
            candidates.append(Path(resolve_model_path(load_run_config(str(cfg_file)).model.path)))
    for c in candidates:
        if (c / "config.json").is_file():
            return str(c.resolve())
    raise ExportError(
        f"export: the LoRA checkpoint {str(ckpt)!r} names base model {base!r}, which is not a "
        "model directory here (a GGUF base cannot be loaded by peft; convert it first with "
        "`peergrade convert`)"
    )


def export_checkpoint(src, out, *, merge_lora: bool = False, log=print) -> Path:
    """Write the checkpoint that ``src`` names as a standalone HF directory ``out``."""
    from peergrade.model.load import auto_tokenizer_mismatches, load_tokenizer, save_tokenizer

    ckpt = find_checkpoint(src, say=log)
    out_path = Path(out).expanduser()
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise RunDirError(
            f"export: output {str(out_path)!r} already exists; choose a new directory "
            "(export never overwrites)"
        )
    is_adapter = (ckpt / "adapter_config.json").is_file()
    if not is_adapter and not (ckpt / "config.json").is_file():
        raise RunDirError(
            f"export: checkpoint {str(ckpt)!r} has neither config.json (a full model) nor "
            "adapter_config.json (a LoRA adapter)"
        )
    if merge_lora and not is_adapter:
        raise ExportError(
            f"export: --merge-lora given but checkpoint {str(ckpt)!r} is a full model, not a "
            "LoRA adapter (drop --merge-lora)"
        )
    tok = load_tokenizer(ckpt)
    tmp = out_path.with_name(out_path.name + ".tmp-export")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        if is_adapter:
            adapter_cfg = json.loads((ckpt / "adapter_config.json").read_text())
            base = _base_model_path(ckpt, adapter_cfg)
            if merge_lora:
                _write_merged(ckpt, base, tmp)
                kind = f"full model (LoRA merged into {base})"
            else:
                if not _copy_globs(ckpt, tmp, ADAPTER_FILE_GLOBS):
                    raise ExportError(
                        f"export: checkpoint {str(ckpt)!r} has adapter_config.json but no "
                        "adapter_model.safetensors"
                    )
                adapter_cfg["base_model_name_or_path"] = base
                (tmp / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2) + "\n")
                kind = f"LoRA adapter (base {base})"
        else:
            copied = _copy_globs(ckpt, tmp, MODEL_FILE_GLOBS)
            if not any(n.endswith((".safetensors", ".bin")) for n in copied):
                raise ExportError(
                    f"export: checkpoint {str(ckpt)!r} has config.json but no weights file "
                    "(*.safetensors or pytorch_model*.bin)"
                )
            kind = "full model"
        save_tokenizer(tok, tmp)
        if (ckpt / "config.yaml").is_file():
            shutil.copy2(ckpt / "config.yaml", tmp / "peergrade_config.yaml")
        problems = auto_tokenizer_mismatches(tmp, tok, _probe_texts(ckpt, tok))
        if problems:
            raise ExportError(
                "export: AutoTokenizer would read the written tokenizer differently from "
                "peergrade:\n  " + "\n  ".join(problems[:5])
            )
        apply_umask(tmp)  # a merged model's safetensors file is written 0600
        if out_path.exists():  # an empty directory
            out_path.rmdir()
        tmp.rename(out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"exported {ckpt} -> {out_path} ({kind})")
    return out_path


def _write_merged(ckpt: Path, base: str, out: Path) -> None:
    """Base model + adapter, merged (``merge_and_unload``), saved as a full model in ``out``."""
    PeftModel = require("peft", needed_for="--merge-lora", pip="peft", extra="lora").PeftModel
    from peergrade.model.load import load_model

    model = load_model(base, dtype="auto", device="cpu")
    merged = PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
    merged.save_pretrained(str(out))
