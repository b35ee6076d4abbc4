"""Leaks: the LSan runner and log reader used by `make test-asan` (tests/lsan_check.py) attributes leaks correctly
and retries only LeakSanitizer's own failures, and preparing, computing and closing plans over and over does not
grow the process's memory on any backend."""

from __future__ import annotations

import gc
import subprocess
import weakref

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import ggml_py as gp
from ggml_py import load_model
from ggml_py.ir import ops

import lsan_check
from conftest import available_backends
from model_factory import write_tiny_llama

SIMD = "/venv/lib/python3.11/site-packages/ggml_py_simd/_simd.cpython-311-x86_64-linux-gnu.so"
LOG = f"""
=================================================================
==11==ERROR: LeakSanitizer: detected memory leaks

Direct leak of 4096 byte(s) in 1 object(s) allocated from:
    #0 0x7f01 in __interceptor_malloc ../../../../src/libsanitizer/asan/asan_malloc_linux.cpp:69 [/usr/lib/libasan.so.8]
    #1 0x7f02 in _PyObject_Malloc Objects/obmalloc.c:2003 [/usr/lib/libpython3.11.so.1.0]

Direct leak of 64 byte(s) in 1 object(s) allocated from:
    #0 0x7f01 in operator new(unsigned long) asan_new_delete.cpp:95 [/usr/lib/libasan.so.8]
    #1 0x7f03 in std::__cxx11::basic_string::_M_create(unsigned long&, unsigned long) <null> [/usr/lib/libstdc++.so.6]
    #2 0x7f04 in gp::Plan::Plan(...) /src/csrc/simd/runtime.cpp:612 [{SIMD}]
    #3 0x7f02 in _PyObject_MakeTpCall Objects/call.c:214 [/usr/lib/libpython3.11.so.1.0]

Indirect leak of 8 byte(s) in 1 object(s) allocated from:
    #0 0x7f01 in __interceptor_posix_memalign asan_malloc_linux.cpp:145 [/usr/lib/libasan.so.8]
    #1 0x7f05 in <null> <null> [{SIMD}]

Direct leak of 32 byte(s) in 1 object(s) allocated from:
    #0 0x7f01 in __interceptor_malloc ../../../../src/libsanitizer/asan/asan_malloc_linux.cpp:69 [/usr/lib/libasan.so.8]
    #1 0x7f06 in PyMem_RawMalloc Objects/obmalloc.c:586 [/usr/lib/libpython3.11.so.1.0]
    #2 0x7f04 in gp::something /src/csrc/simd/module.cpp:10 [{SIMD}]

SUMMARY: AddressSanitizer: 4200 byte(s) leaked in 4 allocation(s).
"""
OVERFLOW = """
=================================================================
==12==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x6020 at pc 0x7f bp 0x7f sp 0x7f
READ of size 4 at 0x6020 thread T0
    #0 0x7f04 in gp::k_add /src/csrc/simd/k_elementwise.cpp:40 [{SIMD}]
SUMMARY: AddressSanitizer: heap-buffer-overflow
==12==ABORTING
"""


RUN_FIRST = True  # rss tests measure this process: before other tests leave allocating threads (conftest.py)


def test_lsan_check_attributes_each_leak_to_the_first_frame_past_the_allocator():
    leaks = lsan_check.parse(LOG.splitlines())
    assert [(lk.kind, lk.nbytes) for lk in leaks] == [("Direct", 4096), ("Direct", 64), ("Indirect", 8), ("Direct", 32)]
    # CPython's object; ours through libstdc++; ours unsymbolized; CPython's allocator called by us (CPython's)
    assert [lk.ours for lk in leaks] == [False, True, True, False]
    assert "runtime.cpp" in leaks[1].origin


def test_lsan_check_fails_on_our_leaks_and_on_error_reports_only(tmp_path, capsys):
    prefix = str(tmp_path / "log")
    (tmp_path / "log.11").write_text(LOG)
    assert lsan_check.main(prefix) == 1
    assert "from ggml_py's native code: 2 record(s), 72 bytes" in capsys.readouterr().out
    (tmp_path / "log.11").write_text(LOG.split("Direct leak of 64")[0])  # only CPython's leak
    assert lsan_check.main(prefix) == 0
    (tmp_path / "log.12").write_text(OVERFLOW.format(SIMD=SIMD))
    assert lsan_check.main(prefix) == 1
    assert "heap-buffer-overflow" in capsys.readouterr().out


TRACER_CRASH = """
Tracer caught signal 11: addr=0x2c48 pc=0x55ea3eb1903a sp=0x7f945ce44d40
==13==LeakSanitizer has encountered a fatal error.
==13==HINT: For debugging, try setting environment variable LSAN_OPTIONS=verbosity=1:log_threads=1
"""


def _fake_pytest(monkeypatch, outcomes):
    """lsan_check.run with pytest replaced: attempt k writes outcomes[k] = (exit code, log text) to its log."""
    calls = []

    def fake_run(cmd, env=None, **kw):
        if cmd[0] == "gcc":
            return subprocess.CompletedProcess(cmd, 0, stdout="/usr/lib/libasan.so\n")
        rc, text = outcomes[len(calls)]
        calls.append(env)
        prefix = next(o for o in env["ASAN_OPTIONS"].split(":") if o.startswith("log_path="))[len("log_path="):]
        with open(prefix + ".13", "w") as f:
            f.write(text)
        return subprocess.CompletedProcess(cmd, rc)

    monkeypatch.setattr(lsan_check.subprocess, "run", fake_run)
    return calls


def test_lsan_runner_retries_leak_sanitizers_own_failure(tmp_path, monkeypatch, capsys):
    clean = LOG.split("Direct leak of 64")[0]
    calls = _fake_pytest(monkeypatch, [(134, TRACER_CRASH), (0, clean)])
    assert lsan_check.run(str(tmp_path), ["tests/test_x.py"]) == 0
    # LSan's tracer crashes reading glibc's dynamic TLS on some machines: the runner keeps it out of the scan
    assert len(calls) == 2 and all("intercept_tls_get_addr=0" in c["ASAN_OPTIONS"].split(":") for c in calls)
    assert "retrying" in capsys.readouterr().out


def test_lsan_runner_fails_when_leak_sanitizer_keeps_failing(tmp_path, monkeypatch, capsys):
    calls = _fake_pytest(monkeypatch, [(134, TRACER_CRASH)] * lsan_check.ATTEMPTS)
    assert lsan_check.run(str(tmp_path), ["tests/test_x.py"]) == 1
    assert len(calls) == lsan_check.ATTEMPTS
    out = capsys.readouterr().out
    assert "LeakSanitizer failed to run in" in out and "Tracer caught signal 11" in out  # the tool's own lines


def test_lsan_runner_does_not_retry_findings_or_test_failures(tmp_path, monkeypatch):
    overflow = OVERFLOW.format(SIMD=SIMD) + TRACER_CRASH
    for outcome in [(134, overflow), (1, LOG.split("Direct leak of 64")[0]), (0, LOG)]:
        calls = _fake_pytest(monkeypatch, [outcome] * lsan_check.ATTEMPTS)
        assert lsan_check.run(str(tmp_path), ["tests/test_x.py"]) == 1
        assert len(calls) == 1


def rss_mib() -> float:
    """The process's current resident set (VmRSS: anonymous and file-backed pages), not its peak: a leak after
    a high-water mark still shows."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


@pytest.mark.rss
def test_rss_mib_sees_memory_come_and_go():
    """What the tests below rely on: a touched allocation raises rss_mib() and freeing it lowers it again (a peak
    such as ru_maxrss would stay up)."""
    before = rss_mib()
    block = np.ones(96 << 20, np.uint8)  # 96 MiB, every page written
    during = rss_mib()
    del block
    after = rss_mib()
    assert during - before > 80 and during - after > 80, (before, during, after)


@pytest.mark.rss
@pytest.mark.parametrize("backend", available_backends())
def test_preparing_and_closing_plans_repeatedly_does_not_grow_memory(backend):
    """Each plan has 4 MiB of compute buffer and a 1 MiB weight; 200 of them leaked would be over 800 MiB."""
    w = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)

    def cycle() -> None:
        x = gp.input((1024, 512), name="x")
        y = ops.gelu(ops.mul_mat(gp.weight(w, name="w"), ops.scale(x, 0.5))).set_name("y")
        plan = gp.prepare(y, backends=[backend])
        plan.set_input("x", np.ones((1024, 512), np.float32))
        plan.compute()
        assert plan.get_output("y").shape == (1024, 512)
        plan.close()

    for _ in range(20):  # warm-up: caches, pools and allocator arenas reach their steady size
        cycle()
    gc.collect()
    before = rss_mib()
    for _ in range(200):
        cycle()
    gc.collect()
    grown = rss_mib() - before
    assert grown < 64, f"RSS grew by {grown:.0f} MiB over 200 prepare/compute/close cycles"
    if backend == "simd":  # again beside a plan that stays open: its repacked weight keeps the repack arena the
        keep = gp.prepare(ops.mul_mat(gp.weight(w.copy(), name="kept"), gp.input((1, 512), name="x")),
                          backends=["simd"])  # cycles' weights are laid in alive, so each must give its pages back
        before = rss_mib()
        for _ in range(200):
            cycle()
        gc.collect()
        grown = rss_mib() - before
        keep.close()
        assert grown < 64, f"RSS grew by {grown:.0f} MiB over 200 cycles beside an open plan"


@pytest.fixture(scope="module")
def leak_model(tmp_path_factory) -> str:
    """F32 weights of about 27 MiB (two 512-wide layers): a model whose mapping or weight copies outlived close()
    would add that much per cycle."""
    path = tmp_path_factory.mktemp("leak") / "leak.gguf"
    write_tiny_llama(path, seed=7, n_embd=512, n_ff=1536, n_head=4, n_head_kv=4, weight_type=QT.F32,
                     embd_type=QT.F32, output_type=QT.F32)
    return str(path)


@pytest.mark.rss
@pytest.mark.parametrize("backend", available_backends())
def test_loading_and_closing_a_model_repeatedly_does_not_grow_memory(leak_model, backend):
    """load -> eval -> generate -> close, 12 times: the process's RSS and the live Model objects stay flat."""
    refs: list[weakref.ref] = []

    def cycle() -> None:
        m = load_model(leak_model, backends=[backend], n_ctx=128, progress=False)
        try:
            ids = m.tokenize("the cat is on the mat")
            m.eval(ids)
            assert len(list(m.generate(ids, 2, temperature=0.0, stop_at_eos=False))) == 2
        finally:
            m.close()
        refs.append(weakref.ref(m))

    for _ in range(2):
        cycle()
    gc.collect()
    before = rss_mib()
    for _ in range(12):
        cycle()
    gc.collect()
    grown = rss_mib() - before
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} closed Model objects are still referenced"
    assert grown < 64, f"RSS grew by {grown:.0f} MiB over 12 load/eval/close cycles of a 27 MiB model"
