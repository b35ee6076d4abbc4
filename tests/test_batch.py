"""Sequences in a shared KV cache and batched decoding on one prepared plan (ggml_py/models/batch.py), on a tiny model
of every architecture: per-sequence logits of mixed steps (chunked prefill beside decoding, sequences joining and
leaving) equal a single-sequence run, cells are freed and reused, a full cache is a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from arch_factory import write_tiny

from ggml_py import load_model
from ggml_py.errors import ModelError
from ggml_py.models import SUPPORTED_ARCHITECTURES
from ggml_py.models.batch import BatchDecoder
from ggml_py.models.kv_cache import CacheFullError, KVCells, causal_mask

from conftest import available_backends
from model_factory import nmse

BACKENDS = available_backends()
# gemma3 with a window of 4 (shorter than the prompts) on layer 0; smollm3 with a rope-less layer (3)
SHAPES = {"gemma3": dict(n_swa=4, swa_pattern=2), "smollm3": dict(n_layer=4)}


@pytest.fixture(scope="module", params=SUPPORTED_ARCHITECTURES)
def tiny(request, tmp_path_factory):
    arch = request.param
    return write_tiny(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, n_embd=128, n_ff=256,
                      **SHAPES.get(arch, {}))


def test_cells_mask_is_causal_per_sequence():
    c = KVCells(16, 3)
    a = c.alloc(np.array([0, 0, 0], np.int32), np.array([0, 1, 2], np.int32))
    b = c.alloc(np.array([1, 1], np.int32), np.array([0, 1], np.int32))
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4] and c.n_kv == 5
    m = c.mask(np.array([0, 1], np.int32), np.array([2, 1], np.int32), c.n_kv)
    assert (m[0] == [0, 0, 0, -np.inf, -np.inf]).all() and (m[1] == [-np.inf] * 3 + [0, 0]).all()
    # one sequence whose cell r holds position r: the single-sequence causal mask, with and without a window
    one = KVCells(8, 1)
    one.alloc(np.zeros(6, np.int32), np.arange(6, dtype=np.int32))
    pos = np.array([3, 4, 5], np.int32)
    assert (one.mask(np.zeros(3, np.int32), pos, 6) == causal_mask(pos, 6)).all()
    assert (one.mask(np.zeros(3, np.int32), pos, 6, window=2) == causal_mask(pos, 6, 2)).all()
    assert c.free(0).size == 3 and c.n_used == 2 and c.n_kv == 5
    assert c.alloc(np.array([2] * 4, np.int32), np.arange(4, dtype=np.int32)).tolist() == [0, 1, 2, 5]
    with pytest.raises(CacheFullError, match="KV cache is full"):
        c.alloc(np.array([2] * 11, np.int32), np.arange(4, 15, dtype=np.int32))
    assert c.n_used == 6  # a refused allocation takes nothing


def test_cells_keep_each_sequence_in_blocks_of_its_own():
    """Sequences decoding side by side get cells in blocks of their own (attention then skips other sequences'
    tiles); a freed sequence's blocks serve the next one; with no free block left, any free cell serves."""
    c = KVCells(128, 4, block=32)
    steps = [c.alloc(np.array([0, 1, 2], np.int32), np.full(3, p, np.int32)).tolist() for p in range(3)]
    assert steps == [[0, 32, 64], [1, 33, 65], [2, 34, 66]] and c.n_kv == 67
    assert c.free(1).size == 3
    got = c.alloc(np.full(40, 3, np.int32), np.arange(40, dtype=np.int32))
    assert got.tolist() == list(range(32, 64)) + list(range(96, 104))  # block 1 (freed), then block 3
    rest = c.alloc(np.full(12, 0, np.int32), np.arange(3, 15, dtype=np.int32))
    assert rest.tolist() == list(range(3, 15))  # its own block first
    full = c.alloc(np.full(40, 2, np.int32), np.arange(3, 43, dtype=np.int32))
    assert sorted(set(full.tolist()) & set(range(64, 96))) == list(range(67, 96))  # its block, then any free cell
    assert c.n_used == c.n_cells - int((c.seq < 0).sum()) and len(set(full.tolist())) == 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_steps_equal_single_sequence_runs(tiny, backend):
    with load_model(tiny, backends=[backend], n_ctx=64, progress=False) as m:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, m.n_vocab, size=n).tolist() for n in (5, 9, 3)]
        refs = []
        for p in prompts:
            m.reset()
            refs.append(m.eval(p + [7, 8]))
        dec = BatchDecoder(m, n_ctx=64, n_seq_max=3, n_batch=16)
        s = [dec.new_sequence() for _ in prompts]
        got = []
        # step 1: a whole prompt beside the first chunk of another (no logits wanted for the chunk)
        out = dec.decode([(s[0], prompts[0], True), (s[1], prompts[1][:4], False)])
        assert out.shape == (1, m.n_vocab)
        got.append((out[0], refs[0][4]))
        # step 2: a decode, the rest of a chunked prompt, a new prompt
        out = dec.decode([(s[0], [7], True), (s[1], prompts[1][4:], True), (s[2], prompts[2], True)])
        got += [(out[0], refs[0][5]), (out[1], refs[1][8]), (out[2], refs[2][2])]
        out = dec.decode([(s[0], [8], True), (s[1], [7], True), (s[2], [7, 8], True)])
        got += [(out[0], refs[0][6]), (out[1], refs[1][9]), (out[2], refs[2][4])]
        # a sequence leaves, a new one joins in its freed cells, beside another's step
        freed = np.flatnonzero(dec.cells.seq == s[1])
        dec.free_sequence(s[1])
        n_used, n_kv = dec.cells.n_used, dec.cells.n_kv
        s3 = dec.new_sequence()
        out = dec.decode([(s3, prompts[1] + [7], True), (s[0], [9], False)])
        got.append((out[0], refs[1][9]))
        assert dec.cells.n_used == n_used + 11 and dec.cells.n_kv == max(n_kv, int(freed.max()) + 1)
        assert np.flatnonzero(dec.cells.seq == s3).tolist() == freed.tolist()
        for a, ref in got:
            assert nmse(a, ref) < 1e-6
        assert dec.plans_prepared == 1  # every step above on one plan
        # the model's own single-sequence path is unaffected by the decoder's cache
        m.reset()
        assert nmse(m.eval(prompts[0])[-1], refs[0][4]) < 1e-6


def test_decoder_errors(tmp_path):
    path = write_tiny(tmp_path / "llama.gguf", "llama", n_embd=128, n_ff=256)
    with load_model(path, backends=BACKENDS[:1], n_ctx=32, progress=False) as m:
        dec = BatchDecoder(m, n_ctx=8, n_seq_max=2, n_batch=8)
        a, b = dec.new_sequence(), dec.new_sequence()
        with pytest.raises(ModelError, match="all 2 sequences are in use"):
            dec.new_sequence()
        with pytest.raises(ModelError, match="exceed the batch size"):
            dec.decode([(a, list(range(9)), True)])
        with pytest.raises(ModelError, match="appears twice"):
            dec.decode([(a, [1], True), (a, [2], True)])
        with pytest.raises(ModelError, match="out of range"):
            dec.decode([(a, [m.n_vocab], True)])
        dec.decode([(a, [1, 2, 3, 4, 5], True)])
        with pytest.raises(CacheFullError, match="KV cache is full"):
            dec.decode([(b, [1, 2, 3, 4], True)])
        assert dec.cells.n_used == 5 and dec.seq_len(b) == 0  # the refused step took nothing
        dec.free_sequence(a)
        dec.decode([(b, [1, 2, 3, 4], True)])
        with pytest.raises(ModelError, match="not active"):
            dec.decode([(a, [1], True)])
    with pytest.raises(ModelError, match="closed"):
        dec.decode([(b, [1], True)])


def test_cells_reused_after_many_sequences(tmp_path):
    path = write_tiny(tmp_path / "llama.gguf", "llama", n_embd=128, n_ff=256)
    with load_model(path, backends=BACKENDS[:1], n_ctx=64, progress=False) as m:
        dec = BatchDecoder(m, n_ctx=32, n_seq_max=2, n_batch=16)
        for _ in range(20):  # 20 sequences of 10 tokens through a 32-cell cache
            s = dec.new_sequence()
            dec.decode([(s, list(range(1, 11)), True)])
            dec.free_sequence(s)
        assert dec.cells.n_used == 0 and dec.plans_prepared == 1
        assert np.all(dec.cells.seq == -1)


def test_quantized_steps_of_two_and_three_rows(tmp_path):
    """A plan sized at its bounds (128 tokens, 8 outputs: the GEMM path) computes steps of 2-3 rows on the GEMV path,
    whose quantized activations need scratch of their own (the simd backend once planned none: 'needs more scratch
    than planned for the symbol bounds')."""
    from gguf import GGMLQuantizationType as QT

    path = write_tiny(tmp_path / "q.gguf", "llama", n_embd=256, n_ff=1536, weight_type=QT.Q8_0, embd_type=QT.Q8_0)
    with load_model(path, backends=BACKENDS[:1], n_ctx=64, progress=False) as m:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        refs = []
        for p in prompts:
            m.reset()
            refs.append(m.eval(p + [20, 21]))
        dec = BatchDecoder(m, n_ctx=64, n_seq_max=8, n_batch=128)
        s = [dec.new_sequence() for _ in prompts]
        dec.decode([(q, p, False) for q, p in zip(s, prompts)])
        out = dec.decode([(q, [20], True) for q in s])  # 3 rows
        for k in range(3):
            assert nmse(out[k], refs[k][len(prompts[k])]) < 1e-3
        out = dec.decode([(q, [21], True) for q in s[:2]])  # 2 rows
        for k in range(2):
            assert nmse(out[k], refs[k][len(prompts[k]) + 1]) < 1e-3


def test_generate_batch_with_max_tokens_zero_gives_empty_completions(tmp_path):
    """max_tokens 0: every prompt gets an empty completion that ended on "length" (the default cache used to be sized
    for the prompts alone, and every prompt was refused as too long for it); a bad max_tokens is a ModelError."""
    from ggml_py.serving import generate_batch

    path = write_tiny(tmp_path / "llama.gguf", "llama", n_embd=128, n_ff=256)
    with load_model(path, backends=BACKENDS[:1], n_ctx=32, progress=False) as m:
        prompts = ["the cat", [5, 6, 7], "a"]
        out = generate_batch(m, prompts, 0)
        assert [(c.tokens, c.text, c.finish_reason) for c in out] == [([], "", "length")] * 3
        assert [c.prompt_tokens for c in out] == [len(m.tokenize("the cat")), 3, len(m.tokenize("a"))]
        one = generate_batch(m, prompts, 1, temperature=0, stop_at_eos=False)
        assert [len(c.tokens) for c in one] == [1, 1, 1]
        for bad in (-1, 1.5, True, None):
            with pytest.raises(ModelError, match="max_tokens must be a non-negative integer"):
                generate_batch(m, prompts, bad)
