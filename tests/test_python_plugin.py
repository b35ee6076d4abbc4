"""The out-of-tree Python plugin (examples/python-backend): pip-installed into a temporary venv, discovered through
its `ggml_py.backends` entry point, listed by `ggml-py backends`, selected by name, passing the conformance kit.

The temporary venv sees this test venv's packages through a .pth file (a venv made from a venv would otherwise only
see the base interpreter's site-packages), so nothing is installed into the test venv itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "python-backend"
CLAIMED = {"ADD", "MUL", "SCALE", "SILU"}


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        bindir = "Scripts" if os.name == "nt" else "bin"
        self.python = str(path / bindir / ("python.exe" if os.name == "nt" else "python"))
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
        for k in ("GGML_PY_BACKENDS", "GGML_PY_BACKEND_PATH", "PYTHONHOME"):
            self.env.pop(k, None)

    def run(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([self.python, *args], capture_output=True, text=True, env={**self.env, **(env or {})},
                           timeout=300)
        if check:
            assert r.returncode == 0, f"{args}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        return r

    def cli(self, *args: str, env: dict[str, str] | None = None) -> Any:
        """`ggml-py ARGS --json` in the venv: its one JSON object."""
        r = self.run("-m", "ggml_py", *args, "--json", env=env)
        return json.loads(r.stdout)

    def script(self, code: str, env: dict[str, str] | None = None) -> Any:
        """Run code that prints one JSON object last; return it."""
        r = self.run("-c", textwrap.dedent(code), env=env)
        return json.loads(r.stdout.strip().splitlines()[-1])


def make_venv(base: Path) -> Venv:
    """A temporary venv that sees this test venv's packages and can build wheels without build isolation."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
    v = Venv(base / "venv")
    purelib = v.run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    # this test venv's packages (numpy, cffi, pip, setuptools) become visible in the temporary one
    Path(purelib, "_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if v.run("-c", "from importlib import metadata as m; m.distribution('ggml_py')", check=False).returncode:
        # ggml_py runs from the source tree here (not installed): declare its reference backend's entry point as
        # the installed distribution would, so the venv sees the numpy backend the way a user's venv does
        stub = Path(purelib, "ggml_py_source_tree-0.0.dist-info")
        stub.mkdir()
        (stub / "METADATA").write_text("Metadata-Version: 2.1\nName: ggml_py_source_tree\nVersion: 0.0\n")
        (stub / "entry_points.txt").write_text("[ggml_py.backends]\nnumpy = ggml_py_numpy:register\n")
    # --no-build-isolation builds with the setuptools at hand; before setuptools 70.1 that needs the `wheel` package
    has_bdist_wheel = "import importlib.util as u; print(bool(u.find_spec('wheel') or " \
                      "u.find_spec('setuptools.command.bdist_wheel')))"
    if v.run("-c", has_bdist_wheel).stdout.strip() != "True":
        r = v.run("-m", "pip", "install", "-q", "--disable-pip-version-check", "wheel", check=False)
        if r.returncode != 0:
            pytest.skip(f"setuptools here cannot build wheels and `wheel` could not be installed: {r.stderr[-300:]}")
    return v


def install_copy(v: Venv, example: Path, base: Path) -> None:
    """pip-install an example package from a copy (setuptools writes build/ and *.egg-info next to the sources)."""
    src = base / example.name
    shutil.copytree(example, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"))
    v.run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check",
          "-q", str(src))


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    base = tmp_path_factory.mktemp("toyvenv")
    v = make_venv(base)
    install_copy(v, EXAMPLE, base)
    yield v
    v.run("-m", "pip", "uninstall", "-y", "-q", "ggml-py-toy", check=False)


def test_installed_plugin_is_discovered_and_listed(venv: Venv) -> None:
    out = venv.script("""
        import json
        from importlib import metadata
        eps = [(e.name, e.value) for e in metadata.entry_points(group="ggml_py.backends")]
        print(json.dumps({"eps": eps}))
    """)
    assert ["toy", "ggml_py_toy:register"] in out["eps"]
    listing = venv.cli("backends")
    rows = {b["name"]: b for b in listing["backends"]}
    toy = rows["toy"]
    assert toy["status"] == "ok" and toy["version"] == "0.1.0"
    assert "ggml_py_toy:register" in toy["source"] and "ggml-py-toy 0.1.0" in toy["source"]
    assert toy["devices"][0]["score"] == 5
    assert "toy" in listing["default"]


def test_selectable_by_name(venv: Venv) -> None:
    out = venv.script("""
        import json
        import numpy as np
        import ggml_py as gp
        from ggml_py import ops
        x = gp.input((3, 8), name="x")
        w = gp.weight(np.full((4, 8), 0.5, np.float32), name="w")
        y = ops.mul_mat(w, ops.silu(ops.scale(ops.mul(ops.add(x, x), x), 0.25)))
        plan = gp.prepare(y)  # the default order: GGML_PY_BACKENDS
        xv = np.linspace(-2, 2, 24, dtype=np.float32).reshape(3, 8)
        plan.set_input("x", xv)
        plan.compute()
        h = (xv + xv) * xv * 0.25
        ref = (h / (1 + np.exp(-h))) @ np.full((8, 4), 0.5, np.float32)
        print(json.dumps({"default": gp.registry.default_names(),
                          "assignment": [(a["op"], a["backend"]) for a in plan.assignment()],
                          "err": float(np.abs(plan.get_output(y) - ref).max())}))
    """, env={"GGML_PY_BACKENDS": "toy,numpy"})
    assert out["default"] == ["toy", "numpy"]
    assert out["assignment"] == [["ADD", "toy"], ["MUL", "toy"], ["SCALE", "toy"], ["SILU", "toy"],
                                 ["MUL_MAT", "numpy"]]
    assert out["err"] < 1e-5


def test_installed_plugin_passes_conformance_kit(venv: Venv) -> None:
    rep = venv.cli("test-backend", "toy")  # exits 1 (and fails here) if any case fails
    assert rep["backend"] == "toy" and rep["failed"] == 0
    assert rep["passed"] > 0 and rep["skipped"] > 0
    assert {r["op"] for r in rep["results"] if r["status"] == "passed"} == CLAIMED  # judged on what it claims
    assert "MUL_MAT" in rep["not_covered"] and not CLAIMED & set(rep["not_covered"])  # and says what it lacks


def test_uninstall_removes_it(venv: Venv) -> None:
    venv.run("-m", "pip", "uninstall", "-y", "-q", "ggml-py-toy")
    assert "toy" not in {b["name"] for b in venv.cli("backends")["backends"]}


def test_toy_in_process_matches_numpy(rng: np.random.Generator) -> None:
    """The same package imported from the source tree (no install): symbolic shapes, broadcasting, strided views."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import ggml_py_toy
    finally:
        sys.path.remove(str(EXAMPLE))
    import ggml_py as gp
    from ggml_py.ir import ops

    toy = ggml_py_toy.register().create()
    n = gp.sym("n", 6)
    x = gp.input((n, 4, 8), name="x")
    b = gp.input((2, 1, 8), name="b")  # tiled twice over dim 0, broadcast over dim 1
    y = ops.silu(ops.scale(ops.mul(ops.add(ops.permute(x, (1, 0, 2)), b), b), 0.5, 0.25))
    plan = gp.prepare(y, backends=[toy, "numpy"])
    assert {a["backend"] for a in plan.assignment()} == {"toy"}
    for k in (1, 6, 3):
        xv = rng.standard_normal((k, 4, 8)).astype(np.float32)
        bv = rng.standard_normal((2, 1, 8)).astype(np.float32)
        plan.set_input("x", xv)
        plan.set_input("b", bv)
        plan.compute()
        bt = np.tile(bv, (2, 1, 1))
        h = ((xv.transpose(1, 0, 2) + bt) * bt) * 0.5 + 0.25
        np.testing.assert_allclose(plan.get_output(y), h / (1 + np.exp(-h)), rtol=1e-5, atol=1e-6)
