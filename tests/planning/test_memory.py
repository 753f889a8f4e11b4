"""The memory estimator (parameter counts against real models, hand-computed breakdowns) and
the child-process measurement, plus `peergrade memory`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from peergrade.model.tiny import tiny_config
from peergrade.planning.memory import (
    MemoryOptions,
    Placement,
    StepShape,
    estimate_for_config,
    estimate_memory,
    measure_memory,
    param_counts,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(
    "arch,tied,kw",
    [
        ("qwen2", True, dict(hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2)),
        ("llama", False, dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4)),
    ],
)
def test_param_counts_match_real_models(arch, tied, kw):
    from transformers import AutoModelForCausalLM

    from peergrade.model.load import apply_lora

    cfg = tiny_config(arch, vocab_size=101, intermediate_size=80, tie_word_embeddings=tied, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    pc = param_counts(cfg, lora={"r": 4, "target_modules": ["q_proj", "down_proj"]})
    assert pc["total"] == sum(p.numel() for p in model.parameters())
    assert pc["lm_head"] == (0 if tied else 101 * kw["hidden_size"])
    peft_model = apply_lora(model, r=4, alpha=8, target_modules=["q_proj", "down_proj"])
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert pc["lora"] == trainable


HAND = {  # a Llama-shaped toy whose sizes are easy to add up by hand
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "vocab_size": 10,
    "tie_word_embeddings": True,
}


def test_estimate_hand_values():
    # params: embedding 10*8 = 80; layer: q 64 + k 32 + v 32 + o 64 + 3 * 128 MLP + 2 * 8 norms
    # = 592; final norm 8 -> 680
    assert param_counts(HAND)["total"] == 680
    step = StepShape(batch=4, seq_len=6, completion_len=2)
    ref = MemoryOptions(beta=0.1)
    e = estimate_memory(HAND, step, MemoryOptions(beta=0.1, algo="grpo"))
    assert e["weights"] == 680 * 4
    assert e["grads"] == 680 * 4
    assert e["optimizer"] == 2 * 680 * 4
    assert e["reference"] == 680 * 4
    assert e["critic"] == 0
    # saved for the backward per token per layer, float32 bytes (memory._token_bytes):
    # 24 H + 16 q_dim + 16 I + 4 L = 192 + 128 + 256 + 24 = 600; 4 x 6 tokens, no sharing (G = 1)
    layer_act = 4 * 6 * 600
    chunk = 2 * min(1024, 4 * 2) * 10 * 4  # two [c, V] float32 buffers
    hidden = 4 * 6 * 8 * 4 + 4 * 2 * 8 * 4  # final norm [B, L, H] + gathered completion rows
    assert e["activations"] == layer_act + chunk + hidden
    static = 680 * 4 * (1 + 1 + 2)  # weights, reference, AdamW state
    # the head's backward: its buffers, the float32 [V, H] accumulator, one layer's gradients
    backward = layer_act + hidden + chunk + 10 * 8 * 4 + layer_act
    assert e["phases"]["update"] == static + max(backward, 680 * 4)
    gen = static + 2 * 1 * 4 * 4 * 6 * 4 + 4 * 4 * 10 * 4  # KV cache + four [N, V] buffers
    assert e["phases"]["generate"] == gen
    assert e["phases"]["reference"] == static + layer_act + chunk + hidden  # no-grad pass
    assert e["phases"]["checkpoint"] == static  # the save streams: nothing on top
    assert e["peak"] == max(e["phases"].values()) == e["phases"]["update"]
    # fsdp on 2 CPU ranks: the decoder layers' share (592 of 680) halves on each rank, and
    # rank 0's save gathers the full weights and AdamW state on top of its shard
    fsdp = estimate_memory(HAND, step, ref, Placement(world=2, strategy="fsdp"))
    kept = 680 * 4 * 4 - sum(int(680 * 4 * k * (592 / 680) / 2) for k in (1, 1, 2))
    assert abs(fsdp["phases"]["checkpoint"] - (kept + 680 * 4 * 3)) <= 3  # int rounding
    assert (
        estimate_memory(HAND, step, ref, Placement(world=2, strategy="ddp"))["phases"]["checkpoint"]
        == static
    )

    # G = 2: the two prompts of the micro-batch run once, the 4 completions against the cache
    # repeated to every row (2 q_dim per prompt position, float32)
    g2 = estimate_memory(HAND, StepShape(batch=4, seq_len=6, completion_len=2, group_size=2), ref)
    assert g2["transient"] - 10 * 8 * 4 == (2 * 4 + 4 * 2) * 600 + 4 * 4 * 2 * 8 * 4
    # under gradient checkpointing the prompt is not shared: every row runs in full
    ckpt = estimate_memory(
        HAND,
        StepShape(batch=4, seq_len=6, completion_len=2, group_size=2),
        MemoryOptions(gradient_checkpointing=True),
    )
    assert ckpt["transient"] - 10 * 8 * 4 == layer_act

    # bf16 autocast on float32 weights: 26 H + 8 q_dim + 8 I + 2 L bytes per token, plus each
    # layer's weights cast to bf16 once
    ac = estimate_memory(HAND, step, MemoryOptions(autocast=True))
    assert ac["transient"] - 10 * 8 * 4 == 4 * 6 * (208 + 64 + 128 + 12)
    assert ac["activations"] == 4 * 6 * 412 + 2 * 592 + chunk + 4 * 6 * 8 * 4 + 4 * 2 * 8 * 4
    assert ac["phases"]["generate"] - e["phases"]["generate"] == 2 * 680 - 680 * 4  # casts, no ref

    # micro-batches below the minibatch: the first one's grads are alive during the second
    acc = estimate_memory(HAND, StepShape(batch=4, seq_len=6, completion_len=2, micro_batch=2), ref)
    half = estimate_memory(HAND, StepShape(batch=2, seq_len=6, completion_len=2), ref)
    assert acc["phases"]["update"] - half["phases"]["update"] == 680 * 4

    ppo = estimate_memory(HAND, step, MemoryOptions(beta=0.1, algo="ppo"))
    assert ppo["critic"] == 4 * 680 * 4  # weights + grads + AdamW state of the value model
    assert ppo["peak"] > e["peak"]

    lora = estimate_memory(
        HAND, step, MemoryOptions(beta=0.1, lora={"r": 2, "target_modules": ["q_proj"]})
    )
    assert lora["reference"] == 0  # the adapter disabled is the reference
    assert lora["trainable_params"] == 2 * (8 + 8)
    assert lora["grads"] == 32 * 4 and lora["optimizer"] == 2 * 32 * 4

    bf16 = estimate_memory(HAND, step, MemoryOptions(dtype="bfloat16"))
    assert bf16["weights"] == 680 * 2 and bf16["reference"] == 0  # beta 0: no reference
    # a bfloat16 lm_head adds one [V, H] product in bf16 to the float32 accumulator; per token
    # 16 H + 8 q_dim + 8 I + 2 L = 332 bytes (all in 2 bytes but the norms' float32 upcast)
    assert bf16["transient"] == 10 * 8 * 4 + 10 * 8 * 2 + 4 * 6 * 332


def test_estimate_shows_the_grpo_ppo_and_lora_gaps_on_a_30m_model():
    cfg = tiny_config(
        "qwen2",
        vocab_size=32000,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1408,
    )
    step = StepShape(batch=8, seq_len=57, completion_len=32)
    grpo = estimate_memory(cfg, step, MemoryOptions(beta=0.04))
    ppo = estimate_memory(cfg, step, MemoryOptions(beta=0.04, algo="ppo"))
    lora = estimate_memory(
        cfg, step, MemoryOptions(beta=0.04, lora={"r": 16, "target_modules": LORA_TARGETS})
    )
    # PPO adds at least the critic's weights and AdamW state (3 x its parameters in fp32)
    critic_params = param_counts(cfg)["total"]  # tied head: the backbone holds every tensor
    assert ppo["peak"] - grpo["peak"] >= 3 * critic_params * 4
    assert 0.5 < grpo["peak"] / ppo["peak"] < 0.7
    assert lora["peak"] / grpo["peak"] < 0.5
    ckpt = estimate_memory(cfg, step, MemoryOptions(beta=0.04, gradient_checkpointing=True))
    assert ckpt["activations"] < grpo["activations"]


@pytest.mark.parametrize(
    "record,kw,match",
    [
        (MemoryOptions, dict(dtype="int8"), "dtype='int8'"),
        (MemoryOptions, dict(algo="dpo"), "algo='dpo'"),
        (MemoryOptions, dict(optimizer="sgd"), "optimizer='sgd'"),
        (Placement, dict(device="tpu"), "device='tpu'"),
        (StepShape, dict(batch=2, seq_len=6, completion_len=6), "completion_len"),
        (StepShape, dict(batch=2, seq_len=6, completion_len=0), "completion_len"),
    ],
)
def test_estimate_rejects_bad_arguments(record, kw, match):
    with pytest.raises(ValueError, match=match):
        record(**kw)


def test_estimate_needs_the_sizes():
    with pytest.raises(ValueError, match="hidden_size"):
        estimate_memory({"vocab_size": 3}, StepShape(batch=1, seq_len=3, completion_len=1))


def test_estimate_defaults_are_float32_grpo_on_one_cpu():
    step = StepShape(batch=4, seq_len=6, completion_len=2)
    plain = estimate_memory(HAND, step)
    assert plain == estimate_memory(HAND, step, MemoryOptions(), Placement())
    assert plain["weights"] == 680 * 4 and plain["reference"] == 0 and plain["critic"] == 0
    # reward models given as a list are kept as a tuple: the options stay immutable
    rm = {"weights": 100, "activations": 10}
    opts = MemoryOptions(reward_models=[rm])
    assert opts.reward_models == (rm,)
    assert estimate_memory(HAND, step, opts)["reward_models"] == 100


def _cfg(model_dir, **over):
    from peergrade.config import load_config

    base = {
        "model.path": str(model_dir),
        "model.device": "cpu",
        "rollout.max_completion_length": 8,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "algo.beta": 0.04,
        "train.threads": 1,
    }
    base.update(over)
    return load_config(None, list(base.items()))


def test_estimate_for_config_reads_the_model_dir(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, **{"optim.micro_batch_size": 2})
    e = estimate_for_config(cfg, prompt_len=10)
    direct = estimate_memory(
        tiny_model_dir,
        StepShape(
            batch=4,
            micro_batch=2,
            seq_len=18,
            completion_len=8,
            group_size=2,
            minibatch=4,
            eval_rows=cfg.train.eval_size * cfg.train.eval_samples,
            eval_batch=4,  # auto: the step's 4
        ),
        MemoryOptions(beta=0.04),
    )
    assert e == direct
    assert estimate_for_config(cfg)["peak"] > 0  # prompt length from the task's prompts


def test_dynamic_sampling_rounds_ahead_counts_its_larger_generation_batch(tiny_model_dir):
    """rollout.rounds_ahead generates up to max_rounds - 1 rounds in one call: the estimate's
    generation KV cache grows with it, unless rollout.generation_batch_size bounds the call."""
    dyn = {"rollout.dynamic_sampling": True, "rollout.max_rounds": 4}
    plain = estimate_for_config(_cfg(tiny_model_dir), prompt_len=10)
    one = estimate_for_config(
        _cfg(tiny_model_dir, **dyn, **{"rollout.rounds_ahead": False}), prompt_len=10
    )
    ahead = estimate_for_config(_cfg(tiny_model_dir, **dyn), prompt_len=10)
    bounded = estimate_for_config(
        _cfg(tiny_model_dir, **dyn, **{"rollout.generation_batch_size": 4}), prompt_len=10
    )
    assert one == plain and bounded == plain  # 4 sequences a call, as the plain step's
    assert ahead["kv_cache"] == 3 * plain["kv_cache"] and ahead["peak"] >= plain["peak"]
    direct = estimate_memory(
        tiny_model_dir,
        StepShape(
            batch=4,
            seq_len=18,
            completion_len=8,
            group_size=2,
            minibatch=4,
            generation_rounds=3,
            eval_rows=200 * 8,
            eval_batch=12,  # auto: the step's call of 3 rounds of 4
        ),
        MemoryOptions(beta=0.04),
    )
    assert ahead == direct


def test_cli_memory_estimate_only(tiny_model_dir, capsys):
    from peergrade.cli import main

    rc = main(
        [
            "memory",
            "--model",
            str(tiny_model_dir),
            "--estimate-only",
            "--lora",
            "--prompt-len",
            "20",
            "--model.device",
            "cpu",
            "--algo.beta",
            "0.04",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("grpo ", "grpo-lora", "ppo ", "ppo-lora"):
        assert label in out, out
    # one whole-run line per variant: its peak, the phase setting it, evaluation and save
    import re

    runs = re.findall(
        r"estimated run peak (\S+): (\d+) MiB, set by (\w+) \(training step (\d+) MiB, "
        r"held-out evaluation (\d+) MiB, checkpoint save (\d+) MiB",
        out,
    )
    assert [r[0] for r in runs] == ["grpo", "grpo-lora", "ppo", "ppo-lora"], out
    for _, peak, _, step, evaluate, save in runs:
        assert int(peak) == max(int(step), int(evaluate), int(save)) and int(save) <= int(step)
    assert main(["memory", "--model", str(tiny_model_dir), "--estimate-only", "--algos", "x"]) == 2


@pytest.mark.slow
def test_measure_memory_ppo_child(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, **{"algo.name": "ppo"})
    m = measure_memory(cfg, steps=2, timeout=600)
    assert set(m["phases"]) == {"load", "generate", "rewards", "reference", "update", "checkpoint"}
    assert m["peak"] == max(m["phases"].values()) > 0
    # the trainer's own save, metered: the resident tensors (the optimizer state now too) and
    # not much more; a few MiB of allocator and file-buffer slack are noise at this toy size
    assert m["phases"]["load"] < m["phases"]["checkpoint"]
    assert m["phases"]["checkpoint"] <= m["phases"]["update"] + 8 * 2**20
    assert m["baseline_bytes"] > 50 * 2**20  # a Python process with torch loaded
    assert m["device"] == "cpu"
    assert m["completion_len"] <= 8 < m["seq_len"]
    # the critic is the policy's backbone (tied head: same parameters) plus a value head
    assert m["critic_params"] == m["params"] + 64 + 1


def test_estimate_with_the_reference_offloaded():
    step = StepShape(batch=4, seq_len=6, completion_len=2)
    opts, cuda = MemoryOptions(beta=0.1, dtype="bfloat16"), Placement(device="cuda")
    resident = estimate_memory(HAND, step, opts, cuda)
    offload = replace(opts, ref_offload=True)
    off = estimate_memory(HAND, step, offload, cuda)
    ref = 680 * 2
    assert off["reference"] == resident["reference"] == ref
    # the reference leaves the generate and update phases, and has a phase of its own
    for phase in ("generate", "update"):
        assert resident["phases"][phase] - off["phases"][phase] == ref
    assert off["phases"]["reference"] < resident["phases"]["update"]
    assert off["peak"] == max(off["phases"].values()) < resident["peak"]
    # no effect on CPU (nowhere to offload to), with LoRA (no copy) or with beta 0 (no reference)
    assert estimate_memory(HAND, step, offload) == estimate_memory(HAND, step, opts)
    lora = {"r": 2, "target_modules": ["q_proj"]}
    assert estimate_memory(HAND, step, replace(offload, lora=lora), cuda) == estimate_memory(
        HAND, step, replace(opts, lora=lora), cuda
    )
    no_ref = replace(opts, beta=0.0)
    assert estimate_memory(HAND, step, replace(no_ref, ref_offload=True), cuda) == (
        estimate_memory(HAND, step, no_ref, cuda)
    )


@pytest.mark.slow
def test_memory_follows_the_trainers_few_shot_prompts(tiny_model_dir):
    """`peergrade memory` runs the trainer's own step: few-shot example turns lengthen the
    prompts it measures and the prompts its estimate assumes, as they lengthen training's."""
    from peergrade.planning.memory import prompt_length

    seen = {}
    for k in (0, 2):
        cfg = _cfg(tiny_model_dir, **{"data.few_shot": k, "algo.beta": 0.0})
        measured = measure_memory(cfg, steps=1, timeout=600)
        seen[k] = (measured["prompt_len"], prompt_length(cfg), estimate_for_config(cfg))
    (m0, p0, e0), (m2, p2, e2) = seen[0], seen[2]
    assert m2 > m0 + 10  # two solved examples: each a question and a reply of several tokens
    assert p2 > p0 + 10
    assert p0 >= m0 and p2 >= m2  # the estimate takes the longest of more prompts
    assert e2["activations"] > e0["activations"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", [{}, {"model.lora.enabled": True}, {"algo.name": "ppo"}], ids=["grpo", "lora", "ppo"]
)
def test_estimate_is_within_20_percent_of_the_measured_peak(tmp_path, variant):
    """The estimate against the measurement of the very same config, on a model whose peak is
    mostly activations (a 3M-parameter Qwen2, 32 completions of 32 tokens in one micro-batch):
    a wrong activation model cannot hide behind the weights. The measurement runs every
    completion to full length and trains every row (``_run_steps``), as the estimate assumes."""
    from peergrade.model.tiny import save_tiny_model

    model = save_tiny_model(
        tmp_path / "m",
        "qwen2",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=704,
    )
    cfg = _cfg(
        model,
        **{
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 8,
            "rollout.max_completion_length": 32,
            **variant,
        },
    )
    m = measure_memory(cfg, steps=2, timeout=600)
    assert m["update_ran"] and m["completion_len"] == 32
    e = estimate_for_config(cfg, prompt_len=m["prompt_len"])
    static = e["weights"] + e["optimizer"] + e["reference"] + e["critic"]
    assert e["peak"] - static > 0.3 * e["peak"]  # the activations matter here
    err = (e["peak"] - m["peak"]) / m["peak"]
    assert abs(err) <= 0.20, (variant, e["peak"] / 2**20, m["peak"] / 2**20, m["phases"])


@pytest.mark.slow
def test_beta_0_measures_a_real_update(tiny_model_dir):
    """With beta 0 and a model that earns nothing, every group scores alike and the trainer
    skips the update; the measurement's probe reward makes it run, and says so."""
    cfg = _cfg(tiny_model_dir, **{"algo.beta": 0.0})
    m = measure_memory(cfg, steps=1, timeout=600)
    assert m["update_ran"] is True
    assert m["phases"]["update"] > m["phases"]["generate"]


def test_eval_batch_auto_keeps_the_run_peak_at_the_step():
    """The held-out evaluation is a phase of the run: its KV cache and logits by the step's
    generation formula at train.eval_batch_size. auto resolves to the step's largest generation
    call (smaller than eval_size * eval_samples here), so the evaluation stays within the step;
    a batch of the whole sampled pass makes the evaluation the run's peak, and says so."""
    from peergrade.config import ConfigError, load_config, validate

    cfg = load_config(None, [("train.eval_size", 200), ("train.eval_samples", 8)])
    assert cfg.train.eval_batch_size == "auto"
    assert cfg.eval_generation_batch() == cfg.batch_size == 128 < 200 * 8
    cfg.rollout.generation_batch_size = 32
    assert cfg.eval_generation_batch() == 32 and cfg.eval_generation_batch(world=8) == 16
    cfg.rollout.generation_batch_size = None
    cfg.train.eval_size, cfg.train.eval_samples = 10, 2  # a pass smaller than the step's
    assert cfg.eval_generation_batch() == 20
    cfg.train.eval_batch_size = 0
    with pytest.raises(ConfigError, match="train.eval_batch_size"):
        validate(cfg)

    shape, ref = StepShape(batch=4, seq_len=6, completion_len=2), MemoryOptions(beta=0.1)
    step = estimate_memory(HAND, shape, ref)
    assert "evaluate" not in step["phases"] and step["eval_generation"] == 0
    auto = estimate_memory(HAND, replace(shape, eval_rows=200 * 8, eval_batch=4), ref)
    # 4 rows: KV cache 2 * 1 layer * 1 kv head * 4 head dim * 4 rows * 6 tokens * 4 bytes = 768,
    # logits and sampling buffers 4 * 4 rows * 10 vocab * 4 bytes = 640
    assert auto["eval_generation"] == 768 + 640
    assert auto["phases"]["evaluate"] == step["phases"]["generate"]  # same formula, same batch
    assert auto["peak"] == auto["step_peak"] == step["peak"] and auto["peak_phase"] == "update"
    whole = estimate_memory(HAND, replace(shape, eval_rows=200 * 8, eval_batch=None), ref)
    assert whole["eval_generation"] == 400 * (768 + 640) and whole["eval_batch"] == 1600
    assert whole["phases"]["evaluate"] == step["phases"]["generate"] + 399 * (768 + 640)
    assert whole["peak"] == whole["phases"]["evaluate"] > whole["step_peak"] == step["peak"]
    assert whole["peak_phase"] == "evaluate"


# ----------------------------------------------------------------------------- distillation

TEACHER = {**HAND, "hidden_size": 16, "intermediate_size": 32}  # twice the student's widths


def test_estimate_counts_the_local_teacher_and_its_pass_by_hand():
    """On-policy distillation's local teacher: its weights are resident in every phase, and
    phase "reference" holds the student's and then the teacher's no-grad log-prob pass."""
    # teacher params: embedding 10*16 = 160; layer: q 256 + k 128 + v 128 + o 256 + 3 * 512
    # MLP + 2 * 16 norms = 2336; final norm 16 -> 2512
    assert param_counts(TEACHER)["total"] == 2512
    step = StepShape(batch=4, seq_len=6, completion_len=2)
    plain = estimate_memory(HAND, step, MemoryOptions())
    local = estimate_memory(HAND, step, MemoryOptions(distill=True, teacher=TEACHER))
    remote = estimate_memory(HAND, step, MemoryOptions(distill=True))  # behind an endpoint
    assert local["teacher"] == 2512 * 4 and plain["teacher"] == remote["teacher"] == 0
    for phase, v in plain["phases"].items():  # resident all run
        assert local["phases"][phase] - v == 2512 * 4, phase
        assert remote["phases"][phase] == v, phase
    assert "reference" not in plain["phases"]  # beta 0, no teacher: no no-grad pass
    static = 680 * 4 * 3  # the student's weights and AdamW state (no reference)
    # the teacher's pass: 24 H + 16 q_dim + 16 I + 4 L = 384 + 256 + 512 + 24 bytes a token and
    # layer, 4 x 6 tokens; two [c, V] float32 buffers; final norm [B, L, H] + completion rows
    teacher_pass = 4 * 6 * 1176 + 2 * 8 * 10 * 4 + (4 * 6 + 4 * 2) * 16 * 4
    student_pass = 4 * 6 * 600 + 2 * 8 * 10 * 4 + (4 * 6 + 4 * 2) * 8 * 4
    assert local["phases"]["reference"] == static + 2512 * 4 + teacher_pass
    assert remote["phases"]["reference"] == static + student_pass
    # here the teacher's pass sets the run's peak: weights plus that pass over the plain peak
    assert local["peak_phase"] == "reference"
    assert local["peak"] - plain["peak"] == 2512 * 4 + teacher_pass - (
        plain["phases"]["update"] - static
    )
    assert local["peak"] > plain["peak"] + 2512 * 4


def test_estimate_for_config_counts_the_teacher_dir(tiny_model_dir, tmp_path):
    """``estimate_for_config`` reads ``algo.teacher_path``: the teacher's real parameter count
    at the policy's dtype; ``algo.teacher_url`` adds the student's pass but no weights."""
    from peergrade.model.tiny import save_tiny_model

    teacher = save_tiny_model(tmp_path / "t", "llama", seed=1, hidden_size=128, num_layers=3)
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(teacher)).parameters())
    plain = estimate_for_config(_cfg(tiny_model_dir), prompt_len=10)
    local = estimate_for_config(
        _cfg(tiny_model_dir, **{"algo.teacher_path": str(teacher)}), prompt_len=10
    )
    assert local["teacher"] == n * 4
    assert local["phases"]["checkpoint"] - plain["phases"]["checkpoint"] == n * 4
    assert local["phases"]["reference"] > plain["phases"]["reference"] + n * 4
    url = {"algo.teacher_url": "http://127.0.0.1:9/v1"}
    remote = estimate_for_config(_cfg(tiny_model_dir, **url), prompt_len=10)
    assert remote["teacher"] == 0 and remote["phases"]["update"] == plain["phases"]["update"]


@pytest.mark.slow
def test_estimate_with_a_teacher_is_within_20_percent_of_the_measured_peak(tmp_path):
    """A teacher 4x the student's size, so its weights and pass set the peak: the estimate of
    the very config against its measurement (the child loads and runs the real teacher)."""
    from peergrade.model.tiny import save_tiny_model

    shape = dict(num_layers=4, num_heads=4, num_kv_heads=2)
    student = save_tiny_model(
        tmp_path / "s", "qwen2", hidden_size=128, intermediate_size=352, **shape
    )
    teacher = save_tiny_model(
        tmp_path / "t", "qwen2", hidden_size=512, intermediate_size=1408, **shape
    )
    over = {
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 8,
        "rollout.max_completion_length": 32,
        "algo.beta": 0.0,
        "algo.teacher_path": str(teacher),
    }
    cfg = _cfg(student, **over)
    m = measure_memory(cfg, steps=2, timeout=600)
    e = estimate_for_config(cfg, prompt_len=m["prompt_len"])
    assert e["teacher"] > e["weights"]
    assert "reference" in m["phases"]
    err = (e["step_peak"] - m["peak"]) / m["peak"]
    assert abs(err) <= 0.20, (e["step_peak"] / 2**20, m["peak"] / 2**20, m["phases"], e["phases"])


def test_cli_memory_estimate_with_a_teacher(tiny_model_dir, capsys):
    """``peergrade memory`` with a teacher: its line and column, and only the grpo variant
    (distillation is a GRPO mode, so the default grpo,ppo pair drops ppo)."""
    from peergrade.cli import main

    argv = ["memory", "--model", str(tiny_model_dir), "--estimate-only", "--prompt-len", "20"]
    argv += ["--model.device", "cpu", "--algo.teacher_path", str(tiny_model_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "teacher (on-policy distillation, resident all run)" in out
    header = next(line for line in out.splitlines() if line.startswith("config "))
    assert " teacher " in header  # the estimate table has the column
    assert "estimated run peak grpo:" in out and "ppo" not in out
