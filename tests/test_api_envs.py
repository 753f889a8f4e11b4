"""``GRPOTrainer(tools=..., environment_factory=...)``: TRL's in-memory tool functions and
environment class train on episodes through the same path as ``--tools`` / ``--env``, with the
same start-up checks, and ``GRPOConfig.max_tool_calling_iterations`` reaches ``env:``."""

from __future__ import annotations

import pytest

from peergrade import GRPOConfig, GRPOTrainer
from peergrade.config import ConfigError, EnvConfig
from peergrade.errors import PeergradeError
from peergrade.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model

ROWS = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in [(3, 4), (5, 6)]]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def undocumented(a: int) -> int:
    return a


class Counter:
    """TRL's environment_factory: reset(**row), a tool method, get_reward."""

    def reset(self, **row):
        self.count, self.answer = 0, row["answer"]

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return 2.0 if self.answer == "12" else 0.0


def used_a_tool(completions, **kwargs):
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


def args(tmp_path, **kw) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=24,
        max_steps=2,
        use_cpu=True,
        **kw,
    )


@pytest.fixture(scope="module")
def tiny():
    """A tiny Qwen2 with a tool-capable chat template, in memory."""
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    return model, tok


def test_max_tool_calling_iterations_maps_onto_env():
    assert GRPOConfig(max_steps=1, max_tool_calling_iterations=3).to_config().env == EnvConfig(
        max_tool_calling_iterations=3
    )
    assert GRPOConfig(max_steps=1).to_config().env.max_tool_calling_iterations is None


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(tools=[undocumented]), "docstring"),
        (dict(tools=multiply), "list of functions"),
        (dict(environment_factory=object), "reset"),
    ],
)
def test_bad_tools_are_refused_before_the_model_loads(kw, expected, tmp_path, monkeypatch):
    from peergrade import components, trainer

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the tools were checked")

    monkeypatch.setattr(trainer, "setup_models", no_load)
    monkeypatch.setattr(components, "load_tokenizer", no_load)
    with pytest.raises((PeergradeError, ConfigError), match=expected):
        GRPOTrainer(
            model="bundled", reward_funcs=used_a_tool, args=args(tmp_path), train_dataset=ROWS, **kw
        )


def test_environment_factory_adds_the_env_reward(tiny, tmp_path):
    model, tok = tiny
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=used_a_tool,
        args=args(tmp_path, max_tool_calling_iterations=2),
        train_dataset=ROWS,
        environment_factory=Counter,
    )
    assert [s.name for s in trainer._run.rewards] == ["used_a_tool", "env"]
    assert trainer._run.make_env.environment_class is Counter
    env = trainer._run.make_env(ROWS[0])
    assert env.max_iterations == 2 and isinstance(env.instance, Counter)
    assert sorted(env.registry) == ["bump"]


@pytest.mark.slow
def test_train_with_tools_and_environment_factory(tiny, tmp_path):
    model, tok = tiny
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=used_a_tool,
        args=args(tmp_path),
        train_dataset=ROWS,
        tools=[multiply],
        environment_factory=Counter,
    )
    trainer.train()
    steps = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(steps) == 2
    for h in steps:
        assert h["tools/call_frequency"] >= 0 and h["turns/mean"] >= 1
        # get_reward: 2.0 for the row whose answer is 12, else 0; one row of each per step
        assert h["rewards/env/mean"] == pytest.approx(1.0)


def test_a_dict_of_environment_classes_gives_the_env_reward_when_one_does():
    from peergrade.envs import make_env_from_objects
    from peergrade.envs.scoring import gives_reward

    class Plain:
        def reset(self, **row):
            pass

    make = make_env_from_objects([multiply], {"count": Counter, "plain": Plain})
    assert gives_reward(make.environment_class)
    assert not gives_reward({"plain": Plain})
    assert isinstance(make({**ROWS[0], "environment": "count"}).instance, Counter)
