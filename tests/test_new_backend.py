"""`ggml-py new-backend NAME --lang python|c` (issue 30, item 5): the packages it writes from the templates in the
installed wheel build, install and pass the conformance kit in a fresh venv, by exactly the commands of
docs/writing-a-backend.md, section "Start from a template: ggml-py new-backend" (read from there: the docs' blocks
marked `<!-- new-backend: LANG -->` are what runs, so they cannot drift apart); the C one as a py3-none wheel.

The fresh venv sees this test venv's packages (the installed ggml_py wheel, pip, setuptools, pytest) through a .pth
file (tests/test_python_plugin.make_venv), and gets `ggml-py`, `pip` and `pytest` commands of its own, so the docs'
lines run as they are, in a shell. One venv serves both languages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from test_python_plugin import Venv, make_venv

from ggml_py.commands import new_backend
from ggml_py.commands.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"
SHIMS = {"ggml-py": "from ggml_py.commands.cli import main", "pip": "from pip._internal.cli.main import main",
         "pytest": "from pytest import main"}


def doc_commands(lang: str) -> list[str]:
    """The shell lines of the docs' block marked `<!-- new-backend: LANG -->`, without their comments."""
    m = re.search(rf"<!-- new-backend: {lang} -->\n```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    assert m, f"docs/writing-a-backend.md has no block <!-- new-backend: {lang} -->"
    return [re.sub(r"\s+#.*", "", line) for line in m[1].splitlines() if line.strip()]


class Shell:
    """Shell lines run in a folder with the venv's commands first on PATH."""

    def __init__(self, v: Venv, cwd: Path) -> None:
        bindir = Path(v.python).parent
        for name, imp in SHIMS.items():  # console scripts as pip would write them (no checkout on sys.path)
            script = bindir / name
            script.write_text(f"#!{v.python}\nimport sys\n{imp}\nsys.exit(main())\n")
            script.chmod(0o755)
        self.cwd = cwd
        self.env = {**v.env, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
                    "PIP_NO_INDEX": "1",  # all it needs is installed: a pip that reached for an index would fail
                    # pytest plugins as in a user's venv, ggml_py's alone: this venv's others (langsmith, anyio,
                    # hypothesis; from the test extras) cost 2 s of start-up per run
                    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "ggml_py.testing.pytest_plugin"}
        self.env.pop("PYTHONPATH", None)  # ggml_py from the installed wheel, never from this checkout

    def run(self, line: str) -> str:
        r = subprocess.run(line, shell=True, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"$ {line}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
        return r.stdout


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    base = tmp_path_factory.mktemp("newbackend")
    sh = Shell(make_venv(base), base)
    where = sh.run("python -c 'import ggml_py; print(ggml_py.__file__)'")
    assert "site-packages" in where, where  # the templates come from the installed wheel
    yield sh
    shutil.rmtree(base, ignore_errors=True)


def run_doc_block(sh: Shell, lang: str) -> dict[str, str]:
    """Each line of the docs' block, in order; the output of each by its first words."""
    out = {}
    for line in doc_commands(lang):
        out[" ".join(line.split()[:2])] = sh.run(line)
    return out


def test_python_template_builds_installs_and_passes_the_kit(shell: Shell) -> None:
    out = run_doc_block(shell, "python")
    assert "pip install --no-build-isolation ./ggml-py-mydev" in out["ggml-py new-backend"]  # says what to run next
    assert re.search(r"\b3 passed\b", out["pytest ggml-py-mydev/tests"]), out["pytest ggml-py-mydev/tests"]
    listed = out["ggml-py backends"]  # mydev 0.1.0 ok / source: entry point ggml_py_mydev:register (...)
    assert re.search(r"^mydev +0\.1\.0 +ok\n +source: entry point ggml_py_mydev:register \(ggml-py-mydev 0\.1\.0\)",
                     listed, flags=re.M), listed
    # ggml_py>=X.Y,<X+1 from the installed version (setuptools writes the specifiers in an order of its own)
    wanted = new_backend.ggml_py_requirement(metadata.version("ggml_py"))
    assert f'"{wanted}"' in (shell.cwd / "ggml-py-mydev" / "pyproject.toml").read_text()
    got = shell.run("python -c 'from importlib.metadata import requires; print(requires(\"ggml-py-mydev\")[0])'")
    assert set(got.strip().removeprefix("ggml_py").split(",")) == set(wanted.removeprefix("ggml_py").split(","))


def test_c_template_builds_a_py3_none_wheel_that_passes_the_kit(shell: Shell) -> None:
    out = run_doc_block(shell, "c")
    assert re.search(r"\b3 passed\b", out["pytest ggml-py-mydevc/tests"]), out["pytest ggml-py-mydevc/tests"]
    (wheel,) = (shell.cwd / "dist").glob("ggml_py_mydevc-*.whl")
    assert re.fullmatch(r"ggml_py_mydevc-0\.1\.0-py3-none-[a-z0-9_]+\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("ggml_py_mydevc-0.1.0.dist-info/WHEEL").decode()
        names = z.namelist()
    assert re.search(r"^Tag: py3-none-", meta, flags=re.M) and "Root-Is-Purelib: false" in meta, meta
    lib = "ggml_py_mydevc/libggml_py_mydevc.so"
    assert lib in names, names  # one name for every Python 3: no cpython-3XX suffix
    listed = out["ggml-py backends"]
    assert re.search(r"^mydevc +0\.1\.0 +ok\n +source: entry point ggml_py_mydevc:library_path ", listed, flags=re.M), \
        listed


def test_generated_sources_are_clean(tmp_path: Path) -> None:
    """The Python of both templates passes this project's ruff rules; the C compiles without a warning."""
    for lang in ("python", "c"):
        new_backend.generate(f"clean{lang}", lang, tmp_path / lang)
    # this project's rules (pyproject.toml), but isolated: to the generated package ggml_py is a third-party import
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff), "check", "--isolated", "--no-cache", "--select", "E,F,W,I,UP,B",
                        "--ignore", "E741,B905,B027", "--line-length", "120", "--target-version", "py310", "."],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler"
    import ggml_py

    r = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsyntax-only",
                        f"-I{ggml_py.get_include()}", str(tmp_path / "c" / "csrc" / "cleanc.c")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args, message", [
    (["My-Dev", "--lang", "python"], "invalid backend name 'My-Dev'"),
    (["1dev", "--lang", "c"], "invalid backend name '1dev'"),
    (["numpy", "--lang", "python"], "'numpy' is a backend ggml_py ships"),
    (["mydev", "--lang", "python", "-o", "{full}"], "already exists and is not an empty folder"),
])
def test_refusals_are_one_line(args: list[str], message: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["new-backend", *[a.format(full=full) for a in args]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]  # nothing written


def test_empty_folder_is_used_and_json_lists_files_and_next_steps(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    assert main(["new-backend", "my_dev2", "--lang", "c", "-o", str(tmp_path / "out"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["package"] == "ggml_py_my_dev2" and out["requires"].startswith("ggml_py>=")
    assert {"csrc/my_dev2.c", "setup.py", "pyproject.toml", "README.md", "ci.sh", "tests/test_kit.py",
            ".github/workflows/ci.yml", "src/ggml_py_my_dev2/__init__.py"} <= set(out["files"])
    assert os.access(tmp_path / "out" / "ci.sh", os.X_OK)
    assert any(s.startswith("pip wheel --no-build-isolation") for s in out["next"])
    assert "{{" not in "".join(p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file()).replace(
        "${{", "")  # every key substituted (GitHub's own ${{ ... }} aside)


@pytest.mark.parametrize("version, requirement", [
    ("0.1.0", "ggml_py>=0.1,<1"), ("1.4.2", "ggml_py>=1.4,<2"), ("2.0", "ggml_py>=2.0,<3"),
    ("0.3.0rc1", "ggml_py>=0.3.0rc1,<1"), ("1.2.0.dev4", "ggml_py>=1.2.0.dev4,<2"), ("1.2.3.post1", "ggml_py>=1.2,<2"),
    ("0.1.0+cpu", "ggml_py>=0.1,<1"),
])
def test_ggml_py_requirement(version: str, requirement: str) -> None:
    assert new_backend.ggml_py_requirement(version) == requirement
