"""Issue 11: what a hostile file or a careless caller can still do. One test (or a few) per row of the issue's table;
each asserts the error type or the right result. Concurrency (rows 7, 8, 10) is in tests/test_concurrency.py."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.commands import cli
from ggml_py.errors import (
    BackendError,
    GgmlPyError,
    GGUFError,
    ModelError,
    PlanError,
    ShapeError,
    TemplateError,
)
from ggml_py.formats.gguf import MAX_NESTED_ARRAYS, open_gguf
from ggml_py.ir import ops
from ggml_py.models import load_model
from ggml_py.models.chat_template import TEMPLATE_MAX_CHARS, render_chat_template
from ggml_py.models.sampling import Sampler, SamplingError
from ggml_py.models.tokenizer import Tokenizer
from ggml_py.testing import gguf_corpus as C

from conftest import available_backends
from model_factory import write_tiny_llama

BACKENDS = available_backends()
PREFERRED = "simd" if "simd" in BACKENDS else "numpy"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("hostile") / "tiny.gguf"
    write_tiny_llama(p, seed=11)
    return p.read_bytes()


def _edit(tiny_bytes: bytes, path: Path, **kvs: tuple[int, bytes]) -> Path:
    """The tiny model with keys replaced (or added): key=(GGUF value type, payload)."""
    raw = C.dissect(tiny_bytes)
    for key, (vtype, payload) in kvs.items():
        raw.set_kv(key.replace("__", "."), vtype, payload)
    path.write_bytes(raw.serialize())
    return path


def _cli(*argv: str) -> tuple[int, str, str]:
    """Run the CLI in a fresh interpreter: exit code, stdout, stderr."""
    r = subprocess.run([sys.executable, "-m", "ggml_py", *argv], capture_output=True, text=True, timeout=120,
                       errors="surrogateescape")
    return r.returncode, r.stdout, r.stderr


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- rows 1, 2: chat templates ---------------------------------------------------------------------------------------
BOMBS = [
    "{{ 'x' * 10**10 }}",
    "{{ [0] * 10**10 }}",
    "{{ 'x'|center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ '%0999999999d'|format(1) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(n=2) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ 2 ** (10 ** 9) }}",
    "{{ '%09999999999d' % 1 }}",
    "{{ '{:>99999999}'.format(1) }}",
    "{{ ('x' * 1000).join(range(100000)|map('string')|list) }}",
    "{{ range(100000)|map('string')|join('x' * 1000) }}",
    "{{ ('x' * 3000000).replace('', 'yyyy') }}",
    "{{ ('x' * 3000000)|replace('', 'yyyy') }}",
    "{{ 'x'|indent(10**9) }}",
    "{{ [1]|slice(10**9)|list }}",
]


@pytest.mark.parametrize("template", BOMBS)
def test_template_limits(template: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="render limit"):
        render_chat_template(template, MSG)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("template,kind", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ range(10**6, 10**7, 0) }}", "ValueError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% if %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError|undefined"),
])
def test_template_errors_are_template_errors(template: str, kind: str) -> None:
    with pytest.raises(TemplateError, match=kind) as ei:
        render_chat_template(template, MSG, source="m.gguf: tokenizer.chat_template")
    assert "m.gguf: tokenizer.chat_template" in str(ei.value)
    assert isinstance(ei.value, ModelError)  # existing `except ModelError` still catches it


def test_templates_still_render() -> None:
    t = ("{% for m in messages %}{{ m.role ~ ':' ~ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}"
         "{{ messages[0].content * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{% for x in nothing %}never{% endfor %}"
         "{{ 'ab'|replace('a', 'c') }}{{ 'x'|center(5) }}{{ 12345678901|string }}{{ '%5d'|format(12345678901) }}"
         "{{ [1, 2]|join(', ') }}{{ 'a-b'.replace('-', '+') }}{{ '%s!' % 'x' }}")
    two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat_template(t, two) == ("user:hi|assistant:yohihihi[1, 1]1024cb  x  1234567890112345678901"
                                            "1, 2a+bx!")
    big = "y" * (TEMPLATE_MAX_CHARS // 2)  # a long message is fine, under the limit
    assert len(render_chat_template("{{ messages[0].content }}", [{"role": "user", "content": big}])) == len(big)


@pytest.mark.python_only
def test_template_bomb_from_the_cli(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = _edit(tiny_bytes, tmp_path / "bomb.gguf",
              tokenizer__chat_template=(C.T_STRING, C.enc_string("{{ 'x' * 10**10 }}")))
    # the child reports its own peak RSS: VmHWM of its memory map (ru_maxrss would count the RSS of this pytest
    # process, which the child was forked from, and RUSAGE_CHILDREN every earlier child of this process)
    script = ("import sys\nfrom ggml_py.commands.cli import main\ncode = main(sys.argv[1:])\n"
              "hwm = [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]\n"
              "print('peak_rss_kib', hwm, file=sys.stderr)\nraise SystemExit(code)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script, "generate", "-m", str(p), "--chat", "-p", "hi", "-n", "1",
                        "--backend", PREFERRED], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and time.perf_counter() - t0 < 60
    line = _one_error_line(r.stderr)
    assert "tokenizer.chat_template" in line and "bomb.gguf" in line and "render limit" in line
    peak = int(r.stderr.split("peak_rss_kib")[1].split()[0])
    assert peak < 1024 * 1024  # KiB: the child stayed under 1 GiB


# -- row 3: numeric metadata arrays as numpy, bounded nesting --------------------------------------------------------
def test_big_numeric_array_stays_compact(tmp_path: Path) -> None:
    n = 16 * 2**20
    raw = C.dissect(C.tiny_model())
    raw.set_kv("test.big", C.T_ARRAY, C.u32(C.T_UINT8) + C.u64(n) + bytes(range(256)) * (n // 256))
    p = tmp_path / "big.gguf"
    p.write_bytes(raw.serialize())
    tracemalloc.start()
    try:
        g = open_gguf(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with g:
        v = g.metadata["test.big"]
        assert isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.shape == (n,) and not v.flags.writeable
        assert v[257] == 1 and v[-1] == 255
    assert peak <= 1.5 * n  # a list of ints would take ~8x (pointers) on top of the ints


@pytest.mark.parametrize("etype,np_type", [(C.T_FLOAT32, np.float32), (C.T_INT64, np.int64), (C.T_BOOL, np.bool_)])
def test_numeric_arrays_keep_their_type(tmp_path: Path, etype: int, np_type: type) -> None:
    vals = [True, False, True] if etype == C.T_BOOL else [1, -2, 3]
    raw = C.dissect(C.tiny_model())
    raw.set_kv("test.arr", C.T_ARRAY, C.enc_array(etype, vals))
    p = tmp_path / "a.gguf"
    p.write_bytes(raw.serialize())
    with open_gguf(p) as g:
        v = g.metadata["test.arr"]
        assert v.dtype == np_type and v.tolist() == vals


def test_many_nested_empty_arrays_are_refused_fast(tmp_path: Path) -> None:
    n = 1_000_000  # 12 MB of empty arrays: used to be a minute of list building
    raw = C.dissect(C.tiny_model())
    raw.set_kv("test.nested", C.T_ARRAY, C.u32(C.T_ARRAY) + C.u64(n) + (C.u32(C.T_UINT8) + C.u64(0)) * n)
    p = tmp_path / "n.gguf"
    p.write_bytes(raw.serialize())
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=f"more than {MAX_NESTED_ARRAYS} arrays nested"):
        open_gguf(p)
    assert time.perf_counter() - t0 < 2.0
    raw.set_kv("test.nested", C.T_ARRAY, C.u32(C.T_ARRAY) + C.u64(1000) + (C.u32(C.T_UINT8) + C.u64(0)) * 1000)
    p.write_bytes(raw.serialize())
    with open_gguf(p) as g:  # a few are still fine
        assert len(g.metadata["test.nested"]) == 1000


# -- row 4: tokenizer and hparams keys of the wrong type ------------------------------------------------------------
def _tok_meta(path: Path) -> dict:
    with open_gguf(path) as g:
        return dict(g.metadata)


@pytest.mark.python_only
@pytest.mark.parametrize("key,vtype,payload,match", [
    ("tokenizer.ggml.tokens", C.T_ARRAY, C.enc_array(C.T_UINT32, list(range(300))), "array of strings"),
    ("tokenizer.ggml.tokens", C.T_UINT32, struct.pack("<I", 5), "array of strings"),
    ("tokenizer.ggml.scores", C.T_UINT32, struct.pack("<I", 5), "array of floats"),
    ("tokenizer.ggml.scores", C.T_ARRAY, C.enc_array(C.T_UINT32, [1] * 300), "array of floats"),
    ("tokenizer.ggml.scores", C.T_ARRAY, C.enc_array(C.T_FLOAT32, [math.nan] * 300), "NaN"),
    ("tokenizer.ggml.merges", C.T_ARRAY, C.enc_array(C.T_UINT32, [1, 2]), "array of strings"),
    ("tokenizer.ggml.token_type", C.T_UINT32, struct.pack("<I", 1), "array of integers"),
    ("tokenizer.ggml.token_type", C.T_ARRAY, C.enc_array(C.T_FLOAT32, [1.0] * 300), "array of integers"),
    ("tokenizer.ggml.bos_token_id", C.T_FLOAT32, struct.pack("<f", math.inf), "must be an integer"),
    ("tokenizer.ggml.bos_token_id", C.T_ARRAY,
     C.u32(C.T_ARRAY) + C.u64(1) + C.enc_array(C.T_UINT32, [1]), "must be an integer"),
    ("tokenizer.ggml.add_bos_token", C.T_STRING, C.enc_string("yes"), "must be an integer"),
    ("tokenizer.chat_template", C.T_ARRAY, C.enc_array(C.T_UINT8, [1]), "must be a string"),
])
def test_tokenizer_keys_of_the_wrong_type(tiny_bytes: bytes, tmp_path: Path, key: str, vtype: int, payload: bytes,
                                          match: str) -> None:
    raw = C.dissect(tiny_bytes)
    raw.set_kv(key, vtype, payload)
    p = tmp_path / "t.gguf"
    p.write_bytes(raw.serialize())
    with pytest.raises(ModelError, match=match):
        Tokenizer.from_metadata(_tok_meta(p))
    info = json.loads(_cli("info", str(p), "--json")[1])  # info reports it, exit 0
    assert match.split()[0] in info["tokenizer"]["error"]
    m = load_model(p, backends=PREFERRED, progress=False)  # the model loads; text needs the tokenizer
    with m:
        assert m.eval([1, 2]).shape == (2, m.n_vocab)
        with pytest.raises(ModelError, match=match):
            m.tokenize("hi")
        code, _, err = _cli("generate", "-m", str(p), "-p", "hi", "-n", "1", "--backend", PREFERRED)
        assert code == 1 and match.split()[0] in _one_error_line(err)


@pytest.mark.python_only
@pytest.mark.parametrize("key,vtype,payload,match", [
    ("llama.rope.scaling.factor", C.T_ARRAY, C.enc_array(C.T_FLOAT32, [2.0, 2.0]), "rope scaling factor"),
    ("llama.rope.scaling.factor", C.T_FLOAT32, struct.pack("<f", math.nan), "rope scaling factor"),
    ("llama.rope.scaling.factor", C.T_FLOAT32, struct.pack("<f", math.inf), "rope scaling factor"),
    ("llama.rope.scaling.factor", C.T_FLOAT32, struct.pack("<f", -2.0), "rope scaling factor"),
    ("llama.rope.scaling.type", C.T_ARRAY, C.enc_array(C.T_UINT8, [1]), "rope scaling type"),
    ("llama.attention.layer_norm_rms_epsilon", C.T_FLOAT64, struct.pack("<d", 1e300), "layer_norm_rms_epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", C.T_FLOAT32, struct.pack("<f", math.nan), "layer_norm_rms_eps"),
    ("llama.attention.head_count_kv", C.T_ARRAY, C.enc_array(C.T_UINT32, [2, 1]), "varies per layer"),
])
def test_hparams_of_the_wrong_type_or_value(tiny_bytes: bytes, tmp_path: Path, key: str, vtype: int,
                                            payload: bytes, match: str) -> None:
    raw = C.dissect(tiny_bytes)
    raw.set_kv(key, vtype, payload)
    p = tmp_path / "h.gguf"
    p.write_bytes(raw.serialize())
    with pytest.raises(ModelError, match=match):
        load_model(p, backends=PREFERRED, progress=False)
    code, out, _ = _cli("info", str(p), "--json")
    assert code == 0 and match.split()[0] in json.loads(out)["hparams_error"]


def test_per_layer_arrays_that_agree_still_load(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = _edit(tiny_bytes, tmp_path / "u.gguf",
              llama__attention__head_count_kv=(C.T_ARRAY, C.enc_array(C.T_UINT32, [2, 2])))
    with load_model(p, backends=PREFERRED, progress=False) as m:
        assert m.hparams.n_head_kv == 2


# -- row 5: bytes that are not UTF-8 ---------------------------------------------------------------------------------
@pytest.mark.python_only
def test_invalid_utf8_text_is_replaced_as_llama_cpp_does(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = tmp_path / "tiny.gguf"
    p.write_bytes(tiny_bytes)
    tok = Tokenizer.from_metadata(_tok_meta(p))
    bad = b"\xff\xfeabc".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert tok.encode(bad) == tok.encode("\ufffd\ufffdabc")
    assert tok.encode("\ud800x") == tok.encode("\ufffdx")  # a lone surrogate from Python code
    with pytest.raises(ModelError, match="must be a str"):
        tok.encode(None)  # type: ignore[arg-type]
    code, out, err = _cli("tokenize", "-m", str(p), "--json", bad)
    assert code == 0, err
    assert json.loads(out)["tokens"] == tok.encode("\ufffd\ufffdabc")
    code, out, err = _cli("generate", "-m", str(p), "-p", bad, "-n", "2", "--temp", "0", "--backend", PREFERRED,
                          "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == tok.encode("\ufffd\ufffdabc")


# -- row 6: narrowing integer inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [2**32 + 1, 2**31, -(2**31) - 1])
def test_int_inputs_are_range_checked(backend: str, bad: int) -> None:
    table = gp.weight(np.arange(12, dtype=np.float32).reshape(4, 3), name="table")
    idx = gp.input((2,), gp.dtypes.I32, name="idx")
    plan = gp.prepare(ops.get_rows(table, idx).set_name("rows"), backends=[backend])
    plan.set_input("idx", np.array([0, 3], dtype=np.int64))  # int64 values that fit are fine
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("rows"), [[0, 1, 2], [9, 10, 11]])
    with pytest.raises(PlanError, match=f"value {bad} is outside"):
        plan.set_input("idx", np.array([0, bad], dtype=np.int64))
    if bad > 0:
        with pytest.raises(PlanError, match="outside"):
            plan.set_input("idx", np.array([0, bad], dtype=np.uint64))


# -- row 9: get_rows out of range on numpy as on simd ---------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", [-1, 4, 2**31 - 1])
def test_get_rows_out_of_range(backend: str, row: int) -> None:
    table = gp.weight(np.arange(12, dtype=np.float32).reshape(4, 3), name="table")
    idx = gp.input((2,), gp.dtypes.I32, name="idx")
    plan = gp.prepare(ops.get_rows(table, idx).set_name("rows"), backends=[backend])
    plan.set_input("idx", np.array([1, row], dtype=np.int32))
    with pytest.raises(BackendError, match="out of range"):
        plan.compute()
    plan.set_input("idx", np.array([1, 3], dtype=np.int32))  # the plan still works
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("rows"), [[3, 4, 5], [9, 10, 11]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("expert", [-1, 4, 2**31 - 1])
def test_mul_mat_id_expert_out_of_range(backend: str, expert: int) -> None:
    """An expert id outside 0..E-1 fails the compute naming it (ggml asserts); the plan computes afterwards."""
    experts = gp.weight(np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3), name="experts")
    x, ids = gp.input((2, 1, 3), name="x"), gp.input((2, 2), gp.dtypes.I32, name="ids")
    plan = gp.prepare(ops.mul_mat_id(experts, x, ids).set_name("y"), backends=[backend])
    plan.set_input("x", np.ones((2, 1, 3), np.float32))
    plan.set_input("ids", np.array([[0, 1], [expert, 2]], dtype=np.int32))
    with pytest.raises(BackendError, match=f"expert id {expert} out of range 0..3"):
        plan.compute()
    plan.set_input("ids", np.array([[0, 1], [3, 3]], dtype=np.int32))
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), [[[3, 12], [21, 30]], [[57, 66], [57, 66]]])


# -- row 10 (plans): a closed plan refuses every call ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_plan_refuses_every_call(backend: str) -> None:
    x = gp.input((4,), name="x")
    plan = gp.prepare(ops.exp(x).set_name("y"), backends=[backend])
    plan.set_input("x", np.zeros(4, np.float32))
    plan.compute()
    plan.close()
    assert plan.closed
    for call in (lambda: plan.set_input("x", np.ones(4, np.float32)), plan.compute, lambda: plan.get_output("y")):
        with pytest.raises(PlanError, match="closed plan"):
            call()
    plan.close()  # twice is fine


# -- row 11: cycles --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_cyclic_graph_is_refused(backend: str) -> None:
    x = gp.input((4,), name="x")
    y = ops.exp(x)
    y.src = (y,)
    with pytest.raises(PlanError, match="cycle"):
        gp.prepare(y, backends=[backend])
    a = ops.exp(x)
    b = ops.neg(a)
    c = ops.add(b, x)
    a.src = (c,)  # a longer loop: a -> c -> b -> a
    with pytest.raises(PlanError, match="cycle"):
        gp.Graph(c)
    d = ops.add(ops.exp(x), ops.exp(x))  # shared sources and diamonds are not cycles
    e = ops.add(d, d)
    assert len(gp.Graph(e)) == 4


# -- row 12: absurd sizes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_absurd_sizes_fail_before_allocation(backend: str) -> None:
    with pytest.raises(PlanError, match="available memory"):
        gp.prepare(ops.exp(gp.input((2**40,))), [backend])
    with pytest.raises(PlanError, match="available memory"):
        gp.prepare(ops.add(gp.state((2**38,), name="s"), gp.input((2**38,))), [backend])
    for shape in [(2**62, 2**62), (2**50,), (2**20, 2**20, 2**20, 2**20)]:
        with pytest.raises(ShapeError, match="would take"):
            gp.input(shape)
    with pytest.raises(ShapeError):
        ops.mul_mat(gp.input((2**30, 2**20)), gp.input((2**30, 2**20)))


# -- row 13: NaN agreement -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_nan_and_fully_masked_attention_follow_ggml(backend: str) -> None:
    x = gp.input((5,), name="x")
    plan = gp.prepare(ops.relu(x).set_name("y"), backends=[backend])
    plan.set_input("x", np.array([np.nan, -1, 2, np.inf, -np.inf], np.float32))
    plan.compute()
    np.testing.assert_array_equal(plan.get_output("y"), [0, 0, 2, np.inf, 0])  # ggml: x > 0 ? x : 0

    rng = np.random.default_rng(0)
    q = gp.input((2, 3, 8), name="q")
    k = gp.input((2, 6, 8), name="k")
    v = gp.input((2, 6, 8), name="v")
    m = gp.input((3, 6), name="m")
    plan = gp.prepare(ops.flash_attn_ext(q, k, v, m, scale=0.3).set_name("o"), backends=[backend])
    mask = np.zeros((3, 6), np.float32)
    mask[1] = -np.inf  # query 1 sees no key
    mask[2, 3:] = -np.inf
    for name, shape in (("q", (2, 3, 8)), ("k", (2, 6, 8)), ("v", (2, 6, 8))):
        plan.set_input(name, rng.standard_normal(shape).astype(np.float32))
    plan.set_input("m", mask)
    plan.compute()
    out = plan.get_output("o")  # (Nq, H, Dv)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0)
    assert np.abs(out[0]).sum() > 0 and np.abs(out[2]).sum() > 0


def test_kit_has_the_nan_cases() -> None:
    from ggml_py.testing import cases

    ids = [c.id for c in cases(op="RELU,FLASH_ATTN_EXT")]
    assert any("RELU" in i and "nan" in i for i in ids)
    assert sum("fully masked" in i for i in ids) == 2


# -- row 14: FIFOs and devices ---------------------------------------------------------------------------------------
def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(GGUFError, open_gguf, fifo).value), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "open_gguf blocked on a FIFO"
    assert "not a regular file" in str(result[0])
    code, _, err = _cli("info", str(fifo))
    assert code == 1 and "not a regular file" in _one_error_line(err)
    with pytest.raises(GGUFError, match="not a regular file"):
        open_gguf("/dev/zero")
    with pytest.raises(GGUFError, match="is a directory"):
        open_gguf(tmp_path)


# -- row 15: eval --out ----------------------------------------------------------------------------------------------
@pytest.mark.python_only
def test_eval_out_names_the_file_it_writes(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = tmp_path / "tiny.gguf"
    p.write_bytes(tiny_bytes)
    d = tmp_path / "outdir"
    d.mkdir()
    code, _, err = _cli("eval", "-m", str(p), "-p", "hi", "--out", str(d), "--backend", PREFERRED)
    assert code == 1 and "is a directory" in _one_error_line(err)
    assert not (tmp_path / "outdir.npy").exists()
    code, out, err = _cli("eval", "-m", str(p), "-p", "hi", "--out", str(tmp_path / "logits"), "--backend", PREFERRED)
    assert code == 0, err
    assert f"written to {tmp_path / 'logits.npy'}" in out and (tmp_path / "logits.npy").exists()


# -- row 16: the weights file shrinks while loaded -------------------------------------------------------------------
def test_shrunk_file_is_caught_before_it_is_read(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = tmp_path / "tiny.gguf"
    p.write_bytes(tiny_bytes)
    m = load_model(p, backends=PREFERRED, progress=False)
    with m:
        m.eval([1, 2, 3])
        it = m.generate([1, 2], 4, temperature=0, stop_at_eos=False)
        next(it)
        os.truncate(p, len(tiny_bytes) // 2)
        with pytest.raises(GGUFError, match="shrank on disk"):
            m.eval([4])
        with pytest.raises(GGUFError, match="shrank on disk"):
            next(it)
        with pytest.raises(GGUFError, match="shrank on disk"):
            list(m.generate([1, 2], 4))
    with pytest.raises(GGUFError, match="extends past the end"):  # and at load
        load_model(p, backends=PREFERRED, progress=False)


# -- row 17: odd numbers from a file or a caller ---------------------------------------------------------------------
def test_odd_numbers_are_refused(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = tmp_path / "tiny.gguf"
    p.write_bytes(tiny_bytes)
    with pytest.raises(SamplingError, match="repeat_penalty"):
        Sampler(repeat_penalty=1e-308)
    with pytest.raises(SamplingError, match="repeat_penalty"):
        Sampler(repeat_penalty=1e300)
    for n in (3000, 0, -1, 2.5, True):
        with pytest.raises(GgmlPyError, match="n_threads"):
            load_model(p, backends=PREFERRED, n_threads=n, progress=False)
    with pytest.raises(BackendError, match="n_threads"):
        gp.prepare(ops.exp(gp.input((4,))), backends=[PREFERRED], n_threads=0)
    code, _, err = _cli("generate", "-m", str(p), "-t", "3000", "-n", "1")
    assert code == 1 and "n_threads" in _one_error_line(err)
    code, _, err = _cli("generate", "-m", str(p), "--repeat-penalty", "1e-308", "-n", "1", "--backend", PREFERRED)
    assert code == 1 and "repeat_penalty" in _one_error_line(err)

    n = gp.sym("n", 8)
    x = gp.input((n,), name="x")
    plan = gp.prepare(ops.exp(x).set_name("y"), backends=[PREFERRED])
    plan.set_input("x", np.zeros(3, np.float32))
    with pytest.raises(PlanError, match="integer"):
        plan.compute(n=3.7)
    with pytest.raises(PlanError, match="integer"):
        plan.compute(n=True)
    plan.compute(n=np.int64(3))
    with pytest.raises(PlanError, match="real numbers"):
        plan.set_input("x", np.zeros(3, np.complex64))
    with pytest.raises(PlanError, match="real numbers"):
        plan.set_input("x", np.array(["a", "b", "c"]))

    with load_model(p, backends=PREFERRED, progress=False) as m:
        for bad in ([1.9, 2.7], [True, False], "12", None, [[1, 2]], [1, 10**12]):
            if not isinstance(bad, str):  # a str prompt is text
                with pytest.raises(ModelError):
                    m.generate(bad, 2)  # type: ignore[arg-type]
            with pytest.raises(ModelError):
                m.eval(bad)  # type: ignore[arg-type]
        with pytest.raises(ModelError):
            m.tokenize(None)  # type: ignore[arg-type]
        with pytest.raises(ModelError):
            m.detokenize([1.5])


@pytest.mark.python_only
def test_info_json_never_prints_bare_nan(tiny_bytes: bytes, tmp_path: Path) -> None:
    p = _edit(tiny_bytes, tmp_path / "nan.gguf", general__name=(C.T_FLOAT32, struct.pack("<f", math.nan)),
              test__nans=(C.T_ARRAY, C.enc_array(C.T_FLOAT64, [math.inf, 1.5])))
    code, out, err = _cli("info", str(p), "--json")
    assert code == 0, err

    def strict(c: str) -> None:
        raise AssertionError(f"bare {c} in JSON")

    assert json.loads(out, parse_constant=strict)["name"] is None
    assert cli._finite({"a": [np.float32(np.nan).item(), 1.0, (math.inf,)]}) == {"a": [None, 1.0, [None]]}
