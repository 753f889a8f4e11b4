"""Episodes: a model talks to an environment (tools, feedback) over several turns, token-exact.

- ``protocol``: the native environment protocol (``reset(row)`` -> messages, ``step(message)`` ->
  ``Step``), sync or async.
- ``template``: chat-template token deltas and the start-up check that a template is
  prefix-preserving.
- ``tools``: TRL's contract (``tools=[fn, ...]``, ``environment_factory``,
  ``max_tool_calling_iterations``) as a native environment: schemas, Hermes/Qwen2 and Llama 3
  JSON tool-call parsing (the chat template's format), tool execution.
- ``runner``: ``run_episodes``, which samples the model's turns batched with one KV cache per
  episode kept across turns, and returns ``Episode`` records with separate attention and loss masks.
- ``load``: ``make_env_from_specs``, the environment factory named by ``--tools FILE:fn`` /
  ``--env FILE:Class``, loaded and checked before a model loads (``make_env_from_objects``:
  the same from the functions and class themselves).
- ``scoring``: ``reward_inputs``, TRL's reward-function arguments for episodes (completions as
  message lists, ``environments``).
- ``verifiers``: ``--env verifiers:MODULE``, a verifiers (0.4) environment's tasks, Python
  Toolsets, stops and rewards as a native environment (its own harness programs do not run here).
- ``calculator``: the calculator demo's safe ``calculate`` tool and ``Calculator`` environment
  (``configs/calculator.yaml``).
- ``python_tool``: ``run_python``, a Python-code tool whose programs run in the code sandbox
  (fail closed: its self-test runs when the tool is loaded).

The trainer (``env:`` / ``--tools`` / ``--env``) builds its factory with ``make_env_from_specs``
(the Python API with ``make_env_from_objects``),
samples with ``peergrade.generation.sample`` (the episode engine, ``generation.episodes``); this package knows nothing of
the trainer. Not done here: sandboxed code tools. See
docs/environments.md.
"""

from peergrade.envs.episode import Episode, episode_metrics
from peergrade.envs.load import make_env_from_objects, make_env_from_specs
from peergrade.envs.protocol import Environment, Step
from peergrade.envs.scoring import reward_inputs
from peergrade.envs.template import TemplateError, check_template
from peergrade.envs.tools import ToolEnvironment, parse_tool_calls, tool_environment_factory

__all__ = [
    "Environment",
    "Episode",
    "Step",
    "TemplateError",
    "ToolEnvironment",
    "check_template",
    "episode_metrics",
    "make_env_from_objects",
    "make_env_from_specs",
    "parse_tool_calls",
    "reward_inputs",
    "tool_environment_factory",
]
