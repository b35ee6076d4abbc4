"""The architecture registry: every GGUF `general.architecture` ggml_py runs, from the declarative specs (specs.py)
and the modules of families with graph code of their own (gemma3.py)."""

from __future__ import annotations

from ggml_py.errors import ModelError
from ggml_py.models import gemma3
from ggml_py.models.architecture import Architecture
from ggml_py.models.specs import DENSE

_registry: dict[str, Architecture] = {}


def architectures() -> dict[str, Architecture]:
    """Every supported architecture by GGUF name, aliases included."""
    if not _registry:
        for spec in DENSE:
            for name in (spec.name, *spec.aliases):
                _registry[name] = spec.architecture(name)
        _registry[gemma3.ARCHITECTURE.name] = gemma3.ARCHITECTURE
    return _registry


def get_architecture(name: str | None, path: str = "") -> Architecture:
    """The architecture called `name`; ModelError listing the supported ones if there is none."""
    archs = architectures()
    if name not in archs:
        where = f"{path}: " if path else ""
        raise ModelError(f"{where}architecture {name!r} is not supported; supported: {', '.join(sorted(archs))}")
    return archs[name]
