"""On-policy distillation (issue 56, part 1): the reverse-KL reward and its advantages by hand,
the student's and teacher's log-probs against one full forward of each model, the tokenizer
check at start-up, per-token advantages through GRPO's update, and CLI-level runs (a teacher
that is the student gives exactly zero signal; another teacher moves the weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.algo.distill import distill_advantages, reverse_kl_reward, token_mean_reward
from peergrade.config import ConfigError, load_config
from peergrade.errors import ModelLoadError
from peergrade.training import checkpoint as ckpt
from peergrade.training.teacher import student_teacher_logprobs, tokenizer_difference
from peergrade.training.update import Models, elided_rows

INF = math.inf


# ----------------------------------------------------------------------------- hand values


def test_reverse_kl_reward_hand_values_and_padding():
    student = torch.tensor([[-1.0, -2.0, -INF], [-0.25, -INF, -INF]])  # [2, 3]
    teacher = torch.tensor([[-0.5, -3.0, math.nan], [-0.25, 0.0, -INF]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    r = reverse_kl_reward(student, teacher, mask)
    assert torch.equal(r, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert token_mean_reward(r, mask) == (-0.5, 3)


def test_distill_advantages_coef_baseline_and_verifier_mix():
    student = torch.tensor([[-1.0, -2.0, -INF], [-0.25, -INF, -INF]])
    teacher = torch.tensor([[-0.5, -3.0, -INF], [-0.25, 0.0, -INF]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = distill_advantages(student, teacher, mask, coef=2.0, baseline=0.25)
    # 2 * (0.5 - 0.25), 2 * (-1 - 0.25), 2 * (0 - 0.25); padding exactly 0
    assert torch.equal(adv, torch.tensor([[0.5, -2.5, 0.0], [-0.5, 0.0, 0.0]]))
    mixed = distill_advantages(
        student,
        teacher,
        mask,
        coef=2.0,
        baseline=0.25,
        verifier_advantages=torch.tensor([2.0, -1.0]),
        verifier_weight=0.5,
    )
    assert torch.equal(mixed, torch.tensor([[1.5, -1.5, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="verifier_advantages"):
        distill_advantages(student, teacher, mask, verifier_weight=1.0)


def test_discounted_returns_count_sampled_tokens_only():
    from peergrade.algo.distill import discounted_returns

    r = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, -INF, -INF]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])  # row 0: an episode, token 1 the env's
    assert torch.equal(
        discounted_returns(r, mask, 0.0), torch.tensor([[1.0, 0, 3, 0], [4, 5, 0, 0]])
    )
    # R = r + 0.5 R_next over counted tokens; the env's token passes the sum through
    assert torch.equal(
        discounted_returns(r, mask, 0.5), torch.tensor([[2.5, 0, 3, 0], [6.5, 5, 0, 0]])
    )
    adv = distill_advantages(
        torch.zeros(2, 4), r.clamp(min=-1.0), mask, coef=2.0, baseline=1.0, discount=1.0
    )  # rewards r - 1 on counted tokens: [[0, ., 2, .], [3, 4]] -> returns [[2, 0, 2, 0], [7, 4]]
    assert torch.equal(adv, torch.tensor([[4.0, 0, 4, 0], [14, 8, 0, 0]]))


def test_per_token_advantages_elide_only_all_zero_rows():
    adv = torch.tensor([[0.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # [3, 2]
    assert elided_rows(adv, kl_on=False).tolist() == [True, False, False]
    assert elided_rows(adv, kl_on=True).tolist() == [False, False, False]


# ----------------------------------------------------------------------------- exactness


def _full_forward_logprobs(model, ids, am, cmask, temperature):
    """Each row's completion log-probs from ONE plain forward of its unpadded tokens."""
    N, L = ids.shape
    C = cmask.shape[1]
    out = torch.zeros(N, C)
    for n in range(N):
        real = ids[n][am[n] == 1]  # prompt + completion, no padding
        n_comp = int(cmask[n].sum())
        with torch.no_grad():
            logits = model(real[None]).logits[0].double() / temperature  # [l, V]
        lp = torch.log_softmax(logits, dim=-1)
        start = len(real) - n_comp  # first completion position
        for c in range(n_comp):
            out[n, c] = float(lp[start + c - 1, real[start + c]])
    return out


def test_student_and_teacher_logprobs_match_one_full_forward(char_tokenizer):
    from peergrade.model.tiny import build_tiny_model

    student, tok = build_tiny_model("qwen2", char_tokenizer, seed=0)
    teacher, _ = build_tiny_model("llama", char_tokenizer, seed=1)
    teacher.eval()
    cfg = load_config(None, [("rollout.temperature", 0.7), ("rollout.group_size", 2)])
    pad = tok.pad_token_id
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [enc("12+3="), enc("12+3="), enc("7*8="), enc("7*8=")]  # two groups of 2
    comps = [enc("15"), enc("151"), enc("56"), enc("5")]
    P = max(map(len, prompts))
    C = max(map(len, comps)) + 1
    rows, ams, cms = [], [], []
    for p, c in zip(prompts, comps):
        rows.append([pad] * (P - len(p)) + p + c + [pad] * (C - len(c)))
        ams.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)))
        cms.append([1] * len(c) + [0] * (C - len(c)))
    ids, am = torch.tensor(rows), torch.tensor(ams)
    cmask = torch.tensor(cms, dtype=torch.float32)
    models = Models(student, tok, None, torch.device("cpu"))
    student.train()  # the student's pass runs in eval mode and restores the mode after
    s_lp, t_lp = student_teacher_logprobs(models, teacher, (ids, am, cmask), cfg)
    assert student.training
    want_s = _full_forward_logprobs(student.eval(), ids, am, cmask, 0.7)
    want_t = _full_forward_logprobs(teacher, ids, am, cmask, 0.7)
    on = cmask == 1
    torch.testing.assert_close(s_lp[on], want_s[on], rtol=0, atol=2e-5)
    torch.testing.assert_close(t_lp[on], want_t[on], rtol=0, atol=2e-5)
    assert (s_lp[~on] == 0).all() and (t_lp[~on] == 0).all()
    adv = distill_advantages(s_lp, t_lp, cmask, coef=1.0)
    torch.testing.assert_close(adv[on], (want_t - want_s)[on], rtol=0, atol=4e-5)
    # algo.teacher_temperature: the teacher's logits at their own temperature, the student's not
    cfg.algo.teacher_temperature = 0.4
    s_lp2, t_lp2 = student_teacher_logprobs(models, teacher, (ids, am, cmask), cfg)
    assert torch.equal(s_lp2, s_lp)
    want_t2 = _full_forward_logprobs(teacher, ids, am, cmask, 0.4)
    torch.testing.assert_close(t_lp2[on], want_t2[on], rtol=0, atol=2e-5)
    assert cfg.rollout.temperature == 0.7  # the caller's config is left as it was


def _two_groups(tok):
    """(input_ids, attention_mask, completion_mask): two groups of 2, left-padded prompts."""
    pad = tok.pad_token_id
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [enc("12+3="), enc("12+3="), enc("7*8="), enc("7*8=")]
    comps = [enc("15"), enc("151"), enc("56"), enc("5")]
    P, C = max(map(len, prompts)), max(map(len, comps)) + 1
    rows, ams, cms = [], [], []
    for p, c in zip(prompts, comps):
        rows.append([pad] * (P - len(p)) + p + c + [pad] * (C - len(c)))
        ams.append([0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (C - len(c)))
        cms.append([1] * len(c) + [0] * (C - len(c)))
    return torch.tensor(rows), torch.tensor(ams), torch.tensor(cms, dtype=torch.float32)


def _full_forward_distributions(model, ids, am, cmask, temperature):
    """``[M, V]`` float64: the log-softmax that predicts each counted completion token (row
    order), from ONE plain forward of each row's unpadded tokens (with grad if the model has)."""
    out = []
    for n in range(ids.shape[0]):
        real = ids[n][am[n] == 1]
        n_comp = int(cmask[n].sum())
        logits = model(real[None]).logits[0].double() / temperature  # [l, V]
        start = len(real) - n_comp
        out.append(torch.log_softmax(logits[start - 1 : start - 1 + n_comp], dim=-1))
    return torch.cat(out)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_divergence_matches_one_full_forward_of_both_models(char_tokenizer, beta):
    """algo.teacher_divergence top_k: the teacher's top-k (``teacher_topk``) and the student's
    log-probs of those ids (``gathered_token_logprobs``, chunks of 3 positions) against one
    plain forward of each model: with k = V and the tail the divergence is the full-vocabulary
    generalized JSD, in value and in its gradient on the student's weights; with k = 5 it is
    the one over the full forward's own top-5."""
    from peergrade.algo.distill import generalized_jsd, topk_divergence
    from peergrade.model.logprobs import gathered_token_logprobs
    from peergrade.model.tiny import build_tiny_model
    from peergrade.training.teacher import teacher_topk

    student, tok = build_tiny_model("qwen2", char_tokenizer, seed=0)
    teacher, _ = build_tiny_model("llama", char_tokenizer, seed=1)
    teacher.eval()
    ids, am, cmask = _two_groups(tok)
    on = cmask == 1
    V = student.get_output_embeddings().weight.shape[0]
    t_full = _full_forward_distributions(teacher, ids, am, cmask, 0.4).detach()  # [M, V]
    for k in (V, 5):
        cfg = load_config(
            None,
            [
                ("rollout.temperature", 0.7),
                ("algo.teacher_temperature", 0.4),
                ("algo.teacher_loss_top_k", k),
                ("model.logprob_chunk_size", 3),
            ],
        )
        vals, tids = teacher_topk(teacher, (ids, am, cmask), cfg)  # [N, C, k]
        assert vals.shape == (*cmask.shape, k) and (vals[~on] == 0).all()
        want_v, want_i = t_full.topk(k, dim=-1)
        torch.testing.assert_close(vals[on].double(), want_v, rtol=0, atol=2e-5)
        student.zero_grad()
        s_at = gathered_token_logprobs(student, ids, am, cmask, tids, temperature=0.7, chunk_size=3)
        assert (s_at[~on] == 0).all()
        got = topk_divergence(s_at[on], vals[on], beta=beta).sum()
        got.backward()
        g_got = {n: p.grad.clone() for n, p in student.named_parameters()}
        student.zero_grad()
        s_full = _full_forward_distributions(student, ids, am, cmask, 0.7)  # [M, V], grad
        if k == V:
            want = generalized_jsd(s_full, t_full, beta).sum()
        else:
            want = topk_divergence(s_full.gather(1, want_i), want_v, beta=beta).sum()
        want.backward()
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-4, abs=1e-5)
        for n, p in student.named_parameters():
            torch.testing.assert_close(g_got[n], p.grad.float(), rtol=1e-3, atol=2e-5, msg=n)


# ----------------------------------------------------------------------------- tokenizers


def test_tokenizer_difference_names_tokens_and_special_ids(char_tokenizer):
    import copy

    assert tokenizer_difference(char_tokenizer, copy.deepcopy(char_tokenizer)) is None
    other = copy.deepcopy(char_tokenizer)
    other.add_tokens(["<teacher-only>"])
    why = tokenizer_difference(char_tokenizer, other)
    assert "<teacher-only>" in why and "only the teacher" in why
    moved_eos = copy.deepcopy(char_tokenizer)
    moved_eos.eos_token = moved_eos.convert_ids_to_tokens(5)
    assert "eos_token_id" in tokenizer_difference(char_tokenizer, moved_eos)


# ----------------------------------------------------------------------------- runs

REWARD_FILE = """
def char_score(prompts, completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(ord(ch) for ch in t) % 97) / 97.0 for t in texts]
"""


def _overrides(model_dir: Path, reward: Path, teacher: Path, **extra):
    base = {
        "model.path": str(model_dir),
        "algo.teacher_path": str(teacher),
        "rewards": [{"name": f"{reward}:char_score", "weight": 1.0}],
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_completion_length": 4,
        "optim.lr": 1e-2,
        "train.steps": 2,
        "train.eval_size": 2,
        "train.eval_samples": 2,
        "train.display": "none",
        "train.threads": 1,
    }
    base.update(extra)
    return list(base.items())


@pytest.fixture
def reward(tmp_path) -> Path:
    p = tmp_path / "rewards.py"
    p.write_text(REWARD_FILE)
    return p


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "distill/reverse_kl" in r]


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(d) / "model.safetensors"))


def test_teacher_equal_to_student_gives_exactly_no_signal(tiny_model_dir, reward, tmp_path):
    """The teacher is the student's own directory: log p_teacher - log p_student is exactly 0
    on every token, so every advantage is 0 (the verifier's rewards, weight 0, are only
    logged) and the weights do not move."""
    from peergrade.training.trainer import train

    run = tmp_path / "run"
    train(load_config(None, _overrides(tiny_model_dir, reward, tiny_model_dir)), run)
    rows = _metrics(run)
    assert len(rows) == 2
    assert [r["distill/reverse_kl"] for r in rows] == [0.0, 0.0]
    assert [r["loss/policy"] for r in rows] == [0.0, 0.0]
    before, after = _weights(tiny_model_dir), _weights(ckpt.latest_checkpoint(run))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_other_teacher_trains_the_student_per_token(tiny_model_dir, reward, tmp_path):
    from peergrade.model.tiny import save_tiny_model
    from peergrade.training.trainer import train

    teacher = save_tiny_model(tmp_path / "teacher", "llama", seed=3)
    run = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_model_dir, reward, teacher))
    train(cfg, run)
    rows = _metrics(run)
    assert len(rows) == 2 and all(r["distill/reverse_kl"] != 0 for r in rows)
    assert all(math.isfinite(r["loss/policy"]) for r in rows)
    before, after = _weights(tiny_model_dir), _weights(ckpt.latest_checkpoint(run))
    assert any(not torch.equal(before[k], after[k]) for k in before)


TOP_K = {"algo.teacher_divergence": "top_k", "algo.teacher_loss_top_k": 4}


def _divergence_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "distill/divergence" in r]


def test_topk_divergence_run_trains_the_student(tiny_model_dir, reward, tmp_path):
    """algo.teacher_divergence top_k from the config: every step logs a positive divergence and
    the teacher's top-4 mass, the policy loss is 0 (no verifier weight: every advantage is 0,
    yet no completion is elided), and the weights move."""
    from peergrade.model.tiny import save_tiny_model
    from peergrade.training.trainer import train

    teacher = save_tiny_model(tmp_path / "teacher", "llama", seed=3)
    run = tmp_path / "run"
    train(load_config(None, _overrides(tiny_model_dir, reward, teacher, **TOP_K)), run)
    rows = _divergence_rows(run)
    assert len(rows) == 2
    assert all(r["distill/divergence"] > 1e-3 for r in rows)
    assert all(0 < r["distill/teacher_topk_mass"] <= 1 for r in rows)
    assert [r["loss/policy"] for r in rows] == [0.0, 0.0]
    assert [r["update/elided_frac"] for r in rows] == [0.0, 0.0]
    before, after = _weights(tiny_model_dir), _weights(ckpt.latest_checkpoint(run))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_topk_divergence_to_itself_is_zero(tiny_model_dir, reward, tmp_path):
    from peergrade.training.trainer import train

    run = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_model_dir, reward, tiny_model_dir, **TOP_K))
    train(cfg, run)
    rows = _divergence_rows(run)
    assert len(rows) == 2 and abs(rows[0]["distill/divergence"]) < 1e-6


def test_topk_divergence_options_are_checked(tiny_model_dir, reward, tmp_path):
    from peergrade.training import trainer

    def cfg(**extra):
        return load_config(None, _overrides(tiny_model_dir, reward, tiny_model_dir, **extra))

    with pytest.raises(ConfigError, match="teacher_beta"):
        cfg(**TOP_K, **{"algo.teacher_beta": 1.5})
    with pytest.raises(ConfigError, match="teacher_loss_top_k"):
        cfg(**{**TOP_K, "algo.teacher_loss_top_k": 0})
    with pytest.raises(ConfigError, match="teacher_discount.*top_k"):
        cfg(**TOP_K, **{"algo.teacher_discount": 0.5})
    with pytest.raises(ConfigError, match="teacher_divergence"):
        cfg(**{"algo.teacher_divergence": "full"})
    with pytest.raises(ModelLoadError, match=r"teacher_loss_top_k=100000.*at most"):
        trainer.setup(cfg(**{**TOP_K, "algo.teacher_loss_top_k": 100_000}))


def test_mismatched_teacher_tokenizer_refuses_at_start_up(tiny_model_dir, reward, tmp_path):
    from transformers import AutoTokenizer

    from peergrade.model.tiny import save_tiny_model
    from peergrade.training import trainer

    teacher = save_tiny_model(tmp_path / "teacher", "qwen2", seed=0)
    tok = AutoTokenizer.from_pretrained(str(teacher))
    tok.add_tokens(["<only-here>"])
    tok.save_pretrained(str(teacher))
    with pytest.raises(ModelLoadError, match=r"algo.teacher_path.*<only-here>"):
        trainer.setup(load_config(None, _overrides(tiny_model_dir, reward, teacher)))


def test_teacher_options_are_checked(tiny_model_dir, reward, tmp_path):
    with pytest.raises(ConfigError, match="distillation is a GRPO mode"):
        load_config(
            None, _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.name": "ppo"})
        )
    with pytest.raises(ConfigError, match="teacher_coef"):
        load_config(
            None, _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.teacher_coef": 0.0})
        )
    with pytest.raises(ConfigError, match="async_steps"):
        load_config(
            None, _overrides(tiny_model_dir, reward, tiny_model_dir, **{"rollout.async_steps": 1})
        )
    with pytest.raises(ConfigError, match="teacher_discount"):
        load_config(
            None, _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.teacher_discount": 2})
        )
    with pytest.raises(ConfigError, match="teacher_temperature"):
        load_config(
            None,
            _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.teacher_temperature": 0}),
        )
    with pytest.raises(ConfigError, match="vespo"):
        load_config(
            None, _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.loss_type": "vespo"})
        )


def test_trl_style_script_distils_through_the_peergrade_escape(tmp_path):
    """A TRL-style script: GRPOConfig's ``peergrade`` dict sets the teacher and GRPOTrainer's
    steps log the distillation metrics (the teacher is the student here: reverse KL 0)."""
    from peergrade import GRPOConfig, GRPOTrainer
    from peergrade.model.load import BUNDLED_MODEL

    def exact(completions, solution, **kw):
        return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]

    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
        for a, b in [(12, 7), (23, 41)]
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=4,
        gradient_checkpointing=False,
        peergrade={"algo.teacher_path": str(BUNDLED_MODEL), "train.eval_size": 2},
    )
    trainer = GRPOTrainer(str(BUNDLED_MODEL), [exact], args, rows)
    assert trainer.config.algo.teacher_path == str(BUNDLED_MODEL)
    trainer.train()
    logged = [
        h["distill/reverse_kl"] for h in trainer.state.log_history if "distill/reverse_kl" in h
    ]
    assert logged == [0.0]


# ----------------------------------------------------------------------------- endpoint teacher


@pytest.fixture
def served(tmp_path):
    """Serve a model directory on loopback (``peergrade serve``'s in-process server); yields
    a function dir -> base URL (``.../v1``) and closes every server after the test."""
    pytest.importorskip("uvicorn")
    from peergrade.model.load import load_model, load_tokenizer, prepare_tokenizer
    from peergrade.serving.server import Engine, Server, build_app

    opened = []

    def serve(model_dir: Path, name: str = "teacher") -> str:
        model = load_model(str(model_dir)).eval()
        engine = Engine(model, prepare_tokenizer(load_tokenizer(str(model_dir))), name)
        server = Server(build_app(engine)).__enter__()
        opened.append((server, engine))
        return server.url + "/v1"

    yield serve
    for server, engine in opened:
        server.__exit__(None, None, None)
        engine.close()


def _teacher_cfg(url: str, **extra):
    base = {"algo.teacher_url": url, "rollout.temperature": 1.0}
    base.update(extra)
    return load_config(None, list(base.items()))


def test_endpoint_teacher_logprobs_equal_the_local_teachers(tiny_model_dir, tmp_path, served):
    """The endpoint's prompt log-probs of the student's sampled tokens are the local teacher's
    (the same model loaded here, temperature 1) on the very batch, padding and all."""
    from peergrade.model.load import load_model, load_tokenizer
    from peergrade.model.tiny import save_tiny_model
    from peergrade.training.teacher import load_teacher

    teacher_dir = save_tiny_model(tmp_path / "teacher", "llama", seed=3)
    url = served(teacher_dir)
    tok = load_tokenizer(str(tiny_model_dir))
    student = load_model(str(tiny_model_dir))
    models = Models(student, tok, None, torch.device("cpu"))
    cfg = _teacher_cfg(url)
    endpoint = load_teacher(cfg, models)  # probes /models and the vocabulary
    assert endpoint.model == "teacher" and endpoint.requests == 2
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [enc("12+3="), enc("12+3="), enc("7*8=")]
    comps = [enc("15"), enc("151"), enc("5")]
    P, C = max(map(len, prompts)), max(map(len, comps)) + 1
    pad = tok.pad_token_id
    ids = torch.tensor(
        [[pad] * (P - len(p)) + p + c + [pad] * (C - len(c)) for p, c in zip(prompts, comps)]
    )
    am = (torch.arange(P + C)[None] >= torch.tensor([P - len(p) for p in prompts])[:, None]).long()
    am[:, P:] = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in comps])
    cmask = am[:, P:].float()
    s_remote, t_remote = student_teacher_logprobs(models, endpoint, (ids, am, cmask), cfg)
    local = load_model(str(teacher_dir)).eval()
    s_local, t_local = student_teacher_logprobs(models, local, (ids, am, cmask), cfg)
    on = cmask == 1
    assert torch.equal(s_remote, s_local)  # the student's side is local either way
    torch.testing.assert_close(t_remote[on], t_local[on], rtol=0, atol=1e-5)
    assert (t_remote[~on] == 0).all() and (t_remote[on] < 0).all()
    want = _full_forward_logprobs(local, ids, am, cmask, 1.0)
    torch.testing.assert_close(t_remote[on], want[on], rtol=0, atol=1e-5)
    # algo.teacher_divergence top_k: the endpoint's prompt_logprobs: k are the local top-k
    from peergrade.training.teacher import teacher_topk

    cfg_k = _teacher_cfg(url, **{"algo.teacher_divergence": "top_k", "algo.teacher_loss_top_k": 5})
    v_remote, i_remote = teacher_topk(endpoint, (ids, am, cmask), cfg_k)
    v_local, i_local = teacher_topk(local, (ids, am, cmask), cfg_k)
    assert v_remote.shape == (3, C, 5) and torch.equal(i_remote[on], i_local[on])
    torch.testing.assert_close(v_remote[on], v_local[on], rtol=0, atol=1e-5)
    assert (v_remote[~on] == 0).all() and (i_remote[~on] == 0).all()


def test_two_step_distillation_with_an_endpoint_teacher(tiny_model_dir, reward, tmp_path, served):
    """A 2-step run whose teacher is served over HTTP: its first step's teacher log-probs are
    those of a run with the same teacher loaded locally (same keyed samples), and the student
    moves."""
    from peergrade.model.tiny import save_tiny_model
    from peergrade.training.trainer import train

    teacher_dir = save_tiny_model(tmp_path / "teacher", "llama", seed=3)
    url = served(teacher_dir)
    remote, local = tmp_path / "remote", tmp_path / "local"
    over = _overrides(tiny_model_dir, reward, teacher_dir, **{"rollout.temperature": 1.0})
    train(load_config(None, over), local)
    over = [(k, v) for k, v in over if k != "algo.teacher_path"] + [("algo.teacher_url", url)]
    train(load_config(None, over), remote)
    r_rows, l_rows = _metrics(remote), _metrics(local)
    assert len(r_rows) == 2 and all(r["distill/reverse_kl"] != 0 for r in r_rows)
    assert r_rows[0]["distill/teacher_logp"] == pytest.approx(
        l_rows[0]["distill/teacher_logp"], abs=1e-5
    )
    before, after = _weights(tiny_model_dir), _weights(ckpt.latest_checkpoint(remote))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_two_step_topk_distillation_with_an_endpoint_teacher(
    tiny_model_dir, reward, tmp_path, served
):
    """algo.teacher_divergence top_k through an endpoint: the first step's divergence and the
    teacher's top-k mass are those of the same teacher loaded locally (same keyed samples)."""
    from peergrade.model.tiny import save_tiny_model
    from peergrade.training.trainer import train

    teacher_dir = save_tiny_model(tmp_path / "teacher", "llama", seed=3)
    url = served(teacher_dir)
    remote, local = tmp_path / "remote", tmp_path / "local"
    over = _overrides(tiny_model_dir, reward, teacher_dir, **{"rollout.temperature": 1.0}, **TOP_K)
    train(load_config(None, over), local)
    over = [(k, v) for k, v in over if k != "algo.teacher_path"] + [("algo.teacher_url", url)]
    train(load_config(None, over), remote)
    r_rows, l_rows = _divergence_rows(remote), _divergence_rows(local)
    assert len(r_rows) == 2 and r_rows[0]["distill/divergence"] > 1e-3
    for key in ("distill/divergence", "distill/teacher_topk_mass"):
        assert r_rows[0][key] == pytest.approx(l_rows[0][key], abs=1e-5)


def test_endpoint_teacher_with_another_tokenizer_refuses_at_start_up(
    tiny_model_dir, reward, tmp_path, served
):
    from peergrade.model.tiny import CHARS, build_char_tokenizer, build_tiny_model
    from peergrade.training import trainer

    tok = build_char_tokenizer(chars=list(reversed(CHARS)))  # same size, other ids
    model, tok = build_tiny_model("llama", tok, seed=1)
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    url = served(tmp_path / "other")
    over = _overrides(tiny_model_dir, reward, tiny_model_dir, **{"rollout.temperature": 1.0})
    over = [(k, v) for k, v in over if k != "algo.teacher_path"] + [("algo.teacher_url", url)]
    with pytest.raises(ModelLoadError, match=r"teacher_url.*decode differently: id \d+: '.'"):
        trainer.setup(load_config(None, over))


def test_dead_endpoint_teacher_names_the_url_before_the_first_step(tiny_model_dir, reward):
    import socket

    from peergrade.training import trainer
    from peergrade.training.teacher_endpoint import TeacherEndpointError

    with socket.socket() as s:  # a port nothing listens on (bound, never accepted)
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        over = _overrides(tiny_model_dir, reward, tiny_model_dir, **{"algo.teacher_timeout": 5})
        over = [(k, v) for k, v in over if k != "algo.teacher_path"] + [("algo.teacher_url", url)]
        with pytest.raises(TeacherEndpointError, match=rf"{url}.*3 attempt"):
            trainer.setup(load_config(None, over))


def test_endpoint_teacher_options_are_checked(tiny_model_dir):
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(ConfigError, match="both set"):
        _teacher_cfg(url, **{"algo.teacher_path": str(tiny_model_dir)})
    with pytest.raises(ConfigError, match="temperature of 0.7"):
        _teacher_cfg(url, **{"rollout.temperature": 0.7})
    assert _teacher_cfg(url, **{"rollout.temperature": 0.7, "algo.teacher_temperature": 1.0})
    with pytest.raises(ConfigError, match="http"):
        _teacher_cfg("127.0.0.1:9")
    with pytest.raises(ConfigError, match="GRPO mode"):
        _teacher_cfg(url, **{"algo.name": "ppo"})
    with pytest.raises(ConfigError, match="async_steps"):
        _teacher_cfg(url, **{"rollout.async_steps": 1})
    with pytest.raises(ConfigError, match="teacher_timeout"):
        _teacher_cfg(url, **{"algo.teacher_timeout": 0})
    with pytest.raises(ConfigError, match="teacher_discount.*top_k"):
        _teacher_cfg(url, **{"algo.teacher_divergence": "top_k", "algo.teacher_discount": 1})
