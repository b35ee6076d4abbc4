"""Compiles cexample.c (C11) against the installed ggml_py's header into ggml_py_cexample/. It is built like a Python
extension only to get setuptools' compiler handling and a platform wheel; Python never imports it, ggml_py dlopens it
(see ggml_py_cexample.library_path)."""

from setuptools import Extension, setup

import ggml_py

setup(ext_modules=[Extension("ggml_py_cexample._plugin", ["cexample.c"], include_dirs=[ggml_py.get_include()],
                             extra_compile_args=["-std=c11", "-O2"])])
