"""Write a ready-to-build backend plugin package (Python or C) from the templates shipped with ggml_py.

The templates are real files under ggml_py/commands/templates/new_backend/: `common/` for both languages, then
`python/` or `c/`. A file's name ends in `.tmpl` (so that neither ruff nor pytest takes a template for code of ours);
a path part `dot_X` becomes `.X` (a `.gitignore` among the templates would apply to ggml_py's own tree); `{{key}}`
in a path or a text is replaced by the value of `key` (an unknown key is an error, so a typo cannot ship).
"""

from __future__ import annotations

import argparse
import re
import shlex
from importlib import metadata
from pathlib import Path
from typing import Any

from ggml_py.runtime import native

TEMPLATES = Path(__file__).resolve().parent / "templates" / "new_backend"
LANGS = ("python", "c")
NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
# The first setuptools with bdist_wheel built in: older ones (Python 3.11's venv has 65.5) build wheels only with the
# `wheel` package, and without build isolation fail with "invalid command 'bdist_wheel'".
SETUPTOOLS = "setuptools>=70.1"
VERSION = "0.1.0"  # a generated package's own first version
_KEY = re.compile(r"\{\{(\w+)\}\}")

EPILOG = """\
examples:
  ggml-py new-backend mydev --lang python     # ./ggml-py-mydev: package ggml_py_mydev, numpy kernels
  ggml-py new-backend mydevc --lang c -o DIR  # DIR: a C11 library (ABI {abi}) in a py3-none wheel

Either package computes ADD, MUL, RMS_NORM and MUL_MAT on F32 tensors as generated and passes the conformance kit
(its tests/test_kit.py); add ops where it says TODO. The command prints the commands that build, install and test
it; docs/writing-a-backend.md, "Start from a template", shows them too."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # the subparser is made by cli.build_parser; a description and examples make `new-backend --help` self-contained
    p.description = ("Write a backend plugin package for ggml_py: the backend's source, a pyproject.toml with the\n"
                     "`ggml_py.backends` entry point and a ggml_py version range, a README, tests that run the\n"
                     "conformance kit on it, and a CI script (ci.sh, .github/workflows/ci.yml).")
    p.epilog = EPILOG.format(abi=".".join(map(str, native.abi_version())))
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("name", metavar="NAME",
                   help="the backend's name: a lowercase letter, then lowercase letters, digits or _ (the Python "
                        "package is ggml_py_NAME, the distribution ggml-py-NAME)")
    p.add_argument("--lang", choices=LANGS, required=True,
                   help="python: numpy kernels in a pure-Python package; c: a C11 shared library against "
                        "ggml_py's C ABI header, built into a py3-none-<platform> wheel")
    p.add_argument("-o", "--output", metavar="DIR", default=None,
                   help="the folder to write (default ./ggml-py-NAME); it must not exist or be empty")


def ggml_py_requirement(version: str) -> str:
    """`ggml_py>=X.Y,<X+1` for an installed version X.Y.Z: the API a generated package is written against, up to the
    next major version (which may break it). A pre-release is its own lower bound (>=X.Y would exclude it)."""
    public = version.split("+")[0]  # a local label (+cpu) is no part of the range
    m = re.match(r"(\d+)\.(\d+)", public)
    if m is None:
        raise ValueError(f"cannot make a version range from ggml_py's version {version!r}")
    major, minor = int(m[1]), int(m[2])
    pre = re.search(r"(?<![a-z])(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", public[m.end():].lower())
    return f"ggml_py>={public if pre else f'{major}.{minor}'},<{major + 1}"


def _builtin_backends() -> set[str]:
    """The backends ggml_py itself ships (their packages are ggml_py_<name>: a plugin of that name would clash)."""
    try:
        eps = metadata.distribution("ggml_py").entry_points
    except metadata.PackageNotFoundError:  # a source tree on sys.path
        return {"numpy", "simd"}
    return {ep.name for ep in eps if ep.group == "ggml_py.backends"}


def context(name: str) -> dict[str, str]:
    version = metadata.version("ggml_py")
    major, minor = native.abi_version()
    return {
        "name": name,
        "version": VERSION,
        "package": f"ggml_py_{name}",
        "dist": f"ggml-py-{name}",
        "camel": "".join(part.capitalize() for part in name.split("_")),
        "ggml_py_version": version,
        "ggml_py_requirement": ggml_py_requirement(version),
        "abi_version": f"{major}.{minor}",
        "setuptools": SETUPTOOLS,
    }


def render(text: str, ctx: dict[str, str], where: str) -> str:
    def value(m: re.Match[str]) -> str:
        if m[1] not in ctx:
            raise KeyError(f"template {where}: unknown key {{{{{m[1]}}}}}")
        return ctx[m[1]]

    return _KEY.sub(value, text)


def template_files(lang: str) -> dict[str, Path]:
    """Relative output path (still with {{keys}}) -> template file; the language's files replace common ones."""
    files: dict[str, Path] = {}
    for part in ("common", lang):
        root = TEMPLATES / part
        for f in sorted(root.rglob("*.tmpl")):
            rel = f.relative_to(root).with_suffix("")  # drops .tmpl
            files["/".join("." + p[4:] if p.startswith("dot_") else p for p in rel.parts)] = f
    return files


def _shown(path: Path) -> str:
    """The folder as a command line argument pip takes for a local project (a bare name would be a requirement)."""
    s = str(path)
    return shlex.quote(s if path.is_absolute() or s.startswith(".") else f"./{s}")


def next_commands(lang: str, out: Path, ctx: dict[str, str]) -> list[str]:
    """The commands that build, install and test the package: the ones docs/writing-a-backend.md shows."""
    src = _shown(out)
    tests = shlex.quote(str(out / "tests"))
    if lang == "python":
        build = [f"pip install --no-build-isolation {src}"]
    else:
        wheel = f"dist/{ctx['package']}-{VERSION}-py3-none-*.whl"
        build = [f"pip wheel --no-build-isolation --no-deps -w dist {src}", f"pip install {wheel}"]
    return [f'pip install "{SETUPTOOLS}"', *build, f"pytest {tests}", "ggml-py backends"]


def generate(name: str, lang: str, out: Path) -> list[Path]:
    """Write the package for backend `name` in language `lang` into `out`; the files written."""
    if not NAME_RE.match(name):
        raise ValueError(f"invalid backend name {name!r}: use a lowercase letter, then lowercase letters, digits "
                         "or _ (e.g. mydev)")
    if name in _builtin_backends():
        raise ValueError(f"{name!r} is a backend ggml_py ships (its package is ggml_py_{name}): choose another name")
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}: one of {', '.join(LANGS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty folder: choose another with -o DIR, or remove it")
    ctx = context(name)
    files = template_files(lang)
    if not files:  # a wheel built without its package data
        raise FileNotFoundError(f"no templates for {lang!r} in {TEMPLATES}: this ggml_py installation is incomplete")
    written = []
    for rel, src in files.items():
        dst = out / render(rel, ctx, rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(render(src.read_text(encoding="utf-8"), ctx, rel), encoding="utf-8")
        if dst.suffix == ".sh":
            dst.chmod(0o755)  # a wheel does not keep the templates' modes
        written.append(dst)
    return written


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.output if args.output is not None else f"ggml-py-{args.name}")
    written = generate(args.name, args.lang, out)
    ctx = context(args.name)
    steps = next_commands(args.lang, out, ctx)
    if not args.json:
        print(f"wrote {len(written)} files to {out}/ (backend {args.name!r}, package {ctx['package']}, "
              f"{args.lang}, {ctx['ggml_py_requirement']})")
        print("next, in a venv where ggml_py is installed:")
        for s in steps:
            print(f"  {s}")
        print(f"then add ops where {out}/README.md and the TODO markers say.")
    return {"name": args.name, "lang": args.lang, "path": str(out), "package": ctx["package"],
            "requires": ctx["ggml_py_requirement"], "files": [str(p.relative_to(out)) for p in written],
            "next": steps}
