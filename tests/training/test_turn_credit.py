"""Per-turn credit for multi-turn episodes (``algo.turn_credit``): hand values of the turn
rewards, returns-to-go, their normalisation within a group and GiGPO's step groups
(``peergrade.algo.credit``); the turns of an episode record; a harness's per-turn rewards;
and the trainer's per-token advantages on recorded episodes: exact on each turn's sampled
tokens, 0 on the environment's, and ``episode`` (the default) bit for bit GRPO's."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import pytest
import torch

from peergrade.algo.advantages import group_advantages
from peergrade.algo.credit import (
    returns_advantages,
    split_reward,
    step_group_advantages,
    token_advantages,
    turn_returns,
)
from peergrade.envs.episode import Episode
from peergrade.envs.harness_pool import reward_of, turn_rewards_of
from test_envs_train import Steered  # eos at every every-th position: turns end

NAN = float("nan")


def close(a, b, tol=1e-6):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    both_nan = torch.isnan(a) & torch.isnan(b)
    assert torch.equal(torch.isnan(a), torch.isnan(b)), (a, b)
    assert torch.allclose(a[~both_nan], b[~both_nan], atol=tol, rtol=0), (a, b)


# ---------------------------------------------------------------- the pure computation


def test_split_reward_gives_the_rest_of_the_total_to_the_last_turn():
    total = torch.tensor([3.0, 1.0, NAN, 2.0])
    step = torch.tensor(
        [[0.5, NAN, 2.0], [NAN, NAN, NAN], [1.0, 1.0, NAN], [0.25, 4.0, NAN]],
        dtype=torch.float64,
    )
    turns = torch.tensor([3, 1, 2, 2])
    u = split_reward(total, step, turns)
    # episode 0: 0.5, 0 (no reward), 3 - 0.5 - 0 = 2.5; episode 1: its only turn gets 1;
    # episode 2 not scored: NaN; episode 3: 0.25 then 2 - 0.25 (its own 4.0 is replaced)
    close(u, [[0.5, 0.0, 2.5], [1.0, NAN, NAN], [NAN, NAN, NAN], [0.25, 1.75, NAN]])
    assert torch.allclose(torch.nansum(u[[0, 1, 3]], dim=1), total[[0, 1, 3]].double())
    with pytest.raises(ValueError, match="turns must lie in"):
        split_reward(total, step, torch.tensor([4, 1, 1, 1]))


def test_turn_returns_are_discounted_sums_to_the_end():
    u = torch.tensor([[1.0, 2.0, 4.0], [3.0, NAN, NAN]], dtype=torch.float64)
    close(turn_returns(u, 0.5), [[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0], [3.0, NAN, NAN]])
    close(turn_returns(u, 1.0), [[7.0, 6.0, 4.0], [3.0, NAN, NAN]])
    close(turn_returns(u, 0.0), u)
    with pytest.raises(ValueError, match="gamma must lie in"):
        turn_returns(u, 1.5)


def test_returns_are_normalised_within_their_group_all_turns_pooled():
    # group 0: returns 1, 0 | 0, (none); group 1: 5, 5 | 5, 5 (all equal: advantage 0)
    ret = torch.tensor([[[1.0, 0.0], [0.0, NAN]], [[5.0, 5.0], [5.0, 5.0]]], dtype=torch.float64)
    adv = returns_advantages(ret)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # Bessel, over the 3 turns
    d = std + 1e-4
    close(adv[0], [[(2 / 3) / d, -(1 / 3) / d], [-(1 / 3) / d, 0.0]])
    assert torch.equal(adv[1], torch.zeros(2, 2))
    close(returns_advantages(ret, scale="none")[0], [[2 / 3, -1 / 3], [-1 / 3, 0.0]])


def test_one_turn_per_episode_is_exactly_grpo():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 2.0, 1.0, 0.0]])
    u = split_reward(r.view(-1), torch.full((8, 1), NAN, dtype=torch.float64), torch.ones(8).long())
    adv = returns_advantages(turn_returns(u, 0.9).view(2, 4, 1))
    assert torch.equal(adv.view(2, 4), group_advantages(r))


def test_step_groups_compare_turns_in_the_same_state():
    # one prompt, 3 episodes of 2 turns: every turn 1 starts in state 0; turns 2 in states
    # 1, 1, 2 (episode 2 alone in its state: step advantage 0)
    ret = torch.tensor([[[1.0, 1.0], [0.0, 0.0], [2.0, 3.0]]], dtype=torch.float64)
    states = torch.tensor([[[0, 1], [0, 1], [0, 2]]])
    ep = torch.tensor([[0.5, -1.0, 0.5]])
    adv = step_group_advantages(ret, states, ep, weight=0.5, scale="none")
    # turn 1: returns 1, 0, 2, mean 1 -> 0, -1, 1; turn 2 in state 1: 1, 0, mean .5 -> +-.5
    close(adv, [[[0.5 + 0.0, 0.5 + 0.25], [-1.0 - 0.5, -1.0 - 0.25], [0.5 + 0.5, 0.5]]])
    # a turn the episode does not have (-1) gets nothing, not even the episode's advantage
    states2 = torch.tensor([[[0, -1], [0, 1], [0, 1]]])
    ret2 = ret.clone()
    ret2[0, 0, 1] = NAN
    adv2 = step_group_advantages(ret2, states2, ep, weight=1.0, scale="none")
    assert adv2[0, 0, 1] == 0.0
    close(adv2[0, 1:, 1], [-1.0 - 1.5, 0.5 + 1.5])  # state 1: returns 0, 3, mean 1.5
    # the std scale is group_advantages': turn 1's std of 1, 0, 2 is 1
    close(
        step_group_advantages(ret, states, ep, weight=1.0)[0, :, 0],
        [0.5, -1 - 1 / 1.0001, 0.5 + 1 / 1.0001],
    )


def test_token_advantages_put_each_turns_value_on_its_tokens_only():
    turn_adv = torch.tensor([[2.0, -1.0], [0.5, 0.0]])
    turn_of_token = torch.tensor([[-1, 0, 0, -1, -1, 1, -1], [0, -1, -1, -1, -1, -1, -1]])
    out = token_advantages(turn_adv, turn_of_token)
    assert out.tolist() == [[0, 2, 2, 0, 0, -1, 0], [0.5, 0, 0, 0, 0, 0, 0]]


# ---------------------------------------------------------------- the episode record


def test_episode_turns_are_the_runs_of_its_loss_mask_and_states_its_observations():
    e = Episode(0, [7, 8], [], 0)
    e.completion_ids = [1, 2, 3, 40, 41, 4, 5, 42, 6]
    e.loss_mask = [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert e.turn_spans() == [(0, 3), (5, 7), (8, 9)]
    e.turn_states = [None, "board-3"]  # the second answer names its state
    assert e.turn_observations() == [
        ("prompt", (7, 8)),
        ("tokens", (40, 41)),
        ("state", "board-3"),
    ]
    assert Episode(0, [1], [], 0).turn_spans() == []


def test_a_harness_may_return_one_reward_per_turn():
    assert reward_of([1.0, 0.0, 0.5]) == (1.5, {})
    assert turn_rewards_of([1, 0]) == [1.0, 0.0]
    assert reward_of({"reward": [0.25, 0.75], "calls": 2}) == (1.0, {"calls": 2.0})
    assert turn_rewards_of({"reward": [0.25, 0.75]}) == [0.25, 0.75]
    assert turn_rewards_of(1.0) is None and turn_rewards_of({"reward": 1}) is None
    assert reward_of(2) == (2.0, {})
    for bad in ([], ["a"], [True], {"reward": "x"}, None):
        with pytest.raises(TypeError, match="a harness must return"):
            reward_of(bad)


# ---------------------------------------------------------------- the trainer's advantages

ENV = '''
class Graded:
    """Three turns; the environment rewards turns 1 and 2 and names its states."""

    def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turns += 1
        if self.turns >= 3:
            return Step(done=True, reward=1.0)
        r = float(len(message["content"]) % 2) * self.turns
        return Step([{"role": "tool", "content": "OBS" + str(self.turns)}], reward=r,
                    state="s" + str(self.turns))


def coarse(completions, **kwargs):
    text = ["".join(m["content"] for m in c if m["role"] == "assistant") for c in completions]
    return [float(sum(map(ord, t)) % 3) for t in text]
'''


@pytest.fixture
def env_files(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text("from peergrade.envs import Step\n" + textwrap.dedent(ENV))
    rows = [{"prompt": p} for p in ("3*4?", "5*6?")]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _setup(mode: str | None, **algo):
    from peergrade.config import load_config
    from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
    from peergrade.training import trainer
    from peergrade.training.components import Given

    cfg = load_config(
        None,
        [
            ("data.path", "data.jsonl"),
            ("env.factory", "my_env.py:Graded"),
            ("rewards", [{"name": "my_env.py:coarse"}]),
            ("rollout.group_size", 3),
            ("rollout.prompts_per_step", 2),
            ("rollout.max_completion_length", 200),
            ("algo.beta", 0.0),
            ("train.audit_rewards", "off"),
        ],
    )
    if mode is not None:  # the fields may not be in the schema yet: set on the instance
        cfg.algo.turn_credit = mode
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    policy = Steered(inner, tok.eos_token_id, every=5)
    run = trainer.setup(cfg, Given(policy=policy, tokenizer=tok))
    rows = [{"prompt": "3*4?"}, {"prompt": "5*6?"}]
    return run, trainer.collect(run, 1, rows), tok


def test_episode_mode_is_grpo_bit_for_bit(env_files):
    from peergrade.training.turn_credit import TurnCredit
    from peergrade.training.update import GRPO

    base_run, base, _ = _setup(None)
    run, exp, _ = _setup("episode")
    assert type(base_run.algo) is GRPO and type(run.algo) is GRPO
    assert not isinstance(run.algo, TurnCredit)
    assert exp.advantages.shape == (6,) and torch.equal(exp.advantages, base.advantages)
    assert torch.equal(exp.rewards, base.rewards) and torch.equal(exp.loss_mask, base.loss_mask)


@pytest.mark.parametrize("mode", ["returns", "step_groups"])
def test_per_turn_advantages_lie_exactly_on_each_turns_sampled_tokens(env_files, mode):
    run, exp, tok = _setup(mode, turn_gamma=0.5, turn_step_weight=0.5)
    eps = exp.sampled.samples.episodes
    N, C = exp.loss_mask.shape
    assert exp.advantages.shape == (N, C)
    # the recorded turns: three per episode, the step rewards kept one per turn
    assert all(e.num_turns == 3 and len(e.turn_spans()) == 3 for e in eps)
    assert all(e.turn_rewards[2] == 1.0 and e.turn_states[:2] == ["s1", "s2"] for e in eps)
    # the expected turn advantages, built by hand from the episodes
    step = torch.tensor([[r if r is not None else NAN for r in e.turn_rewards] for e in eps])
    u = split_reward(exp.rewards.double(), step.double(), torch.full((N,), 3))
    ret = turn_returns(u, 0.5).view(2, 3, 3)
    if mode == "returns":
        want = returns_advantages(ret)
    else:  # states: turn 1 the prompt (one per row), turns 2 and 3 the environment's keys
        states = torch.tensor([[0, 1, 2]] * 3 + [[3, 1, 2]] * 3).view(2, 3, 3)
        want = step_group_advantages(ret, states, exp_grpo(run, exp), weight=0.5)
    want = want.view(N, 3)
    P = exp.input_ids.shape[1] - C
    for i, e in enumerate(eps):
        a = exp.advantages[i]
        for k, (s, t) in enumerate(e.turn_spans()):
            assert torch.equal(a[s:t], torch.full((t - s,), float(want[i, k])))
        env_tokens = [j for j in range(C) if exp.loss_mask[i, j] == 0]
        assert torch.equal(a[env_tokens], torch.zeros(len(env_tokens)))
        between = e.completion_ids[e.turn_spans()[0][1] : e.turn_spans()[1][0]]
        assert "OBS1" in tok.decode(between)  # the masked run is the environment's answer
        assert exp.input_ids[i, P : P + len(e.completion_ids)].tolist() == e.completion_ids
    assert exp.metrics["credit/turns_mean"] == 3.0
    # the update takes them (the same path as distillation's per-token advantages), on the
    # model under the steering wrapper
    models = run.algo.models
    run.algo.models = dataclasses.replace(models, policy=models.policy.inner)
    metrics = run.algo.update(exp, 1)
    assert math.isfinite(metrics["loss/policy"])


def exp_grpo(run, exp):
    """GRPO's episode-level advantages of ``exp``'s rewards, [P, G]."""
    a = run.cfg.algo
    return group_advantages(
        exp.rewards.view(-1, 3).float(), scale=a.advantage_scale, baseline=a.advantage_baseline
    )


@pytest.mark.parametrize(
    "algo, expected",
    [
        ({"turn_credit": "turns"}, "algo.turn_credit: 'turns' is not allowed; choose one of"),
        ({"turn_credit": "returns", "turn_gamma": 2.0}, "algo.turn_gamma"),
        ({"turn_credit": "step_groups", "turn_step_weight": -1.0}, "algo.turn_step_weight"),
        ({"turn_credit": "returns", "advantage_scale": "batch"}, "advantage_scale: batch"),
        ({"turn_credit": "step_groups", "loss_type": "vespo"}, "vespo"),
        ({"turn_credit": "returns", "name": "ppo"}, "algo.name: ppo"),
    ],
)
def test_what_turn_credit_cannot_combine_with_is_refused(algo, expected):
    """On load, from the keys a user writes (--algo.turn_credit returns ...)."""
    from peergrade.config import load_config
    from peergrade.errors import ConfigError

    with pytest.raises(ConfigError, match=expected):
        load_config(None, [(f"algo.{k}", v) for k, v in algo.items()])
    assert load_config().algo.turn_credit == "episode"  # the default: nothing to refuse


def test_a_harness_s_per_turn_rewards_reach_its_recorded_episode():
    """A harness that returns one reward per request: the episode's reward is their sum and
    the record keeps the list, one entry per recorded model turn."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
    from peergrade.serving.harness import HarnessRunner

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)

    def harness(row, base_url, model):
        c = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
        messages = [{"role": "user", "content": row["q"]}]
        for _ in range(2):
            r = c.chat.completions.create(model=model, messages=messages, max_tokens=4)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "go on"})
        return [0.25, 0.5 + len(row["q"])]

    runner = HarnessRunner(Steered(inner.eval(), tok.eos_token_id, every=3), tok)
    try:
        results = runner.run(harness, [{"q": "hi"}], n=2, max_completion_length=40, seed=1)
    finally:
        runner.close()
    for r in results:
        assert r.error is None and r.reward == 0.25 + 2.5
        assert r.episode.turn_rewards == [0.25, 2.5]
        assert len(r.episode.turn_spans()) == 2
