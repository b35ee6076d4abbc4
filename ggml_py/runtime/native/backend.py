"""A plugin as an ordinary Backend and BackendRegistration."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ggml_py import counters
from ggml_py.errors import BackendError
from ggml_py.ir import schema
from ggml_py.ir.tensor import Tensor
from ggml_py.runtime.backend import Backend, BackendRegistration, ComputeCancelled, Device, Split
from ggml_py.runtime.native.abi import STATUS, const, ffi
from ggml_py.runtime.native.lowering import upper_layout, write_node, write_tensor
from ggml_py.runtime.native.plan import NativePlan, current_compute

if TYPE_CHECKING:
    from ggml_py.runtime.native.library import NativeLibrary


def _free_backend(lib: NativeLibrary, ctx_holder: list[Any], lock: Any) -> None:
    with lock:
        ctx, ctx_holder[0] = ctx_holder[0], None
        if ctx is not None:
            lib.plugin.backend.free(ctx)


class NativeBackend(Backend):
    """A ggml_py Backend whose kernels are a plugin's."""

    def __init__(self, library: NativeLibrary, device: Device, options: Mapping[str, Any] | None = None) -> None:
        f = ffi()
        if library.score <= 0:
            raise BackendError(f"{library.where()} reports score {library.score}: it cannot run on this machine")
        self.library = library
        self.device = device
        index = device.caps.get("device_index")  # a plugin driving several devices: which one
        self.name = library.name if index is None else f"{library.name}:{device.name}"
        self.default_buffer_type = library.buffer_types[index or 0]
        self.is_async = library.is_async
        opts = ";".join(f"{k}={v}" for k, v in (options or {}).items() if v is not None)
        ctx = (library.plugin.backend.init(int(device.n_threads), opts.encode()) if index is None else
               library.plugin.init_device(int(index), int(device.n_threads), opts.encode()))
        if ctx == f.NULL:
            raise BackendError(f"{library.where()}: backend init(n_threads={device.n_threads}, options={opts!r}) "
                               "returned NULL (an option it does not accept?)")
        self._ctx = ctx
        # plans hold the holder, so a plan freed after its backend never calls into a freed context
        self._ctx_holder: list[Any] = [ctx]
        # the ABI promises one call at a time per context; plans sharing this backend may compute from two threads
        self.lock = threading.RLock()  # re-entrant: a GC-run plan finalizer may free while this thread holds it
        self._finalizer = weakref.finalize(self, _free_backend, library, self._ctx_holder, self.lock)

    def supports_op(self, node: Tensor) -> bool:
        if node.op not in schema.ABI_IDS or len(node.src) > 4:
            return False
        # a plugin built before a parameter or source of this node existed would compute it without them
        if schema.get(node.op).abi_minor(node.params, [s is not None for s in node.src]) > self.library.abi_minor:
            return False
        f = ffi()
        keep: list[Any] = []

        def tensor_of(t: Tensor) -> Any:
            tc = f.new("ggml_py_tensor *")
            write_tensor(tc, t, *upper_layout(t), data=0)
            if t.is_symbolic:
                tc.flags |= const("GGML_PY_TENSOR_SYMBOLIC")
            keep.append(tc)
            return tc

        nc = f.new("ggml_py_node *")
        try:
            write_node(nc, node, tensor_of)
        except BackendError:
            return False
        with self.lock:
            return bool(self.library.plugin.backend.supports_op(self._ctx, nc))

    def graph_plan_create(self, split: Split) -> NativePlan:
        return NativePlan(self, split)

    def graph_plan_compute(self, plan: NativePlan, bindings: Mapping[str, int]) -> None:
        self._compute(plan, bindings, queued=False)

    def graph_plan_compute_async(self, plan: NativePlan, bindings: Mapping[str, int]) -> None:
        """Enqueue the compute (ABI 2.2 graph_compute_async); its errors come from event_synchronize."""
        self._compute(plan, bindings, queued=True)

    def _compute(self, plan: NativePlan, bindings: Mapping[str, int], queued: bool) -> None:
        syms = plan.syms
        for k, name in enumerate(plan.symbol_names):
            syms[k] = bindings[name]
        err = plan.err
        err.node = -1
        err.message[0] = b"\0"
        state = plan.state
        state.cancelled = False
        state.exc = None
        with self.lock:
            if self._ctx_holder[0] is None:
                raise BackendError(f"{self.library.where()}: this backend was closed; prepare the graph again")
            if queued:
                rc = int(self.library.plugin.graph_compute_async(self._ctx, plan.handle, plan.graph, plan.args_async))
            else:
                outer = getattr(current_compute, "state", None)  # a signal handler may compute while we compute
                current_compute.state = state
                try:
                    rc = int(plan._compute(self._ctx, plan.handle, plan.graph, plan.args))
                finally:
                    current_compute.state = outer
        if rc == 0:
            return
        if state.exc is not None:  # Ctrl-C (or another signal handler's exception) during the compute
            raise state.exc
        if rc == 4 and state.cancelled:
            raise ComputeCancelled(f"{self.library.where()}: compute cancelled")
        what = plan._message() if int(err.node) >= 0 else (
            f"a split of {plan.n} nodes ({', '.join(sorted({n.op or '' for n in plan.nodes_py}))}): "
            f"{plan._message()}")
        raise BackendError(f"{self.library.where()} failed in {what} (status {rc} {STATUS.get(rc, '?')})")

    def graph_plan_free(self, plan: NativePlan) -> None:
        plan.free()

    def graph_plan_profile(self, plan: NativePlan, on: bool) -> None:
        """Start (zeroing) or stop accumulating per-node wall time in the plugin."""
        plan.set_profiling(on)

    def graph_plan_node_seconds(self, plan: NativePlan) -> list[float] | None:
        """Per-node seconds accumulated since profiling started, or None when it is off."""
        if plan.node_seconds is None:
            return None
        return [float(plan.node_seconds[i]) for i in range(plan.n)]

    def graph_plan_cancel(self, plan: NativePlan) -> None:
        """Ask a compute of `plan` running in another thread to stop at the plugin's next poll."""
        plan.state.cancelled = True

    def set_tensor_async(self, buffer: Any, offset: int, data: Any) -> None:
        """Enqueue a host-to-device copy (ABI 2.2 set_tensor_async); `data` stays untouched until a later event."""
        if not self.is_async or getattr(buffer, "_lib", None) is not self.library:
            super().set_tensor_async(buffer, offset, data)
            return
        buffer._check(offset, data.nbytes)
        with self.lock:
            rc = int(self.library.plugin.set_tensor_async(self._ctx, buffer._cbuf, offset, ffi().from_buffer(data),
                                                           data.nbytes))
        if rc != 0:
            raise BackendError(f"{self.library.where()}: set_tensor_async failed (status {rc} {STATUS.get(rc, '?')})")
        counters.bump("abi_set_tensor_async")

    def event_record(self) -> NativeEvent | None:
        if not self.is_async:
            return None
        p = self.library.plugin
        with self.lock:
            handle = p.event_new(self._ctx)
            if handle == ffi().NULL:
                raise BackendError(f"{self.library.where()}: event_new returned NULL")
            ev = NativeEvent(self, handle)
            rc = int(p.event_record(self._ctx, handle))
        if rc != 0:
            raise BackendError(f"{self.library.where()}: event_record failed (status {rc} {STATUS.get(rc, '?')})")
        return ev

    def event_synchronize(self, event: NativeEvent | None) -> float | None:
        if event is None:
            return None
        if event.done:
            return event.seconds
        f = ffi()
        seconds = f.new("double *")
        err = f.new("ggml_py_error *")
        err.node = -1
        rc = int(self.library.plugin.event_synchronize(self._ctx, event.handle, seconds, err))  # waits: no lock
        event.done, event.seconds = True, float(seconds[0]) or None
        if rc != 0:
            msg = f.string(err.message).decode("utf-8", "replace").strip() or "no message"
            raise BackendError(f"{self.library.where()} failed in queued work: {msg} (status {rc} "
                               f"{STATUS.get(rc, '?')})")
        return event.seconds

    def synchronize(self) -> None:
        fn = self.library.fn("backend.synchronize")
        if fn is not None:
            with self.lock:
                fn(self._ctx)

    def set_n_threads(self, n: int) -> None:
        super().set_n_threads(n)
        fn = self.library.fn("backend.set_n_threads")
        if fn is not None:
            with self.lock:
                fn(self._ctx, int(n))

    def close(self) -> None:
        """Free the plugin's backend context now (plans made by this backend must not be computed afterwards)."""
        self._finalizer()


class NativeEvent:
    """A plugin event (ABI 2.2): a point in a backend's queue; freed with the object."""

    def __init__(self, backend: NativeBackend, handle: Any) -> None:
        self.handle = handle
        self.done = False
        self.seconds: float | None = None
        self._finalizer = weakref.finalize(self, _free_event, backend.library, backend._ctx_holder, handle,
                                           backend.lock)


def _free_event(lib: NativeLibrary, ctx_holder: list[Any], handle: Any, lock: Any) -> None:
    with lock:
        if ctx_holder[0] is not None:
            lib.plugin.event_free(ctx_holder[0], handle)


class NativeRegistration(BackendRegistration):
    """The registration of a plugin: one device, backends created through the plugin's init."""

    backend_class: type[NativeBackend] = NativeBackend

    def __init__(self, library: NativeLibrary) -> None:
        self.library = library
        self.name = library.name
        self.version = library.version

    def device_caps(self) -> dict[str, Any]:
        lib = self.library
        return {"native": True, "library": lib.path, "abi_version": lib.abi_version,
                "buffer_type": lib.buffer_type.name, "host_buffer": lib.is_host, "precision": lib.precision,
                "async": lib.is_async, "host_threads": lib.host_threads}

    def devices(self) -> list[Device]:
        lib = self.library
        p = lib.plugin
        if lib.devices:  # a plugin driving several devices (ABI 2.2)
            out = []
            for i, name in enumerate(lib.devices):
                d = p.devices[i]
                desc = lib._string(d.description, "device description", "")
                out.append(Device(name, desc or f"device {name} of native plugin {lib.name}",
                                  memory_total=int(d.memory_total), memory_free=int(d.memory_free),
                                  n_threads=lib.default_threads, score=lib.score,
                                  caps={**self.device_caps(), "buffer_type": lib.buffer_types[i].name,
                                        "device_index": i}))
            return out
        return [Device("native", lib.description or f"native plugin {lib.name}", memory_total=int(p.memory_total),
                       memory_free=int(p.memory_free), n_threads=lib.default_threads, score=lib.score,
                       caps=self.device_caps())]

    def create(self, device: Device | str | None = None, **options: Any) -> Backend:
        """A backend; n_threads sets its thread count, every other option goes to the plugin's init as key=value.
        `device`: one of devices(), or its name (a plugin driving several)."""
        if isinstance(device, str):
            named = {d.name: d for d in self.devices()}
            if device not in named:
                raise BackendError(f"backend {self.name!r} has no device {device!r}; it has {', '.join(named)}")
            device = named[device]
        dev = device or self.devices()[0]
        n = options.pop("n_threads", None) or dev.n_threads
        return self.backend_class(self.library, Device(dev.name, dev.description, dev.memory_total, dev.memory_free,
                                                       n_threads=int(n), score=dev.score, caps=dict(dev.caps)),
                                  options)
