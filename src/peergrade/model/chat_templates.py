"""Bundled chat templates for tool calling, and ``model.chat_template: FILE | NAME``.

Many small models a user can run on one GPU (SmolLM2-135M-Instruct among them) ship a chat
template that does not render tool schemas, or one whose tool format the model was never tuned
on. ``model.chat_template`` (TRL's ``chat_template_path``) replaces the tokenizer's template:
a Jinja file, or one of the names below. It is set on the tokenizer where the tokenizer is
prepared (``model.load.prepare_tokenizer``), so training, evaluation, the endpoint and every
checkpoint and export (``save_pretrained`` writes ``chat_template.jinja``, which
``AutoTokenizer`` reads back) all use it.

The bundled templates, each prefix-preserving (the episode runner's token deltas need that):

* ``hermes`` (alias ``qwen2.5``, ``chatml-tools``): ChatML framing (``<|im_start|>`` /
  ``<|im_end|>``: SmolLM2, Qwen2/2.5, the bundled tiny models), the tools' JSON schemas in the
  system turn inside ``<tools></tools>``, a call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, results in a user turn as
  ``<tool_response>`` blocks, as Qwen2.5's own template does. Parsed by
  ``envs.tools.parse_tool_calls(text, "hermes")``.
* ``llama3`` (alias ``llama3-json``): Llama 3.1's framing (``<|start_header_id|>`` /
  ``<|eot_id|>``, needs a Llama 3 tokenizer), the tool schemas in the system turn, a call as the
  whole assistant turn ``{"name": ..., "parameters": {...}}`` (several joined by ``"; "``; the
  turn's text beside calls is not rendered, as in Llama 3.1's template), results in ``ipython``
  turns. Parsed by ``parse_tool_calls(text, "llama3")``.

``tool_format(template)`` says which parser a template's calls need (``"hermes"`` unless the
template writes Llama 3's ``"parameters"`` calls), so a model's own Qwen2.5 or Llama 3.1
template gets the right parser too.

This module does not parse calls (``envs.tools``) or check templates (``envs.template``).
"""

from __future__ import annotations

from pathlib import Path

from peergrade.errors import InputError

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not (loop.first and tools) %}"
    "<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'user' or (m['role'] == 'assistant' and not m.get('tool_calls')) %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for tc in m['tool_calls'] %}"
    "{% set f = tc['function'] if tc['function'] is defined else tc %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}"
    "{% else %}{{ f['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n\n{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{% if tools %}{{ '\\n' }}\nYou have access to the following functions. To call a function, "
    "respond with only a JSON object in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m['tool_calls'] %}"
    "{% set f = tc['function'] if tc['function'] is defined else tc %}"
    "{% if not loop.first %}; {% endif %}"
    '{"name": {{ f[\'name\'] | tojson }}, "parameters": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}"
    "{% else %}{{ f['arguments'] | tojson }}{% endif %}}"
    "{% endfor %}<|eot_id|>"
    "{% elif m['role'] == 'tool' or m['role'] == 'ipython' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] or '' }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: name -> (template, the call format its calls are parsed in)
NAMED: dict[str, tuple[str, str]] = {
    "hermes": (HERMES_TEMPLATE, "hermes"),
    "qwen2.5": (HERMES_TEMPLATE, "hermes"),
    "chatml-tools": (HERMES_TEMPLATE, "hermes"),
    "llama3": (LLAMA3_TEMPLATE, "llama3"),
    "llama3-json": (LLAMA3_TEMPLATE, "llama3"),
}

#: the call formats ``envs.tools.parse_tool_calls`` reads
FORMATS = ("hermes", "llama3")


def resolve_chat_template(value: str | None, where: str = "model.chat_template") -> str | None:
    """The template text of ``value``: a bundled name (``NAMED``), a file holding a Jinja
    template (``.jinja`` or any text file; a tokenizer_config.json-style JSON with a
    ``chat_template`` key is read too), or None (keep the tokenizer's own). An InputError names
    the value and the choices."""
    if value is None or value == "":
        return None
    if value in NAMED:
        return NAMED[value][0]
    p = Path(value).expanduser()
    if p.is_dir():  # a tokenizer directory (TRL's chat_template_path takes one): its template
        found = [
            p / n for n in ("chat_template.jinja", "tokenizer_config.json") if (p / n).is_file()
        ]
        if not found:
            raise InputError(
                f"{where}={value!r}: a directory without chat_template.jinja or "
                "tokenizer_config.json"
            )
        p = found[0]
    if not p.is_file():
        raise InputError(
            f"{where}={value!r}: neither a bundled template ({', '.join(sorted(NAMED))}) nor a "
            "file (a Jinja chat template, e.g. chat_template.jinja)"
        )
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{where}={value!r}: cannot read the file: {e}") from e
    if p.suffix == ".json":
        import json

        try:
            text = json.loads(text)["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(
                f"{where}={value!r}: a .json file must hold an object with a 'chat_template' "
                f"string ({e})"
            ) from e
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{where}={value!r}: the file holds no template")
    return text


def tool_format(template: str | None) -> str:
    """The call format (``FORMATS``) a template renders assistant tool calls in: ``llama3``
    for Llama 3's ``{"name": ..., "parameters": ...}`` (its ``<|python_tag|>`` or
    ``"parameters"``, with no ``<tool_call>``), else ``hermes`` (also for a template that
    renders no calls at all: the bundled tiny models are taught that format)."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or '"parameters"' in t:
        return "llama3"
    return "hermes"


def format_tool_call(name: str, arguments: dict, fmt: str = "hermes") -> str:
    """A call as the model writes it in ``fmt`` (what the bundled template of that format
    renders for an assistant turn with only this call)."""
    import json

    if fmt == "hermes":
        return (
            "<tool_call>\n"
            + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            + "\n</tool_call>"
        )
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    raise ValueError(f"tool call format {fmt!r}: expected one of {', '.join(FORMATS)}")
