"""The Python API in TRL's words (peergrade.api): batch arithmetic against TRL's own
GRPOConfig and sampler, every TRL field classified, refused and ignored fields, the generated
docs table, and TRL's quickstart / docs examples run on the bundled tiny model by changing
the import line (and the Hub model id and dataset, which cannot be downloaded here)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import warnings
from pathlib import Path

import pytest

from peergrade.api import (
    IGNORED,
    MAPPED,
    OWN_DEFAULTS,
    UNSUPPORTED,
    GRPOConfig,
    _field_kind,
)
from peergrade.config import ConfigError
from peergrade.model.load import BUNDLED_MODEL

DOCS = Path(__file__).resolve().parents[2] / "docs"

BATCHES = [
    dict(per_device_train_batch_size=8, num_generations=8),
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8),
    dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, num_generations=3),
    dict(per_device_train_batch_size=4, generation_batch_size=16, num_generations=4),
    dict(per_device_train_batch_size=2, steps_per_generation=4, num_generations=2),
    dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=4,
    ),
]


@pytest.mark.parametrize("kw", BATCHES)
def test_prompts_per_step_and_group_size_as_trl_computes(kw, tmp_path):
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import RepeatSampler

    theirs = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kw
    )
    ours = GRPOConfig(**kw, max_steps=1)
    cfg = ours.to_config()
    assert cfg.rollout.group_size == theirs.num_generations
    assert cfg.rollout.prompts_per_step == theirs.generation_batch_size // theirs.num_generations
    # TRL's sampler: one generation batch holds exactly that many distinct prompts, G each
    sampler = RepeatSampler(
        data_source=list(range(100)),
        mini_repeat_count=theirs.num_generations,
        batch_size=theirs.generation_batch_size // theirs.num_generations,
        repeat_count=theirs.num_iterations * theirs.steps_per_generation,
        seed=0,
    )
    first = list(sampler)[: theirs.generation_batch_size]
    assert len(set(first)) == cfg.rollout.prompts_per_step
    assert {first.count(i) for i in set(first)} == {cfg.rollout.group_size}
    # an optimizer step sees per_device x accumulation completions, as TRL's does
    per_update = kw["per_device_train_batch_size"] * kw.get("gradient_accumulation_steps", 1)
    assert cfg.minibatch_size == per_update
    assert cfg.micro_batch_size == kw["per_device_train_batch_size"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(per_device_train_batch_size=3, num_generations=2),  # 3 completions, groups of 2
        dict(per_device_train_batch_size=4, generation_batch_size=6, num_generations=2),
        dict(generation_batch_size=16, steps_per_generation=2, per_device_train_batch_size=8),
        dict(num_generations=1, per_device_train_batch_size=8),
    ],
)
def test_batches_trl_refuses_are_refused(kw, tmp_path):
    trl = pytest.importorskip("trl")
    with pytest.raises(ValueError):
        trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)
    with pytest.raises(ConfigError):
        GRPOConfig(**kw)


def test_max_steps_counts_optimizer_steps_and_epochs_count_rows():
    # two optimizer steps per generation (steps_per_generation = 2 x accumulation)
    c = GRPOConfig(
        per_device_train_batch_size=2, steps_per_generation=2, num_generations=2, max_steps=10
    )
    assert c.to_config().train.steps == 5 and c.to_config().updates_per_step == 2
    e = GRPOConfig(per_device_train_batch_size=4, num_generations=2, num_train_epochs=2)
    assert e.to_config(num_rows=11).train.steps == 2 * (11 // 2)


def test_unsupported_field_is_an_error_naming_it_and_what_to_use():
    with pytest.raises(ConfigError, match=r"'optim'.*AdamW"):
        GRPOConfig(optim="adafactor")
    with pytest.raises(ConfigError, match=r"'fp16'.*bf16"):
        GRPOConfig(fp16=True)
    with pytest.raises(ConfigError, match="loss_type='sapo2'.*dapo.*vespo"):
        GRPOConfig(loss_type="sapo2", max_steps=1).to_config()
    with pytest.raises(ConfigError, match="no field 'num_generation'.*'num_generations'"):
        GRPOConfig(num_generation=4)
    with pytest.raises(ConfigError, match="no field 'use_peft'.*peft_config=LoraConfig"):
        GRPOConfig(use_peft=True)
    GRPOConfig(optim="adamw_torch_fused", fp16=False)  # TRL's own defaults ask for nothing


def test_every_trl_loss_type_is_accepted_with_its_parameters():
    """TRL 1.16's loss_type values all map to algo.loss_type, with their own parameters."""
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        assert GRPOConfig(loss_type=lt, max_steps=1).to_config().algo.loss_type == lt
    a = (
        GRPOConfig(
            loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, max_steps=1
        )
        .to_config()
        .algo
    )
    assert (a.sapo_temperature_pos, a.sapo_temperature_neg) == (0.5, 2.0)
    with pytest.warns(UserWarning, match="vespo.*importance_sampling_level"):
        a = (
            GRPOConfig(loss_type="vespo", importance_sampling_level="sequence", max_steps=1)
            .to_config()
            .algo
        )
    assert a.ratio_level == "token"
    with pytest.raises(ConfigError, match="algo.delta.*loss_type='cispo'"):
        GRPOConfig(loss_type="cispo", delta=4.0, max_steps=1).to_config()
    with pytest.raises(ConfigError, match="multi_objective_aggregation='mean'.*normalize_then_sum"):
        GRPOConfig(multi_objective_aggregation="mean", max_steps=1).to_config()
    with pytest.raises(ConfigError, match="algo.top_entropy_quantile must be in"):
        GRPOConfig(top_entropy_quantile=1.5, max_steps=1).to_config()


def test_meaningless_fields_are_warned_about_once():
    with pytest.warns(UserWarning) as got:
        GRPOConfig(vllm_tensor_parallel_size=2, hub_model_id="me/x", push_to_hub=True)
    assert len(got) == 1
    for name in ("vllm_tensor_parallel_size", "hub_model_id", "push_to_hub"):
        assert name in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(use_vllm=False)  # the default is no news


def test_every_trl_field_is_classified_with_trls_default():
    trl = pytest.importorskip("trl")
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for name, f in theirs.items():
        assert _field_kind(name), f"TRL field {name!r} is in no table of peergrade.api"
        if name in UNSUPPORTED:
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            assert UNSUPPORTED[name][0] == default, name
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name in MAPPED:
        if name in theirs and name not in OWN_DEFAULTS:  # max_prompt_length: TRL < 1.0
            assert ours[name] == theirs[name].default, name
    assert set(OWN_DEFAULTS) <= set(MAPPED) and ours["per_device_eval_batch_size"] is None
    tables = [set(MAPPED), set(IGNORED), set(UNSUPPORTED)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])


def test_every_mapped_field_sets_the_key_it_names():
    """Changing one TRL field changes only the peergrade key the docs table names."""
    base = dict(max_steps=4, per_device_train_batch_size=4, num_generations=2)
    changed = {
        "output_dir": "elsewhere",
        "num_generations": 4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "generation_batch_size": 8,
        "steps_per_generation": 2,
        "max_steps": 6,
        "max_completion_length": 16,
        "max_tool_calling_iterations": 3,
        "max_prompt_length": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "cosine",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "warmup_steps": 2,
        "warmup_ratio": 0.5,
        "weight_decay": 0.1,
        "adam_beta1": 0.8,
        "adam_beta2": 0.95,
        "max_grad_norm": 0.5,
        "beta": 0.04,
        "epsilon": 0.3,
        "epsilon_high": 0.28,
        "use_bias_correction_kl": False,
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "delta": 4.0,
        "sapo_temperature_neg": 1.2,
        "sapo_temperature_pos": 0.9,
        "vespo_k_pos": 1.5,
        "vespo_lambda_pos": 2.5,
        "vespo_k_neg": 2.5,
        "vespo_lambda_neg": 1.5,
        "multi_objective_aggregation": "normalize_then_sum",
        "off_policy_mask_threshold": 0.5,
        "top_entropy_quantile": 0.2,
        "entropy_coef": 0.01,
        "use_adaptive_entropy": True,
        "entropy_coef_min": 0.001,
        "entropy_coef_max": 0.5,
        "entropy_coef_delta": 0.01,
        "entropy_target": 1.0,
        "scale_rewards": "batch",
        "num_iterations": 2,
        "mask_truncated_completions": True,
        "seed": 7,
        "save_steps": 2,
        "save_strategy": "no",
        "save_total_limit": 3,
        "eval_strategy": "steps",
        "num_generations_eval": 3,
        "per_device_eval_batch_size": 16,
        "report_to": ["tensorboard"],
        "project": "mine",
        "gradient_checkpointing": False,
        "bf16": True,
        "use_cpu": True,
        "ddp_timeout": 60,
        "model_init_kwargs": {"dtype": "bfloat16"},
        "disable_dropout": True,
        "use_vllm": True,
        "vllm_gpu_memory_utilization": 0.5,
        "vllm_max_model_length": 256,
        "vllm_mode": "server",
        "vllm_server_timeout": 60.0,
        "chat_template_path": "hermes",
    }
    # need rows / rewards / strategy; read by GRPOTrainer.train; the server's URL: with
    # use_vllm=True and vllm_mode="server" only (test_vllm_server.py)
    skip = {"num_train_epochs", "reward_weights", "eval_steps", "overwrite_output_dir"}
    skip |= {"vllm_server_base_url", "vllm_server_host", "vllm_server_port"}
    if importlib.util.find_spec("vllm") is None:  # use_vllm=True without vLLM: the own kernel
        del changed["use_vllm"]
        skip.add("use_vllm")
    assert set(changed) | skip == set(MAPPED)

    def flat(cfg) -> dict:
        return dict(_leaves(dataclasses.asdict(cfg)))

    before = flat(GRPOConfig(**base).to_config())
    for name, value in changed.items():
        after = flat(GRPOConfig(**{**base, name: value}).to_config())
        moved = {k for k in after if after[k] != before[k]}
        key = MAPPED[name][0]
        assert key in moved, (name, moved)
        # the batch fields are TRL's products of each other (prompts = completions / G, ...);
        # every other field touches its own key (and the step counts derived from it) only
        if name not in BATCH_FIELDS:
            assert moved <= {key, "train.steps", "train.eval_every"}, (name, moved)


BATCH_FIELDS = {
    "num_iterations",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
}


def _leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict) and k not in ("task_options", "columns"):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_import_peergrade_stays_light():
    import subprocess
    import sys

    code = "import sys, peergrade; peergrade.GRPOConfig; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- TRL's scripts


def _rows(n: int = 4) -> list[dict]:
    pairs = [(12, 7), (23, 41), (30, 15), (8, 9), (44, 21), (17, 17)][:n]
    return [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
        for a, b in pairs
    ]


def _long_context_model(tmp_path) -> Path:
    """The bundled model with a 1024-position context (RoPE: same weights), so that TRL's
    default max_completion_length (512) fits after a prompt; the bundled one has 512."""
    import json
    import shutil

    out = tmp_path / "tiny-1k"
    shutil.copytree(BUNDLED_MODEL, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _run_trl_script(script: str, tmp_path, monkeypatch) -> dict:
    """Exec a TRL script with only its ``from trl import`` line changed (and the Hub model
    id / load_dataset line pointed at the tiny model and an in-memory dataset)."""
    ours = script.replace("from trl import", "from peergrade import")
    assert ours.count("\n") == script.count("\n") and ours != script
    ours = ours.replace('"Qwen/Qwen2-0.5B-Instruct"', repr(str(_long_context_model(tmp_path))))
    ours = re.sub(r"load_dataset\([^)]*\)", "Dataset.from_list(ROWS)", ours)
    monkeypatch.chdir(tmp_path)
    from datasets import Dataset

    scope = {"Dataset": Dataset, "ROWS": _rows(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(ours, "trl_script.py", "exec"), scope)
    return scope


QUICKSTART = """
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
"""

DOCS_EXAMPLE = """
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=16, max_steps=2)
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
"""


@pytest.mark.slow
def test_trl_quickstart_runs_with_the_import_changed(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("math_verify")
    scope = _run_trl_script(QUICKSTART, tmp_path, monkeypatch)
    trainer = scope["trainer"]
    # TRL's defaults: 8 completions per device, groups of 8 -> 1 prompt a step; 3 epochs of 2
    assert trainer.config.rollout.group_size == 8 and trainer.config.rollout.prompts_per_step == 1
    steps = [h for h in trainer.state.log_history if not h.get("final")]
    assert [h["step"] for h in steps] == list(range(1, 7))
    # TRL's own accuracy_reward scored every completion (0.0 or 1.0, none failed)
    assert all(0.0 <= h["rewards/accuracy_reward/mean"] <= 1.0 for h in steps)
    assert all(h["reward/errors"] == 0 for h in steps)
    assert (tmp_path / "tiny-1k-GRPO" / "metrics.jsonl").is_file()  # TRL's f"{model}-GRPO"


@pytest.mark.slow
def test_trl_docs_example_runs_with_the_import_changed(tmp_path, monkeypatch):
    scope = _run_trl_script(DOCS_EXAMPLE, tmp_path, monkeypatch)
    trainer = scope["trainer"]
    history = trainer.state.log_history
    assert [h["step"] for h in history] == [1, 2]
    # the reward is the function's own: -|20 - length| is never positive
    assert all(h["rewards/reward_len/mean"] <= 0 for h in history)
    assert history[-1]["reward"] == history[-1]["reward/total/mean"]
    assert (tmp_path / "Qwen2-0.5B-GRPO" / "checkpoints").is_dir()
    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (name, a), b in zip(trainer.model.state_dict().items(), again.state_dict().values()):
        assert (a == b).all(), name


@pytest.mark.slow
def test_python_api_page_example_runs(tmp_path, monkeypatch):
    text = (DOCS / "python-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 14
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "python-api.md", "exec"), scope)
    trainer = scope["trainer"]
    assert len(trainer.state.log_history) == trainer.config.train.steps
    assert (tmp_path / "my-model" / "config.json").is_file()


def test_in_memory_objects_reach_the_trainer(tmp_path):
    """A loaded model object, a callable and bad rows: the objects are used, rows checked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peergrade import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL))
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))

    def shortness(completions, **kw):
        return [0.0 for _ in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        max_completion_length=4,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model, shortness, args, _rows(2), processing_class=tok)
    assert trainer.model is model and trainer.reward_funcs == [shortness]
    assert trainer.config.rewards[0].name.endswith(
        ":test_in_memory_objects_reach_the_trainer.<locals>.shortness"
    )
    with pytest.raises(Exception, match=r"train_dataset: row 2: missing column 'prompt'"):
        GRPOTrainer(
            model, shortness, args, [{"prompt": "1+1="}, {"question": "x"}], processing_class=tok
        )


@pytest.mark.slow
def test_lora_eval_dataset_and_callbacks(tmp_path):
    """peft_config trains adapters, eval_dataset is the held-out split, callbacks see the run."""
    peft = pytest.importorskip("peft")
    from peergrade import GRPOTrainer

    events = []

    class Recorder:
        def on_train_begin(self, args, state, control, **kw):
            events.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kw):
            events.append(("step", state.global_step))

        def on_log(self, args, state, control, logs=None, **kw):
            events.append(("log", logs["step"]))

        def on_train_end(self, args, state, control, model=None, **kw):
            events.append(("end", state.global_step))

    def exact(completions, solution, **kw):
        return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        max_completion_length=4,
        gradient_checkpointing=False,
        learning_rate=1e-3,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(
        model=str(BUNDLED_MODEL),
        reward_funcs=[exact],
        args=args,
        train_dataset=_rows(4),
        eval_dataset=_rows(2),
        peft_config=lora,
        callbacks=[Recorder()],
    )
    assert trainer.config.model.lora.enabled and trainer.config.model.lora.r == 4
    base = {k: v.clone() for k, v in trainer.model.named_parameters() if "lora_" not in k}
    trainer.train()
    assert events[0] == ("begin", 0) and events[-1] == ("end", 2)
    assert ("step", 1) in events and ("step", 2) in events
    history = trainer.state.log_history
    assert history[0]["step"] == 0 and "eval/pass@1_greedy" in history[0]  # before training
    assert history[-1]["final"] and "eval/pass@1_greedy" in history[-1]
    for k, v in trainer.model.named_parameters():
        if k in base:  # only the adapters moved
            assert (v == base[k]).all(), k
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_native_api_trains_a_config(tmp_path):
    import peergrade

    cfg = peergrade.load_config(
        None,
        [
            ("train.output_dir", str(tmp_path / "native")),
            ("train.steps", 1),
            ("rollout.prompts_per_step", 2),
            ("rollout.group_size", 2),
            ("train.eval_size", 2),
            ("train.eval_samples", 1),
        ],
    )
    assert isinstance(cfg, peergrade.Config)
    summary = peergrade.train(cfg)
    assert summary["step"] == 1 and (tmp_path / "native" / "metrics.jsonl").is_file()


def _tiny_args(out, **kw) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        gradient_checkpointing=False,
        save_strategy="no",
        **kw,
    )


def _zero(completions, **kw):
    return [0.0 for _ in completions]


def test_ctrl_c_saves_raises_and_resumes_and_overwrite_replaces_as_in_trl(tmp_path, capsys):
    """Ctrl-C in train(): the step finishes, a checkpoint is saved, KeyboardInterrupt is
    raised (a script does not go on to save a half-trained model as final) and the hint is
    Python; a rerun is refused in Python's words, resumed with resume_from_checkpoint=True
    (or the checkpoint's path), replaced with overwrite_output_dir=True."""
    import os
    import signal

    from peergrade import GRPOTrainer
    from peergrade.training.checkpoint import RunDirError

    out = tmp_path / "run"

    class CtrlC:
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    trainer = GRPOTrainer(
        str(BUNDLED_MODEL), _zero, _tiny_args(out, max_steps=3), _rows(2), callbacks=[CtrlC()]
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    said = capsys.readouterr()
    assert "resume_from_checkpoint=" in said.out + said.err
    assert "peergrade train --resume" not in said.out + said.err
    assert (out / "checkpoints" / "step-1").is_dir()

    again = GRPOTrainer(str(BUNDLED_MODEL), _zero, _tiny_args(out, max_steps=3), _rows(2))
    with pytest.raises(RunDirError, match=r"overwrite_output_dir=True.*resume_from_checkpoint"):
        again.train()
    with pytest.raises(RunDirError, match="resumes a run from its last checkpoint"):
        again.train(resume_from_checkpoint=str(out / "checkpoints" / "step-0"))
    result = again.train(resume_from_checkpoint=str(out / "checkpoints" / "step-1"))
    assert result.global_step == 3
    assert [h["step"] for h in again.state.log_history] == [2, 3]

    fresh = GRPOTrainer(
        str(BUNDLED_MODEL), _zero, _tiny_args(out, max_steps=1, overwrite_output_dir=True), _rows(2)
    )
    assert fresh.train().global_step == 1
    assert not (out / "checkpoints" / "step-3").exists()  # replaced, not continued


def test_sigterm_in_train_raises_the_public_terminated(tmp_path):
    """A SIGTERM (preemption) in train(): the step finishes, a checkpoint is saved, and
    peergrade.Terminated is raised (a KeyboardInterrupt, with the resume hint as its message),
    not an internal class."""
    import os
    import signal

    import peergrade
    from peergrade import GRPOTrainer

    out = tmp_path / "run"

    class Preempt:
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = GRPOTrainer(
        str(BUNDLED_MODEL), _zero, _tiny_args(out, max_steps=3), _rows(2), callbacks=[Preempt()]
    )
    with pytest.raises(peergrade.Terminated, match="resume_from_checkpoint=") as info:
        trainer.train()
    assert type(info.value).__module__ == "peergrade.errors"
    assert isinstance(info.value, KeyboardInterrupt)
    assert (out / "checkpoints" / "step-1").is_dir()


def test_every_peergrade_key_is_settable_from_grpoconfig_and_checked():
    """peergrade={dotted key: value}: the keys TRL has no field for, checked like a YAML file's."""
    cfg = GRPOConfig(
        max_steps=2,
        peergrade={
            "rollout.async_steps": 1,
            "rollout.dynamic_sampling": True,
            "env.tool_timeout": 5,
            "env.max_tool_output_chars": 100,
            "train.audit_rewards": "fail",
        },
    ).to_config()
    assert cfg.rollout.async_steps == 1 and cfg.rollout.dynamic_sampling
    assert cfg.env.tool_timeout == 5.0 and cfg.env.max_tool_output_chars == 100
    assert cfg.train.audit_rewards == "fail"
    with pytest.raises(
        ConfigError,
        match=r"peergrade\['rollout.async_step'\].*did you mean "
        r"'rollout.async_steps'",
    ):
        GRPOConfig(peergrade={"rollout.async_step": 1})
    with pytest.raises(ConfigError, match="rollout.async_steps: expected an integer"):
        GRPOConfig(peergrade={"rollout.async_steps": "soon"})
    with pytest.raises(ConfigError, match="set from TRL's num_generations"):
        GRPOConfig(peergrade={"rollout.group_size": 4})
    with pytest.raises(ConfigError, match="set from TRL's bf16"):  # bf16=False is autocast off
        GRPOConfig(peergrade={"model.autocast": "off"})
    # a peergrade key given as a field says where it goes
    with pytest.raises(ConfigError, match=r"peergrade=\{'rollout.async_steps'"):
        GRPOConfig(async_steps=1)


def test_length_limits_beyond_the_context_fail_when_the_trainer_is_built(tmp_path):
    """TRL's default max_completion_length (512) on the bundled model (512 positions): an
    error naming max_completion_length and the model's limit at GRPOTrainer(...), before any
    evaluation or run directory; eval_strategy without eval data is TRL's error."""
    from peergrade import GRPOTrainer

    out = tmp_path / "run"
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=2, num_generations=2, max_steps=1
    )
    with pytest.raises(
        ConfigError,
        match=r"max_completion_length.*= 512.*context of 512 tokens"
        r".*at most 256",
    ):
        GRPOTrainer(str(BUNDLED_MODEL), _zero, args, _rows(2))
    assert not out.exists()
    # a loaded model object: its config says the same
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL))
    with pytest.raises(ConfigError, match="context of 512 tokens"):
        GRPOTrainer(model, _zero, args, _rows(2))
    with pytest.raises(ConfigError, match=r"eval_strategy='steps'.*no eval_dataset"):
        GRPOTrainer(str(BUNDLED_MODEL), _zero, _tiny_args(out, eval_strategy="steps"), _rows(2))


def test_disable_dropout_sets_the_policys_dropout_to_zero(tmp_path):
    import json
    import shutil

    from peergrade import GRPOTrainer

    model = tmp_path / "dropout"
    shutil.copytree(BUNDLED_MODEL, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["attention_dropout"] = 0.3
    (model / "config.json").write_text(json.dumps(cfg))
    attn = [
        m
        for m in GRPOTrainer(
            str(model), _zero, _tiny_args(tmp_path / "a", max_steps=1), _rows(2)
        ).model.modules()
        if hasattr(m, "attention_dropout")
    ]
    assert attn and all(m.attention_dropout == 0.3 for m in attn)  # kept by default, as TRL
    trainer = GRPOTrainer(
        str(model), _zero, _tiny_args(tmp_path / "b", max_steps=1, disable_dropout=True), _rows(2)
    )
    attn = [m for m in trainer.model.modules() if hasattr(m, "attention_dropout")]
    assert attn and all(m.attention_dropout == 0.0 for m in attn)
    assert trainer.config.model.disable_dropout


def test_progress_line_counts_the_steps_log_history_counts(tmp_path, capsys):
    """Two optimizer steps per generation step: the progress line and log_history both count
    TRL's optimizer steps (2/4, 4/4), not peergrade's generation steps (1/2, 2/2)."""
    from peergrade import GRPOTrainer

    args = _tiny_args(
        tmp_path / "run", max_steps=4, steps_per_generation=4, gradient_accumulation_steps=2
    )
    trainer = GRPOTrainer(str(BUNDLED_MODEL), _zero, args, _rows(4))
    assert trainer.config.train.steps == 2 and trainer.state.max_steps == 4
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history] == [2, 4]
    shown = re.findall(r"^step (\d+)/(\d+) ", capsys.readouterr().out, re.M)
    assert shown == [("2", "4"), ("4", "4")]


def test_first_bf16_step_that_moves_the_model_far_more_than_float32_raises_an_alert(tmp_path):
    """A model whose weights sit on bfloat16 midpoints (a de-quantised GGUF's), trained with
    bf16 autocast at TRL's lr 1e-6: the first step's line has the probe's numbers and the
    bf16_update alert; after round_bf16_ties (what `peergrade convert` writes) it has neither."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peergrade import GRPOTrainer
    from peergrade.model.gguf import round_bf16_ties

    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    lines = {}
    for name in ("ties", "rounded"):
        model = AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(((p.view(torch.int32) & -65536) | 0x8000).view(torch.float32))
        if name == "rounded":
            round_bf16_ties(model)
        args = _tiny_args(tmp_path / name, max_steps=1, bf16=True, learning_rate=1e-6)
        trainer = GRPOTrainer(model, _zero_one, args, _rows(2), processing_class=tok)
        trainer.train()
        lines[name] = trainer.state.log_history[0]
    assert lines["ties"]["precision/bf16_step_ratio"] > 30
    assert "bf16_update" in lines["ties"]["alerts"]
    assert lines["rounded"]["precision/bf16_step_ratio"] < 3
    assert "bf16_update" not in lines["rounded"].get("alerts", {})


def _zero_one(completions, **kw):  # rewards that differ, so that the update moves the weights
    return [float(i % 2) for i in range(len(completions))]
