"""Tinker's API on this machine (peergrade.tinker_server, docs/tinker.md).

The losses against Tinker's documented formulas (hand-computed values and a slow per-token
loop, 1e-6; dro and gspo included) and peergrade's losses through ``peergrade:<name>``; then
the real ``tinker`` SDK against the local server: sampler log-probs equal the trainer's
forward within 1e-5 on every datum (LoRA and full fine-tuning), the loss the server reports
is the documented formula (or peergrade's ``policy_loss``) of the log-probs it returns, top-k
log-probs, checkpoints round-trip, the futures' ``.result()`` and ``*_async`` forms,
``forward_backward_custom``, refused requests, and short cookbook-style RL and supervised
loops (examples/tinker/). The SDK tests
skip with a message where ``tinker`` is missing (``pip install -e ".[tinker]"``)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from peergrade.algo.tinker_losses import TINKER_LOSSES, tinker_loss

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tinker"
#: the tinker SDK releases this server is tested against (pyproject's `tinker` extra)
SUPPORTED = ((0, 38), (0, 39))  # >= 0.38, < 0.39

# ------------------------------------------------------------------------------- losses


def _inputs(**kw):
    return {k: torch.tensor([v], dtype=torch.float64) for k, v in kw.items()}


def test_losses_equal_hand_computed_values():
    """Two tokens, values worked out by hand from the formulas on Tinker's loss pages."""
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    # cross_entropy: -(w * logp).sum() = -(1 * ln 0.5 + 2 * ln 0.25) = 5 ln 2
    loss, _ = tinker_loss("cross_entropy", lp, _inputs(weights=[1.0, 2.0]), mask)
    assert loss.item() == pytest.approx(5 * math.log(2), abs=1e-6)
    # sampler logprobs ln 0.4 and ln 0.25: ratios 1.25 and 1.0; advantages 2 and -1
    ins = _inputs(logprobs=[math.log(0.4), math.log(0.25)], advantages=[2.0, -1.0])
    loss, _ = tinker_loss("importance_sampling", lp, ins, mask)
    assert loss.item() == pytest.approx(-(1.25 * 2 - 1.0), abs=1e-6)  # -1.5
    # ppo (0.8, 1.2): token 1 min(2.5, 1.2 * 2) = 2.4; token 2 min(-1, -1) = -1 -> -1.4
    loss, _ = tinker_loss("ppo", lp, ins, mask)
    assert loss.item() == pytest.approx(-1.4, abs=1e-6)
    # ppo with thresholds from loss_fn_config (0.9, 1.1): 1.1 * 2 = 2.2 -> -(2.2 - 1) = -1.2
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    loss, _ = tinker_loss("ppo", lp, ins, mask, cfg)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    # cispo: -(clip(r) * logp * A).sum() = -(1.2 * ln0.5 * 2 + 1.0 * ln0.25 * -1)
    loss, _ = tinker_loss("cispo", lp, ins, mask)
    want = -(1.2 * math.log(0.5) * 2 + 1.0 * math.log(0.25) * -1)
    assert loss.item() == pytest.approx(want, abs=1e-6)


def _gspo_log_ratio(lp, ins, mask, b):
    """GSPO's sequence log-ratio of datum ``b``: the mean token log-ratio over the positions
    its ``sequence_ratio_mask`` marks, one float at a time."""
    terms = [
        float(lp[b, t]) - float(ins["logprobs"][b, t])
        for t in range(lp.shape[1])
        if mask[b, t] and float(ins["sequence_ratio_mask"][b, t]) != 0
    ]
    return sum(terms) / len(terms)


def _slow_reference(name, lp, ins, mask, lo=0.8, hi=1.2, beta=0.1):
    """One token at a time, in plain Python floats, exactly as the docs write each loss."""
    total = 0.0
    for b in range(lp.shape[0]):
        seq_r = math.exp(_gspo_log_ratio(lp, ins, mask, b)) if name == "gspo" else None
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            x = float(lp[b, t])
            if name == "cross_entropy":
                total += -float(ins["weights"][b, t]) * x
                continue
            a, q = float(ins["advantages"][b, t]), float(ins["logprobs"][b, t])
            r = math.exp(x - q) if seq_r is None else seq_r
            c = min(max(r, lo), hi)
            if name == "importance_sampling":
                total += -r * a
            elif name in ("ppo", "gspo"):
                total += -min(r * a, c * a)
            elif name == "dro":
                total += -(x * a - 0.5 * beta * (x - q) ** 2)
            else:
                total += -c * x * a
    return total


@pytest.mark.parametrize("name", TINKER_LOSSES)
def test_losses_match_a_slow_loop_reference(name):
    g = torch.Generator().manual_seed(7)
    B, T = 4, 9
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ins = {
        "weights": torch.rand(B, T, generator=g, dtype=torch.float64),
        "logprobs": lp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.8,
        "advantages": torch.randn(B, T, generator=g, dtype=torch.float64),
        "sequence_ratio_mask": (torch.rand(B, T, generator=g) > 0.3).double(),
    }
    ins["sequence_ratio_mask"][:, 0] = 1.0  # every datum has a position in its ratio
    mask = torch.ones(B, T)
    mask[1, 6:] = 0  # padding: its garbage must not count
    ins["advantages"][1, 6:] = 1e6
    ins["logprobs"][1, 6:] = 1e3  # not in the sequence ratio either
    config = {"beta": 0.1} if name == "dro" else None
    loss, per_token = tinker_loss(name, lp, ins, mask, config)
    assert loss.item() == pytest.approx(_slow_reference(name, lp, ins, mask), abs=1e-6)
    assert per_token[1, 6:].abs().max().item() == 0.0


def test_cispo_stops_the_gradient_through_the_ratio():
    """d loss / d logp = -clip(r) * A (the clipped ratio is a constant), unlike ppo's."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ins = _inputs(logprobs=[-1.1, -2.5], advantages=[1.5, -0.5])
    tinker_loss("cispo", lp, ins, torch.ones(1, 2))[0].backward()
    r = torch.exp(lp.detach() - ins["logprobs"]).clamp(0.8, 1.2)
    assert torch.allclose(lp.grad, -r * ins["advantages"], atol=1e-12)


def test_dro_and_gspo_equal_hand_computed_values():
    """The same two tokens: ratios 1.25 and 1.0, advantages 2 and -1."""
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    ins = _inputs(logprobs=[math.log(0.4), math.log(0.25)], advantages=[2.0, -1.0])
    # dro: -(ln0.5 * 2 + ln0.25 * -1) + 0.5 * beta * (ln 1.25)^2; the first part is 0
    loss, _ = tinker_loss("dro", lp, ins, mask, {"beta": 0.5})
    assert loss.item() == pytest.approx(0.25 * math.log(1.25) ** 2, abs=1e-6)
    # gspo over both tokens: s = exp((ln 1.25 + 0) / 2) = sqrt(1.25), unclipped: -(2s - s)
    ins["sequence_ratio_mask"] = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, _ = tinker_loss("gspo", lp, ins, mask)
    assert loss.item() == pytest.approx(-math.sqrt(1.25), abs=1e-6)
    # clip_high 1.1: token 1 min(2s, 2.2) = 2.2, token 2 min(-s, -1.1) = -s
    loss, _ = tinker_loss("gspo", lp, ins, mask, {"clip_high_threshold": 1.1})
    assert loss.item() == pytest.approx(-(2.2 - math.sqrt(1.25)), abs=1e-6)
    # the ratio over the first token only: s = 1.25; min(2.5, 2.4) = 2.4, min(-1.25, -1.2)
    ins["sequence_ratio_mask"] = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    loss, _ = tinker_loss("gspo", lp, ins, mask)
    assert loss.item() == pytest.approx(-(2.4 - 1.25), abs=1e-6)


def test_gspo_gives_each_token_its_own_gradient_times_the_sequence_ratio():
    """d loss / d logp_t = -s * A_t where unclipped (s the sequence ratio, a constant), 0
    where the clipped branch is the minimum; dro's is -(A - beta * (logp - q))."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ins = _inputs(logprobs=[-1.1, -2.2, -0.4], advantages=[1.5, -0.5, 0.7])
    ins["sequence_ratio_mask"] = torch.ones(1, 3, dtype=torch.float64)
    tinker_loss("gspo", lp, ins, torch.ones(1, 3))[0].backward()
    s = math.exp((0.1 + 0.2 - 0.1) / 3)
    assert torch.allclose(lp.grad, -s * ins["advantages"], atol=1e-12)
    lp.grad = None
    tinker_loss("dro", lp, ins, torch.ones(1, 3), {"beta": 0.3})[0].backward()
    want = -(ins["advantages"] - 0.3 * (lp.detach() - ins["logprobs"]))
    assert torch.allclose(lp.grad, want, atol=1e-12)


def test_peergrade_losses_through_the_tinker_route():
    """``peergrade:<name>`` is peergrade's policy loss with old_logp = the datum's logprobs,
    the mask from weights (else advantages != 0), one value per datum as its advantage; and a
    request split into micro-batches adds up to the request's loss (request_counts)."""
    from peergrade.algo import policy_loss
    from peergrade.algo.tinker_losses import request_counts

    lp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    ins = _inputs(logprobs=[math.log(0.4), math.log(0.25)], advantages=[2.0, -1.0])
    # grpo (clip 0.2): tokens min(2.5, 2.4) and -1, mean over the sequence -> -(2.4 - 1) / 2
    loss, per_token = tinker_loss("peergrade:grpo", lp, ins, torch.ones(1, 2))
    assert loss.item() == pytest.approx(-0.7, abs=1e-6) and per_token is None
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[:, :2] = 0.0  # the prompt: advantage 0, not counted
    adv[3, 5:] = 0.0  # a shorter completion
    ins = {"logprobs": lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)}
    ins["advantages"] = adv
    mask = torch.ones(B, T)
    m = (adv != 0).double()
    for name, cfg in [("dapo", {}), ("vespo", {}), ("grpo", {"ratio_level": "sequence"})]:
        whole, _ = tinker_loss(f"peergrade:{name}", lp, ins, mask, cfg)
        want, _ = policy_loss(
            lp * m, ins["logprobs"] * m, adv[:, 2] * 1.0, m, **cfg, loss_type=name
        )
        assert whole.item() == pytest.approx(want.item(), abs=1e-9), name
        rows = [{k: v[b] for k, v in ins.items()} for b in range(B)]
        counts = request_counts(f"peergrade:{name}", cfg, rows)
        parts = sum(
            tinker_loss(
                f"peergrade:{name}",
                lp[b : b + 1],
                {k: v[b : b + 1] for k, v in ins.items()},
                mask[b : b + 1],
                cfg,
                counts=counts,
            )[0].item()
            for b in range(B)
        )
        assert parts == pytest.approx(whole.item(), abs=1e-9), name


def test_bad_loss_requests_name_what_is_expected():
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="cross_entropy, importance_sampling, ppo, cispo, dro"):
        tinker_loss("nope", lp, {}, mask)
    with pytest.raises(ValueError, match="stable_reinforce.*not served locally"):
        tinker_loss("stable_reinforce", lp, {}, mask)
    ins = _inputs(logprobs=[0, 0], advantages=[0, 0])
    with pytest.raises(ValueError, match=r"needs loss_fn_config=\{'beta'"):
        tinker_loss("dro", lp, ins, mask)
    with pytest.raises(ValueError, match="sequence_ratio_mask"):
        tinker_loss("gspo", lp, ins, mask)
    with pytest.raises(ValueError, match=r"expected one of \('grpo', 'bnpo'.*got 'nope'"):
        tinker_loss("peergrade:nope", lp, ins, mask)
    with pytest.raises(ValueError, match="reference log-probs"):
        tinker_loss("peergrade:grpo", lp, ins, mask, {"beta": 0.1})
    with pytest.raises(ValueError, match="goes with loss_fn='importance_sampling'"):
        tinker_loss("ppo", lp, ins, mask, {"peergrade_loss": "grpo"})
    with pytest.raises(ValueError, match=r"needs loss_fn_inputs \['advantages'\]"):
        tinker_loss("ppo", lp, {"logprobs": torch.zeros(1, 2)}, mask)
    with pytest.raises(ValueError, match="not understood"):
        tinker_loss(
            "importance_sampling",
            lp,
            _inputs(logprobs=[0, 0], advantages=[0, 0]),
            mask,
            {"clip_low_threshold": 0.5},
        )


# ------------------------------------------------------------------- the SDK, for real

try:
    import tinker
    from tinker import types
except ImportError:  # the loss tests above still run
    tinker = types = None
sdk = pytest.mark.skipif(
    tinker is None, reason='the tinker SDK is not installed (pip install -e ".[tinker]")'
)


@sdk
def test_the_installed_sdk_is_a_supported_release():
    v = tuple(int(x) for x in tinker.__version__.split(".")[:2])
    assert SUPPORTED[0] <= v < SUPPORTED[1], (tinker.__version__, SUPPORTED)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from peergrade.tinker_server import TinkerServer

    srv = TinkerServer(root=tmp_path_factory.mktemp("tinker"), seed=3)
    url = srv.start()
    yield srv, url
    srv.close()


@pytest.fixture(scope="module")
def service(server):
    """The SDK's client, closed before the server: a client left open keeps heartbeating
    from a thread of its own, and its retries draw from Python's global random generator,
    which shifts the draws of whatever runs next in this process (a reward using random)."""
    client = tinker.ServiceClient(base_url=server[1], api_key="tml-local")
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def lora_client(service):
    return service.create_lora_training_client(base_model="bundled", rank=4, seed=0).result()


@pytest.fixture(scope="module")
def full_client(service):
    return service.create_lora_training_client(base_model="bundled", rank=0).result()


def _prompt(tc, text="37+45="):
    tok = tc.get_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _rl_datums(prompt, sequences, advantages):
    """The cookbook rl_loop's datums: prompt + all but the last sampled token in, shifted out."""
    out = []
    for s, a in zip(sequences, advantages):
        ob = len(prompt) - 1
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [0] * ob + list(s.tokens),
                    "logprobs": [0.0] * ob + list(s.logprobs),
                    "advantages": [0.0] * ob + [a] * len(s.tokens),
                },
            )
        )
    return out


def _one_adam_step(tc, prompt):
    """Move the weights off their start (a fresh LoRA adapter is the identity)."""
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)},
    )
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


@sdk
@pytest.mark.parametrize("which", ["lora_client", "full_client"])
def test_sampler_logprobs_equal_the_trainers_forward(which, request):
    tc = request.getfixturevalue(which)
    prompt = _prompt(tc)
    _one_adam_step(tc, prompt)
    sc = tc.save_weights_and_get_sampling_client().result()
    res = sc.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=8,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=11),
    ).result()
    assert len(res.sequences) == 8 and all(s.sequence_id for s in res.sequences)
    datums = _rl_datums(prompt, res.sequences, [0.0] * 8)
    fwd = tc.forward(datums, "importance_sampling").result()
    worst = 0.0
    for s, out in zip(res.sequences, fwd.loss_fn_outputs):
        trainer = out["logprobs"].tolist()[len(prompt) - 1 :]
        assert len(trainer) == len(s.logprobs)
        worst = max(worst, max(abs(a - b) for a, b in zip(trainer, s.logprobs)))
    assert worst <= 1e-5, worst
    # the same request with the same seed draws the same tokens
    again = sc.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=8,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=11),
    ).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]


def _nudged_rl_datums(tc, prompt):
    """Four sampled datums whose sampler logprobs are nudged (+-0.3) so ratios leave
    [0.8, 1.2] and the clipping acts; each with gspo's ``sequence_ratio_mask`` (the
    sampled tokens, as the cookbook's rl_loop sets it)."""
    sc = tc.save_weights_and_get_sampling_client().result()
    res = sc.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=4,
        sampling_params=types.SamplingParams(max_tokens=5, seed=5),
    ).result()
    datums = _rl_datums(prompt, res.sequences, [1.0, -0.5, 0.25, -0.75])
    ob = len(prompt) - 1
    for k, d in enumerate(datums):
        lp = d.loss_fn_inputs["logprobs"].to_torch()
        lp[ob:] += 0.3 if k % 2 else -0.3
        d.loss_fn_inputs["logprobs"] = types.TensorData.from_torch(lp)
        ratio_mask = torch.zeros(lp.shape[0])
        ratio_mask[ob:] = 1.0
        d.loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_torch(ratio_mask)
    return datums


@sdk
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_reported_loss_is_the_documented_formula_of_the_returned_logprobs(loss_fn, lora_client):
    tc = lora_client
    prompt = _prompt(tc, "58-23=")
    datums = _nudged_rl_datums(tc, prompt)
    config = {"beta": 0.3} if loss_fn == "dro" else None
    fb = tc.forward(datums, loss_fn, config).result()  # forward only: the weights stay
    lp = [torch.tensor(o["logprobs"].tolist(), dtype=torch.float64) for o in fb.loss_fn_outputs]
    keys = ("logprobs", "advantages", "sequence_ratio_mask")
    want = sum(
        _slow_reference(
            loss_fn,
            x[None],
            {k: d.loss_fn_inputs[k].to_torch().double()[None] for k in keys},
            torch.ones(1, x.shape[0]),
            beta=0.3,
        )
        for x, d in zip(lp, datums)
    )
    assert fb.metrics["loss:sum"] == pytest.approx(want, abs=1e-4)


def _half_grpo(batch, options):
    """A loss registered with peergrade.register_loss: half of grpo's."""
    from peergrade.algo import policy_loss

    loss, _ = policy_loss(
        batch.logp, batch.old_logp, batch.advantages, batch.mask, counts=batch.counts
    )
    return 0.5 * loss, {}


@sdk
@pytest.mark.parametrize(
    "loss_fn, config",
    [
        ("peergrade:grpo", None),
        ("peergrade:dapo", {"clip_eps_high": 0.28}),
        ("peergrade:dr_grpo", {"max_completion_length": 5}),
        ("peergrade:cispo", None),
        ("peergrade:sapo", None),
        ("peergrade:luspo", None),
        ("peergrade:vespo", None),
        ("importance_sampling", {"peergrade_loss": "grpo", "ratio_level": "sequence"}),
        ("peergrade:tinker_test_half_grpo", None),
    ],
)
def test_peergrade_losses_through_the_sdk(loss_fn, config, lora_client):
    """peergrade's losses reached through the real SDK: the server's ``loss:sum`` is
    ``policy_loss`` of the log-probs it returns, old_logp the sampler's, the mask the
    positions with a nonzero advantage, each datum's advantage its value there."""
    import peergrade
    from peergrade.algo import policy_loss
    from peergrade.algo.loss_options import loss_options

    peergrade.register_loss("tinker_test_half_grpo", _half_grpo, replace=True)
    tc = lora_client
    prompt = _prompt(tc, "58-23=")
    datums = _nudged_rl_datums(tc, prompt)
    fb = tc.forward(datums, loss_fn, config).result()
    L = max(len(o["logprobs"].tolist()) for o in fb.loss_fn_outputs)

    def padded(rows):
        out = torch.zeros(len(rows), L, dtype=torch.float64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        return out

    lp = padded([o["logprobs"].tolist() for o in fb.loss_fn_outputs])
    adv = padded([d.loss_fn_inputs["advantages"].tolist() for d in datums])
    old = padded([d.loss_fn_inputs["logprobs"].tolist() for d in datums])
    m = (adv != 0).double()
    knobs = {k: v for k, v in (config or {}).items() if k != "peergrade_loss"}
    name = (config or {}).get("peergrade_loss") or loss_fn.split(":", 1)[1]
    opts = loss_options(name, **knobs)
    per_datum = torch.tensor([d.loss_fn_inputs["advantages"].tolist()[-1] for d in datums])
    want, _ = policy_loss(lp * m, old * m, per_datum.double(), m, opts)
    assert fb.metrics["loss:sum"] == pytest.approx(want.item(), abs=1e-4)
    with pytest.raises(Exception, match=r"expected one of \('grpo'.*tinker_test_half_grpo"):
        tc.forward(datums, "peergrade:no_such_loss").result()


@sdk
def test_topk_logprobs_of_prompt_and_samples(lora_client):
    """``topk_prompt_logprobs`` / ``topk_sample_logprobs``: k (id, log-prob) pairs per
    position, best first, and the token actually there, when among them, has the log-prob
    ``prompt_logprobs`` / the sampled ``logprobs`` report (its rank among them is right)."""
    tc = lora_client
    prompt = _prompt(tc, "12+30=")
    sc = tc.save_weights_and_get_sampling_client().result()
    k = 5
    res = sc.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=0.7, seed=2),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=k,
    ).result()
    pairs = [(res.topk_prompt_logprobs, prompt, res.prompt_logprobs)]
    pairs += [(s.topk_logprobs, s.tokens, s.logprobs) for s in res.sequences]
    found = 0
    for tops, tokens, logprobs in pairs:
        assert len(tops) == len(tokens)
        for top, tok, lp in zip(tops, tokens, logprobs):
            if lp is None:  # the first prompt token: no context, no entry
                assert top is None
                continue
            assert len(top) == k and len({t for t, _ in top}) == k
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1 + 1e-5
            assert lp <= values[0] + 1e-4  # nothing the top-1 does not beat
            if tok in dict(top):
                found += 1
                assert dict(top)[tok] == pytest.approx(lp, abs=1e-4)
            else:
                assert lp <= values[-1] + 1e-4
    assert found > 0


@sdk
def test_rank_zero_is_full_fine_tuning_and_info_says_so(lora_client, full_client, server):
    assert lora_client.get_info().is_lora is True and lora_client.get_info().lora_rank == 4
    assert full_client.get_info().is_lora is False
    srv = server[0]
    full = next(r.model for r in srv.runs.values() if r.model.rank == 0)
    lora = next(r.model for r in srv.runs.values() if r.model.rank == 4)
    n_all = sum(p.numel() for p in full.model.parameters())
    assert sum(p.numel() for p in full.params.values()) == n_all
    assert 0 < sum(p.numel() for p in lora.params.values()) < n_all / 2


@sdk
def test_save_state_and_load_state_round_trip(service, lora_client):
    tc = lora_client
    prompt = _prompt(tc, "11+22=")
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)},
    )
    saved = tc.save_state("roundtrip").result()
    assert saved.path.endswith("/weights/roundtrip")
    before = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    _one_adam_step(tc, prompt)
    moved = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(before, moved)) > 1e-4
    tc.load_state_with_optimizer(saved.path).result()
    back = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert back == pytest.approx(before, abs=1e-6)
    # a second training client from the checkpoint: same weights
    tc2 = service.create_training_client_from_state_with_optimizer(saved.path).result()
    other = tc2.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert other == pytest.approx(before, abs=1e-6)
    # a named sampler checkpoint samples through create_sampling_client
    sp = tc.save_weights_for_sampler("named").result().path
    sc = tc.create_sampling_client(sp).result()
    out = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4))
    assert len(out.result().sequences) == 2


@sdk
def test_async_forms_and_custom_loss(lora_client):
    tc = lora_client
    prompt = _prompt(tc, "40+41=")
    w = [0.0] * (len(prompt) - 2) + [1.0]
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "weights": w},
    )

    async def go():
        ce = await tc.forward([d], "cross_entropy")  # the APIFuture awaited
        sc = await tc.save_weights_and_get_sampling_client()
        with warnings.catch_warnings():  # the *_async forms: deprecated in 0.38, still served
            warnings.simplefilter("ignore", FutureWarning)
            fut = await tc.forward_async([d], "cross_entropy")
            ce_old = await fut.result_async()
            res = await sc.sample_async(
                prompt=types.ModelInput.from_ints(prompt),
                num_samples=2,
                sampling_params=types.SamplingParams(max_tokens=3),
            )
        assert ce_old.metrics["loss:sum"] == pytest.approx(ce.metrics["loss:sum"], abs=1e-6)
        return ce, res

    ce, res = asyncio.run(go())
    assert len(res.sequences) == 2

    def custom(data, logprobs_list):  # cross-entropy again, computed client-side
        loss = sum(
            -(lp * torch.tensor(x.loss_fn_inputs["weights"].tolist())).sum()
            for lp, x in zip(logprobs_list, data)
        )
        return loss, {"custom": 1.0}

    out = tc.forward_backward_custom([d], custom).result()
    assert out.metrics["loss:sum"] == pytest.approx(ce.metrics["loss:sum"], abs=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the gradients


@sdk
def test_unsupported_requests_fail_with_a_clear_message(server, service, lora_client):
    prompt = _prompt(lora_client)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)},
    )
    with pytest.raises(Exception, match="expected one of cross_entropy"):
        lora_client.forward_backward([d], "no_such_loss").result()
    with pytest.raises(Exception, match="stable_reinforce.*not served locally"):
        lora_client.forward_backward([d], "stable_reinforce").result()
    sc = lora_client.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="prompt_alt_tokens_k are not served locally"):
        sc.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=2),
            prompt_alt_tokens_k=2,
        ).result()
    with pytest.raises(Exception, match="not served here"):
        service.create_lora_training_client(base_model="no/such-model").result()


def _example(name):
    spec = importlib.util.spec_from_file_location(f"tinker_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@sdk
@pytest.mark.parametrize(
    "loss_fn, config, steps",
    [("importance_sampling", None, 3), ("gspo", None, 2), ("peergrade:dapo", {"delta": 2.0}, 2)],
)
def test_cookbook_style_rl_loop_runs_a_few_batches(server, loss_fn, config, steps):
    """examples/tinker/rl_loop.py (the cookbook's rl_loop.py calls), a few small batches
    through the SDK; the measured reward rise is in docs/tinker.md."""
    rl = _example("rl_loop")
    hist = rl.run(
        base_url=server[1],
        batch_size=4,
        group_size=4,
        max_steps=steps,
        loss_fn=loss_fn,
        loss_fn_config=config,
        log=lambda s: None,
    )
    assert len(hist) == steps
    assert all(0.0 <= m["reward/total"] <= 1.0 for m in hist)
    trained = [m for m in hist if "loss:sum" in m]
    assert trained and all(math.isfinite(m["optim/grad_norm"]) for m in trained)


@sdk
def test_cookbook_style_supervised_loop_lowers_the_nll_of_its_batch(service, monkeypatch):
    """examples/tinker/sl_loop.py's calls on one fixed batch: cross_entropy + Adam must fit it."""
    sl = _example("sl_loop")
    tc = service.create_lora_training_client(base_model="bundled", rank=8, seed=1).result()
    from peergrade.tasks.arithmetic import ArithmeticTask

    rows = ArithmeticTask(ops="+").eval_rows(16)
    datums = [sl.datum_of(tc.get_tokenizer(), r, types) for r in rows]
    nll = []
    for _ in range(12):
        fb = tc.forward_backward(datums, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        nll.append(sl.mean_nll(fb.result(), datums))
    assert nll[-1] < 0.7 * nll[0], nll
    if importlib.util.find_spec("tinker_cookbook") is not None:  # the cookbook's own formula
        from tinker_cookbook.supervised.common import compute_mean_nll

        fb = tc.forward(datums, "cross_entropy").result()
        got = compute_mean_nll(
            [o["logprobs"] for o in fb.loss_fn_outputs],
            [d.loss_fn_inputs["weights"] for d in datums],
        )
        assert got == pytest.approx(sl.mean_nll(fb, datums), rel=1e-6)


@sdk
def test_a_run_replays_whatever_order_its_sample_requests_arrive_in():
    """Two fresh servers, the same short loop: the same rewards and losses. The loop sends a
    batch's sample() calls at once, so they reach the server in any order; a seedless
    request's seed names the request (its session and sequence id), not its arrival."""
    rl = _example("rl_loop")

    def go():
        hist = rl.run(batch_size=4, group_size=4, max_steps=2, seed=1, log=lambda s: None)
        return [(m["reward/total"], m.get("loss:sum")) for m in hist]

    assert go() == go()
