"""Native (C ABI) plugins: the header, the cffi loader, the example C backend, discovery, and every refusal path.

The example (examples/c-backend/cexample.c) and a configurable test plugin (tests/plugins/testplug.c) are built with
the system C compiler into a temporary directory, as a plugin author would build them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ggml_py as gp
from ggml_py.errors import BackendError, PlanError
from ggml_py.ir import dtypes, ops
from ggml_py.ir.schema import VIEW_OPS
from ggml_py.ir.tensor import INPUT, OUTPUT, PARAM, STATE
from ggml_py.runtime import native
from ggml_py.runtime import registry as registry_mod
from ggml_py.runtime.registry import Registry, registry

from conftest import SLOWDOWN, sigint_default, tool_env

ROOT = Path(__file__).resolve().parents[1]
HEADER = Path(gp.get_include()) / "ggml_py" / "backend_abi.h"
EXAMPLE = ROOT / "examples" / "c-backend" / "cexample.c"
TESTPLUG = Path(__file__).resolve().parent / "plugins" / "testplug.c"
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


# under `make test-asan` / `make test-tsan` the plugins are instrumented too (the runtime is preloaded)
SANITIZE = [f"-fsanitize={s}", "-g", "-fno-omit-frame-pointer"] if (s := os.environ.get("GGML_PY_SANITIZE")) else []


def build(src: Path | str, out: Path, *defines: str, sanitize: bool = True) -> Path:
    """cc -shared -fPIC, warnings as errors: what a plugin author runs. `sanitize=False` leaves a plugin whose bugs
    are planted (reads out of bounds among them) uninstrumented under the sanitizer runs."""
    cmd = [CC, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{HEADER.parents[1]}",
           *(SANITIZE if sanitize else []), *defines, "-o", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=tool_env())
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return out


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CC is None:
        pytest.skip("no C compiler")
    return tmp_path_factory.mktemp("native")


@pytest.fixture(scope="module")
def cexample(libdir: Path) -> Path:
    return build(EXAMPLE, libdir / "libggml_py_cexample.so")


_variants: dict[str, Path] = {}


def plug(libdir: Path, name: str, *defines: str) -> Path:
    """The test plugin built with `defines` under backend name `name` (each variant its own file)."""
    key = name + " ".join(defines)
    if key not in _variants:
        _variants[key] = build(TESTPLUG, libdir / f"lib{name}.so", f'-DPLUG_NAME="{name}"', *defines)
    return _variants[key]


def stat(path: Path, k: int) -> int:
    import cffi

    f = cffi.FFI()
    f.cdef("int32_t testplug_stat(int32_t k);")
    return int(f.dlopen(str(path)).testplug_stat(k))


def run(plan: gp.Plan, inputs: dict[str, np.ndarray], out: gp.Tensor, **bind: int) -> np.ndarray:
    for k, v in inputs.items():
        plan.set_input(k, v)
    plan.compute(**bind)
    return plan.get_output(out)


# -- the header ------------------------------------------------------------------------------------------------------
@needs_cc
def test_header_is_plain_c99_and_cxx(tmp_path: Path) -> None:
    src = tmp_path / "h.c"
    src.write_text('#include "ggml_py/backend_abi.h"\nint main(void) { return (int)sizeof(ggml_py_plugin) * 0; }\n')
    r = subprocess.run([CC, "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", f"-I{HEADER.parents[1]}",
                        "-c", str(src), "-o", str(tmp_path / "h.o")], capture_output=True, text=True, env=tool_env())
    assert r.returncode == 0, r.stderr
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx:
        r = subprocess.run([cxx, "-x", "c++", "-Wall", "-Werror", f"-I{HEADER.parents[1]}", "-c", str(src), "-o",
                            str(tmp_path / "h2.o")], capture_output=True, text=True, env=tool_env())
        assert r.returncode == 0, r.stderr


def test_abi_enums_match_ggml_py() -> None:
    f = native.ffi()
    types = {k.removeprefix("GGML_PY_TYPE_"): v for k, v in f.typeof("enum ggml_py_type").relements.items()}
    assert types == {t.name: t.ggml_id for t in dtypes.ALL}  # ggml's ids, every type
    codes = {k.removeprefix("GGML_PY_OP_"): v for k, v in f.typeof("enum ggml_py_op").relements.items()}
    codes.pop("NONE"), codes.pop("COUNT")
    from ggml_py_numpy.kernels import KERNELS

    assert set(codes) == set(KERNELS) - VIEW_OPS  # every op a backend can be given has a code, and no more
    assert len(set(codes.values())) == len(codes)
    flags = {"INPUT": INPUT, "OUTPUT": OUTPUT, "PARAM": PARAM, "STATE": STATE}
    for name, value in flags.items():
        assert native.const(f"GGML_PY_TENSOR_{name}") == value
    major, minor = native.abi_version()
    assert native.const("GGML_PY_ABI_VERSION") == (major << 16) | minor


# -- loading the example directly -------------------------------------------------------------------------------------
def test_load_example_directly(cexample: Path) -> None:
    reg = native.load(cexample)
    assert reg is native.load(str(cexample))  # opened once
    assert reg.name == "cexample" and reg.version == "0.1.0"
    (dev,) = reg.devices()
    assert dev.score == 10 and dev.caps["library"] == str(cexample)
    assert dev.caps["abi_version"] == "{}.{}".format(*native.abi_version())
    be = reg.create(n_threads=2)
    assert be.name == "cexample" and be.n_threads == 2
    bt = be.default_buffer_type
    assert bt.name == "cexample" and bt.is_host and bt.alignment == 64
    buf = bt.alloc_buffer(100)
    assert buf.size == 100 and buf.base % 64 == 0
    assert not buf.get_tensor(0, 100).any()  # zeroed
    buf.set_tensor(8, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(buf.host_view()[8:24].view(np.float32), np.arange(4, dtype=np.float32))
    view = buf.host_view()
    buf.free()
    assert view[8:24].view(np.float32)[3] == 3.0  # memory lives while a view of it does
    be.set_n_threads(1)


def test_example_through_scheduler_with_numpy_fallback(cexample: Path, rng: np.random.Generator) -> None:
    be = native.backend(cexample)
    w = gp.weight(rng.standard_normal((16, 8)).astype(np.float32), name="w")
    x = gp.input((2, 4, 8), name="x")
    b = gp.input((16,), name="b")
    h = ops.silu(ops.add(ops.mul_mat(w, x), b))  # MUL_MAT, ADD: C; SILU: numpy
    y = ops.mul(h, ops.scale(h, 0.5))  # SCALE: numpy, MUL: C
    plan = gp.prepare(y, backends=[be, "numpy"])
    got = [(a["op"], a["backend"]) for a in plan.assignment()]
    assert got == [("MUL_MAT", "cexample"), ("ADD", "cexample"), ("SILU", "numpy"), ("SCALE", "numpy"),
                   ("MUL", "cexample")]
    assert plan.stats()["splits"] == 3 and plan.stats()["copies"] == 0  # host memory on both sides
    for _ in range(3):  # prepared once, computed many times
        xv = rng.standard_normal((2, 4, 8)).astype(np.float32)
        bv = rng.standard_normal(16).astype(np.float32)
        r = xv @ w.data.T + bv
        r = r / (1 + np.exp(-r))
        np.testing.assert_allclose(run(plan, {"x": xv, "b": bv}, y), r * (r * 0.5), rtol=1e-5, atol=1e-5)


def test_example_strided_and_broadcast_operands(cexample: Path, rng: np.random.Generator) -> None:
    """Permuted (non-contiguous) operands and ggml broadcasting, checked against the numpy backend."""
    be = native.backend(cexample)
    a = gp.input((3, 4, 6), name="a")
    m = gp.input((3, 1), name="m")
    w = gp.input((2, 6, 4), name="w")
    b = gp.input((2, 2, 5, 6), name="b")
    at = ops.permute(a, (1, 0, 2))  # (4, 3, 6), not contiguous
    s = ops.mul(ops.add(at, m), m)  # m tiled over a permuted operand
    mm = ops.mul_mat(ops.permute(w, (0, 2, 1)), b)  # a strided weight (2, 4, 6) broadcast over b's outer (2, 2)
    plan = gp.prepare([s, mm], backends=[be, "numpy"])
    assert {x["backend"] for x in plan.assignment()} == {"cexample"}
    ref = gp.prepare([s, mm], backends=["numpy"])
    inputs = {"a": rng.standard_normal((3, 4, 6)), "m": rng.standard_normal((3, 1)),
              "w": rng.standard_normal((2, 6, 4)), "b": rng.standard_normal((2, 2, 5, 6))}
    for p in (plan, ref):
        for k, v in inputs.items():
            p.set_input(k, v.astype(np.float32))
        p.compute()
    atv = inputs["a"].astype(np.float32).transpose(1, 0, 2)
    mv = inputs["m"].astype(np.float32)
    np.testing.assert_allclose(plan.get_output(s), (atv + mv) * mv, rtol=1e-6)
    np.testing.assert_allclose(plan.get_output(mm), ref.get_output(mm), rtol=1e-5, atol=1e-5)


def test_example_symbolic_dims_bound_by_the_plugin(cexample: Path, rng: np.random.Generator) -> None:
    be = native.backend(cexample)
    n = gp.sym("n_tok", 12)
    w = gp.weight(rng.standard_normal((5, 8)).astype(np.float32), name="w")
    x = gp.input((n, 8), name="x")
    y = ops.add(ops.mul_mat(w, x), gp.input((n, 5), name="r"))
    plan = gp.prepare(y, backends=[be, "numpy"])
    (run0,) = plan.runs
    f = native.ffi()
    node_mm, node_add = (run0.plan.graph.nodes[i] for i in range(2))
    symbolic = [t.sym != f.NULL for t in (node_mm.src[0], node_mm.src[1], node_mm.dst, node_add.src[1], node_add.dst)]
    assert symbolic == [False, True, True, True, True]  # x, the product, r and y depend on n_tok; the weight does not
    assert node_mm.src[1].sym.ne[1].n_terms == 1 and node_mm.src[1].sym.ne[1].c == 0  # ne[1] = n_tok
    for k in (1, 7, 12, 3):
        xv = rng.standard_normal((k, 8)).astype(np.float32)
        rv = rng.standard_normal((k, 5)).astype(np.float32)
        np.testing.assert_allclose(run(plan, {"x": xv, "r": rv}, y), xv @ w.data.T + rv, rtol=1e-5, atol=1e-5)


# -- discovery ---------------------------------------------------------------------------------------------------------
def test_discovered_through_backend_path(cexample: Path, libdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = libdir / "libnothere.so"
    monkeypatch.setenv("GGML_PY_BACKEND_PATH", os.pathsep.join([str(cexample), str(missing)]))
    reg = Registry()
    infos = {i.name: i for i in reg.infos()}
    assert "cexample" in infos and "GGML_PY_BACKEND_PATH" in infos["cexample"].source
    assert reg.registration("cexample").devices()[0].score == 10
    assert "cexample" in reg.default_names()
    assert isinstance(reg.backend("cexample"), native.NativeBackend)
    # a broken entry is listed (under its file name) with its error, and asking for it re-raises
    assert "nothere" in infos
    assert "does not exist" in infos["nothere"].describe()["status"]
    with pytest.raises(BackendError, match="libnothere.so does not exist"):
        reg.registration("nothere")


def test_backend_path_directory_and_cli(cexample: Path, libdir: Path) -> None:
    env = {**os.environ, "GGML_PY_BACKEND_PATH": str(cexample)}
    r = subprocess.run([sys.executable, "-m", "ggml_py", "backends", "--json"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    rows = {b["name"]: b for b in json.loads(r.stdout)["backends"]}
    assert rows["cexample"]["status"] == "ok" and rows["cexample"]["devices"][0]["score"] == 10
    # a directory entry means every library in it
    paths = registry_mod.library_paths(f"{cexample.parent}{os.pathsep}")
    assert str(cexample) in paths


def test_entry_point_object_is_a_path(cexample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution whose `ggml_py.backends` entry point names a path string, or a callable returning one."""
    (tmp_path / "cplugpaths.py").write_text(textwrap.dedent(f"""
        LIBRARY = {str(cexample)!r}

        def library_path():
            return LIBRARY
    """))
    dist = tmp_path / "cplugpaths-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cplugpaths\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ggml_py.backends]\ncexample = cplugpaths:LIBRARY\n"
                                           "cexample_fn = cplugpaths:library_path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("GGML_PY_BACKEND_PATH", raising=False)
    reg = Registry()
    for name in ("cexample", "cexample_fn"):
        r = reg.registration(name)
        assert isinstance(r, native.NativeRegistration) and r.name == "cexample"
        assert "cplugpaths" in next(i for i in reg.infos() if i.name == name).source


def test_register_in_process(cexample: Path) -> None:
    name = registry_mod.register_library(cexample)
    try:
        assert name == "cexample" and "cexample" in registry.names()
        assert gp.get_backend("cexample").name == "cexample"
    finally:
        registry.unregister("cexample")


# -- refusals and failures --------------------------------------------------------------------------------------------
def test_missing_symbols(libdir: Path, tmp_path: Path) -> None:
    src = tmp_path / "notaplugin.c"
    src.write_text("int some_function(void) { return 42; }\n")
    lib = build(src, libdir / "libnotaplugin.so")
    with pytest.raises(BackendError, match=r"libnotaplugin\.so is not a ggml_py backend plugin: missing symbol\(s\) "
                                           r"ggml_py_plugin_abi_version, ggml_py_plugin_init"):
        native.load(lib)
    half = tmp_path / "half.c"
    half.write_text("#include <stdint.h>\nuint32_t ggml_py_plugin_abi_version(void) { return 1; }\n")
    with pytest.raises(BackendError, match=r"missing symbol\(s\) ggml_py_plugin_init \(see"):
        native.load(build(half, libdir / "libhalf.so"))
    text = tmp_path / "libtext.so"
    text.write_text("not a library")
    with pytest.raises(BackendError, match=r"cannot load native backend library .*libtext\.so"):
        native.load(text)


def test_abi_version_mismatch(libdir: Path) -> None:
    major, minor = native.abi_version()
    lib = plug(libdir, "oldabi", "-DPLUG_ABI=999")
    with pytest.raises(BackendError, match=rf"liboldabi\.so: plugin built for ggml_py backend ABI version 999, but "
                                           rf"this ggml_py speaks {major}\.{minor} .*rebuild it against the header in "
                                           r"ggml_py\.get_include\(\)"):
        native.load(lib)
    with pytest.raises(BackendError, match=r"ABI version 1, but .*rebuild"):  # version 1 plugins are refused
        native.load(plug(libdir, "abiv1", "-DPLUG_ABI=1"))
    newer = f"-DPLUG_ABI={(major << 16) | (minor + 1)}"
    with pytest.raises(BackendError, match=rf"ABI {major}\.{minor + 1}, newer than this ggml_py's {major}\.{minor}: "
                                           "upgrade ggml_py"):
        native.load(plug(libdir, "newerabi", newer))


def test_plugin_built_against_an_older_minor_loads(libdir: Path, rng: np.random.Generator) -> None:
    """A 2.0 plugin: a shorter ggml_py_plugin (its struct_size) whose bytes beyond hold garbage, never read."""
    lib = plug(libdir, "abi20", "-DPLUG_ABI_2_0")
    reg = native.load(lib)
    assert reg.library.abi_version == f"{native.abi_version()[0]}.0"
    assert reg.library.fn("buffer_from_host_ptr") is None  # a 2.1 field, absent
    be = reg.create()
    w = gp.weight(rng.standard_normal((3, 4)).astype(np.float32), name="w")
    a = gp.input((3, 4), name="a")
    y = ops.add(a, w)
    plan = gp.prepare(y, backends=[be])
    av = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(run(plan, {"a": av}, y), av + w.data, rtol=1e-6)
    assert stat(lib, 5) == 0  # the weight was copied into the plugin's memory, not wrapped


def test_an_older_minor_is_offered_only_nodes_it_knows(libdir: Path) -> None:
    """ABI 2.2 added ROPE's YaRN parameters and frequency factors (src[2]): a 2.1 plugin, here one that accepts any
    node, is offered only ROPE nodes that use neither, so it never computes a rope with them silently dropped; the
    scheduler gives the others to the next backend. A 2.2 plugin is offered all of them."""
    major, _ = native.abi_version()
    old = native.load(plug(libdir, "anyop21", "-DPLUG_ANY_OP", f"-DPLUG_ABI={(major << 16) | 1}")).create()
    new = native.load(plug(libdir, "anyop", "-DPLUG_ANY_OP")).create()
    x, pos = gp.input((3, 2, 64), name="x"), gp.input((3,), dtypes.I32, name="pos")
    plain = ops.rope(x, pos, 64, freq_scale=0.5)
    idle = ops.rope(x, pos, 64, beta_fast=4.0, n_ctx_orig=99)  # without ext_factor these do nothing: stored neutral
    scaled = {"freq_factors": ops.rope(x, pos, 64, freq_factors=gp.input((32,), name="ff")),
              "yarn": ops.rope(x, pos, 64, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64),
              "attn_factor": ops.rope(x, pos, 64, attn_factor=0.5)}
    assert old.supports_op(plain) and old.supports_op(idle)
    assert [k for k, n in scaled.items() if old.supports_op(n)] == []
    assert all(new.supports_op(n) for n in (plain, idle, *scaled.values()))
    plan = gp.prepare([plain.set_output(), scaled["yarn"].set_output()], backends=[old, "numpy"])
    assert [a["backend"] for a in plan.assignment() if a["op"] == "ROPE"] == ["anyop21", "numpy"]


def test_weights_wrapped_without_a_copy(libdir: Path, rng: np.random.Generator, tmp_path: Path) -> None:
    """ABI 2.1 buffer_from_host_ptr: a weight mapped from a file is computed on where it is."""
    lib = plug(libdir, "wraps")
    be = native.backend(lib)
    data = rng.standard_normal((3, 4)).astype(np.float32)
    path = tmp_path / "w.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=(3, 4))
    buf = be.default_buffer_type.buffer_from_host(mm)
    assert buf is not None and buf.base == mm.ctypes.data and stat(lib, 5) >= 1
    before = stat(lib, 3)
    w = gp.weight(mm, name="w")
    a = gp.input((3, 4), name="a")
    y = ops.add(a, w)
    plan = gp.prepare(y, backends=[be])
    assert stat(lib, 3) == before + 1  # one compute buffer allocated; the weight took none
    av = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(run(plan, {"a": av}, y), av + data, rtol=1e-6)


def test_cancel_from_another_thread(libdir: Path) -> None:
    lib = plug(libdir, "slowpoll", "-DPLUG_SLOW=3000")
    be = native.backend(lib)
    a = gp.input((4,), name="a")
    y = ops.add(ops.add(a, a), a)
    plan = gp.prepare(y, backends=[be])
    plan.set_input("a", np.ones(4, np.float32))
    run0 = plan.runs[0]
    threading.Timer(0.2, be.graph_plan_cancel, (run0.plan,)).start()
    t0 = time.perf_counter()
    with pytest.raises(native.ComputeCancelled):
        plan.compute()
    assert time.perf_counter() - t0 < 1.0 * SLOWDOWN and stat(lib, 6) >= 1


@pytest.mark.parametrize("how", ["python", "cli"])
def test_ctrl_c_stops_a_long_native_compute_at_once(libdir: Path, how: str) -> None:
    """SIGINT during a C call that runs for minutes: the plugin's next abort poll stops it (exit 130 from the CLI)."""
    lib = plug(libdir, "slowplug", "-DPLUG_SLOW=120000")
    env = {**os.environ, "GGML_PY_BACKEND_PATH": str(lib)}
    if how == "cli":
        cmd = [sys.executable, "-u", "-m", "ggml_py", "test-backend", "slowplug", "--op", "ADD"]
    else:
        cmd = [sys.executable, "-u", "-c", textwrap.dedent("""
            import numpy as np, ggml_py as gp
            a = gp.input((4,), name="a")
            plan = gp.prepare(gp.ops.add(a, a), backends=["slowplug"])
            plan.set_input("a", np.ones(4, np.float32))
            print("computing", flush=True)
            try:
                plan.compute()
            except KeyboardInterrupt:
                raise SystemExit(130)
            """)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=sigint_default)
    try:
        if how == "python":
            assert p.stdout.readline().strip() == "computing"
        time.sleep(2.0)  # well inside the plugin's 120 s node
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        elapsed = time.perf_counter() - t0
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert elapsed < 0.5 * SLOWDOWN, f"{elapsed:.2f} s from Ctrl-C to exit"
    if how == "cli":
        assert err.rstrip().endswith("error: interrupted") and "Traceback" not in err


def test_struct_size_mismatch(libdir: Path) -> None:
    with pytest.raises(BackendError, match=r"libbadsize\.so: ggml_py_plugin is \d+ bytes in the plugin, which ABI "
                                           r"\d+\.\d+ does not allow"):
        native.load(plug(libdir, "badsize", "-DPLUG_BAD_SIZE"))


def test_null_required_function(libdir: Path) -> None:
    with pytest.raises(BackendError, match=r"libnocompute\.so \(backend 'nocompute'\): required plugin function\(s\) "
                                           r"backend\.graph_compute are NULL"):
        native.load(plug(libdir, "nocompute", "-DPLUG_NULL_COMPUTE"))


def test_score_zero_is_refused(libdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = plug(libdir, "nohere", "-DPLUG_SCORE=0")
    reg = native.load(lib)
    assert reg.devices()[0].score == 0  # listed, with its score ...
    with pytest.raises(BackendError, match=r"native backend 'nohere' \(.*libnohere\.so\) reports score 0: it cannot "
                                           r"run on this machine"):
        reg.create()  # ... but never created
    monkeypatch.setenv("GGML_PY_BACKEND_PATH", str(lib))
    r = Registry()
    assert "nohere" in r.names() and "nohere" not in r.default_names()
    with pytest.raises(BackendError, match="score 0"):
        r.backend("nohere")


def test_compute_error_names_plugin_and_op(libdir: Path) -> None:
    lib = plug(libdir, "failing", "-DPLUG_FAIL_COMPUTE")
    be = native.backend(lib)
    a = gp.input((4,), name="a")
    y = ops.silu(ops.add(a, a).set_name("the_add"))
    plan = gp.prepare(y, backends=[be, "numpy"])
    plan.set_input("a", np.ones(4, np.float32))
    msg = (r"native backend 'failing' \(.*libfailing\.so\) failed in ADD \(node 'the_add', 1 of 1\): "
           r"injected failure in node the_add \(status 1 FAILED\)")
    with pytest.raises(BackendError, match=msg):
        plan.compute()


def test_plan_lowered_once_one_call_per_compute(libdir: Path) -> None:
    lib = plug(libdir, "counting")
    be = native.backend(lib)
    assert stat(lib, 4) >= 1  # a backend context is alive
    created, computed, freed = (stat(lib, k) for k in range(3))
    a = gp.input((3, 4), name="a")
    y = ops.add(ops.add(a, a), a)
    plan = gp.prepare(y, backends=[be, "numpy"])
    assert stat(lib, 0) == created + 1  # one split, lowered once
    av = np.arange(12, dtype=np.float32).reshape(3, 4)
    for _ in range(4):
        np.testing.assert_array_equal(run(plan, {"a": av}, y), 3 * av)
    assert stat(lib, 1) == computed + 4  # one C call per compute for the whole split
    plan.close()
    assert stat(lib, 2) == freed + 1


def test_non_host_buffer_type(libdir: Path, rng: np.random.Generator) -> None:
    """A plugin whose memory ggml_py may only reach through its copy functions: inputs and outputs are copied."""
    lib = plug(libdir, "devmem", "-DPLUG_NON_HOST")
    be = native.backend(lib)
    bt = be.default_buffer_type
    assert not bt.is_host and bt.name == "devmem_mem"
    buf = bt.alloc_buffer(64)
    buf.set_tensor(4, np.arange(3, dtype=np.uint8) + 1)
    assert buf.get_tensor(0, 8).tolist() == [0, 0, 0, 0, 1, 2, 3, 0]
    buf.memset(0, 7, 2)
    assert buf.get_tensor(0, 3).tolist() == [7, 7, 0]
    live = stat(lib, 3)
    buf.free()
    assert stat(lib, 3) == live - 1
    a = gp.input((2, 8), name="a")
    b = gp.input((8,), name="b")
    y = ops.silu(ops.add(ops.silu(a), b))  # numpy -> devmem -> numpy: copies both ways
    plan = gp.prepare(y, backends=[be, "numpy"])
    assert [x["backend"] for x in plan.assignment()] == ["numpy", "devmem", "numpy"]
    assert plan.stats()["copies"] >= 2
    av = rng.standard_normal((2, 8)).astype(np.float32)
    bv = rng.standard_normal(8).astype(np.float32)

    def silu(v: np.ndarray) -> np.ndarray:
        return v / (1 + np.exp(-v))

    np.testing.assert_allclose(run(plan, {"a": av, "b": bv}, y), silu(silu(av) + bv), rtol=1e-5, atol=1e-6)


def test_plans_sharing_a_backend_across_threads(cexample: Path, rng: np.random.Generator) -> None:
    from concurrent.futures import ThreadPoolExecutor

    be = native.backend(cexample)
    plans, refs = [], []
    for _ in range(6):
        w = rng.standard_normal((32, 64)).astype(np.float32)
        xv = rng.standard_normal((16, 64)).astype(np.float32)
        x = gp.input((16, 64), name="x")
        y = ops.add(ops.mul_mat(gp.weight(w), x), gp.input((32,), name="b"))
        p = gp.prepare(y, backends=[be, "numpy"])
        p.set_input("x", xv)
        p.set_input("b", np.ones(32, np.float32))
        plans.append((p, y))
        refs.append(xv @ w.T + 1)

    def work(i: int) -> float:
        p, y = plans[i]  # one plan per thread, all on the same backend context
        err = 0.0
        for _ in range(20):
            p.compute()
            err = max(err, float(np.abs(p.get_output(y) - refs[i]).max()))
        return err

    with ThreadPoolExecutor(6) as ex:
        assert max(ex.map(work, range(6))) < 1e-3


def test_closed_backend_refuses_compute(libdir: Path) -> None:
    be = native.backend(plug(libdir, "closing"))
    a = gp.input((4,), name="a")
    plan = gp.prepare(ops.add(a, a), backends=[be])
    plan.set_input("a", np.ones(4, np.float32))
    plan.compute()
    be.close()
    with pytest.raises(BackendError, match="this backend was closed"):
        plan.compute()


def test_no_backend_for_op_mentions_native_backend(cexample: Path) -> None:
    be = native.backend(cexample)
    with pytest.raises(PlanError, match="no backend supports SILU .*tried cexample"):
        gp.prepare(ops.silu(gp.input((4,))), backends=[be])


# -- the conformance kit -------------------------------------------------------------------------------------------
CLAIMED = {"ADD", "MUL", "MUL_MAT", "RMS_NORM"}


def _kit() -> Any:
    import importlib

    testing = importlib.import_module("ggml_py.testing")
    if not hasattr(testing, "run_backend"):
        pytest.skip("ggml_py.testing.run_backend is not available yet")
    return testing


def test_example_passes_conformance_kit(cexample: Path) -> None:
    kit = _kit()
    report = kit.run_backend(native.backend(cexample))
    assert report.failed == 0, report.table(show=("failed",))
    assert report.passed > 0 and report.skipped > 0
    passed_ops = {r.op for r in report.results if r.status == "passed"}
    assert passed_ops == CLAIMED  # every op it claims was tested and passed; nothing else ran on it
    assert "SILU" in report.not_covered and not CLAIMED & set(report.not_covered)  # the rest is reported as skipped


# Bugs real plugins had, each planted in the example by a patch of its source: (what the example has, what the bug
# writes instead, the ops whose cases the kit runs on it)
PLANTED_BUGS = {
    "eps ignored": ("sqrt(sum / (double)d->ne[0] + eps)", "sqrt(sum / (double)d->ne[0] + 0.0 * eps)", "RMS_NORM"),
    "NaN where b == 0": ("mul ? x * y : x + y", "mul ? (y == 0.0f ? NAN : x * y) : x + y", "MUL"),
    "strides ignored": ("(char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]",
                        "(char *)t->data + 4 * (i0 + t->ne[0] * (i1 + t->ne[1] * (i2 + t->ne[2] * i3)))",
                        "ADD,MUL,RMS_NORM,MUL_MAT"),
    "symbols never bound": ("ggml_py_tensor_bind(in->src[1], args->syms, &b);", "b = *in->src[1];", "ADD,MUL_MAT"),
    "weight broadcast by modulo": ("at(a, 0, m, i2 / r2, i3 / r3)",
                                   "at(a, 0, m, i2 % a->ne[2] + 0 * r2, i3 % a->ne[3] + 0 * r3)", "MUL_MAT"),
}


@pytest.mark.parametrize("bug", list(PLANTED_BUGS))
def test_kit_fails_the_example_with_a_planted_bug(bug: str, libdir: Path) -> None:
    kit = _kit()
    good, bad, ops_ = PLANTED_BUGS[bug]
    src = EXAMPLE.read_text()
    assert src.count(good) == 1, f"the example no longer has {good!r}: update the planted bug"
    patched = libdir / f"cexample_{bug.replace(' ', '_').replace('=', '')}.c"
    patched.write_text(src.replace(good, bad))
    lib = build(patched, libdir / f"lib{patched.stem}.so", sanitize=False)
    report = kit.run_backend(native.backend(lib), kit.cases(op=ops_))
    assert report.failed > 0, f"the kit let '{bug}' through: {report.passed} passed"
    # every op the bug touches is caught, not only one of them (strides ignored: by the view cases of each)
    assert {r.op for r in report.failures} == set(ops_.split(",")), report.table(show=("failed",))
    if bug == "strides ignored":  # each source of each op, through its generated views alone (view_cases.py)
        from ggml_py.testing.view_cases import view_of

        views = kit.run_backend(native.backend(lib), [c for c in kit.cases(op=ops_) if view_of(c)])
        assert {(r.op, view_of(r)[0]) for r in views.failures} == {
            ("ADD", "a"), ("ADD", "b"), ("MUL", "a"), ("MUL", "b"), ("RMS_NORM", "a"), ("MUL_MAT", "a"),
            ("MUL_MAT", "b")}, views.table(show=("failed",))


# A plugin that computes MUL_MAT's products in F16 (as GPU plugins may): both operands rounded to F16's significand
_ROUND_F16 = """
static float round_f16(float x) { /* to F16's 11-bit significand, nearest even (range not limited) */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x0FFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    memcpy(&x, &u, sizeof x);
    return x;
}

"""
_F16_PRODUCTS = [
    ("/* dst[n, m] = sum_k a[m, k] * b[n, k]", _ROUND_F16 + "/* dst[n, m] = sum_k a[m, k] * b[n, k]"),
    ("sum += *(const float *)(arow + k * a->nb[0]) * *(const float *)(brow + k * b->nb[0]);",
     "sum += round_f16(*(const float *)(arow + k * a->nb[0])) * round_f16(*(const float *)(brow + k * b->nb[0]));"),
]
_DECLARE_REDUCED = ("GGML_PY_PRECISION_EXACT,", "GGML_PY_PRECISION_REDUCED,")


@pytest.mark.parametrize("tier", ["exact", "reduced"])
def test_f16_products_pass_only_as_a_reduced_plugin(tier: str, libdir: Path) -> None:
    kit = _kit()
    src = EXAMPLE.read_text()
    for good, bad in _F16_PRODUCTS + ([_DECLARE_REDUCED] if tier == "reduced" else []):
        assert src.count(good) == 1, f"the example no longer has {good!r}"
        src = src.replace(good, bad)
    path = libdir / f"cexample_f16_{tier}.c"
    path.write_text(src)
    be = native.backend(build(path, libdir / f"lib{path.stem}.so"))
    assert be.device.caps["precision"] == tier
    report = kit.run_backend(be, kit.cases(op="MUL_MAT"))
    assert report.precision == tier
    float_cases = [r for r in report.results if r.status != "skipped"]
    worst = max(r.nmse for r in float_cases if r.nmse is not None)
    assert 1e-10 < worst < 5e-4  # what F16 products cost: far above the exact tier's bound, far below ggml's
    if tier == "exact":
        assert report.failed > 0 and all("> 1.0e-10" in r.message for r in report.failures)
    else:
        assert report.failed == 0 and report.passed > 0, report.table(show=("failed",))


def test_kit_catches_wrong_and_failing_plugins(libdir: Path) -> None:
    kit = _kit()
    add_cases = kit.cases(op="ADD")
    wrong = kit.run_backend(native.backend(plug(libdir, "wrongadd", "-DPLUG_WRONG")), add_cases)
    assert wrong.failed > 0 and {r.op for r in wrong.failures} == {"ADD"}
    assert all(r.nmse is not None and r.nmse > r.max_nmse for r in wrong.failures)
    failing = kit.run_backend(native.backend(plug(libdir, "failadd", "-DPLUG_FAIL_COMPUTE")), add_cases)
    assert failing.failed > 0 and failing.passed == 0
    msg = failing.failures[0].message
    assert "native backend 'failadd'" in msg and "failed in ADD" in msg and "injected failure" in msg


def test_cli_errors_from_plugins_are_one_line(libdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin that fails to load is findable by the name it would have had; one that raises anything (not only
    ggml_py's errors) gives `error: <one line>` and exit 1, the traceback only under --debug."""
    lib = plug(libdir, "brokenabi", "-DPLUG_ABI=999")
    env = {**os.environ, "GGML_PY_BACKEND_PATH": str(lib)}
    r = subprocess.run([sys.executable, "-m", "ggml_py", "test-backend", "brokenabi"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "ABI version 999" in r.stderr

    from ggml_py.commands import cli
    from ggml_py.runtime.backend import BackendRegistration

    class Boom(BackendRegistration):
        name = "boom"

        def devices(self):  # type: ignore[no-untyped-def]
            return []

        def create(self, device=None, **options):  # type: ignore[no-untyped-def]
            raise ZeroDivisionError("the plugin divided by zero")

    registry.register("boom", Boom(), source="test")
    try:
        assert cli.main(["test-backend", "boom"]) == 1
        err = capsys.readouterr().err
        assert err.strip() == ("error: ZeroDivisionError: the plugin divided by zero (run with --debug for the "
                               "traceback)")
        with pytest.raises(ZeroDivisionError):
            cli.main(["test-backend", "boom", "--debug"])
    finally:
        registry.unregister("boom")


@needs_cc
def test_plugin_built_against_the_installed_header_passes_the_kit(tmp_path: Path) -> None:
    """What a plugin author with a pip-installed ggml_py (no checkout) does: -I$(ggml-py config --include), build,
    load through GGML_PY_BACKEND_PATH, run the kit. `python -I` ignores this checkout and uses the installed package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", "-m", "ggml_py", "config", "--include"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    include = Path(r.stdout.strip())
    # the suite runs against the installed wheel (conftest): its header, not the checkout's
    assert r.returncode == 0 and include != ROOT / "ggml_py" / "include", r.stderr.strip() or include
    assert (include / "ggml_py" / "backend_abi.h").is_file()
    lib = tmp_path / "libggml_py_cexample.so"
    cmd = [CC, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{include}", "-o", str(lib),
           str(EXAMPLE)]
    b = subprocess.run(cmd, capture_output=True, text=True, env=tool_env())
    assert b.returncode == 0, b.stderr
    r = subprocess.run([sys.executable, "-I", "-m", "ggml_py", "test-backend", "cexample", "--json"],
                       capture_output=True, text=True, cwd=tmp_path, env={**env, "GGML_PY_BACKEND_PATH": str(lib)},
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["failed"] == 0 and rep["passed"] >= 40


def test_profile_per_backend_and_op_and_tiny_split_warning(cexample: Path, libdir: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    lib = plug(libdir, "timed")
    be = native.backend(lib)
    a = gp.input((64,), name="a")
    y = ops.silu(ops.add(ops.add(a, a), a))  # ADD, ADD on the plugin; SILU on numpy
    plan = gp.prepare(y, backends=[be, "numpy"])
    plan.set_input("a", np.ones(64, np.float32))
    rep = plan.profile(computes=3)
    assert rep["computes"] == 3 and [s["backend"] for s in rep["splits"]] == ["timed", "numpy"]
    # the plugin timed its nodes through the ABI, numpy (a NodePlan) its own
    assert rep["by_op"]["ADD"] > 0 and set(rep["by_op"]) == {"ADD", "SILU"}
    assert {b: set(o) for b, o in rep["by_backend_op"].items()} == {"timed": {"ADD"}, "numpy": {"SILU"}}
    assert rep["seconds_per_compute"] >= sum(rep["by_backend"].values()) > 0
    assert rep["host_seconds_per_compute"] >= 0 and not rep["warnings"]
    np.testing.assert_allclose(plan.get_output(y), 3 / (1 + np.exp(-3)) * np.ones(64), rtol=1e-5)
    # a plugin that claims scattered nodes cuts the plan into many tiny splits: said at prepare
    x = gp.input((8,), name="x")
    z = x
    for _ in range(20):
        z = ops.silu(ops.add(z, x))
    with caplog.at_level("WARNING", logger="ggml_py"):
        cut = gp.prepare(z, backends=[native.backend(cexample), "numpy"])
    assert len(cut.runs) == 40 and cut.warnings and "40 splits" in caplog.text


# -- shipped as a wheel ------------------------------------------------------------------------------------------
@pytest.mark.python_only  # packaging (a venv, setuptools, pip: 25 s under ASan); the library's kit runs are above
def test_native_plugin_shipped_as_a_wheel(tmp_path: Path) -> None:
    """examples/c-backend as a package (setuptools compiles cexample.c against ggml_py.get_include() into the
    wheel; the entry point returns the library's path), pip-installed into a temporary venv: found by its entry
    point, listed, and passing the conformance kit on what it claims; uninstalled, it is gone."""
    from test_python_plugin import install_copy, make_venv

    v = make_venv(tmp_path)
    install_copy(v, EXAMPLE.parent, tmp_path)
    rows = {b["name"]: b for b in v.cli("backends")["backends"]}
    assert rows["cexample"]["status"] == "ok", rows["cexample"]
    assert "ggml_py_cexample:library_path" in rows["cexample"]["source"]
    rep = v.cli("test-backend", "cexample")
    assert rep["failed"] == 0 and rep["passed"] > 0
    assert {r["op"] for r in rep["results"] if r["status"] == "passed"} == CLAIMED
    v.run("-m", "pip", "uninstall", "-y", "-q", "ggml-py-cexample")
    assert "cexample" not in {b["name"] for b in v.cli("backends")["backends"]}
