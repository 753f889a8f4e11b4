"""Dynamic sampling wired into the step (``rollout.dynamic_sampling``, ``trainer.fill_step``):
every trained batch holds exactly P groups whose rewards differ when they can be found, in at
most ``rollout.max_rounds`` rounds; short steps are padded with advantage-0 groups that count
in the normalisers; an all-degenerate source stops with a clear error; a step is a function
of (seed, step); the flag off is the plain step, and a step whose round 0 is full is exactly
the plain step; a resumed run equals an uninterrupted one. (2 ranks == 1 process:
tests/test_distributed.py.)
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peergrade.config import ConfigError, load_config
from peergrade.errors import InputError
from peergrade.generation.kernel import Rollout
from peergrade.training import trainer
from peergrade.training.dynamic import informative_groups
from test_trainer import tiny_overrides

REWARD_FILE = '''
def _text(c):
    return c[0]["content"] if isinstance(c, list) else c

def char_score(prompts, completions, **kwargs):
    """Dense: two different completions almost always score differently."""
    return [(sum(ord(ch) for ch in _text(c)) % 97) / 97.0 for c in completions]

def coarse(prompts, completions, **kwargs):
    """Binary: about half of the 2-completion groups agree."""
    return [float(s > 0.5) for s in char_score(prompts, completions)]

def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("rewards") / "dyn_rewards.py"
    p.write_text(REWARD_FILE)
    return p


def config(model_dir, reward_file, fn="coarse", **extra):
    base = dict(tiny_overrides(model_dir, reward_file))  # the trainer tests' tiny run
    base.update(
        {
            "rewards": [{"name": f"{reward_file}:{fn}", "weight": 1.0}],
            "rollout.prompts_per_step": 4,
            "rollout.dynamic_sampling": True,
            "rollout.max_rounds": 6,
            "train.audit_rewards": "off",
        }
    )
    base.update(extra)
    return load_config(None, list(base.items()))


def step_rows(run, step: int) -> list[dict]:
    P = run.cfg.rollout.prompts_per_step
    stream = run.task.train_rows(run.cfg.train.seed)
    return list(itertools.islice(stream, (step - 1) * P, step * P))


def groups(exp, G: int) -> torch.Tensor:
    return exp.rewards.view(-1, G).to(torch.float32)  # [P, G]


def test_every_batch_has_P_groups_with_spread_in_at_most_max_rounds(
    tiny_model_dir, reward_file, monkeypatch
):
    cfg = config(tiny_model_dir, reward_file)
    run = trainer.setup(cfg)
    P, G = 4, 2
    real_sample, keys = trainer.sample, []

    def recording(run, rows, step, row_keys):
        keys.append(list(row_keys))
        return real_sample(run, rows, step, row_keys)

    monkeypatch.setattr(trainer, "sample", recording)
    extra_rounds = 0
    for step in (1, 2, 3):
        keys.clear()
        exp = trainer.collect(run, step, step_rows(run, step))
        m = exp.sampled.dynamic
        # round r samples with keys rP .. rP + P - 1: no draw of another round is reused;
        # round 0 alone (the plain step's), the extra rounds batched (rollout.rounds_ahead)
        assert keys[0] == list(range(P))
        assert sum(keys, []) == list(range(P * int(m["dynamic/rounds"])))
        assert exp.num_sequences == P * G and len(exp.sampled.rows) == P
        assert 1 <= m["dynamic/rounds"] <= cfg.rollout.max_rounds
        assert m["dynamic/unfilled_groups"] == 0
        assert informative_groups(groups(exp, G)).all()
        assert (exp.advantages.view(P, G) != 0).any(dim=1).all()  # every group teaches
        assert m["dynamic/sampled_groups"] == P * m["dynamic/rounds"]
        assert m["dynamic/completions_per_informative_group"] == m["dynamic/sampled_groups"] * G / P
        extra_rounds += m["dynamic/rounds"] - 1
        # the rows travel with their completions: the logged prompt is the one sampled
        rendered = [run.models.tokenizer.decode(ids) for ids in exp.sampled.prompt_ids]
        assert all(
            row["prompt"][-1]["content"] in text for row, text in zip(exp.sampled.rows, rendered)
        )
    assert extra_rounds > 0  # the binary reward leaves groups that agree: rounds were added
    # the trained batch's metrics describe the kept groups; the sampled ones their own
    exp.seconds["update"] = 0.0
    metrics = trainer.step_result(run, exp, {}, 3).metrics
    assert metrics["rollout/frac_zero_std_groups"] == 0.0
    assert metrics["reward/total/mean"] == pytest.approx(exp.rewards.double().mean().item())
    assert metrics["dynamic/frac_zero_std_groups_sampled"] > 0


def test_a_step_is_a_function_of_seed_and_step(tiny_model_dir, reward_file):
    cfg = config(tiny_model_dir, reward_file)
    a, b = trainer.setup(cfg), trainer.setup(cfg)
    # b has sampled other steps first: step 2 still draws what a draws
    trainer.collect(b, 1, step_rows(b, 1))
    ea, eb = (trainer.collect(r, 2, step_rows(r, 2)) for r in (a, b))
    assert torch.equal(ea.input_ids, eb.input_ids) and torch.equal(ea.advantages, eb.advantages)
    assert ea.sampled.rows == eb.sampled.rows and ea.sampled.dynamic == eb.sampled.dynamic
    other = trainer.setup(config(tiny_model_dir, reward_file, **{"train.seed": 1}))
    ec = trainer.collect(other, 2, step_rows(a, 2))
    assert not torch.equal(ea.input_ids, ec.input_ids) or ea.sampled.rows != ec.sampled.rows


def test_short_steps_are_padded_with_groups_that_agree_and_counted(tiny_model_dir, reward_file):
    """max_rounds 1: slots round 0 could not fill hold its groups that agree (advantage 0),
    with their loss mask: every normaliser counts P * G rows whatever the fill."""
    cfg = config(tiny_model_dir, reward_file, **{"rollout.max_rounds": 1})
    run = trainer.setup(cfg)
    P, G = 4, 2
    for step in range(1, 8):
        exp = trainer.collect(run, step, step_rows(run, step))
        short = int(exp.sampled.dynamic["dynamic/unfilled_groups"])
        if 0 < short < P:
            break
    else:
        pytest.fail("no partly filled step in 7 (the reward should leave some groups agreeing)")
    ok = informative_groups(groups(exp, G))
    assert exp.num_sequences == P * G
    assert ok.tolist() == [True] * (P - short) + [False] * short  # picks first, then the pads
    pads = exp.advantages.view(P, G)[~ok]
    assert (pads == 0).all()
    assert (exp.loss_mask.view(P, G, -1)[~ok].sum(dim=-1) > 0).all()  # counted by the losses
    exp.seconds["update"] = 0.0
    m = trainer.step_result(run, exp, {}, step).metrics
    assert m["rollout/frac_zero_std_groups"] == short / P
    assert m["dynamic/rounds"] == 1


def test_all_degenerate_data_stops_with_a_clear_error(tiny_model_dir, reward_file, tmp_path):
    cfg = config(tiny_model_dir, reward_file, fn="constant", **{"rollout.max_rounds": 3})
    run = trainer.setup(cfg)
    with pytest.raises(InputError, match=r"none of the 12 groups sampled in 3 round"):
        trainer.collect(run, 1, step_rows(run, 1))
    # through the CLI's path: train stops, nothing half-written claims success
    with pytest.raises(InputError, match="rollout.dynamic_sampling"):
        trainer.train(cfg, tmp_path / "run")


def test_once_a_group_differed_an_empty_step_is_padded_not_fatal(tiny_model_dir, reward_file):
    run = trainer.setup(config(tiny_model_dir, reward_file, fn="constant"))
    run.informative_seen = True  # as after a step that found one (checkpointed)
    exp = trainer.collect(run, 1, step_rows(run, 1))
    assert exp.sampled.dynamic["dynamic/unfilled_groups"] == 4
    assert exp.sampled.dynamic["dynamic/rounds"] == 6
    assert (exp.advantages == 0).all()


def test_a_full_round_zero_is_the_plain_step(tiny_model_dir, reward_file):
    """A dense reward makes every group of round 0 differ: the dynamic step then trains on
    exactly what the plain step trains on, bit for bit (the same prompts, keys, batch)."""
    plain = trainer.setup(
        config(tiny_model_dir, reward_file, fn="char_score", **{"rollout.dynamic_sampling": False})
    )
    dyn = trainer.setup(config(tiny_model_dir, reward_file, fn="char_score"))
    for step in (1, 2):
        rp = trainer.train_step(plain, step, step_rows(plain, step))
        rd = trainer.train_step(dyn, step, step_rows(dyn, step))
        assert rd.metrics["dynamic/rounds"] == 1 and rd.metrics["dynamic/unfilled_groups"] == 0
        same = {
            k: v for k, v in rd.metrics.items() if not k.startswith(("dynamic/", "time/", "perf/"))
        }
        assert same == {k: v for k, v in rp.metrics.items() if not k.startswith(("time/", "perf/"))}
        assert rd.samples == rp.samples
    for (k, a), (_, b) in zip(
        plain.models.policy.state_dict().items(), dyn.models.policy.state_dict().items()
    ):
        assert torch.equal(a, b), k


def test_rounds_ahead_batches_the_rounds_and_keeps_the_same_groups(
    tiny_model_dir, reward_file, monkeypatch
):
    """rollout.rounds_ahead samples the extra rounds in fewer, larger batches; a round's draws
    are keyed by (seed, step, round, prompt), so the kept groups, the update and the weights
    are those of one round per batch."""
    calls = []
    real_sample = trainer.sample

    def recording(run, rows, step, row_keys):
        calls.append(len(row_keys))
        return real_sample(run, rows, step, row_keys)

    monkeypatch.setattr(trainer, "sample", recording)
    one = trainer.setup(config(tiny_model_dir, reward_file, **{"rollout.rounds_ahead": False}))
    ahead = trainer.setup(config(tiny_model_dir, reward_file))
    P, batched = 4, False
    for step in (1, 2, 3):
        calls.clear()
        r1 = trainer.train_step(one, step, step_rows(one, step))
        assert calls == [P] * int(r1.metrics["dynamic/rounds"])
        calls.clear()
        r2 = trainer.train_step(ahead, step, step_rows(ahead, step))
        assert calls[0] == P and sum(calls) == P * r2.metrics["dynamic/rounds"]
        batched = batched or len(calls) < r2.metrics["dynamic/rounds"]
        assert r2.metrics["dynamic/rounds"] >= r1.metrics["dynamic/rounds"]
        drop = ("dynamic/", "time/", "perf/")
        same = {k: v for k, v in r1.metrics.items() if not k.startswith(drop)}
        assert same == {k: v for k, v in r2.metrics.items() if not k.startswith(drop)}
        assert r1.samples == r2.samples
    assert batched  # some step asked for two or more rounds at once
    for (k, a), (_, b) in zip(
        one.models.policy.state_dict().items(), ahead.models.policy.state_dict().items()
    ):
        assert torch.equal(a, b), k


def test_flag_off_never_enters_the_dynamic_path(tiny_model_dir, reward_file, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("fill_step called with rollout.dynamic_sampling off")

    monkeypatch.setattr(trainer, "fill_step", boom)
    run = trainer.setup(config(tiny_model_dir, reward_file, **{"rollout.dynamic_sampling": False}))
    m = trainer.train_step(run, 1, step_rows(run, 1)).metrics
    assert not any(k.startswith("dynamic/") for k in m)


def read_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
        for r in rows
        if "loss/policy" in r
    ]


def test_resume_with_dynamic_sampling_is_exact(tiny_model_dir, reward_file, tmp_path):
    steps = {"train.steps": 4, "train.save_every": 2, "train.keep_last": 5}
    a, b = tmp_path / "a", tmp_path / "b"
    trainer.train(config(tiny_model_dir, reward_file, **steps), a)
    trainer.train(config(tiny_model_dir, reward_file, **{**steps, "train.steps": 2}), b)
    trainer.train(load_config(b / "config.yaml", [("train.steps", 4)]), b, resume=True)
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ma] == [1, 2, 3, 4]
    assert any(r["dynamic/rounds"] > 1 for r in ma)  # extra rounds happened, and were redrawn
    assert ma == mb
    wa = load_file(str(a / "checkpoints/step-4/model.safetensors"))
    wb = load_file(str(b / "checkpoints/step-4/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    state = json.loads((b / "checkpoints/step-2/trainer_state.json").read_text())
    assert state["dynamic_informative_seen"] is True
    assert (a / "samples.jsonl").read_text() == (b / "samples.jsonl").read_text()


def test_config_refuses_what_cannot_work(tiny_model_dir, reward_file):
    with pytest.raises(ConfigError, match="rollout.max_rounds must be >= 1"):
        config(tiny_model_dir, reward_file, **{"rollout.max_rounds": 0})
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling.*ppo"):
        config(tiny_model_dir, reward_file, **{"algo.name": "ppo"})
    with pytest.raises(ConfigError, match="group_size"):
        config(tiny_model_dir, reward_file, **{"rollout.group_size": 1})


def test_rollout_take_and_concat_keep_each_sequence(tiny_model_dir, reward_file):
    """Groups cut out of rollouts and joined (the kept groups of several rounds) train on the
    tokens they were sampled with: each row of the joined batch is its source row, re-padded."""
    run = trainer.setup(config(tiny_model_dir, reward_file))
    pad = run.models.tokenizer.pad_token_id
    rows = step_rows(run, 1)
    a = trainer.sample(run, rows[:2], 1, range(2))
    b = trainer.sample(run, rows[2:], 1, range(2, 4))
    parts = [b.take([2, 3]), a.take([0, 1, 2, 3])]  # group 1 of b, then a's two groups
    joined = Rollout.concat(parts, pad)
    assert joined.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert joined.completion_text == b.completion_text[2:] + a.completion_text
    ids, att, _ = joined.training_batch(pad)
    C = joined.completion_ids.shape[1]
    for i, (src, j) in enumerate([(b, 2), (b, 3), (a, 0), (a, 1), (a, 2), (a, 3)]):
        s_ids, s_att, _ = src.training_batch(pad)
        n = int(src.completion_mask[j].sum())
        assert ids[i, -C:][:n].tolist() == s_ids[j, -src.completion_ids.shape[1] :][:n].tolist()
        assert ids[i][att[i] == 1].tolist() == s_ids[j][s_att[j] == 1].tolist()
        assert torch.equal(joined.sampler_logprobs[i, :n], src.sampler_logprobs[j, :n])
        assert joined.loss_mask[i, n:].sum() == 0
