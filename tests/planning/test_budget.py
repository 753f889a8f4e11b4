"""`peergrade memory --budget`: sizes parsed by hand, the Qwen2.5-1.5B / 7B shapes counted
against their published parameter counts, the fit decision at the boundary, and the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peergrade.cli import main
from peergrade.errors import InputError
from peergrade.planning.budget import format_budget, parse_size
from peergrade.planning.memory import (
    SAMPLER_VOCAB_BUFFERS,
    MemoryOptions,
    Placement,
    StepShape,
    estimate_memory,
    param_counts,
)

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("24GiB", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("16G", 16 * 2**30),
        ("1.5TiB", int(1.5 * 2**40)),
        ("512MiB", 512 * 2**20),
        ("1000", 1000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24 parsecs", "-3GiB", "0GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(InputError, match="--budget"):
        parse_size(text)


def test_qwen25_shapes_match_the_published_parameter_counts():
    # Qwen2.5-1.5B: embedding 151936 * 1536 = 233,373,696 (tied); per layer q/o 1536^2 each,
    # k/v 1536 * 256 each, MLP 3 * 1536 * 8960, norms 2 * 1536, q/k/v biases 1536 + 2 * 256
    # = 46,797,824; 28 layers + final norm 1536 -> 1,543,714,304 ("1.54B").
    assert param_counts(MODELS / "qwen2.5-1.5b")["total"] == 1_543_714_304
    # Qwen2.5-7B: untied, 2 * 152064 * 3584 = 1,089,994,752; per layer 233,057,792; -> 7.62B
    pc = param_counts(MODELS / "qwen2.5-7b")
    assert pc["total"] == 7_615_616_512
    # LoRA r=16 on all 7 projections: per layer 16 * (in + out) summed = 1,441,792; x 28
    lora = {
        "r": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    }
    assert param_counts(MODELS / "qwen2.5-7b", lora)["lora"] == 40_370_176


def test_fit_decision_at_the_boundary():
    est = estimate_memory(
        MODELS / "qwen2.5-7b",
        StepShape(batch=8, seq_len=96, completion_len=64),
        MemoryOptions(dtype="bfloat16"),
        Placement(device="cuda"),
    )
    assert est["weights"] == 7_615_616_512 * 2  # bfloat16
    peak = est["peak"]
    rows = [("GRPO", est)]
    line = format_budget(rows, peak).splitlines()[2]
    assert line.startswith("GRPO") and line.endswith("yes (0.00 free)")
    over = format_budget(rows, peak - 2**30).splitlines()[2]
    assert over.endswith("NO (1.00 over)")
    assert format_budget(rows, peak).splitlines()[-1].startswith("(GiB;")
    # under 1 GiB everywhere: MiB. peak 3 MiB against 4 MiB -> 1.00 MiB free
    small = {**est, "peak": 3 * 2**20, "phases": {"generate": 2 * 2**20, "update": 3 * 2**20}}
    table = format_budget([("GRPO", small)], 4 * 2**20).splitlines()
    assert table[2].endswith("yes (1.00 free)") and table[-1].startswith("(MiB;")


def _row(out: str, label: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith(label + " "))
    return line.split()


BATCH = [
    "--rollout.prompts_per_step",
    "8",
    "--rollout.group_size",
    "8",
    "--rollout.max_completion_length",
    "512",
    "--optim.micro_batch_size",
    "4",
    "--algo.beta",
    "0.04",
]


def test_cli_budget_7b_and_1_5b(capsys, tmp_path):
    out_html = tmp_path / "mem.html"
    rc = main(
        [
            "memory",
            "--model",
            str(MODELS / "qwen2.5-7b"),
            "--budget",
            "24GiB",
            *BATCH,
            "-o",
            str(out_html),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "prompt: 256 + completion: 512" in out  # no tokenizer: data.max_prompt_length
    grpo, ppo, lora = _row(out, "GRPO"), _row(out, "PPO"), _row(out, "GRPO+LoRA")
    # weights 7,615,616,512 * 2 B = 14.19 GiB; AdamW state twice that; PPO adds a critic
    assert grpo[1] == "14.19" and grpo[3] == "28.37"
    assert grpo[-3] == "NO" and ppo[-3] == "NO" and lora[-3] == "yes"
    # LoRA: adapter grads 40,370,176 * 4 B (float32) = 0.15 GiB
    assert lora[2] == "0.15"
    html = out_html.read_text()
    assert '<figure class="plot" data-panel="memory">' in html and "<svg" in html
    assert not re.search(r"https?:", html)

    assert (
        main(["memory", "--model", str(MODELS / "qwen2.5-1.5b"), "--budget", "24GiB", *BATCH]) == 0
    )
    out = capsys.readouterr().out
    assert _row(out, "GRPO")[-3] == "yes" and _row(out, "PPO")[-3] == "NO"
    assert _row(out, "GRPO+LoRA")[-3] == "yes"


def test_cli_budget_errors(capsys, tmp_path):
    assert main(["memory", "--model", str(tmp_path), "--budget", "24GiB"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["memory", "--model", str(MODELS / "qwen2.5-7b"), "--budget", "lots"]) == 2
    assert "--budget 'lots'" in capsys.readouterr().err


def test_report_budget_section_for_a_runs_config(tmp_path, capsys):
    from peergrade.config import load_config, to_yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None)))  # the bundled demo config
    (run / "metrics.jsonl").write_text("")
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--budget", "1MiB", "-o", str(out)]) == 0
    html = out.read_text()
    assert '<figure class="plot" data-panel="memory">' in html
    # the 0.75M-parameter demo model does not fit in 1 MiB in any variant
    assert html.count(" over)") == 3


# ----------------------------------------------------------------------------- what fits


def _demo_cfg(model: Path, **over):
    from peergrade.config import load_config

    return load_config(None, [("model.path", str(model)), *over.items()])


def test_fit_search_keeps_the_objective_when_it_can_and_finds_the_cheapest():
    """Qwen2.5-1.5B, GRPO with a reference, the CPU demo's batch (16 x 8, micro-batch 128) at
    512 tokens, on a 24 GiB GPU: the micro-batch or checkpointing alone must be enough; the
    answer fits, and taking back any one of its changes does not."""
    from peergrade.planning.budget import _with, fit_search
    from peergrade.planning.memory import estimate_for_config

    cfg = _demo_cfg(
        MODELS / "qwen2.5-1.5b",
        **{
            "rollout.max_completion_length": 512,
            "algo.beta": 0.04,
            "model.gradient_checkpointing": False,
        },
    )
    budget = 24 * 2**30
    kw = dict(prompt_len=256, device="cuda")
    assert estimate_for_config(cfg, **kw)["peak"] > budget
    fit = fit_search(cfg, budget, device="cuda", prompt_len=256)
    assert fit["fits"] and not fit["objective"] and fit["peak"] <= budget
    objective_keys = {"model.lora.enabled", "rollout.group_size", "rollout.max_completion_length"}
    assert fit["changes"] and not set(fit["changes"]) & objective_keys
    assert estimate_for_config(_with(cfg, fit["changes"]), **kw)["peak"] == fit["peak"]
    for key in fit["changes"]:  # minimal: each change is needed
        fewer = {k: v for k, v in fit["changes"].items() if k != key}
        assert estimate_for_config(_with(cfg, fewer), **kw)["peak"] > budget, key


def test_fit_search_changes_the_objective_only_when_it_must():
    from peergrade.planning.budget import fit_search

    cfg = _demo_cfg(MODELS / "qwen2.5-7b")
    budget = 24 * 2**30
    # full fine-tuning of 7.6B parameters: weights, grads and AdamW state alone are 57 GiB
    fit = fit_search(cfg, budget, device="cuda", prompt_len=256)
    assert fit["fits"] and fit["objective"] and fit["changes"]["model.lora.enabled"] is True
    # PPO's critic is trained in full whatever the policy does: nothing fits, and it says why
    ppo = _demo_cfg(MODELS / "qwen2.5-7b", **{"algo.name": "ppo"})
    none = fit_search(ppo, budget, device="cuda", prompt_len=256)
    assert not none["fits"] and none["floor"] > budget


def test_cli_budget_prints_the_settings_to_paste(capsys):
    """The issue's command: the CPU demo's batch settings, Qwen2.5-7B, 24 GiB."""
    assert main(["memory", "--model", str(MODELS / "qwen2.5-7b"), "--budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    advice = out[out.index("What fits in 24.00 GiB") :]
    lora = advice[advice.index("  GRPO+LoRA:") :]
    assert "(the same objective) with:" in lora.splitlines()[0]
    assert "      optim:" in lora and re.search(r"micro_batch_size: \d+", lora)
    grpo = advice[advice.index("  GRPO:") : advice.index("  PPO:")]
    assert "changing the objective" in grpo and "enabled: true" in grpo
    assert "nothing searched fits" in advice[advice.index("  PPO:") :]
    # the pasted lines give a config whose estimate fits
    from peergrade.planning.budget import _with
    from peergrade.planning.memory import estimate_for_config

    micro = int(re.search(r"micro_batch_size: (\d+)", lora).group(1))
    cfg = _with(
        _demo_cfg(MODELS / "qwen2.5-7b"),
        {"model.lora.enabled": True, "optim.micro_batch_size": micro},
    )
    assert estimate_for_config(cfg, prompt_len=256, device="cuda")["peak"] <= 24 * 2**30


def test_a_producer_adds_its_weight_copies_and_runs_beside_the_update():
    """rollout.async_steps k: k + 2 copies of the trainable weights (the producer's own and the
    k + 1 versions) and generation's transients on top of the update's; k = 0 adds nothing."""
    step = StepShape(batch=32, seq_len=192, completion_len=32)
    sync = estimate_memory(MODELS / "qwen2.5-1.5b", step, MemoryOptions(dtype="float32"))
    assert sync == estimate_memory(MODELS / "qwen2.5-1.5b", step, MemoryOptions(async_steps=0))
    assert "pipelined" not in sync["phases"] and sync["producer"] == 0
    logits = SAMPLER_VOCAB_BUFFERS * 32 * 151_936 * 4
    static = sync["phases"]["generate"] - sync["kv_cache"] - logits
    for k in (1, 2):
        est = estimate_memory(MODELS / "qwen2.5-1.5b", step, MemoryOptions(async_steps=k))
        assert est["producer"] == (k + 2) * est["trainable_params"] * 4
        assert est["phases"]["pipelined"] == (
            sync["phases"]["update"] + est["producer"] + sync["phases"]["generate"] - static
        )
        assert est["peak"] == est["phases"]["pipelined"] > sync["peak"]
    lora = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    small = estimate_memory(MODELS / "qwen2.5-1.5b", step, MemoryOptions(lora=lora, async_steps=1))
    assert small["producer"] == 3 * small["trainable_params"] * 4  # the adapters only


def test_fit_search_sets_the_eval_batch_back_to_auto_when_evaluation_is_the_peak():
    """A held-out evaluation of the whole sampled pass at once (200 x 8 sequences of
    Qwen2.5-1.5B: 1600 rows of 152k-vocabulary logits and KV cache) is the run's peak, above a
    step that fits: the budget says so per phase, and fit_search's answer is train.eval_batch_size
    auto (same objective), under which the run's peak is the step's."""
    from peergrade.planning.budget import _with, fit_search
    from peergrade.planning.memory import estimate_for_config

    cfg = _demo_cfg(
        MODELS / "qwen2.5-1.5b",
        **{
            "rollout.max_completion_length": 512,
            "train.eval_batch_size": 1600,
            "optim.micro_batch_size": 8,
        },
    )
    kw = dict(prompt_len=256, device="cuda")
    est = estimate_for_config(cfg, **kw)
    assert est["peak_phase"] == "evaluate" and est["peak"] > est["step_peak"]
    budget = (est["step_peak"] + est["peak"]) // 2  # the step fits, the evaluation does not
    fit = fit_search(cfg, budget, device="cuda", prompt_len=256)
    assert fit["fits"] and not fit["objective"]
    assert fit["changes"] == {"train.eval_batch_size": "auto"}
    auto = estimate_for_config(_with(cfg, fit["changes"]), **kw)
    assert auto["peak"] == auto["step_peak"] == est["step_peak"] == fit["peak"] <= budget
    assert "evaluate peak" in format_budget([("GRPO", est)], budget)
