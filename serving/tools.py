"""Tool calling: the tool-call format of a model family, its prompt, its grammar, and parsing its output.

    format_of(chat_template)      hermes (Qwen/Hermes <tool_call> JSON), llama3 (Llama 3.1 JSON), mistral ([TOOL_CALLS])
    prepare_messages(...)         conversations with tools, tool results and earlier calls, in the template's terms
    tool_grammar(...)             tool_choice required / a named function as a Lark grammar (engine/grammar.py)
    parse_tool_calls(fmt, text)   the model's output -> (content, [calls]) in OpenAI's shape

A template that does not know tools (SmolLM2's) gets them as a Hermes-style system message, and earlier calls
and results as text, so every model can call tools; the template's own format wins when it has one.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cpuserve.engine.errors import InvalidRequest
from cpuserve.engine.grammar import JSON_OPTIONS, grammar_of
from cpuserve.serving.protocol import RequestError

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ARGS_KEY = {HERMES: "arguments", LLAMA3: "parameters", MISTRAL: "arguments"}


# -- the OpenAI request shapes ------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str  # checked by check_tools, as for gRPC
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema when tool_choice enforces a call


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None) -> str | None:
    """Validate tools (OpenAI's shape, as dicts) and tool_choice together, for both APIs (request_model.py).

    Returns the one function a call must use, when tool_choice names one. Errors name the field, e.g.
    tools.1.function.name, tools.0.function.parameters, tool_choice.
    """
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        f, where = tool["function"], f"tools.{i}.function"
        if not _NAME.fullmatch(f["name"]):
            raise RequestError(f"{where}.name={f['name']!r}: use 1 to 64 letters, digits, _ or -", f"{where}.name")
        if f["name"] in names:
            raise RequestError(f"{where}.name: function {f['name']!r} is given twice", f"{where}.name")
        names.append(f["name"])
        try:
            grammar_of("json_schema", json.dumps(f.get("parameters") or {"type": "object"}))
        except InvalidRequest as e:
            raise RequestError(f"{where}.parameters: {e.message.split(': ', 1)[-1]}", f"{where}.parameters") from None
    if choice is None:
        return None
    named = isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(
        choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
    if not (named or choice in ("none", "auto", "required")):
        raise RequestError(f"tool_choice={json.dumps(choice)[:80]}: use none, auto, required or "
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if choice != "none" and not names:
        raise RequestError(f"tool_choice={json.dumps(choice)} needs tools", "tool_choice")
    if isinstance(choice, str):
        return None
    name = choice["function"]["name"]
    if name not in names:
        raise RequestError(f"tool_choice names {name!r}, which is not among tools: {names}", "tool_choice")
    return name


# -- formats, prompts, grammars, parsing ---------------------------------------------------------------------
def format_of(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (Hermes when it teaches none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return LLAMA3
    return HERMES


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def prepare_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     knows_tools: bool) -> list[dict[str, Any]]:
    """Messages as the template renders them: arguments as objects (Hugging Face's convention); for a template
    that knows no tools, the tools in a system message and calls/results as Hermes text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = [{"type": "function", "id": c.get("id"),
                  "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in m.pop("tool_calls", None) or []]
        if knows_tools:
            if calls:
                m["tool_calls"] = calls
            m["content"] = m.get("content") or ""
        elif calls:
            text = "".join(f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}'
                           "\n</tool_call>\n" for c in calls)
            m["content"] = (m.get("content") or "") + text
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not knows_tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        system = ("You may call one or more functions to assist with the user query. The functions:\n<tools>\n"
                  f"{listing}\n</tools>\nTo call a function, answer with a JSON object of its name and arguments "
                  'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                  "<args-json-object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def tool_grammar(fmt: str, tools: list[dict[str, Any]], only: str | None, parallel: bool,
                 mistral_token_id: int | None = None) -> str:
    """A Lark grammar whose every sentence is one call (or several, when parallel) of the allowed tools."""
    key = _ARGS_KEY[fmt]
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 key: t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False}
               for t in tools if only is None or t["function"]["name"] == only]
    body = "body: %json " + json.dumps({"anyOf": options, "x-guidance": JSON_OPTIONS})
    def more(separator: str, item: str) -> str:  # further calls, when parallel ones are allowed
        return f' ("{separator}" {item})*' if parallel else ""

    if fmt == HERMES:
        start = f'start: call{more(chr(92) + "n", "call")}\ncall: "<tool_call>\\n" body "\\n</tool_call>"'
    elif fmt == LLAMA3:
        start = f'start: body{more("; ", "body")}'
    else:
        head = f"<[{mistral_token_id}]>" if mistral_token_id is not None else '"[TOOL_CALLS]"'
        start = f'start: {head} "[" body{more(", ", "body")} "]"'
    return f"{start}\n{body}"


def parse_tool_calls(fmt: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls or None, OpenAI tool_calls); text without a well-formed call is all content."""
    raw: list[Any] = []
    content = text
    if fmt == HERMES:
        start = text.find("<tool_call>")
        if start >= 0:
            content = text[:start]
            raw = [_json(b) for b in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[start:], re.S)]
    elif fmt == LLAMA3:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            raw, content = [_json(b) for b in body.split("; ")], ""
    else:
        start = text.find("[TOOL_CALLS]")
        if start >= 0:
            content = text[:start]
            listed = _json(text[start + len("[TOOL_CALLS]"):].strip())
            raw = listed if isinstance(listed, list) else [listed]
    calls = []
    for r in raw:
        if not (isinstance(r, dict) and isinstance(r.get("name"), str)):
            return text, []  # not a call after all: the model wrote text that looks like one
        args = r.get(_ARGS_KEY[fmt], r.get("arguments", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": r["name"], "arguments": json.dumps(args)}})
    return (content.strip() or None) if calls else text, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
