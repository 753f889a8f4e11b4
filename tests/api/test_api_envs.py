"""``GRPOTrainer(tools=..., environment_factory=...)``: TRL's in-memory tool functions and
environment class train on episodes through the same path as ``--tools`` / ``--env``, with the
same start-up checks, and ``GRPOConfig.max_tool_calling_iterations`` reaches ``env:``."""

from __future__ import annotations

import copy

import pytest

from peergrade import GRPOConfig, GRPOTrainer
from peergrade.config import ConfigError, EnvConfig
from peergrade.errors import PeergradeError
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model

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
    from peergrade.training import components, trainer

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


@pytest.mark.slow
def test_episodes_in_a_producer_process_train_as_in_a_producer_thread(tiny, tmp_path):
    """rollout.async_steps 1: the environments (TRL's class, its get_reward) and the tools run
    in the producer; a forked process and a thread log the same steps, to the last digit."""
    from test_trainer import comparable

    model, tok = tiny
    logged = {}
    for kind in ("thread", "process"):
        trainer = GRPOTrainer(
            model=copy.deepcopy(model),
            processing_class=tok,
            reward_funcs=used_a_tool,
            args=args(tmp_path / kind),
            train_dataset=ROWS,
            tools=[multiply],
            environment_factory=Counter,
        )
        trainer.config.rollout.async_steps = 1
        trainer.config.rollout.producer = kind
        trainer.train()
        logged[kind] = comparable(trainer.state.log_history)
    steps = [h for h in logged["process"] if "tools/call_frequency" in h]
    assert [h["async/staleness_max"] for h in steps] == [0, 1]
    assert all(h["rewards/env/mean"] == pytest.approx(1.0) for h in steps)
    assert logged["process"] == logged["thread"]


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


# ---------------------------------------------------------------- recorded for a resume

TOOLS_MODULE = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Counter:
    def reset(self, **row):
        self.count = 0

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return str(self.count)
'''


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """A module of tools on sys.path, as a user's own package would be."""
    import importlib

    (tmp_path / "pg_resume_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("pg_resume_tools")
    import sys

    sys.modules.pop("pg_resume_tools", None)


def test_in_memory_tools_are_recorded_so_a_command_line_resume_loads_them(
    tiny, tmp_path, importable
):
    from peergrade.config import load_run_config, to_yaml
    from peergrade.training.components import build_env

    model, tok = tiny
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=used_a_tool,
        args=args(tmp_path),
        train_dataset=ROWS,
        tools=[importable.multiply],
        environment_factory=importable.Counter,
    )
    assert trainer.config.env.tools == ["pg_resume_tools:multiply"]
    assert trainer.config.env.factory == "pg_resume_tools:Counter"
    # what `peergrade train --resume` reads back and builds its environments from
    (tmp_path / "config.yaml").write_text(to_yaml(trainer.config))
    cfg = load_run_config(str(tmp_path / "config.yaml"))
    env = build_env(cfg)(ROWS[0])
    assert env.registry["multiply"] is importable.multiply
    assert isinstance(env.instance, importable.Counter) and sorted(env.registry) == [
        "bump",
        "multiply",
    ]


def test_tools_that_cannot_be_imported_stop_a_command_line_resume(tiny, tmp_path, capsys):
    from peergrade.cli import main
    from peergrade.config import to_yaml

    def local_add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first term
            b: the second term
        """
        return a + b

    model, tok = tiny
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=used_a_tool,
        args=args(tmp_path),
        train_dataset=ROWS,
        tools=[multiply, local_add],
    )
    recorded = trainer.config.env.tools
    assert recorded[1].startswith("python-object:") and "local_add" in recorded[1], recorded
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_text(to_yaml(trainer.config))
    rc = main(["train", "--resume", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and err.count("\n") == 1, err
    # one line naming everything the command line cannot load: the tool and the in-memory rows
    assert "local_add" in err and "resume the run from Python" in err, err
    assert "train_dataset (2 rows)" in err, err


def test_in_memory_data_stops_a_command_line_resume_instead_of_training_the_default_task(
    tiny, tmp_path, capsys
):
    """A run given its rows as a list records them as in-memory data, not the default
    arithmetic task a command-line resume would otherwise quietly train on."""
    from peergrade.cli import main
    from peergrade.config import to_yaml

    model, tok = tiny
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=used_a_tool,
        args=args(tmp_path),
        train_dataset=ROWS,
        eval_dataset=ROWS,
    )
    assert trainer.config.data.path == "python-object:train_dataset (2 rows)"
    assert trainer.config.data.eval_path == "python-object:eval_dataset"
    capsys.readouterr()  # the start-up audit's warning about used_a_tool on single replies
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "config.yaml").write_text(to_yaml(trainer.config))
    rc = main(["train", "--resume", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert "data.path: python-object:train_dataset (2 rows)" in err, err
    assert "--data FILE" in err, err


@pytest.mark.parametrize("kw", [dict(tools=[multiply]), dict(environment_factory=Counter)])
def test_a_template_that_hides_the_tools_is_an_error_before_the_model_loads(
    kw, tmp_path, monkeypatch
):
    """The bundled model's template renders no tool schemas: with tools the model would never
    see them (0 calls, no warning). An error naming the template and the way out, before
    the model loads; env.unrendered_tools (a model that knows its tools) lets it run."""
    from peergrade.envs.template import renders_tools
    from peergrade.model.load import BUNDLED_MODEL, load_tokenizer
    from peergrade.training import trainer

    tok = load_tokenizer(str(BUNDLED_MODEL))
    shown = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    from peergrade.envs.tools import tool_schema

    assert not renders_tools(tok, [tool_schema(multiply)])
    assert renders_tools(shown, [tool_schema(multiply)])

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the template was checked")

    monkeypatch.setattr(trainer, "setup_models", no_load)
    with pytest.raises(
        PeergradeError,
        match=r"tiny-arith does not render tool schemas.*"
        r"(multiply|bump).*env.unrendered_tools",
    ):
        GRPOTrainer(
            model="bundled", reward_funcs=used_a_tool, args=args(tmp_path), train_dataset=ROWS, **kw
        )
    with pytest.raises(AssertionError, match="loaded before the template"):  # got past it
        GRPOTrainer(
            model="bundled",
            reward_funcs=used_a_tool,
            train_dataset=ROWS,
            args=args(tmp_path, peergrade={"env.unrendered_tools": True}),
            **kw,
        )


def test_episode_start_up_line_shows_the_prompt_the_model_sees():
    """Episode mode's start-up line renders the opening as the episodes do: the chat template
    with the tool schemas, whatever data.use_chat_template says for single replies."""
    from peergrade.config import load_config
    from peergrade.envs import make_env_from_objects
    from peergrade.rewards import make_reward_specs
    from peergrade.tasks.files import FileTask
    from peergrade.training.components import run_header

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    cfg = load_config(None, [("data.use_chat_template", False)])
    make_env = make_env_from_objects([multiply], None)
    (scorer,) = make_reward_specs([(used_a_tool, 1.0, {}, "used_a_tool")])
    lines = run_header(cfg, FileTask(data=ROWS), tok, scorer, "the only reward", make_env)
    (line,) = [x for x in lines if x.startswith("episodes:")]
    assert "with the schemas of multiply" in line and "<tools>" in line
    assert "What is" in line and "<|im_start|>assistant" in line


def test_episode_start_up_line_says_when_the_template_hides_the_tools():
    from peergrade.config import load_config
    from peergrade.envs import make_env_from_objects
    from peergrade.model.tiny import COMPACT_TOOL_CHAT_TEMPLATE
    from peergrade.rewards import make_reward_specs
    from peergrade.tasks.files import FileTask
    from peergrade.training.components import run_header

    tok = build_char_tokenizer(chat_template=COMPACT_TOOL_CHAT_TEMPLATE)
    cfg = load_config(None, [("env.unrendered_tools", True)])
    (scorer,) = make_reward_specs([(used_a_tool, 1.0, {}, "used_a_tool")])
    lines = run_header(
        cfg,
        FileTask(data=ROWS),
        tok,
        scorer,
        "the only reward",
        make_env_from_objects([multiply], None),
    )
    (line,) = [x for x in lines if x.startswith("episodes:")]
    assert "shows no tool schemas: the model must know multiply already" in line
