"""What peergrade writes loads correctly with the tools users already have (issue 12).

Plain ``AutoTokenizer`` gives the same ids as peergrade's loader on the demo prompts (bundled
model, tiny fixtures of both architectures, a checkpoint of a short CLI run); greedy accuracy
through plain ``AutoModelForCausalLM.generate`` equals ``peergrade eval``'s; the older
word-level character tokenizer (which ``AutoTokenizer`` misread) is converted when saved; and
``peergrade export`` writes full models, LoRA adapters (``AutoPeftModelForCausalLM``) and merged
LoRA models, refusing bad input with one ``error:`` line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cli_helper import cli
from peergrade.config import load_config
from peergrade.model.load import (
    BUNDLED_MODEL,
    auto_tokenizer_mismatches,
    load_model,
    load_tokenizer,
    save_tokenizer,
)
from peergrade.tasks import load_task, render_prompt
from written_files import assert_same_written

TINY_RUN = {
    "rollout.prompts_per_step": "2",
    "rollout.group_size": "2",
    "rollout.max_completion_length": "4",
    "train.eval_size": "4",
    "train.eval_samples": "2",
    "train.display": "none",
    "train.threads": "1",
    "train.steps": "2",
    "train.save_every": "2",
    "optim.lr": "0.01",
}


def demo_task():
    """The task of the CPU demo, as the default config builds it."""
    d = load_config(None).data
    return load_task(d.task, **d.task_options)


def demo_texts(tok, n: int = 60) -> list[str]:
    """Held-out demo prompts rendered with the chat template, with and without the answer."""
    task = demo_task()
    out = []
    for r in task.eval_rows(n):
        prompt = render_prompt(r["prompt"], tok, system_prompt=task.system_prompt)
        out += [prompt, prompt + str(r["answer"])]
    return out


def flags(d: dict[str, str]) -> list[str]:
    return [x for k, v in d.items() for x in (f"--{k}", v)]


def hf_greedy_accuracy(path, n: int, max_new_tokens: int = 16) -> float:
    """Greedy accuracy on the demo's first ``n`` held-out problems, the way a user of plain
    transformers measures it: AutoTokenizer, the chat template, AutoModelForCausalLM.generate,
    then the task's own verifier on the decoded text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peergrade.rewards import resolve_reward

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    task = demo_task()
    rows = task.eval_rows(n)
    texts = []
    for r in rows:
        msgs = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
        p = r["prompt"]  # the built-in tasks give chat messages, as a TRL dataset would
        msgs += p if isinstance(p, list) else [{"role": "user", "content": p}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
        texts.append(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    verifier = resolve_reward(task.default_rewards[0][0])
    cols = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    scores = verifier(prompts=[r["prompt"] for r in rows], completions=texts, **cols)
    return sum(1.0 for s in scores if s is not None and s >= 1.0 - 1e-6) / n


def peergrade_greedy_accuracy(path, n: int) -> float:
    from peergrade.cli.evaluate import EvalRequest, run_eval_command

    d = load_config(None).data
    request = EvalRequest(task=d.task, task_options=d.task_options, n=n, k=1, max_new_tokens=16)
    res = run_eval_command(model=str(path), request=request, device="cpu")
    return res["pass@1_greedy"]


def word_level_char_tokenizer(chat_template: str):
    """The character tokenizer in the form peergrade built before issue 12 (WordLevel model,
    one-character Split): the form AutoTokenizer misreads for a Qwen2 directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from peergrade.model.tiny import CHARS, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", padding_side="left"
    )
    tok.chat_template = chat_template
    return tok


# ----------------------------------------------------------------------------- tokenizers


def test_bundled_model_autotokenizer_ids_equal_ours():
    from transformers import AutoTokenizer

    ours = load_tokenizer(BUNDLED_MODEL)
    auto = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    texts = demo_texts(ours)
    assert any("\n" in t for t in texts)  # the newline Qwen2Tokenizer used to drop
    for text in texts:
        assert auto(text)["input_ids"] == ours(text)["input_ids"], text
        assert auto.decode(ours(text)["input_ids"]) == text
    msgs = [{"role": "user", "content": "12+34="}]
    assert auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    assert (auto.pad_token_id, auto.eos_token_id) == (ours.pad_token_id, ours.eos_token_id)
    assert auto_tokenizer_mismatches(BUNDLED_MODEL, ours, texts) == []


def test_bundled_tokenizer_files_are_what_sft_writes(tmp_path):
    """The documented `peergrade sft --init qwen2 ...` writes these tokenizer files byte for byte
    (the weights take a full SFT run to check; see docs/getting-started.md, "The bundled model")."""
    from peergrade.model.tiny import COMPACT_CHAT_TEMPLATE, build_char_tokenizer

    save_tokenizer(build_char_tokenizer(chat_template=COMPACT_CHAT_TEMPLATE), tmp_path)
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    assert_same_written(tmp_path, BUNDLED_MODEL, names)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_dirs_round_trip_through_autotokenizer(arch, tmp_path):
    from peergrade.model.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / arch, arch, hidden_size=16, num_layers=1)
    ours = load_tokenizer(path)
    texts = demo_texts(ours, 10) + [" two  spaces\nand\n\nnewlines ~!"]
    assert auto_tokenizer_mismatches(path, ours, texts) == []


def test_word_level_tokenizer_is_converted_when_saved(tmp_path):
    """The old form loses every newline under AutoTokenizer; save_tokenizer writes the
    byte-level form instead, with the same ids."""
    from peergrade.model.tiny import COMPACT_CHAT_TEMPLATE, build_tiny_model

    old = word_level_char_tokenizer(COMPACT_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", old, hidden_size=16, num_layers=1)
    texts = demo_texts(old, 10)
    plain, fixed = tmp_path / "plain", tmp_path / "fixed"
    for d in (plain, fixed):
        model.save_pretrained(d)
    old.save_pretrained(plain)
    save_tokenizer(old, fixed)
    assert auto_tokenizer_mismatches(plain, old, texts)  # what issue 12 reported
    assert auto_tokenizer_mismatches(fixed, old, texts) == []
    assert load_tokenizer(fixed)(texts[1])["input_ids"] == old(texts[1])["input_ids"]


def test_greedy_accuracy_through_plain_generate_equals_peergrade_eval():
    n = 24
    hf = hf_greedy_accuracy(BUNDLED_MODEL, n)
    ours = peergrade_greedy_accuracy(BUNDLED_MODEL, n)
    assert hf == ours
    assert ours >= 0.25  # the demo model's held-out greedy accuracy is ~0.55, not ~0.05


# ----------------------------------------------------------------------------- a trained run


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step CLI run of the bundled model (its checkpoint is what the trainer writes)."""
    root = tmp_path_factory.mktemp("run12")
    proc = cli(["train", *flags(TINY_RUN), "-o", "run"], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


@pytest.mark.slow
def test_trained_checkpoint_loads_with_plain_hf_tools(trained_run):
    from peergrade.training.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(trained_run)
    assert ckpt is not None and ckpt.name == "step-2"
    ours = load_tokenizer(ckpt)
    assert auto_tokenizer_mismatches(ckpt, ours, demo_texts(ours)) == []
    n = 16
    assert hf_greedy_accuracy(ckpt, n) == peergrade_greedy_accuracy(ckpt, n)


@pytest.mark.slow
def test_export_full_model(trained_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from peergrade.training.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(trained_run)
    proc = cli(["export", str(trained_run), str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"training_state.pt", "trainer_state.json"}
    digest = [
        hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (ckpt, out)
    ]
    assert digest[0] == digest[1]  # the run's latest weights, byte for byte
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = load_model(ckpt).eval()
    ids = torch.tensor([load_tokenizer(ckpt)("Q:12+34=\nA:")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    ours = load_tokenizer(ckpt)
    assert auto_tokenizer_mismatches(out, ours, demo_texts(ours, 10)) == []

    # a checkpoint dir works too; bad input is one error line, exit 2, nothing written
    assert cli(["export", str(ckpt), str(tmp_path / "out2")], tmp_path).returncode == 0
    for args, match in [
        ([str(trained_run), str(out)], "already exists"),
        ([str(tmp_path / "nope"), str(tmp_path / "o3")], "does not exist"),
        ([str(BUNDLED_MODEL), str(tmp_path / "o4")], "neither a peergrade run"),
        ([str(trained_run), str(tmp_path / "o5"), "--merge-lora"], "not a LoRA adapter"),
    ]:
        proc = cli(["export", *args], tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert match in proc.stderr and "Traceback" not in proc.stderr
    assert not any((tmp_path / f"o{i}").exists() for i in (3, 4, 5))
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == digest[1]


@pytest.mark.slow
def test_export_lora_adapter_and_merged(tmp_path):
    pytest.importorskip("peft")
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    opts = {**TINY_RUN, "model.lora.enabled": "true", "model.lora.r": "4", "optim.lr": "0.05"}
    proc = cli(["train", *flags(opts), "-o", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "adapter_config.json").is_file()

    ids = torch.tensor([load_tokenizer(ckpt)("Q:12+34=\nA:")["input_ids"]])
    with torch.no_grad():
        base_logits = load_model(BUNDLED_MODEL)(ids).logits
        ref = PeftModel.from_pretrained(load_model(BUNDLED_MODEL), str(ckpt)).eval()
        ref_logits = ref(ids).logits
    assert not torch.allclose(ref_logits, base_logits)  # the adapter moved

    # elsewhere than the run's cwd: the adapter must name its base by an absolute path
    assert cli(["export", "run", str(tmp_path / "adapter")], tmp_path).returncode == 0
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert Path(cfg["base_model_name_or_path"]).is_absolute()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()

    proc = cli(["export", "run", str(tmp_path / "merged"), "--merge-lora"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapter(ids).logits, ref_logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(ids).logits, ref_logits, rtol=1e-4, atol=1e-4)
    ours = load_tokenizer(ckpt)
    for d in ("adapter", "merged"):
        assert auto_tokenizer_mismatches(tmp_path / d, ours, demo_texts(ours, 10)) == []


def test_written_files_ignore_only_the_library_version_stamps(tmp_path):
    """The bundled-file comparison (issue 60) passes a newer transformers' stamp and nothing else."""
    shipped = json.loads((BUNDLED_MODEL / "config.json").read_text())
    for name, change, same in [
        ("a", {"transformers_version": "9.99.0"}, True),
        ("b", {"vocab_size": shipped["vocab_size"] + 1}, False),
        ("c", {"model_type": "llama"}, False),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**shipped, **change}, indent=1))
        try:
            assert_same_written(tmp_path / name, BUNDLED_MODEL, ["config.json"])
        except AssertionError:
            assert not same, change
        else:
            assert same, change
