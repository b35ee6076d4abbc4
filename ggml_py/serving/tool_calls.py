"""OpenAI tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) in a generic JSON format that any chat template
can carry: the tools are described in a system message, and the answer is one JSON object, constrained by a JSON
schema (models/grammar.py), that is either `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or (with
`tool_choice` "auto") `{"response": "text"}`. The server parses it into OpenAI's `tool_calls` (ids, arguments as
JSON strings) with finish_reason "tool_calls", or into the message's content.

The history is rendered back the same way: an assistant message's `tool_calls` become the JSON object it would have
written, and `tool` messages become user messages holding `{"tool_response": {"tool_call_id", "name", "content"}}`
(consecutive ones merged, so templates that insist on alternating roles accept them).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ggml_py.models.grammar import GrammarError, json_schema_grammar
from ggml_py.serving.http_common import BadRequest

MAX_TOOLS = 128
# calls in one answer (parallel_tool_calls): a small model repeats a call until max_tokens when nothing stops it
MAX_PARALLEL_CALLS = 4


@dataclass
class ToolPlan:
    """What a request's tools ask for: the functions, which may be called ("auto", "required", or one name), and
    whether several calls may come in one answer."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"}
    choice: str  # "auto", "required" or "named"
    parallel: bool

    def schema(self) -> dict[str, Any]:
        """The JSON schema every answer follows."""
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        call_list: dict[str, Any] = {"type": "array", "items": items, "minItems": 1,
                                     "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
        tool_calls = {"type": "object", "properties": {"tool_calls": call_list}, "required": ["tool_calls"],
                      "additionalProperties": False}
        if self.choice != "auto":
            return tool_calls
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        return {"anyOf": [tool_calls, response]}

    def grammar(self) -> str:
        try:
            return json_schema_grammar(self.schema())
        except GrammarError as e:
            raise BadRequest(f"tools: {e}", "tools") from None

    def system_prompt(self) -> str:
        tools = json.dumps([{"name": f["name"], "description": f.get("description", ""),
                             "parameters": f["parameters"]} for f in self.functions], ensure_ascii=False)
        many = "one or more tools" if self.parallel else "one tool"
        if self.choice == "auto":
            how = (f'To call {many}, answer with {{"tool_calls": [{{"name": <tool name>, "arguments": {{...}}}}]}}; '
                   'to answer directly, with {"response": <your answer>}.')
        else:
            how = f'Call {many}: answer with {{"tool_calls": [{{"name": <tool name>, "arguments": {{...}}}}]}}.'
        return f"You can use these tools:\n{tools}\nAnswer with one JSON object. {how}"


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The request's tools and tool_choice (OpenAI's shapes; the legacy `functions` / `function_call` too), None
    when no tool may be called. Every bad value is a BadRequest naming its field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    legacy = tools is None and choice is None and (body.get("functions") is not None
                                                   or body.get("function_call") is not None)
    if legacy:  # the deprecated functions API: the same, without the "type": "function" wrapper
        tools = [{"type": "function", "function": f} for f in _list(body.get("functions"), "functions")]
        choice = body.get("function_call")
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice}
    field = "functions" if legacy else "tools"
    cfield = "function_call" if legacy else "tool_choice"
    tools = _list(tools, field)
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest(f"{cfield} {json.dumps(choice)} needs {field}", cfield)
        return None
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"{field} has {len(tools)} tools; at most {MAX_TOOLS} are accepted", field)
    functions, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f'{field}[{i}] must be {{"type": "function", "function": {{"name": ..., '
                             '"parameters": {...}}}', field)
        if f["name"] in names:
            raise BadRequest(f"{field}[{i}]: the name {f['name']!r} is used twice", field)
        names.add(f["name"])
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"{field}[{i}].parameters must be a JSON schema (an object)", field)
        desc = f.get("description", "")
        functions.append({"name": f["name"], "description": desc if isinstance(desc, str) else "",
                          "parameters": params})
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto", parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(functions, "required", parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise BadRequest(f'{cfield} must be "none", "auto", "required" or {{"type": "function", "function": '
                         '{"name": ...}}', cfield)
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise BadRequest(f"{cfield} names {name!r}, which is not one of the {field}", cfield)
    return ToolPlan(chosen, "named", False)


def _list(v: Any, field: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise BadRequest(f"{field} must be a list", field)
    return v


def render_history(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, str]]:
    """Messages as the chat template takes them (role and content strings): the tools' system prompt first (merged
    into a leading system message), assistant tool calls and tool results written as the generic format has them."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["name"], "arguments": c["arguments"]} for c in m["tool_calls"]]
            content = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        elif role == "tool":
            resp = {"tool_call_id": m.get("tool_call_id"), "content": content}
            if m.get("name"):
                resp["name"] = m["name"]
            content = json.dumps({"tool_response": resp}, ensure_ascii=False)
            if out and out[-1].get("_tool"):  # results of several calls: one message
                out[-1]["content"] += "\n" + content
                continue
            out.append({"role": "user", "content": content, "_tool": "1"})
            continue
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if plan is not None:
        prompt = plan.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse_answer(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A generic-format answer: (content, tool_calls in OpenAI's shape). A text answer cut by max_tokens is the
    text so far; other text that is not the format (calls cut short, a stop string) is returned as it is."""
    try:
        obj = json.loads(text)
    except ValueError:
        return _cut_response(text), []
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        calls = []
        for c in obj["tool_calls"]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return text, []
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": c["name"],
                                       "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}})
        return None, calls
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []


_RESPONSE = '{"response": "'


def response_so_far(text: str) -> str | None:
    """The text of a text answer (`{"response": "...`) from the start of its JSON, complete or not: its string's
    characters so far (an escape not complete yet, and the closing quote and brace, left out), a prefix of its final
    text; None when the answer is not a text answer (or not yet known to be one)."""
    if not text.startswith(_RESPONSE):
        return None
    rest = text[len(_RESPONSE):]
    for end in range(len(rest), max(-1, len(rest) - 7), -1):
        try:
            return str(json.loads('"' + rest[:end] + '"'))
        except ValueError:
            continue
    return None


def _cut_response(text: str) -> str:
    """A text answer cut by max_tokens: the text it had so far, as any text answer cut short; other cut answers as
    they are."""
    so_far = response_so_far(text)
    return text if so_far is None else so_far
