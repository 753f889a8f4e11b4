"""Training on episodes: the ``env:`` section and ``--tools`` / ``--env`` on ``peergrade train``,
the Experience ``collect`` builds from episodes (environment tokens attended to, never trained
on), the errors before the model loads, and PPO refused."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from peergrade.cli import main
from peergrade.config import ConfigError, load_config
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from peergrade.training.components import Given

MARK = "FEEDBACK#"  # environment text that the model's sampled tokens must never contain

TOOLS = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def undocumented(a: int) -> int:
    return a


def encoded(a: int) -> bytes:
    """Encode.

    Args:
        a: how many bytes
    """
    return bytes(a)
'''

REWARD = """
def used_a_tool(completions, **kwargs):
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]
"""

NATIVE_ENV = f'''
class Counter:
    """TRL's environment_factory: reset(**row), a tool method, an async get_reward."""

    def reset(self, **row):
        self.count = 0
        self.answer = row["answer"]

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return str(self.count)

    async def get_reward(self):
        return 2.0 if self.answer in ("12", "30") else 0.0


def saw_environments(completions, environments, **kwargs):
    return [float(type(e).__name__ == "Counter") for e in environments]


class StepOnly:
    def step(self, message):
        return [], True


class ToolFeedback:
    """Answers every model turn with a tool message until the third turn."""

    def reset(self, row):
        self.turns = 0
        return [{{"role": "user", "content": row["prompt"]}}]

    def step(self, message):
        self.turns += 1
        if self.turns >= 3:
            return [], True, 1.0
        return [{{"role": "tool", "content": "{MARK}" + str(self.turns)}}], False, 0.25
'''


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny Qwen2 with a tool-capable chat template, saved as a model directory."""
    out = tmp_path_factory.mktemp("tool_model")
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def files(tmp_path):
    write(tmp_path / "my_tools.py", TOOLS)
    write(tmp_path / "my_reward.py", REWARD)
    write(tmp_path / "my_env.py", NATIVE_ENV)
    rows = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in [(3, 4), (5, 6)]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


SMALL = [
    "--rollout.group_size",
    "2",
    "--rollout.prompts_per_step",
    "2",
    "--rollout.max_completion_length",
    "24",
    "--train.eval_every",
    "0",
    "--train.save_every",
    "0",
    "--train.display",
    "none",
    "--train.audit_rewards",
    "'off'",
]


# ---------------------------------------------------------------- config and command line


def test_env_paths_resolve_like_other_config_paths(files, monkeypatch):
    monkeypatch.chdir(files)
    cfg = load_config(
        None,
        [("env.tools", ["my_tools.py:multiply", "json:dumps"]), ("env.factory", "my_env.py:X")],
    )
    assert cfg.env.tools == [str(files / "my_tools.py") + ":multiply", "json:dumps"]
    assert cfg.env.factory == str(files / "my_env.py") + ":X"
    assert cfg.given_paths["env.tools[0]"] == "my_tools.py:multiply"
    assert cfg.env.enabled and not load_config().env.enabled
    # in a YAML file: relative to the file
    sub = files / "sub"
    sub.mkdir()
    write(sub / "c.yaml", "env:\n  tools: [../my_tools.py:multiply]\n  max_turns: 3\n")
    cfg = load_config(sub / "c.yaml")
    assert cfg.env.tools == [str(files / "my_tools.py") + ":multiply"]
    assert cfg.env.max_turns == 3


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [("env.tools", ["t.py:f"]), ("algo.name", "ppo")],
            "algo.name=ppo does not train episodes",
        ),
        ([("env.max_turns", 0)], "env.max_turns must be >= 1"),
        ([("env.tool_timeout", 0)], "env.tool_timeout must be > 0"),
        ([("env.timeout_s", -1)], "env.timeout_s must be > 0 or null, got -1"),
        ([("env.factory", "nocolon")], "env.factory must be"),
    ],
)
def test_bad_env_config_is_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--tools", "missing_tools.py:multiply"], "missing_tools.py"),
        (["--tools", "my_tools.py:undocumented"], "undocumented"),
        (["--tools", "my_tools.py:nope"], "nope"),
        (["--env", "my_env.py:Nope"], "Nope"),
        (["--tools", "my_tools.py:encoded"], "tool encoded returns bytes"),
        (["--env", "my_env.py:StepOnly"], "StepOnly has step but no reset"),
        (["--algo.name", "ppo", "--tools", "my_tools.py:multiply"], "algo.name=ppo"),
    ],
)
def test_bad_tools_exit_2_before_the_model_loads(files, monkeypatch, capsys, flags, expected):
    """The model directory does not exist: an error about the tool (not the model) proves the
    tools were checked first."""
    monkeypatch.chdir(files)
    rc = main(
        [
            "train",
            "--model",
            "no_such_model",
            "--data",
            "data.jsonl",
            "--steps",
            "1",
            *flags,
            *SMALL,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert expected in err and "no_such_model" not in err, err


DROPS_TOOL_TEXT = (
    "{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.slow
def test_template_without_tool_turns_exits_2_before_the_policy_loads(files, monkeypatch, capsys):
    """A template that drops tool messages is named, exit 2; the directory has no weights, so
    reaching the policy's loading would have been another error."""
    tok = build_char_tokenizer(chat_template=DROPS_TOOL_TEXT)
    model, _ = build_tiny_model("qwen2", tok, seed=0)
    (files / "no_weights").mkdir()
    tok.save_pretrained(files / "no_weights")
    model.config.save_pretrained(files / "no_weights")
    monkeypatch.chdir(files)
    rc = main(
        ["train", "--model", "no_weights", "--data", "data.jsonl", "--steps", "1"]
        + ["--tools", "my_tools.py:multiply", *SMALL]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "chat template" in err and "tool" in err, err


# ---------------------------------------------------------------- the experience of episodes


class Steered(torch.nn.Module):
    """The tiny model with eos forced at every ``every``-th position, so turns end and episodes
    have several (a random model would run every turn to the budget)."""

    def __init__(self, inner, eos_id, every):
        super().__init__()
        self.inner, self.config, self.generation_config = (
            inner,
            inner.config,
            inner.generation_config,
        )
        self.eos_id, self.every = eos_id, every

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
    ):
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
        pos = position_ids[:, -out.logits.shape[1] :]
        out.logits[..., self.eos_id] += 1e4 * ((pos + 1) % self.every == 0).to(out.logits.dtype)
        return out


def test_collected_experience_masks_environment_tokens(files, monkeypatch):
    from peergrade.training import trainer

    monkeypatch.chdir(files)
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    policy = Steered(inner, tok.eos_token_id, every=6)
    cfg = load_config(
        None,
        [
            ("data.path", "data.jsonl"),
            ("env.factory", "my_env.py:ToolFeedback"),
            ("rewards", [{"name": "my_reward.py:used_a_tool"}]),
            ("rollout.group_size", 2),
            ("rollout.prompts_per_step", 2),
            ("rollout.max_completion_length", 200),
            ("algo.beta", 0.0),
            ("train.audit_rewards", "off"),
        ],
    )
    run = trainer.setup(cfg, Given(policy=policy, tokenizer=tok))
    assert [s.name for s in run.rewards] == ["used_a_tool", "env"]
    exp = trainer.collect(run, 1, [{"prompt": "3*4?"}, {"prompt": "5*6?"}])
    eps = exp.sampled.samples.episodes
    assert len(eps) == 4 and all(e.num_turns == 3 and e.finish_reason == "done" for e in eps)

    n, C = exp.loss_mask.shape
    P = exp.input_ids.shape[1] - C
    assert exp.attention_mask.dtype == torch.long and exp.loss_mask.dtype == torch.float32
    for i, e in enumerate(eps):
        ids = exp.input_ids[i, P : P + len(e.completion_ids)].tolist()
        assert ids == e.completion_ids
        lm = exp.loss_mask[i, : len(ids)]
        # every completion token is attended to, the padding after it is not
        assert exp.attention_mask[i, P : P + len(ids)].eq(1).all()
        assert exp.attention_mask[i, P + len(ids) :].eq(0).all()
        trained = tok.decode([t for t, m in zip(ids, lm.tolist()) if m])
        appended = tok.decode([t for t, m in zip(ids, lm.tolist()) if not m])
        assert MARK not in trained and "tool" not in trained
        assert appended.count(MARK) == 2  # two tool answers, attended to, loss mask 0
        assert 0 < lm.sum() < len(ids)
    # the native environment's step rewards are the reward 'env': 0.25 + 0.25 + 1.0
    assert exp.sampled.scores.per_fn["env"].tolist() == [1.5] * 4
    assert exp.sampled.scores.per_fn["used_a_tool"].tolist() == [1.0] * 4
    assert exp.advantages.shape == (4,)  # group-relative, one per episode

    exp.seconds["update"] = 0.0
    result = trainer.step_result(run, exp, {}, 1)
    m = result.metrics
    assert m["turns/mean"] == 3 and m["episode/stop_reason/done"] == 1.0
    # lengths count what the model sampled, not the tool answers
    assert m["rollout/len_mean"] == sum(e.num_sampled_tokens for e in eps) / 4
    assert m["episode/len_mean"] > m["rollout/len_mean"]
    assert all(isinstance(c, list) for s in result.samples for c in s["completions"])


def test_environment_factory_reward_and_instances_reach_the_score(files, monkeypatch):
    """TRL's contract: ``get_reward()`` (async here) is the reward 'env', and reward functions
    get the user's instances in ``environments``."""
    from peergrade.training import trainer

    monkeypatch.chdir(files)
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    cfg = load_config(
        None,
        [
            ("data.path", "data.jsonl"),
            ("env.factory", "my_env.py:Counter"),
            ("rewards", [{"name": "my_env.py:saw_environments"}]),
            ("rollout.group_size", 2),
            ("rollout.prompts_per_step", 2),
            ("rollout.max_completion_length", 60),
            ("algo.beta", 0.0),
            ("train.audit_rewards", "off"),
        ],
    )
    run = trainer.setup(cfg, Given(policy=Steered(inner, tok.eos_token_id, 6), tokenizer=tok))
    rows = [{"prompt": "3*4?", "answer": "12"}, {"prompt": "1*1?", "answer": "1"}]
    exp = trainer.collect(run, 1, rows)
    assert exp.sampled.scores.per_fn["env"].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert exp.sampled.scores.per_fn["saw_environments"].tolist() == [1.0] * 4
    assert exp.rewards.tolist() == [3.0, 3.0, 1.0, 1.0]


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("async_steps", [0, 1])  # 1: episodes run in the producer process
def test_train_with_tools_from_the_command_line(
    files, tool_model, monkeypatch, capsys, async_steps
):
    monkeypatch.chdir(files)
    rc = main(
        ["train", "--model", str(tool_model), "--data", "data.jsonl"]
        + ["--tools", "my_tools.py:multiply", "--reward", "my_reward.py:used_a_tool"]
        + ["--steps", "2", "-o", "run", *SMALL, "--env.max_turns", "3"]
        + ["--rollout.async_steps", str(async_steps)]
    )
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in (files / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "tools/call_frequency" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert [m.get("async/staleness_max") for m in steps] == ([0, 1] if async_steps else [None] * 2)
    for m in steps:
        assert m["turns/mean"] >= 1 and m["tools/call_frequency"] >= 0
        assert any(k.startswith("episode/stop_reason/") for k in m)
    samples = [json.loads(x) for x in (files / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        assert isinstance(s["prompt"], list) and s["prompt"][-1]["role"] == "user"
        for c in s["completions"]:
            assert isinstance(c, list) and c and c[0]["role"] == "assistant"
    saved = load_config(files / "run" / "config.yaml")
    assert saved.env.tools == [str(files / "my_tools.py") + ":multiply"]


COARSE = """
def coarse(completions, **kwargs):
    # binary, from the sampled text: about half of the groups of two agree
    text = ["".join(m["content"] for m in c if m["role"] == "assistant") for c in completions]
    return [float(sum(map(ord, t)) % 2) for t in text]
"""


def test_dynamic_sampling_fills_a_step_of_episodes(files, monkeypatch):
    """rollout.dynamic_sampling with an environment: extra rounds run their own episodes (rows
    from the dataset's keyed extra stream) and the kept groups' episodes are the batch."""
    from peergrade.training import trainer
    from peergrade.training.dynamic import informative_groups

    monkeypatch.chdir(files)
    write(files / "my_dyn.py", COARSE)
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    cfg = load_config(
        None,
        [
            ("data.path", "data.jsonl"),
            ("env.factory", "my_env.py:ToolFeedback"),
            ("rewards", [{"name": "my_dyn.py:coarse"}]),
            ("rollout.group_size", 2),
            ("rollout.prompts_per_step", 2),
            ("rollout.max_completion_length", 60),
            ("rollout.dynamic_sampling", True),
            ("rollout.max_rounds", 8),
            ("train.audit_rewards", "off"),
        ],
    )
    run = trainer.setup(cfg, Given(policy=Steered(inner, tok.eos_token_id, 6), tokenizer=tok))
    rounds = []
    for step in (1, 2, 3):
        exp = trainer.collect(run, step, [{"prompt": "3*4?"}, {"prompt": "5*6?"}])
        m = exp.sampled.dynamic
        rounds.append(m["dynamic/rounds"])
        eps = exp.sampled.samples.episodes
        assert len(eps) == 4 and m["dynamic/unfilled_groups"] == 0
        assert informative_groups(exp.rewards.view(2, 2)).all()
        C = exp.loss_mask.shape[1]
        for i, e in enumerate(eps):  # the batch is built from the kept episodes
            L = exp.input_ids.shape[1] - C
            assert exp.input_ids[i, L : L + len(e.completion_ids)].tolist() == e.completion_ids
    assert max(rounds) > 1  # some step needed rows beyond its own


HANGING_ENV = """
import time


class Stuck:
    def reset(self, row):
        time.sleep(600)

    def step(self, message):
        return [], True
"""


def test_an_environment_that_hangs_ends_the_run_with_one_named_line(
    files, tool_model, monkeypatch, capsys
):
    """env.timeout_s: a reset past its limit is one error line (class, method, row, limit),
    exit 2, within seconds, not a hang; the start-up line shows the limit (a step's limit:
    tests/envs/test_tools_guard.py)."""
    import time

    write(files / "stuck_env.py", HANGING_ENV)
    monkeypatch.chdir(files)
    start = time.monotonic()
    rc = main(
        ["train", "--model", str(tool_model), "--data", "data.jsonl"]
        + ["--env.factory", "stuck_env.py:Stuck", "--env.timeout_s", "1"]
        + ["--steps", "1", "-o", "run", *SMALL, "--train.display", "plain"]
    )
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert time.monotonic() - start < 120
    line = next(x for x in err.splitlines() if x.startswith("error:"))
    assert "environment Stuck.reset (rows[" in line
    assert "did not return within 1s (env.timeout_s; null = no limit)" in line
    assert "environment: reset and step may take 1 s each (env.timeout_s)" in out + err
