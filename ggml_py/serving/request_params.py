"""An OpenAI request body read into the engine's terms: sampling and stopping parameters (`GenParams`), chat
messages, the fields refused until implemented; every bad value a `BadRequest` naming its field."""

from __future__ import annotations

import json
import math
from typing import Any

from ggml_py.models.grammar import GrammarError, json_schema_grammar, lark_grammar
from ggml_py.models.logprobs import MAX_TOP_LOGPROBS
from ggml_py.serving.engine import GenParams
from ggml_py.serving.http_common import (
    BadRequest,
    notes,
)

MAX_N = 16  # completions per prompt (n)


def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name} must be an integer {rng}, got {v!r}", name)
    return v


def _logit_bias(body: dict[str, Any], n_vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings of decimal digits)."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to numbers in [-100, 100]", "logit_bias")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()) or (n_vocab is not None and int(k) >= n_vocab):
            raise BadRequest(f"logit_bias: {k!r} is not a token id in [0, {n_vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        out[int(k)] = float(v)
    return out or None


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {v!r}", name)
    return bool(v)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The alternatives each token reports (0: its own logprob only), None without logprobs. Chat: `logprobs`
    true and `top_logprobs` 0..20; completions: `logprobs` 0..20 (OpenAI's legacy API, up to 5 there)."""
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not on:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if on else None
    return _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """What the server does not do yet is refused (400), never silently ignored."""
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n", 1):
        raise BadRequest("best_of is not supported (only best_of equal to n, which returns every completion): "
                         "ask for n completions with logprobs and choose among them", "best_of")


def grammar(body: dict[str, Any]) -> str | None:
    """The llguidance grammar the output must follow (models/grammar.py), None for free text: OpenAI's
    `response_format` ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}) or the
    `grammar` extension (a Lark grammar, llguidance's dialect). Only a grammar's syntax is checked here; whether it
    compiles for the model's tokenizer is the server's check (a 400 too)."""
    rf, lark = body.get("response_format"), body.get("grammar")
    if lark is not None and not isinstance(lark, str):
        raise BadRequest("grammar must be a string (a Lark grammar)", "grammar")
    if lark is not None and rf not in (None, {"type": "text"}):
        raise BadRequest("response_format and grammar cannot both constrain the output: send one", "grammar")
    try:
        if lark is not None:
            return lark_grammar(lark)
        if rf is None:
            return None
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return json_schema_grammar(None)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
                raise BadRequest('response_format json_schema must be {"name": ..., "schema": {...}}',
                                 "response_format")
            schema = js.get("schema")
            if schema is not None and not isinstance(schema, dict | bool):
                raise BadRequest("response_format.json_schema.schema must be a JSON schema (an object)",
                                 "response_format")
            return json_schema_grammar({} if schema is None else schema)
    except GrammarError as e:
        raise BadRequest(str(e), "grammar" if lark is not None else "response_format") from None
    raise BadRequest('response_format type must be "text", "json_object" or "json_schema"', "response_format")


def _refuse_unserved(body: dict[str, Any]) -> None:
    """What would change the answer's kind, or its checks, and is not done here is refused (400) too: inserting
    before a suffix, audio output, web search, moderation. (Hints and metadata, such as `user`, `store`,
    `reasoning_effort` or `prediction`, do not change the text returned and are ignored: docs/serving.md's table.)"""
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix is not supported: insertion before a suffix (fill-in-the-middle) is not implemented",
                         "suffix")
    if body.get("modalities") not in (None, ["text"]):
        raise BadRequest('modalities is not supported beyond ["text"]: audio output is not implemented',
                         "modalities")
    for name, what in (("audio", "audio output is not implemented"), ("web_search_options", "no web search is done"),
                       ("moderation", "no moderation model runs here")):
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported: {what}", name)


def n_choices(body: dict[str, Any]) -> int:
    """`n`: completions per prompt."""
    return int(_int(body, "n", 1, 1, MAX_N) or 1)


def echo(body: dict[str, Any]) -> bool:
    """`echo` (completions): the prompt comes before each completion, with its tokens' logprobs when `logprobs`
    is set."""
    return _bool(body, "echo")


def gen_params(body: dict[str, Any], default_max_tokens: int | None, n_vocab: int | None = None,
               chat: bool = True) -> GenParams:
    """Sampling and stopping from an OpenAI request body (+ llama.cpp's top_k, min_p, repeat_penalty extensions).
    Unset values take ggml_py's sampler defaults (as llama-server does), not OpenAI's temperature 1. `top_p` 0 is
    greedy (only the most likely token is kept); `logit_bias` ids are checked against `n_vocab`."""
    d = GenParams()
    n_choices(body)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _int({"max_tokens": mt}, "max_tokens", default_max_tokens, 0)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("stop must be a string or a list of at most 4 strings", "stop")
    seed = _int(body, "seed", None, 0, 2**63 - 1)
    _refuse_unsupported(body)
    logprobs = _logprobs(body, chat)
    if chat and body.get("echo") is not None:
        raise BadRequest("echo is a field of /v1/completions, not of chat completions", "echo")
    _refuse_unserved(body)
    temperature = _num(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = _num(body, "top_p", d.top_p, 0.0, 1.0)
    if top_p == 0.0:  # the smallest set reaching probability 0: the most likely token alone
        temperature, top_p = 0.0, 1.0
    return GenParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=int(_int(body, "top_k", d.top_k, 0) or 0),
        min_p=_num(body, "min_p", d.min_p, 0.0, 1.0), repeat_penalty=_num(body, "repeat_penalty", 1.0, 1e-6, 1e6),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0), seed=seed, stop=stops,
        stop_at_eos=not body.get("ignore_eos", False), logit_bias=_logit_bias(body, n_vocab), logprobs=logprobs,
        echo_logprobs=not chat and echo(body) and logprobs is not None, eog_logprob=not chat, grammar=grammar(body))


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            out.append(p["text"])
        return "".join(out)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages: role and content (text), an assistant's tool_calls, a tool message's tool_call_id and name."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {m['role']!r} is not one of system, developer, user, assistant, "
                             "tool", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    msg[k] = m[k]
        out.append(msg)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as {"name", "arguments"} (arguments parsed from their JSON string)."""
    what = f'messages[{i}].tool_calls must be a list of {{"type": "function", "function": {{"name": ..., ' \
           '"arguments": "<JSON>"}}'
    if not isinstance(calls, list):
        raise BadRequest(what, "messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise BadRequest(what, "messages")
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the text it is
        out.append({"id": c.get("id"), "name": f["name"], "arguments": args})
    return out


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        notes("deep-json", "a request body nested too deeply was refused (400)")
        raise BadRequest("the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def max_token_bytes(tokenizer: Any) -> int:
    """The bytes of the longest token's text (special tokens' included): no token stands for more of a prompt."""
    return max((len(tokenizer.token_to_piece(i)) for i in range(tokenizer.n_vocab)), default=1) or 1


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def embedding_inputs(body: dict[str, Any], max_inputs: int) -> list[str | list[int]]:
    """OpenAI's embeddings `input`: a string, a list of strings, a list of token ids (one input) or a list of lists
    of token ids; as a list of single inputs, at most `max_inputs`. An empty string, list or list of ids is a 400
    (as OpenAI's); the ids' range is checked against the model later."""
    x = body.get("input")
    what = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(x, str):
        items: list[Any] = [x]
    elif isinstance(x, list) and x and all(_is_token(t) for t in x):
        items = [x]
    elif isinstance(x, list) and x:
        items = x
    elif isinstance(x, list):
        raise BadRequest("input is an empty list", "input")
    else:
        raise BadRequest(f"input must be {what}", "input")
    if len(items) > max_inputs:
        raise BadRequest(f"input has {len(items)} items; at most {max_inputs} are accepted in one request", "input")
    for i, it in enumerate(items):
        if isinstance(it, str):
            if not it:
                raise BadRequest(f"{'input' if x is it else f'input[{i}]'} is an empty string", "input")
        elif not (isinstance(it, list) and it and all(_is_token(t) for t in it)):
            raise BadRequest(f"input[{i}] must be a non-empty string or a non-empty list of token ids (input is "
                             f"{what})", "input")
    return items


def embedding_format(body: dict[str, Any], n_embd: int) -> str:
    """`encoding_format` ("float", the default, or "base64"), with `dimensions` refused unless it is the model's
    (a model without Matryoshka training has no shorter vectors to give)."""
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise BadRequest(f"encoding_format must be \"float\" or \"base64\", got {fmt!r}", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_token(dims) or dims != n_embd):
        raise BadRequest(f"dimensions {dims!r} is not supported: this model's embeddings have {n_embd} dimensions",
                         "dimensions")
    return str(fmt)
