"""Loading models/tokenizers from local directories, their error messages, and LoRA helpers."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from peergrade.model.load import (
    ModelLoadError,
    apply_lora,
    disable_adapter,
    load_model,
    load_tokenizer,
)
from peergrade.model.logprobs import naive_token_logprobs, token_logprobs


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    """A private copy of the tiny model dir that a test may break."""
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    return d


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, 10), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0
    ids[0, :2] = 0
    cm = torch.ones(3, 6, dtype=torch.long)
    cm[1, 4:] = 0
    return ids, am, cm


# ------------------------------------------------------------------------------------ loading


def test_round_trip_identical_outputs(tiny_qwen2, tmp_path):
    model, tok = tiny_qwen2
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    tok2 = load_tokenizer(tmp_path)
    text = "<|im_start|>user\n12+30=?<|im_end|>\n"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.padding_side == "left" and tok2.pad_token_id == tok.pad_token_id == 0
    assert tok2.chat_template == tok.chat_template
    inp = batch(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(token_logprobs(loaded, *inp), token_logprobs(model, *inp))
        assert torch.equal(loaded(inp[0]).logits, model(inp[0]).logits)
    for (n, p), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    assert loaded.generation_config.pad_token_id == 0


@pytest.mark.parametrize(
    "dtype,expected",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("auto", torch.float32)],
)
def test_dtype_option(tiny_model_dir, dtype, expected):
    m = load_model(tiny_model_dir, dtype=dtype)
    assert {p.dtype for p in m.parameters()} == {expected}


def test_bad_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match="'float32', 'bfloat16', 'float16', 'auto'"):
        load_model(tiny_model_dir, dtype="fp8")


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=r"nope.*does not exist"):
        load_model(missing)
    with pytest.raises(ModelLoadError, match=r"nope.*does not exist"):
        load_tokenizer(missing)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_model(f)


def test_no_config_json(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"model.*has no config\.json"):
        load_model(model_dir)


def test_config_without_model_type(model_dir):
    data = json.loads((model_dir / "config.json").read_text())
    del data["model_type"]
    (model_dir / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="no 'model_type' key"):
        load_model(model_dir)


def test_config_not_a_causal_lm(model_dir):
    edit_json(model_dir / "config.json", architectures=["Qwen2ForSequenceClassification"])
    with pytest.raises(ModelLoadError, match=r"does not describe a causal LM.*SequenceClass"):
        load_model(model_dir)


def test_config_of_a_non_lm_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ModelLoadError, match=r"does not describe a causal LM.*'vit'"):
        load_model(tmp_path)


def test_no_weights(model_dir):
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"model.*has no weights file.*safetensors"):
        load_model(model_dir)


def test_corrupt_weights(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="could not load the model weights"):
        load_model(model_dir)


def test_no_tokenizer_files(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"model.*has no tokenizer files.*tokenizer\.json"):
        load_tokenizer(model_dir)


def test_tokenizer_without_pad_uses_eos(char_tokenizer, tmp_path):
    tok = copy.deepcopy(char_tokenizer)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no pad token: using the eos token"):
        t = load_tokenizer(tmp_path)
    assert t.pad_token == t.eos_token == "<|im_end|>" and t.pad_token_id == t.eos_token_id
    assert t.padding_side == "left"


def test_tokenizer_without_pad_or_eos(char_tokenizer, tmp_path):
    tok = copy.deepcopy(char_tokenizer)
    tok.pad_token = None
    tok.eos_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="neither a pad token nor an eos token"):
        load_tokenizer(tmp_path)


def test_generation_pad_filled_from_eos(tiny_qwen2, tmp_path):
    model = copy.deepcopy(tiny_qwen2[0])
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = [3, 1]
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.generation_config.pad_token_id == 3


def test_gradient_checkpointing_same_grads(tiny_model_dir):
    """Gradient checkpointing changes memory, not the numbers."""
    plain = load_model(tiny_model_dir).train()
    ckpt = load_model(tiny_model_dir, gradient_checkpointing=True).train()
    assert ckpt.is_activation_checkpointing and not plain.is_activation_checkpointing
    inp = batch(plain.config.vocab_size)
    for m in (plain, ckpt):
        token_logprobs(m, *inp, chunk_size=4).sum().backward()
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=n)


# --------------------------------------------------------------------------------------- LoRA


def test_disable_adapter_gives_exact_base_logprobs(tiny_llama):
    pytest.importorskip("peft")
    base = copy.deepcopy(tiny_llama[0])
    inp = batch(base.config.vocab_size, seed=2)
    with torch.no_grad():
        ref = token_logprobs(base, *inp)
    peft_model = apply_lora(base, r=4, alpha=16, dropout=0.0, target_modules="all-linear")
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.2)
        adapted = token_logprobs(peft_model, *inp)
        with disable_adapter(peft_model) as m:
            assert m is peft_model
            off = token_logprobs(m, *inp)
            off_naive = naive_token_logprobs(m, *inp)
        back_on = token_logprobs(peft_model, *inp)
    assert (adapted - ref).abs().max() > 1e-3  # the perturbation really changes the policy
    assert torch.equal(off, ref)
    torch.testing.assert_close(off_naive, ref, atol=1e-5, rtol=0)
    assert torch.equal(back_on, adapted)  # the adapter is back after the with-block


def test_disable_adapter_on_plain_model_raises(tiny_qwen2):
    with (
        pytest.raises(ValueError, match="needs a peft-wrapped model"),
        disable_adapter(tiny_qwen2[0]),
    ):
        pass


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(r=0, alpha=8), "lora r=0"),
        (dict(r=4, alpha=0), "lora alpha=0"),
        (dict(r=4, alpha=8, dropout=1.0), "lora dropout=1.0"),
        (dict(r=4, alpha=8, target_modules="attention"), "'all-linear' or a list"),
        (dict(r=4, alpha=8, target_modules=[]), "target_modules is empty"),
    ],
)
def test_apply_lora_bad_arguments(tiny_qwen2, kwargs, match):
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match=match):
        apply_lora(copy.deepcopy(tiny_qwen2[0]), **kwargs)


def test_apply_lora_without_peft(tiny_qwen2, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match="pip install"):
        apply_lora(tiny_qwen2[0], r=4, alpha=8)
