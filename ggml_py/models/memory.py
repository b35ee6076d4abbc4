"""Refusing a model that would not fit in memory: what loading it will need, against what the kernel says is free."""

from __future__ import annotations

from collections.abc import Sequence

from ggml_py.errors import ModelError
from ggml_py.sysmem import available_memory, mib

__all__ = ["available_memory", "mib", "require_memory"]


def require_memory(parts: Sequence[tuple[str, int]], hint: str) -> None:
    """Raise ModelError, naming every part and its size, if the parts together exceed the available memory."""
    avail = available_memory()
    need = sum(n for _, n in parts)
    if avail is not None and need > avail:
        detail = ", ".join(f"{what}: {mib(n)}" for what, n in parts if n)
        raise ModelError(f"the model needs {mib(need)} ({detail}), more than the {mib(avail)} of available memory; "
                         f"{hint}")
