"""List discovered backends: name, version, devices, source entry point, status."""

from __future__ import annotations

import argparse
from typing import Any

from ggml_py.runtime.registry import registry


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = [info.describe() for info in registry.infos()]
    default = registry.default_names()
    if not args.json:
        for r in rows:
            print(f"{r['name']:<10} {r['version'] or '-':<8} {r['status']}")
            print(f"  source: {r['source']}")
            for d in r["devices"]:
                precision = d.get("caps", {}).get("precision", "exact")  # the conformance kit's tier
                print(f"  device {d['name']}: {d['description']} (score {d['score']}, threads {d['n_threads']}, "
                      f"precision {precision})")
        print(f"default order: {', '.join(default) or 'none'}")
    return {"backends": rows, "default": default}
