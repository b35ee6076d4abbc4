"""The SIMD backend: C++ kernels (scalar / AVX2 / AVX-512, chosen at run time) behind ggml_py's C ABI v2.

It is a plugin like any other: the compiled module `_simd` holds a `ggml_py_plugin` table (csrc/simd/plugin.cpp), and
ggml_py drives it through `ggml_py.runtime.native`, the path a third-party shared library takes. The module's pybind11
functions are only what is simd's own: ISA level selection, CPU features, kernel utilities for tests and benchmarks. A
split is lowered once into the ABI's node array; every compute is one C call with the GIL released, on a persistent
thread pool. See docs/simd.md.

Environment: `GGML_PY_SIMD=scalar|avx2|avx512` forces a level (an error if the CPU lacks it);
`GGML_PY_SIMD_THREADS` overrides the default thread count (the number of physical cores).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ggml_py.errors import BackendError
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime import native
from ggml_py.runtime.backend import Backend, BackendRegistration, Device

__version__ = "0.2.0"

try:
    from . import _simd
except ImportError as _e:  # pragma: no cover - the extension is not built
    _simd = None
    _IMPORT_ERROR: Exception | None = _e
else:
    _IMPORT_ERROR = None


def _require() -> Any:
    if _simd is None:
        raise BackendError(f"the simd backend's compiled module is not available: {_IMPORT_ERROR}")
    return _simd


def _apply_env_level() -> None:
    want = os.environ.get("GGML_PY_SIMD", "").strip().lower()
    if want:
        try:
            _require().set_level(want)
        except ValueError as e:
            raise BackendError(f"GGML_PY_SIMD={want}: {e}") from None


def level() -> str:
    """The active SIMD level (plans built from now on use it)."""
    return _require().level()


def set_level(name: str) -> None:
    """Select the SIMD level for plans built afterwards; BackendError if the CPU lacks it."""
    try:
        _require().set_level(name)
    except ValueError as e:
        raise BackendError(str(e)) from None


def levels() -> list[str]:
    """The levels this CPU supports, lowest first."""
    return list(_require().levels())


def library() -> native.NativeLibrary:
    """The backend's ABI v2 plugin table, loaded as any native plugin is."""
    simd = _require()
    return native.load_table(simd.plugin_table(), simd, "ggml_py_simd._simd")


class SimdBackend(native.NativeBackend):
    """A native backend over simd's table, plus what only simd knows: the memory its weight repacking takes."""

    @property
    def level(self) -> str | None:
        return self.options.get("level")

    def __init__(self, library: native.NativeLibrary, device: Device, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        super().__init__(library, device, self.options)

    def plan_info(self, plan: Any) -> dict[str, Any]:
        """What simd chose for a plan of this backend: level, n_threads, n_nodes, n_tasks, grouped_products
        (matrix-vector products computed in the task of an earlier one that reads the same input), scratch."""
        return dict(_require().plan_info(int(native.ffi().cast("uintptr_t", plan.handle))))

    def weight_cache_bytes(self, weights: Sequence[Tensor]) -> int:
        """The interleaved copies made for matrix products (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K matrices,
        at AVX2 and up): an upper bound, as a matrix only used by GET_ROWS (an untied embedding) is never repacked."""
        simd = _require()
        return sum(simd.repacked_nbytes(t.dtype.ggml_id, t.shape[1], t.shape[0], self.level)
                   for t in weights if t.ndim == 2)


class SimdRegistration(native.NativeRegistration):
    backend_class = SimdBackend

    def device_caps(self) -> dict[str, Any]:
        simd = _require()
        feats = simd.cpu_features()
        return {**super().device_caps(), "level": simd.level(), "levels": simd.levels(),
                "features": [k for k, v in feats.items() if v is True]}

    def devices(self) -> list[Device]:
        simd = _require()
        dev = super().devices()[0]
        threads = int(os.environ.get("GGML_PY_SIMD_THREADS", "0") or 0) or simd.physical_cores()
        brand = simd.cpu_features().get("brand") or "CPU"
        return [Device("cpu", f"SIMD kernels ({simd.level()}) on {brand}", n_threads=threads, score=dev.score,
                       caps=dev.caps)]

    def create(self, device: Device | None = None, **options: Any) -> Backend:
        """Options: n_threads, level (scalar, avx2, avx512: refused if the CPU lacks it)."""
        lvl = options.get("level")
        if lvl is not None:
            lvl = options["level"] = str(lvl).lower()
            try:
                missing = _require().level_missing(lvl)
            except ValueError as e:
                raise BackendError(f"simd: {e} (scalar, avx2, avx512)") from None
            if missing:
                raise BackendError(f"simd level {lvl!r} is not supported by this CPU (missing: {missing})")
        return super().create(device, **options)


def register() -> BackendRegistration:
    """Entry point of the `ggml_py.backends` group."""
    _require()
    _apply_env_level()
    return SimdRegistration(library())
