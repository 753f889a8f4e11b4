"""Model FLOPs per phase (peergrade.monitoring.flops): the formula against a hand count and against torch's
own count of a real forward (FlopCounterMode), the update's rows, the step metrics, and the
CPU peak derived from a fake /proc/cpuinfo."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from peergrade.monitoring.flops import (
    Shape,
    Work,
    cpu_peak,
    generation,
    logprob_pass,
    split_lengths,
)

# d 8, 2 layers, 2 heads of 4, 1 kv head, MLP 16, vocab 10
TINY = Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_per_token_costs_by_hand():
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16: 576 multiply-adds per layer
    assert TINY.per_token == 2 * 2 * (64 + 32 + 32 + 64 + 384) == 2304
    assert TINY.per_pair == 4 * 2 * 2 * 4 == 64  # q.k and p.v, 2 heads of 4, 2 layers
    assert TINY.per_logit_row == 2 * 8 * 10 == 160
    plain = Shape(8, 2, 2, 1, 4, 16, 10, gated_mlp=False)
    assert TINY.per_token - plain.per_token == 2 * 2 * 8 * 16


def test_generation_and_logprob_pass_by_hand():
    # one prompt of 3 tokens, G = 2 completions of 2 and 1 tokens, in a [2, 3 + 2] batch
    am = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    p, c = split_lengths(am, 2)
    assert p.tolist() == [3, 3] and c.tolist() == [2, 1]
    g = generation(TINY, p, c, group_size=2)
    # prefill once: 3 tokens, 1+2+3 pairs, 1 logits row; row 0 feeds its first token back
    # (4 keys), its last token and row 1's only one are never fed
    assert g[:3] == (4, 6 + 4, 2)
    assert g.flops == 4 * 2304 + 10 * 64 + 2 * 160
    lp = logprob_pass(TINY, p, c, torch.tensor([2, 1]), group_size=2)
    # prompt once (3 tokens, 6 pairs), then 2 + 1 completion tokens (4+5 and 4 keys)
    assert lp[:3] == (6, 6 + 9 + 4, 3)
    only_1 = logprob_pass(TINY, p, c, torch.tensor([2, 1]), 2, rows=torch.tensor([False, True]))
    assert only_1[:3] == (4, 6 + 4, 1)
    # two groups of one row each: each prompt is its own
    assert logprob_pass(TINY, p, c, torch.tensor([2, 1]), group_size=1)[:3] == (9, 12 + 9 + 4, 3)
    assert (g + lp).flops == g.flops + lp.flops and lp.times(3).flops == 3 * lp.flops


def test_shape_of_a_transformers_config():
    from peergrade.model.tiny import tiny_config

    cfg = tiny_config("llama", vocab_size=50, hidden_size=32, num_heads=4, num_kv_heads=2)
    s = Shape.of(cfg)
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim) == (32, 2, 4, 2, 8)
    assert (s.intermediate, s.vocab, s.gated_mlp) == (128, 50, True)
    assert Shape.of(cfg.to_dict()) == s
    with pytest.raises(ValueError, match="intermediate_size"):
        Shape.of({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from peergrade.model.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("qwen2", vocab_size=61, hidden_size=48, num_heads=4, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def measured(fn) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


def test_a_forward_matches_torchs_count(model):
    """A plain forward of [B, L] (logits at every position). Eager attention is matmuls, which
    torch counts as the full L x L square the kernel computes (ours counts the causal half;
    torch does not count the CPU's fused sdpa kernel at all), so with the square's pairs the
    two agree to 0.1% (torch counts the rotary embedding's small matmul too)."""
    B, L = 3, 11
    ids = torch.randint(1, 61, (B, L))
    got = measured(lambda: model(input_ids=ids))
    s = Shape.of(model.config)
    want = s.forward(tokens=B * L, pairs=B * L * L, logit_rows=B * L)
    assert abs(got - want) / want < 1e-3, (got, want)
    # a formula that forgot the MLP's gate, or the attention, would be far off
    assert (
        abs(got - Shape(**{**s.__dict__, "gated_mlp": False}).forward(B * L, B * L * L, B * L))
        > 0.1 * want
    )
    assert abs(got - s.forward(B * L, 0, B * L)) > 0.01 * want


def test_a_shared_prompt_logprob_pass_matches_torchs_count(model):
    """token_logprobs with the shared prompt: the prompt once per group, then the completion
    tokens against its cache, lm_head on the counted positions only. Tokens and logits rows are
    ours exactly; the attention torch counts is the rectangle the (eager) kernel computes."""
    from peergrade.model.logprobs import token_logprobs

    G, P, C = 3, 7, 5
    prompt = torch.randint(1, 61, (1, P)).expand(2 * G, P).clone()
    prompt[G:] = torch.randint(1, 61, (1, P))  # a second group, another prompt
    comp = torch.randint(1, 61, (2 * G, C))
    ids = torch.cat([prompt, comp], dim=1)
    am = torch.ones_like(ids)
    cmask = torch.ones(2 * G, C)
    cmask[0, 3:] = 0  # a shorter completion: fewer logits rows, same tokens fed
    am[0, P + 3 :] = 0
    got = measured(lambda: token_logprobs(model, ids, am, cmask, share_prompts=True))
    s = Shape.of(model.config)
    p, c = split_lengths(am, C)
    ours = logprob_pass(s, p, c, cmask.sum(dim=1), group_size=G)
    assert ours.tokens == 2 * P + int(c.sum()) and ours.logit_rows == int(cmask.sum())
    rectangle = 2 * P * P + 2 * G * C * (P + C)  # what sdpa computes, padding included
    fed_padded = 2 * P + 2 * G * C  # the trimmed batch feeds the padded column too
    want = s.forward(fed_padded, rectangle, ours.logit_rows)
    assert abs(got - want) / want < 1e-3, (got, want)


def test_the_update_counts_what_its_result_needs(tiny_model_dir):
    from peergrade.config import load_config
    from peergrade.training.update import grpo_update_work

    am = torch.ones(4, 6, dtype=torch.long)
    cmask = torch.ones(4, 3)
    batch = (torch.zeros(4, 6, dtype=torch.long), am, cmask)
    adv = torch.tensor([0.0, 1.0, 0.0, -1.0])
    p, c = split_lengths(am, 3)

    def cfg(**kw):
        over = [("model.path", str(tiny_model_dir)), ("rollout.group_size", 2)]
        over += [("rollout.prompts_per_step", 2), *kw.items()]
        return load_config(None, over)

    kept = logprob_pass(TINY, p, c, cmask.sum(dim=1), 2, rows=adv != 0)
    assert grpo_update_work(TINY, batch, adv, cfg(), kl_on=False) == kept.times(3)
    # a KL term: every row has a gradient
    every = logprob_pass(TINY, p, c, cmask.sum(dim=1), 2)
    assert grpo_update_work(TINY, batch, adv, cfg(), kl_on=True) == every.times(3)
    # two passes: 2 x forward+backward, and the old-policy pass once
    two = cfg(**{"algo.num_iterations": 2})
    assert grpo_update_work(TINY, batch, adv, two, kl_on=False) == kept.times(7)
    assert grpo_update_work(TINY, batch, torch.zeros(4), two, kl_on=False) == Work(0, 0, 0, 0)


def test_a_step_logs_flops_per_phase(tiny_model_dir):
    from peergrade.config import load_config
    from peergrade.training import trainer

    over = [("model.path", str(tiny_model_dir)), ("train.threads", 1), ("algo.beta", 0.04)]
    over += [("rollout.prompts_per_step", 2), ("rollout.group_size", 2)]
    over += [("rollout.max_completion_length", 4), ("train.audit_rewards", "off")]
    run = trainer.setup(load_config(None, over))
    rows = run.task.train_rows(0)
    m = trainer.train_step(run, 1, [next(rows) for _ in range(2)]).metrics
    for k in ("gen", "ref", "update", "step"):
        assert m[f"perf/{k}_tflops"] > 0, k
    # the step's rate is the phases' work over their time
    work = sum(
        m[f"perf/{k}_tflops"] * m[f"time/{t}_s"]
        for k, t in (("gen", "generate"), ("ref", "ref"), ("update", "update"))
    )
    secs = sum(m[f"time/{t}_s"] for t in ("generate", "reward", "ref", "update"))
    assert m["perf/step_tflops"] == pytest.approx(work / secs, rel=1e-9)


SPR = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz
cpu MHz\t\t: 2000.000
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""


def test_peak_from_a_fake_cpuinfo():
    bf16 = cpu_peak("bfloat16", cpuinfo=SPR)
    assert bf16.per_cycle == 1024 and bf16.ghz == 2.0 and bf16.flops_per_s == 2.048e12
    assert "AMX" in bf16.unit and "2.00 GHz" in bf16.how and "estimate" in bf16.how
    assert cpu_peak("float32", cores=2, cpuinfo=SPR).flops_per_s == 2 * 64 * 2e9
    no_amx = SPR.replace(" amx_bf16 amx_tile amx_int8", "")
    assert cpu_peak("bfloat16", cpuinfo=no_amx).per_cycle == 128
    assert cpu_peak("float16", cpuinfo=no_amx).per_cycle == 128
    avx2 = no_amx.replace(" avx512f avx512_bf16 avx512_fp16", "")
    assert cpu_peak("float32", cpuinfo=avx2).per_cycle == 32
    fallback = cpu_peak("bfloat16", cpuinfo=avx2)  # no bf16 units: the float32 rate
    assert fallback.per_cycle == 32 and "converted to float32" in fallback.unit
    assert cpu_peak("float32", cpuinfo=SPR, fma_units=1).per_cycle == 32
    assert cpu_peak("float32", cpuinfo=SPR, ghz=3.5).flops_per_s == 64 * 3.5e9
    no_mhz = "flags\t: avx2 fma\nmodel name\t: Some CPU @ 3.10GHz\n"
    assert cpu_peak("float32", cpuinfo=no_mhz).ghz == 3.1
    with pytest.raises(ValueError, match="ghz"):
        cpu_peak("float32", cpuinfo="flags\t: avx2\n")
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_peak("int8", cpuinfo=SPR)


def test_dynamic_sampling_counts_every_rounds_generation(tiny_model_dir, tmp_path):
    """With rollout.dynamic_sampling the step generated every round's groups, not only the
    kept ones: generation's work is counted over all of them."""
    from peergrade.config import load_config
    from peergrade.training import trainer

    rewards = tmp_path / "coarse.py"  # binary: about half of the 2-completion groups agree
    rewards.write_text(
        "def coarse(prompts, completions, **kw):\n"
        "    t = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [float(sum(map(ord, x)) % 97 > 48) for x in t]\n"
    )
    over = [("model.path", str(tiny_model_dir)), ("train.threads", 1)]
    over += [("rewards", [{"name": f"{rewards}:coarse", "weight": 1.0}])]
    over += [("rollout.prompts_per_step", 4), ("rollout.group_size", 2)]
    over += [("rollout.max_completion_length", 4), ("train.audit_rewards", "off")]
    over += [("rollout.dynamic_sampling", True), ("rollout.max_rounds", 6)]
    run = trainer.setup(load_config(None, over))
    rows = run.task.train_rows(0)
    shape = Shape.of(run.models.policy.config)
    for step in range(1, 6):
        exp = trainer.collect(run, step, [next(rows) for _ in range(4)])
        rounds = int(exp.sampled.dynamic["dynamic/rounds"])
        if rounds > 1:
            break
    assert rounds > 1, "no step took a second round: pick another reward"
    p, c = exp.sampled.generated_lengths
    assert len(p) == len(c) == rounds * 4 * 2
    gen = trainer.phase_work(run, exp)["gen"]
    assert gen == generation(shape, p, c, 2)
    kept = generation(shape, *split_lengths(exp.attention_mask, exp.loss_mask.shape[1]), 2)
    assert gen.tokens > kept.tokens
