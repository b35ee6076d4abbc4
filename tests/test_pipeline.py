"""Pipeline stages in one process (ggml_py/models/stage.py): a model's blocks split into 2 and 3 stages, each a plan
of its own with its own record of the KV cells, give the logits of the model run whole, for every architecture, with
sequences joining, leaving and prefilled in chunks; only hidden states and a few bytes of metadata cross a stage."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from arch_factory import write_tiny
from gguf import GGMLQuantizationType as QT

from ggml_py import load_model
from ggml_py.errors import ModelError
from ggml_py.models import SUPPORTED_ARCHITECTURES
from ggml_py.models.batch import BatchDecoder
from ggml_py.models.specs import DENSE
from ggml_py.models.stage import Stage, StepMeta, split_by_memory, split_layers, stage_memory_parts

from conftest import available_backends
from model_factory import nmse

BACKENDS = available_backends()
ALIASES = {a for spec in DENSE for a in spec.aliases}  # the graph of another architecture, tested under its name
SHAPES = {"gemma3": dict(head_dim=128, n_swa=8, swa_pattern=2, rope_base=1e6, rope_base_swa=10000.0)}
N_CTX, N_SEQ, N_BATCH = 128, 4, 32


def _script(dec: BatchDecoder, rng: np.random.Generator,
            after: Callable[[int], None] = lambda i: None) -> list[np.ndarray]:
    """Sequences of different lengths joining, prefilled in chunks beside others' decoding, one leaving early; the
    logits of every step (`after(i)` is called after step i)."""
    out: list[np.ndarray] = []
    _decode = dec.decode

    def decode(entries):
        out.append(_decode(entries))
        after(len(out) - 1)
        return out[-1]

    dec = _Decoding(decode, dec)
    a, b = dec.new_sequence(), dec.new_sequence()
    pa, pb = rng.integers(0, 200, 23), rng.integers(0, 200, 9)
    dec.decode([(a, pa[:12], True), (b, pb, True)])
    dec.decode([(a, pa[12:], True), (b, [int(out[-1][1].argmax())], True)])
    c = dec.new_sequence()
    for step in range(6):
        entries = [(a, [int(out[-1][0].argmax())], True), (b, [int(out[-1][1].argmax())], True)]
        if step == 0:
            entries.append((c, rng.integers(0, 200, 5), False))
        elif step > 0:
            entries.append((c, [7 + step], True))
        dec.decode(entries)
        if step == 3:
            dec.free_sequence(b)
            d = dec.new_sequence()
            dec.decode([(a, [3], True), (c, [4], True), (d, rng.integers(0, 200, 6), True)])
            b = d
    return out


class _Decoding:
    """A decoder whose decode() is the given one (the script's, which records each step)."""

    def __init__(self, decode: Callable, dec: BatchDecoder) -> None:
        self.decode, self._dec = decode, dec

    def __getattr__(self, name: str):
        return getattr(self._dec, name)


def _run(m, stages: list[range] | None) -> list[np.ndarray]:
    made = None if stages is None else [Stage(m, r, N_CTX, N_SEQ, N_BATCH) for r in stages]
    try:
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=made) as dec:
            return _script(dec, np.random.default_rng(0))
    finally:
        for st in made or ():  # given stages are the caller's to close
            st.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", sorted(set(SUPPORTED_ARCHITECTURES) - ALIASES))
def test_two_and_three_stages_equal_the_whole_model(arch, backend, tmp_path):
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, seed=4, n_layer=3, **SHAPES.get(arch, {}))
    with load_model(path, backends=[backend], n_ctx=N_CTX, progress=False) as m:
        whole = _run(m, None)
        for shares in ([1, 2], [1, 1, 1]):
            split = _run(m, split_layers(3, shares))
            assert len(split) == len(whole)
            for i, (x, y) in enumerate(zip(split, whole)):
                assert x.shape == y.shape
                assert nmse(x, y) < 1e-6, f"{arch} on {backend}, {len(shares)} stages, step {i}: {nmse(x, y):.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_stages_give_the_same_greedy_tokens(backend, tmp_path):
    path = write_tiny(tmp_path / "q.gguf", "llama", seed=6, n_layer=4, weight_type=QT.Q4_0, embd_type=QT.Q8_0)
    with load_model(path, backends=[backend], n_ctx=N_CTX, progress=False) as m:
        whole = _run(m, None)
        split = _run(m, split_layers(4, [1, 1]))
        assert [x.argmax(-1).tolist() for x in split] == [x.argmax(-1).tolist() for x in whole]


def test_what_crosses_a_stage_boundary_is_small(tmp_path):
    """Per token and boundary: the hidden states (n_embd floats) and at most 64 bytes of metadata."""
    path = write_tiny(tmp_path / "m.gguf", "llama", seed=1, n_layer=2)
    with load_model(path, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
        seen: list[tuple[StepMeta, np.ndarray]] = []
        first = Stage(m, range(0, 1), N_CTX, N_SEQ, N_BATCH)
        last = Stage(m, range(1, 2), N_CTX, N_SEQ, N_BATCH)
        orig = last.step

        def spy(meta: StepMeta, x: np.ndarray) -> np.ndarray:
            seen.append((meta, x))
            return orig(meta, x)

        last.step = spy  # type: ignore[method-assign]
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[first, last]) as dec:
            _script(dec, np.random.default_rng(2))
        assert len(seen) > 5
        for meta, x in seen:
            assert x.dtype == np.float32 and x.shape == (meta.n_tokens, m.hparams.n_embd)
            assert meta.nbytes() <= 64 * meta.n_tokens and meta.pack().nbytes <= 64 * meta.n_tokens
            back = StepMeta.unpack(meta.pack())  # what a remote stage gets
            assert back.freed == meta.freed and all(np.array_equal(getattr(back, k), getattr(meta, k))
                                                    for k in ("seqs", "pos", "cells", "out_rows", "released"))


def test_split_layers():
    assert split_layers(30, [1, 1]) == [range(0, 15), range(15, 30)]
    assert split_layers(30, [1, 2]) == [range(0, 10), range(10, 30)]
    assert split_layers(3, [100, 1, 1]) == [range(0, 1), range(1, 2), range(2, 3)]  # at least one block each
    assert split_layers(24, [0.6, 0.4]) == [range(0, 14), range(14, 24)]
    for bad in ([], [1, 0], [1] * 4):
        with pytest.raises(ModelError):
            split_layers(3, bad)


def test_split_by_memory():
    def cost(blocks: list[int]):
        return lambda r: sum(blocks[r.start:r.stop])

    assert split_by_memory(cost([1] * 6), 6, [1, 1]) == [range(0, 3), range(3, 6)]
    assert split_by_memory(cost([1] * 6), 6, [2, 1]) == [range(0, 4), range(4, 6)]
    assert split_by_memory(cost([5, 1, 1, 1, 1, 1]), 6, [1, 1]) == [range(0, 1), range(1, 6)]  # the embedding's
    rng = np.random.default_rng(0)
    for _ in range(20):  # the lowest worst ratio of every split, found by trying them all
        blocks, budgets = rng.integers(1, 20, 7).tolist(), rng.integers(1, 5, 3).tolist()
        ratio = lambda rs, blocks=blocks, budgets=budgets: max(  # noqa: E731
            sum(blocks[r.start:r.stop]) / b for r, b in zip(rs, budgets))
        best = min(ratio([range(0, i), range(i, j), range(j, 7)]) for i in range(1, 6) for j in range(i + 1, 7))
        got = split_by_memory(cost(blocks), 7, budgets)
        assert [r.start for r in got] == [0, got[0].stop, got[1].stop] and got[-1].stop == 7
        assert ratio(got) == best
    for bad in ([], [1, 0], [1] * 7):
        with pytest.raises(ModelError):
            split_by_memory(cost([1] * 6), 6, bad)


def test_a_stage_over_its_memory_limit_is_refused_before_allocating(tmp_path):
    path = write_tiny(tmp_path / "l.gguf", "llama", seed=1, n_layer=2)
    with load_model(path, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
        parts = stage_memory_parts(m, range(1, 2), N_CTX, N_SEQ, N_BATCH, m.cache.dtype)
        need = sum(n for _, n in parts)
        assert parts[0][0] == "weights of blocks 1-1" and parts[0][1] > 0
        with pytest.raises(ModelError, match=r"weights of blocks 1-1: .* more than the .* of memory limit"):
            Stage(m, range(1, 2), N_CTX, N_SEQ, N_BATCH, count_weights=True, memory_limit=need - 1)
        st = Stage(m, range(1, 2), N_CTX, N_SEQ, N_BATCH, count_weights=True, memory_limit=need)
        assert sum(n for _, n in st.memory_parts) == need
        st.close()


def test_stages_serve_one_decoder_after_another(tmp_path):
    """Stages are the caller's: a second decoder on the same stages starts from an empty cache (the first one's
    sequences were never freed) and gets the same logits."""
    path = write_tiny(tmp_path / "r.gguf", "llama", seed=8, n_layer=2)
    with load_model(path, backends=["numpy"], n_ctx=N_CTX, progress=False) as m:
        stages = [Stage(m, r, N_CTX, N_SEQ, N_BATCH) for r in split_layers(2, [1, 1])]
        runs = []
        for _ in range(2):
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=stages) as dec:
                runs.append(_script(dec, np.random.default_rng(3)))
        for st in stages:
            st.close()
        assert all(np.array_equal(x, y) for x, y in zip(*runs))


class _LosableStage:
    """A local stage that can be lost (its plan and cache closed: its steps raise) and is started afresh by
    recover(), as a pipeline starts a dead stage's actor again."""

    def __init__(self, m, layers: range) -> None:
        self._make = lambda: Stage(m, layers, N_CTX, N_SEQ, N_BATCH)
        self.stage: Stage | None = self._make()
        self.started = 1

    def lose(self) -> None:
        assert self.stage is not None
        self.stage.close()
        self.stage = None

    def step(self, meta: StepMeta, x: np.ndarray) -> np.ndarray:
        if self.stage is None:
            raise RuntimeError("stage lost")
        return self.stage.step(meta, x)

    def recover(self) -> bool:
        if self.stage is not None:
            return False
        self.stage, self.started = self._make(), self.started + 1
        return True

    def reset(self) -> None:
        if self.stage is not None:
            self.stage.reset()

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()


@pytest.mark.parametrize("arch", sorted(set(SUPPORTED_ARCHITECTURES) - ALIASES))
def test_a_lost_stage_is_rebuilt_from_the_sequences_tokens(arch, tmp_path):
    """A stage lost mid-script (before or after a sequence ended) is started afresh, every stage's cache is rebuilt
    from the active sequences' tokens into the same cells, and the step goes on: the logits of the run without loss."""
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, seed=4, n_layer=3, **SHAPES.get(arch, {}))
    with load_model(path, backends=[BACKENDS[0]], n_ctx=N_CTX, progress=False) as m:
        whole = _run(m, None)
        stages = [_LosableStage(m, range(0, 1)), _LosableStage(m, range(1, 3))]
        losses = {1: stages[1].lose, 4: stages[0].lose, 6: stages[1].lose}  # step 6 frees a sequence (_script)
        try:
            with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=stages) as dec:
                got = _script(dec, np.random.default_rng(0), lambda i: losses.get(i, lambda: None)())
                assert dec.recoveries == 3 and [st.started for st in stages] == [2, 3]
        finally:
            for st in stages:
                st.close()
        for i, (x, y) in enumerate(zip(got, whole)):
            assert nmse(x, y) < 1e-6, f"{arch}, step {i}: {nmse(x, y):.2e}"
            assert (x.argmax(-1) == y.argmax(-1)).all()


def test_a_stage_that_cannot_recover_fails_the_step(tmp_path):
    """A stage that raises and has nothing to start again fails the step; the decoder's cells are as before it."""
    path = write_tiny(tmp_path / "f.gguf", "llama", seed=4, n_layer=2)
    with load_model(path, backends=[BACKENDS[0]], n_ctx=N_CTX, progress=False) as m:
        st = _LosableStage(m, range(0, 2))
        st.recover = lambda: False  # type: ignore[method-assign]
        with BatchDecoder(m, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, stages=[st]) as dec:
            s = dec.new_sequence()
            dec.decode([(s, [1, 2, 3], True)])
            st.lose()
            used = dec.cells.n_used
            with pytest.raises(RuntimeError, match="stage lost"):
                dec.decode([(s, [4], True)])
            assert dec.cells.n_used == used and dec.seq_len(s) == 3 and dec.recoveries == 0
        st.close()
