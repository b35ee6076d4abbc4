"""Backend discovery through the `ggml_py.backends` entry-point group.

Discovery is lazy (nothing is imported until a backend is asked for or listed) and fault-tolerant: a plugin that
raises is logged and recorded with its error, never breaking `import ggml_py`; asking for it by name re-raises.
`GGML_PY_BACKENDS=simd,numpy` selects and orders the default backends. Native (C ABI) plugins come from entry points
whose object is a library path, or from `GGML_PY_BACKEND_PATH` (see ggml_py/runtime/native/).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ggml_py.errors import BackendError
from ggml_py.runtime.backend import Backend, BackendRegistration, Device

PATH_ENV = "GGML_PY_BACKEND_PATH"  # os.pathsep-separated native plugin libraries, or folders of them
LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")

log = logging.getLogger("ggml_py.runtime.registry")

ENTRY_POINT_GROUP = "ggml_py.backends"


@dataclass
class BackendInfo:
    """One discovered backend: where it came from and whether it loaded."""

    name: str
    source: str  # "entry point <value> (<distribution>)" or "registered in process"
    loader: Callable[[], BackendRegistration] | None = None
    registration: BackendRegistration | None = None
    error: BaseException | None = None
    instances: dict[str, Backend] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.error is not None:
            return f"error: {type(self.error).__name__}: {self.error}"
        return "ok" if self.registration is not None else "not loaded"

    def load(self) -> BackendRegistration:
        if self.registration is None and self.error is None and self.loader is not None:
            try:
                reg = self.loader()
                if not isinstance(reg, BackendRegistration):
                    raise BackendError(f"backend {self.name!r}: its entry point returned {type(reg).__name__}, "
                                       "not a ggml_py.runtime.backend.BackendRegistration")
                self.registration = reg
            except Exception as e:  # a broken plugin must not break the runtime
                log.warning("backend %r (%s) failed to load: %s", self.name, self.source, e)
                self.error = e
        if self.error is not None:
            raise self.error
        assert self.registration is not None
        return self.registration

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "source": self.source, "status": "ok", "version": None,
                             "devices": []}
        try:
            reg = self.load()
            d["version"] = reg.version
            d["devices"] = [_device_dict(dev) for dev in reg.devices()]
        except Exception as e:
            d["status"] = f"error: {type(e).__name__}: {e}"
        return d


def _device_dict(d: Device) -> dict[str, Any]:
    return {"name": d.name, "description": d.description, "memory_total": d.memory_total,
            "memory_free": d.memory_free, "n_threads": d.n_threads, "score": d.score, "caps": d.caps}


class Registry:
    def __init__(self) -> None:
        self._infos: dict[str, BackendInfo] | None = None
        self._lock = threading.RLock()

    def _discover(self) -> dict[str, BackendInfo]:
        with self._lock:
            if self._infos is None:
                infos: dict[str, BackendInfo] = {}
                for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                    if ep.name in infos:
                        log.warning("backend %r is registered twice; keeping %s", ep.name, infos[ep.name].source)
                        continue
                    dist = getattr(ep, "dist", None)
                    where = f"entry point {ep.value}" + (f" ({dist.name} {dist.version})" if dist else "")
                    infos[ep.name] = BackendInfo(ep.name, where, loader=_entry_point_loader(ep))
                if os.environ.get(PATH_ENV, "").strip():  # native plugin libraries
                    for name, where, loader in discover_path_backends():
                        if name in infos:
                            log.warning("backend %r is registered twice; keeping %s", name, infos[name].source)
                            continue
                        infos[name] = BackendInfo(name, where, loader=loader)
                self._infos = infos
            return self._infos

    def register(self, name: str, loader: Callable[[], BackendRegistration] | BackendRegistration,
                 source: str = "registered in process") -> None:
        """Add a backend without an entry point (tests, notebooks). Replaces one of the same name."""
        fn = loader if callable(loader) and not isinstance(loader, BackendRegistration) else (lambda: loader)
        with self._lock:
            self._discover()[name] = BackendInfo(name, source, loader=fn)  # type: ignore[arg-type]

    def unregister(self, name: str) -> None:
        with self._lock:
            self._discover().pop(name, None)

    def refresh(self) -> None:
        """Forget everything discovered (entry points are read again on next use)."""
        with self._lock:
            self._infos = None

    def infos(self) -> list[BackendInfo]:
        return list(self._discover().values())

    def names(self) -> list[str]:
        return list(self._discover())

    def registration(self, name: str) -> BackendRegistration:
        info = self._discover().get(name)
        if info is None:
            raise BackendError(f"unknown backend {name!r}; available: {', '.join(self.names()) or 'none'}")
        return info.load()

    def backend(self, name: str, **options: Any) -> Backend:
        """A shared instance of backend `name` for the given options (created once). "NAME:DEVICE" names one device
        of a backend that drives several."""
        name, _, device = name.partition(":")
        reg = self.registration(name)
        info = self._discover()[name]
        if device:
            options = {**options, "device": device}
        key = repr(sorted(options.items()))
        with self._lock:
            if key not in info.instances:
                info.instances[key] = reg.create(**options)
            return info.instances[key]

    def default_names(self) -> list[str]:
        """GGML_PY_BACKENDS if set, else every loadable backend whose best device scores > 0, best first."""
        env = os.environ.get("GGML_PY_BACKENDS", "").strip()
        if env:
            return [n.strip() for n in env.split(",") if n.strip()]
        scored = []
        for info in self.infos():
            try:
                score = max((d.score for d in info.load().devices()), default=0)
            except Exception:
                continue
            if score > 0:
                scored.append((-score, info.name))
        return [n for _, n in sorted(scored)]


def _entry_point_loader(ep: metadata.EntryPoint) -> Callable[[], BackendRegistration]:
    def load() -> BackendRegistration:
        obj = ep.load()
        obj = obj() if callable(obj) and not isinstance(obj, BackendRegistration) else obj
        if isinstance(obj, (str, os.PathLike)):  # a native plugin: the path of its shared library
            from ggml_py.runtime.native import load

            return load(obj)
        return obj

    return load


registry = Registry()


def get_backend(name: str, **options: Any) -> Backend:
    """The shared backend instance called `name` (raises BackendError listing the available ones)."""
    return registry.backend(name, **options)


MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS


def _check_threads(n: Any) -> None:
    """n_threads as a caller gives it: a positive int, at most MAX_THREADS. More threads than CPUs only slow a
    compute down (they wait on each other), so that is allowed but logged."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise BackendError(f"n_threads must be an integer in 1..{MAX_THREADS}, got {n!r}")
    cpus = os.cpu_count()
    if cpus and n > cpus:
        log.warning("n_threads %d is more than the %d CPUs: threads will wait on each other", n, cpus)


def parse_backend_options(items: Sequence[str]) -> dict[str, dict[str, str]]:
    """`NAME:KEY=VALUE` strings (the CLI's --backend-opt) as {NAME: {KEY: VALUE}}; NAME may be NAME:DEVICE."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, kv = item.rpartition(":")
        key, eq, value = kv.partition("=")
        if not sep or not name or not eq or not key.strip():
            raise BackendError(f"backend option {item!r} is not NAME:KEY=VALUE (e.g. simd:level=avx2)")
        out.setdefault(name.strip(), {})[key.strip()] = value.strip()
    return out


def resolve_backends(backends: Any = None, backend_options: Mapping[str, Mapping[str, Any]] | None = None,
                     **options: Any) -> list[Backend]:
    """Backends from names, instances, a comma-separated string, or the default order. `options` (e.g. n_threads)
    go to every backend created by name; `backend_options` {NAME: {KEY: VALUE}} to the one of that name only (for
    "NAME:DEVICE", to that device, else to every device of NAME)."""
    if backends is None:
        names: list[Any] = registry.default_names()
    elif isinstance(backends, str):
        names = [b.strip() for b in backends.split(",") if b.strip()]
    elif isinstance(backends, Backend):
        names = [backends]
    else:
        names = list(backends)
    if not names:
        raise BackendError(f"no backends selected; available: {', '.join(registry.names()) or 'none'}")
    if "n_threads" in options:
        _check_threads(options["n_threads"])
    per = {k: dict(v) for k, v in (backend_options or {}).items()}
    named = {n for n in names if isinstance(n, str)}
    unused = [k for k in per if k not in named and k not in {n.partition(":")[0] for n in named}]
    if unused:
        raise BackendError(f"options for backend(s) {', '.join(unused)}, which are not selected (selected: "
                           f"{', '.join(str(getattr(n, 'name', n)) for n in names)})")
    for name, v in per.items():
        if "n_threads" in v:  # a CLI option arrives as text
            try:
                v["n_threads"] = int(v["n_threads"])
            except (TypeError, ValueError):
                raise BackendError(f"backend {name!r}: n_threads must be an integer, got {v['n_threads']!r}") from None
            _check_threads(v["n_threads"])

    def opts(name: str) -> dict[str, Any]:
        return {**options, **per.get(name.partition(":")[0], {}), **per.get(name, {})}

    out = [b if isinstance(b, Backend) else registry.backend(b, **opts(b)) for b in names]
    # The thread budget: a backend whose queue keeps host threads busy while the others compute (host_threads)
    # takes them out of the budget (n_threads, else the CPUs) of the host backends created here without a count.
    reserved = sum(int(b.device.caps.get("host_threads") or 0) for b in out if b.is_async)
    if reserved:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        budget = int(options.get("n_threads") or cpus)
        share = max(1, budget - reserved)
        out = [registry.backend(n, **{**opts(n), "n_threads": share})
               if isinstance(n, str) and not b.is_async and "n_threads" not in {**per.get(n.partition(":")[0], {}),
                                                                                  **per.get(n, {})}
               and b.n_threads > share else b for n, b in zip(names, out)]
    return out


# -- native plugin libraries -----------------------------------------------------------------------------------------
def register_library(path: str | os.PathLike[str], name: str | None = None) -> str:
    """Add the native plugin library at `path` to the registry in-process; returns the name it is registered under."""
    from ggml_py.runtime.native import load

    reg = load(path)
    registry.register(name or reg.name, reg, source=f"native library {os.fspath(path)}")
    return name or reg.name


def library_paths(value: str) -> list[str]:
    """The libraries a GGML_PY_BACKEND_PATH value names: files as given, directories expanded to their libraries."""
    out: list[str] = []
    for entry in value.split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        p = Path(entry).expanduser()
        if p.is_dir():
            out.extend(str(c) for c in sorted(p.iterdir()) if c.suffix in LIBRARY_SUFFIXES and c.is_file())
        else:
            out.append(str(p))
    return out


def _guess_name(path: str) -> str:
    stem = Path(path).name.split(".")[0]
    stem = stem[3:] if stem.startswith("lib") else stem
    return re.sub(r"[^a-z0-9_]", "_", stem.lower()) or "native"


def discover_path_backends(value: str | None = None) -> list[tuple[str, str, Callable[[], BackendRegistration]]]:
    """(name, source, loader) for every library in GGML_PY_BACKEND_PATH (or `value`).

    The name is the one the library's init reports; a library that cannot be loaded is listed under its file name
    with a loader that re-raises the error (so `ggml-py backends` shows it and asking for it explains why).
    """
    from ggml_py.runtime.native import load_library

    value = os.environ.get(PATH_ENV, "") if value is None else value
    found = []
    for path in library_paths(value):
        source = f"{PATH_ENV} {path}"
        try:
            lib = load_library(path)
        except Exception as e:
            err = e

            def fail(err: BaseException = err) -> BackendRegistration:
                raise err

            found.append((_guess_name(path), source, fail))
            continue
        found.append((lib.name, source, lambda lib=lib: lib.registration))
    return found
