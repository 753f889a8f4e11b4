"""Supervised warm-up (``peergrade sft``): teach a model a task's answer format from examples.

Each example is the task's prompt rendered with the chat template, followed by the reference
answer and the end-of-turn token; the loss is the mean cross-entropy over the answer tokens
only (prompt tokens are context, not targets). This is how the bundled demo model is made:
a fresh tiny Qwen2 model trained *deliberately short of mastery*, so that GRPO has something to
find (see docs/getting-started.md, "The bundled model").

Deterministic for a fixed seed, torch version and thread count. The output directory is written
to a temporary sibling and renamed, so an interrupted run never leaves a half-written model.
With ``tool_fraction`` (``peergrade sft --tool-fraction F``, arithmetic only), that share of
the examples are calculator episodes instead (``envs.calculator.calculator_turns``: the call,
the tool's result, the answer), tokenised exactly as the episode runner builds them: the model's
turns as their own tokens, the tool's answer as the chat template's token delta
(``envs.template.turn_delta``), which gets no loss; every prompt is rendered with the
calculator's tool schemas, as the episodes are (templates that show tools in the system turn,
e.g. Qwen2.5's, show them to the warm-up too). This is how the calculator demo's model
(``assets/tiny-calc``) is made: it calls the tool on some problems and answers others in its head.

With ``tools`` (``peergrade sft --tools FILE:fn``), every example is a warm-up episode built
from the user's own tools (``tool_warmup_rows``): a prompt (a row of ``--data`` with its
``call``, or one written from the tool's schema and docstring with arguments drawn from the
schema's types), the model's call in the format the chat template writes
(``model.chat_templates.format_tool_call``), the tool's real result as the environment appends
it (its text, no loss), and the final answer (the row's ``answer``, else the result). It teaches
the format, not the task. ``chat_template`` (``--chat-template``) replaces the tokenizer's
template first and is saved with the output, so GRPO renders prompts as the warm-up did.

This module is not a general SFT trainer (no packing, no LoRA, no eval loop).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peergrade.tasks import load_task, render_prompt
from peergrade.training.checkpoint import RunDirError, apply_umask, check_writable


def sft_batch(
    rows: list[dict], tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None
):
    """(input_ids [B, L], attention_mask [B, L], labels [B, L]) with labels = -100 off the answer.

    Right-padded: prompt tokens then answer + eos; labels hold the answer + eos token ids.
    ``tools``: the tool schemas every prompt is rendered with, as episodes render them (a
    template that shows tools in the system turn shows them to the bare answers too).
    """
    seqs, labels = [], []
    for row in rows:
        if "turns" in row:
            s, lab = episode_example(row, tokenizer, system_prompt, tools)
            seqs.append(s)
            labels.append(lab)
            continue
        if tools:
            from peergrade.envs.template import render
            from peergrade.tasks.prompts import to_messages

            messages = to_messages(row["prompt"], system_prompt)
            p_ids = render(tokenizer, messages, add_generation_prompt=True, tools=tools)
        else:
            prompt = render_prompt(row["prompt"], tokenizer, system_prompt=system_prompt)
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        seqs.append(p_ids + a_ids)
        labels.append([-100] * len(p_ids) + a_ids)
    L = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), L), dtype=torch.long)
    label_t = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        label_t[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention_mask, label_t


def episode_example(
    row: dict, tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None
):
    """(ids, labels) of an episode row: ``row["turns"]`` are the messages after the prompt. The
    model's turns are labels (their tokens and eos); what follows each (tool results, the next
    generation prompt) is the template's token delta, context only. ``tools``: the schemas the
    episode runner renders the conversation with (the environment's ``tools``)."""
    from peergrade.envs.template import render, turn_delta
    from peergrade.tasks.prompts import to_messages

    eos = tokenizer.eos_token_id
    history = to_messages(row["prompt"], system_prompt)
    ids = render(tokenizer, history, add_generation_prompt=True, tools=tools)
    labels = [-100] * len(ids)
    pending: list[dict] = []  # environment messages since the last model turn
    for m in row["turns"]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            delta = turn_delta(tokenizer, history, pending, eos_ids=[eos], tools=tools)
            ids, labels = ids + delta, labels + [-100] * len(delta)
            history, pending = history + pending, []
        turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [eos]
        ids, labels = ids + turn, labels + turn
        history.append(m)
    return ids, labels


def with_tool_turns(rows, fraction: float, seed: int):
    """``rows`` (arithmetic problems) with a ``fraction`` of them, drawn with ``seed``, turned
    into solved calculator episodes (``turns``)."""
    import random

    from peergrade.envs.calculator import calculator_turns

    rng = random.Random(f"sft/tool-fraction/{seed}")
    for row in rows:
        if rng.random() < fraction:
            names = {"a": row["a"], "b": row["b"]}  # as envs.calculator.Calculator binds them
            row = {**row, "turns": calculator_turns(f"a{row['op']}b", names)}
        yield row


_WORDS = ("alpha", "blue", "river", "seven", "paris", "meter", "cloud", "north")


def _draw_argument(schema: dict, rng) -> object:
    """A value of a JSON-schema type (an enum's member when it has one)."""
    if schema.get("enum"):
        return rng.choice(list(schema["enum"]))
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer":
        return rng.randint(1, 999)
    if kind == "number":
        return round(rng.uniform(0, 100), rng.choice((0, 1, 2)))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_draw_argument(schema.get("items") or {}, rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {}
    return rng.choice(_WORDS)


def _schema_prompt(fn: dict, args: dict) -> str:
    """A request for a call of the tool ``fn`` (its schema) with ``args``, from its description."""
    what = (fn.get("description") or fn["name"]).strip().split("\n")[0].rstrip(".")
    given = ", ".join(f"{k} = {json.dumps(v)}" for k, v in args.items())
    return f"{what}: {given}." if given else f"{what}."


def schema_request(schemas: dict[str, dict], rng) -> tuple[str, dict, str]:
    """(tool name, arguments, prompt): a request for a call of one of ``schemas`` (tool name ->
    the ``function`` part of its schema) drawn with ``rng``, the arguments drawn from its types
    and the prompt written from its description: the warm-up's prompts without ``rows``, and
    ``peergrade doctor``'s (``planning.doctor``)."""
    name = rng.choice(sorted(schemas))
    props = schemas[name].get("parameters", {}).get("properties", {})
    args = {k: _draw_argument(v, rng) for k, v in props.items()}
    return name, args, _schema_prompt(schemas[name], args)


def tool_warmup_rows(fns, *, fmt: str, seed: int, rows: list[dict] | None = None):
    """Endless warm-up episodes (``{"prompt", "turns"}``) calling the tools ``fns`` (functions
    with schemas): ``rows`` (each with ``prompt`` and ``call``: ``{"name", "arguments"}``, and an
    optional ``answer``) in a seeded order, else prompts written from each tool's schema with
    arguments drawn from its types. The call is written in ``fmt`` (the chat template's call
    format); the tool really runs, and its result is the tool message's text as the
    environment sends it; the final answer is ``answer`` or that result."""
    import random

    from peergrade.envs.tools import _result_text, check_result, tool_schema
    from peergrade.errors import InputError
    from peergrade.model.chat_templates import format_tool_call

    registry = {fn.__name__: fn for fn in fns}
    schemas = {fn.__name__: tool_schema(fn, "--tools")["function"] for fn in fns}
    for i, row in enumerate(rows or []):
        c = row.get("call") if isinstance(row, dict) else None
        if (
            not isinstance(row, dict)
            or "prompt" not in row
            or not isinstance(c, dict)
            or c.get("name") not in registry
            or not isinstance(c.get("arguments", {}), dict)
        ):
            raise InputError(
                f"warm-up row {i}: expected {{'prompt': ..., 'call': {{'name': one of "
                f"{sorted(registry)}, 'arguments': {{...}}}}, 'answer' (optional)}}, got "
                f"{str(row)[:200]}"
            )
    rng = random.Random(f"sft/tools/{seed}")
    order: list[dict] = []
    while True:
        if rows:
            if not order:
                order = list(rows)
                rng.shuffle(order)
            row = order.pop()
            name, args = row["call"]["name"], dict(row["call"].get("arguments") or {})
            prompt, answer = row["prompt"], row.get("answer")
        else:
            name, args, prompt = schema_request(schemas, rng)
            answer = None
        try:
            result = check_result(name, registry[name](**args))
        except InputError:
            raise
        except Exception as e:  # the tool's own failure: the model reads it, as in an episode
            result = {"error": str(e) or type(e).__name__}
        text, _ = _result_text(result, None)
        yield {
            "prompt": prompt,
            "turns": [
                {"role": "assistant", "content": format_tool_call(name, args, fmt)},
                {"role": "tool", "name": name, "content": text},
                {"role": "assistant", "content": str(text if answer is None else answer)},
            ],
        }


def calculator_tools() -> list[dict]:
    """The tool schemas a calculator episode is rendered with (``envs.calculator.Calculator``'s,
    as the episode runner reads them from the environment)."""
    from peergrade.envs import make_env_from_objects
    from peergrade.envs.calculator import Calculator

    return make_env_from_objects([], Calculator)({"a": 0, "b": 0}).tools


def sft_loss(model, input_ids, attention_mask, labels) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@dataclass(frozen=True)
class SFTSettings:
    """What ``run_sft`` trains on and how (``peergrade sft``'s options); checked when built.

    task, task_options: the built-in task whose answers are taught; steps: optimizer steps;
    batch_size: examples per step; lr: AdamW's learning rate; seed; threads: torch CPU threads
    (0: torch's default); model_sizes: ``build_tiny_model`` sizes for ``init`` (None: its
    defaults); tool_fraction: share of examples taught as calculator episodes (arithmetic
    only); tools: the user's tools ('file.py:fn' / 'module:fn' specs or the functions): every
    example is a warm-up episode calling them (``tool_warmup_rows``); data: with ``tools``, a
    file of rows with ``prompt``, ``call`` and an optional ``answer``; chat_template: a bundled
    name or a file replacing the tokenizer's template (``model.chat_template``), saved with the
    model.
    """

    task: str = "arithmetic"
    task_options: dict = field(default_factory=dict)
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    threads: int = 0
    model_sizes: dict | None = None
    tool_fraction: float = 0.0
    tools: tuple = ()
    data: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "task_options", dict(self.task_options or {}))
        object.__setattr__(self, "tools", tuple(self.tools or ()))
        steps, batch_size, lr = self.steps, self.batch_size, self.lr
        if steps < 1 or batch_size < 1 or lr <= 0:
            raise ValueError(
                f"sft: steps and batch_size must be >= 1 and lr > 0 (got {steps}, {batch_size}, {lr})"
            )
        tool_fraction = self.tool_fraction
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"sft: tool_fraction must be in [0, 1] (got {tool_fraction})")
        if self.tools and tool_fraction:
            raise ValueError(
                "sft: --tools makes every example a warm-up episode with your tools; "
                "--tool-fraction (the calculator's episodes) cannot be added to it"
            )
        if tool_fraction and self.task != "arithmetic":
            raise ValueError(
                "sft: tool_fraction needs the arithmetic task (its calculator episodes), "
                f"got {self.task!r}"
            )


def _check_out_dir(out_path: Path, overwrite: bool) -> None:
    """Raise for an occupied or unwritable output dir, before any model loads."""
    if out_path.exists() and any(out_path.iterdir()) and not overwrite:
        raise RunDirError(f"output dir {str(out_path)!r} exists and is not empty; pass --overwrite")
    check_writable(out_path, "output dir")  # before any model is built or loaded


def _load_tools(tools) -> list:
    """The tool functions of ``tools`` (specs are loaded as ``env.tools`` are), schema-checked."""
    from peergrade.envs.load import load_object
    from peergrade.envs.tools import tool_schema

    fns = [load_object(t, "--tools") if isinstance(t, str) else t for t in tools or []]
    for fn in fns:
        tool_schema(fn, "--tools")
    return fns


def _read_warmup_rows(path: str) -> list[dict]:
    """The rows of a warm-up data file (JSONL, JSON, CSV, Parquet or a saved dataset)."""
    from peergrade.tasks.files import read_rows

    numbered, _ = read_rows(path)
    return [row for _, row in numbered]


def _start_model(init, model, *, seed, model_sizes, tool_fraction, chat_template=None):
    """(model, tokenizer): a fresh tiny ``init`` architecture, or the model directory ``model``."""
    from peergrade.model.load import load_model, load_tokenizer, prepare_tokenizer
    from peergrade.model.tiny import (
        COMPACT_CHAT_TEMPLATE,
        COMPACT_TOOL_CHAT_TEMPLATE,
        build_char_tokenizer,
        build_tiny_model,
    )

    if init is not None:
        sizes = {"hidden_size": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2}
        sizes.update(model_sizes or {})
        template = COMPACT_TOOL_CHAT_TEMPLATE if tool_fraction else COMPACT_CHAT_TEMPLATE
        tok = build_char_tokenizer(chat_template=template)
        net, tok = build_tiny_model(init, tok, seed=seed, **sizes)
        tok = prepare_tokenizer(tok, chat_template=chat_template)
    else:
        from peergrade.model.load import resolve_model_path

        tok = load_tokenizer(resolve_model_path(model), chat_template)
        net = load_model(resolve_model_path(model), dtype="float32", device="cpu")
    return net, tok


def _save_model(out_path: Path, net, tok, info: dict) -> None:
    """Write the model, tokenizer and ``sft_info.json`` to a temporary sibling, then rename it
    onto ``out_path``: an interrupted run never leaves a half-written model."""
    from peergrade.model.load import save_tokenizer

    tmp = out_path.with_name(out_path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    net.save_pretrained(tmp)
    save_tokenizer(tok, tmp)
    (tmp / "sft_info.json").write_text(json.dumps(info, indent=2) + "\n")
    apply_umask(tmp)  # safetensors writes its file 0600
    if out_path.exists():
        shutil.rmtree(out_path)
    tmp.rename(out_path)


def run_sft(
    *,
    out: str,
    init: str | None,
    model: str | None,
    settings: SFTSettings | None = None,
    overwrite: bool = False,
    log=print,
    on_step=None,
) -> Path:
    """Train and save to ``out``; returns the path. ``init`` = tiny arch name, or ``model`` = dir.

    ``settings``: the task, steps, batch size, learning rate, seed, tools and the rest
    (``SFTSettings``; None: its defaults, the arithmetic task for 300 steps). ``overwrite``:
    replace a non-empty ``out``. ``log``: where progress lines go; ``on_step(step, net, tok)``
    runs after each optimizer step."""
    st = settings if settings is not None else SFTSettings()
    out_path = Path(out)
    _check_out_dir(out_path, overwrite)
    fns = _load_tools(st.tools)  # the user's files: every problem before a model loads
    warm_rows = _read_warmup_rows(st.data) if st.data else None
    if st.threads:
        torch.set_num_threads(st.threads)
    the_task = None if fns else load_task(st.task, **st.task_options)
    torch.manual_seed(st.seed)
    net, tok = _start_model(
        init,
        model,
        seed=st.seed,
        model_sizes=st.model_sizes,
        tool_fraction=st.tool_fraction or bool(fns),
        chat_template=st.chat_template,
    )
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=st.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = 20  # fixed, so a run of N steps is the prefix of a longer one
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm))
    rows, system_prompt, schemas = _examples(st, fns, the_task, tok, warm_rows, log)
    steps = st.steps
    t0 = time.perf_counter()
    loss_ema = None
    for step in range(1, steps + 1):
        batch = [next(rows) for _ in range(st.batch_size)]
        ii, am, lab = sft_batch(batch, tok, system_prompt, schemas)
        loss = sft_loss(net, ii, am, lab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        if on_step is not None:
            on_step(step, net, tok)
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"sft step {step}/{steps}  loss {loss_ema:.4f}  ({time.perf_counter() - t0:.0f} s)")
    net.eval()
    info = {
        "task": None if fns else st.task,
        "task_options": {} if fns else st.task_options,
        **({"tools": [getattr(f, "__name__", str(f)) for f in fns]} if fns else {}),
        **({"data": st.data} if st.data else {}),
        **({"chat_template": st.chat_template} if st.chat_template else {}),
        "steps": steps,
        "batch_size": st.batch_size,
        "lr": st.lr,
        "seed": st.seed,
        "init": init,
        "base_model": model,
        **({"tool_fraction": st.tool_fraction} if st.tool_fraction else {}),
        "final_loss_ema": loss_ema,
        "torch": torch.__version__,
    }
    _save_model(out_path, net, tok, info)
    log(f"saved {out_path}")
    return out_path


def _examples(st: SFTSettings, fns: list, the_task, tok, warm_rows, log):
    """(the training rows, the system prompt, the tool schemas prompts are rendered with): the
    tools' warm-up episodes with ``fns``, else the task's rows (some turned into calculator
    episodes with ``tool_fraction``)."""
    schemas = None
    system_prompt = None
    if fns:
        from peergrade.envs.tools import tool_schema
        from peergrade.model.chat_templates import tool_format

        fmt = tool_format(tok.chat_template)
        rows = tool_warmup_rows(fns, fmt=fmt, seed=st.seed, rows=warm_rows)
        schemas = [tool_schema(fn) for fn in fns]
        log(f"sft: warm-up episodes calling {', '.join(f.__name__ for f in fns)} ({fmt} calls)")
    else:
        rows = the_task.train_rows(st.seed)
        system_prompt = the_task.system_prompt
    if st.tool_fraction:
        rows = with_tool_turns(rows, st.tool_fraction, st.seed)
        schemas = calculator_tools()
    return rows, system_prompt, schemas
