"""Where ggml_py is installed and what it speaks: the C ABI header's folder (for native plugins), the ABI version."""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any

from ggml_py.runtime import native


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--include", action="store_true",
                   help="print only the folder to add to a native plugin's include path (-I)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    major, minor = native.abi_version()
    info = {"version": metadata.version("ggml_py"), "include": native.get_include(), "abi_version": f"{major}.{minor}"}
    if not args.json:
        if args.include:
            print(info["include"])
        else:
            for k, v in info.items():
                print(f"{k}: {v}")
    return info
