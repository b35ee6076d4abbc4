"""Compiles cexample.c (C11) against the installed ggml_py's header into ggml_py_cexample/, in a py3-none-<platform>
wheel. It is declared as a Python extension only to get setuptools' compiler handling; Python never imports it,
ggml_py dlopens it (see ggml_py_cexample.library_path), and it never touches CPython's ABI. So the overrides below
give it a name without a CPython tag, no PyInit_ export and no Python library, and tag the wheel py3-none: one wheel
for every Python 3 on the platform. Needs setuptools >= 70.1 (bdist_wheel built in; older ones fail without
isolation with "invalid command 'bdist_wheel'")."""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError as e:
    raise SystemExit('ggml-py-cexample: building needs setuptools >= 70.1: pip install "setuptools>=70.1"') from e

import ggml_py

LIBRARY = "libggml_py_cexample" + (".dll" if sys.platform == "win32" else ".so")  # ggml_py_cexample.LIBRARY


class BuildLibrary(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")[:-1], LIBRARY)  # the package's folder, then the fixed name

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return ext.export_symbols  # no PyInit_: nothing to import

    def get_libraries(self, ext: Extension) -> list[str]:
        return ext.libraries  # no Python library


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


setup(ext_modules=[Extension("ggml_py_cexample._plugin", ["cexample.c"], include_dirs=[ggml_py.get_include()],
                             extra_compile_args=["-std=c11", "-O2"])],
      cmdclass={"build_ext": BuildLibrary, "bdist_wheel": PlatformWheel})
