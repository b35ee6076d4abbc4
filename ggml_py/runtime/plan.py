"""Plans: a graph scheduled (schedule.py), its memory planned (alloc.py) and each split lowered, once.

`prepare()` does all of that once; `Plan.compute()` then only writes inputs, copies split inputs that cross
buffer types, and calls each backend's lowered plan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_py import counters
from ggml_py.errors import BackendError, GgmlPyError, PlanError
from ggml_py.gcpause import gc_paused
from ggml_py.ir.graph import Graph
from ggml_py.ir.symbolic import Expr, evaluate
from ggml_py.ir.tensor import INPUT, OUTPUT, PARAM, STATE, Tensor, nbytes_upper
from ggml_py.runtime.alloc import plan_memory
from ggml_py.runtime.backend import Backend, Buffer, ComputeCancelled, Split
from ggml_py.runtime.placement import check_host_alloc, place_static
from ggml_py.runtime.registry import resolve_backends
from ggml_py.runtime.schedule import root, schedule, symbols_of

log = logging.getLogger("ggml_py")

# A plan cut into more splits than this, averaging fewer nodes than TINY_SPLIT_NODES each, gets a warning: every
# split boundary costs a backend call and maybe copies (a plugin claiming scattered elementwise ops, say).
MANY_SPLITS = 16
TINY_SPLIT_NODES = 4


@dataclass
class _Copy:
    """Before a split runs: copy a root tensor's bytes from the buffer it lives in to one the backend can read."""

    src: tuple[Buffer, int]
    dst: tuple[Buffer, int]
    size: int
    producer: int = -1  # the split that writes the source (-1: an input, written before the compute)
    label: str = ""
    ahead: bool = False  # enqueued by an earlier host split (Plan._ahead), not by its own


def run_copy(c: _Copy) -> None:
    """A copy done now: buffer to buffer when the destination can (host memory, or one plugin's buffer_copy), else
    through host memory."""
    (sb, so), (db, do) = c.src, c.dst
    if not db.copy_tensor(sb, so, do, c.size):
        db.set_tensor(do, sb.get_tensor(so, c.size))


@dataclass
class _SplitRun:
    split: Split
    plan: Any
    copies: list[_Copy] = field(default_factory=list)


class Plan:
    """A graph prepared for repeated execution on a list of backends. Create with `ggml_py.prepare`."""

    def __init__(self, graph: Graph, backends: Sequence[Backend]) -> None:
        t0 = time.perf_counter()
        self.graph = graph
        self.backends = list(backends)
        self._lock = threading.Lock()
        self._computing: int | None = None  # the thread inside compute(), to refuse re-entry instead of deadlocking
        self._closed = False
        self._pending: dict[str, int] = {}
        # per-tensor facts that never change for a plan, so a decode step's few set_input/get_output calls stay cheap
        self._concrete: dict[int, bool] = {}
        self._out_views: dict[int, np.ndarray] = {}
        self.symbols = symbols_of((*graph.leafs, *graph.nodes))
        self._n_computes = 0
        self._cancelled = False  # set by cancel() while a compute runs
        # while profiling (start_profiling): seconds per split, and the computes and compute time when it started
        self._split_seconds: list[float] | None = None
        self._compute_seconds = 0.0
        self._profile_computes0 = 0
        self._profile_t0 = 0.0
        self._timeline: list[tuple[str, str, float | None, float | None]] = []  # the last profiled queued compute
        self._build_splits()
        self.warnings: list[str] = []
        n_compute = sum(len(r.split.nodes) for r in self.runs)
        if len(self.runs) > MANY_SPLITS and n_compute < TINY_SPLIT_NODES * len(self.runs):
            self.warnings.append(f"the plan is cut into {len(self.runs)} splits of {n_compute / len(self.runs):.1f} "
                                 f"nodes on average ({', '.join(b.name for b in self.backends)}): every split costs "
                                 "a backend call and maybe copies; see plan.profile() and plan.assignment()")
        for w in self.warnings:
            log.warning("ggml_py: %s", w)
        self.prepare_seconds = time.perf_counter() - t0
        counters.bump("plans_prepared")

    # -- preparation ------------------------------------------------------------------------------------------
    def _build_splits(self) -> None:
        sch = schedule(self.graph, self.backends)
        self.backend_of = sch.backend_of
        self._pinned = sch.pinned
        groups, home, split_copies, copies = sch.groups, sch.home, sch.split_copies, sch.copies

        bts = {bt.name: bt for bt in home.values()}
        leafs = [t for t in self.graph.leafs if not t.flags & (PARAM | STATE)] + copies
        alloc = plan_memory(self.graph.nodes, leafs, buffer_type_of=lambda t: home[root(t).id].name,
                            alignment_of=lambda name: bts[name].alignment,
                            size_of=lambda t: bts[home[root(t).id].name].alloc_size(t))
        self.buffers: dict[str, Buffer] = {}
        for name, size in alloc.sizes.items():
            bt = bts[name]
            if size > bt.max_size:
                raise PlanError(f"compute buffer of {size} bytes exceeds the maximum of {bt.name} ({bt.max_size})")
            check_host_alloc(bt, size, "the compute buffer")
            self.buffers[name] = bt.alloc_buffer(max(size, 1))
            counters.bump("buffers_allocated")
        self.alloc = alloc

        self.locations: dict[int, tuple[Buffer, int]] = {}
        for tid, (bt_name, off) in alloc.offsets.items():
            self.locations[tid] = (self.buffers[bt_name], off)

        producer = {root(n).id: k for k, (_, nodes) in enumerate(groups) for n in nodes}
        self.runs: list[_SplitRun] = []
        for (b, nodes), pairs in zip(groups, split_copies):
            locs = _SplitLocations(self.locations, b)
            run_copies = []
            for n in nodes:
                for t in (n, *n.src):
                    if t is not None and root(t).flags & (PARAM | STATE):
                        locs.override[root(t).id] = self._location(t, b)
            for r, c in pairs:
                locs.override[r.id] = self.locations[c.id]
                run_copies.append(_Copy(self._location(r), self.locations[c.id], r.nbytes, producer.get(r.id, -1),
                                        f"{r.name} -> {b.name}"))
            split = Split(b, nodes, self.symbols, locs)
            try:
                bplan = b.graph_plan_create(split)
            except PlanError:
                raise
            except Exception as e:
                raise PlanError(f"backend {b.name!r} failed to lower a split of {len(nodes)} nodes: "
                                f"{type(e).__name__}: {e}") from e
            self.runs.append(_SplitRun(split, bplan, run_copies))
        self.n_copies = sum(len(p) for p in split_copies)
        # backends with a queue of their own (is_async), by the buffer type they compute on: Plan.compute enqueues
        # their splits and the copies into their memory instead of waiting for each
        self._queues = {b.default_buffer_type.name: b for b in self.backends if b.is_async}
        # the host-to-queue copies each host split enqueues before it computes: those of later splits whose source
        # an earlier host split (or the caller: an input) wrote, at the first host split after it
        self._ahead: dict[int, list[_Copy]] = {}
        host_splits = [k for k, r in enumerate(self.runs) if not r.split.backend.is_async] if self._queues else []
        for j, run in enumerate(self.runs):
            for c in run.copies:
                if (c.src[0].buffer_type.is_host and c.dst[0].buffer_type.name in self._queues
                        and (c.producer < 0 or not self.runs[c.producer].split.backend.is_async)):
                    k = next((k for k in host_splits if c.producer < k < j), None)
                    if k is not None:
                        self._ahead.setdefault(k, []).append(c)
                        c.ahead = True

    def _location(self, t: Tensor, backend: Backend | None = None) -> tuple[Buffer, int]:
        r = root(t)
        if r.flags & (PARAM | STATE):
            b = backend or self.backends[0]
            for placed in r._static.values():
                if b.supports_buffer_type(placed[0].buffer_type):
                    return placed
            if r.flags & STATE and r._static:
                raise PlanError(f"state {r.name!r} lives in {list(r._static)}, which backend {b.name!r} cannot "
                                "read; a state must stay in one buffer type")
            return place_static(r, b.default_buffer_type)
        try:
            return self.locations[r.id]
        except KeyError:
            raise PlanError(f"tensor {t.name!r} is not part of this plan") from None

    # -- execution ----------------------------------------------------------------------------------------------
    def _tensor(self, key: str | Tensor, want: int) -> Tensor:
        if isinstance(key, Tensor):
            t = key
            if t.id not in self._ids():
                raise PlanError(f"tensor {t.name!r} is not part of this plan")
        else:
            try:
                t = self.graph.find(key)
            except KeyError:
                kind = "inputs" if want == INPUT else "outputs"
                known = [x.name for x in (self.graph.inputs if want == INPUT else self.graph.outputs)]
                raise PlanError(f"no tensor named {key!r} in this plan; {kind}: {', '.join(known)}") from None
        return t

    def _ids(self) -> set[int]:
        if not hasattr(self, "_id_set"):
            self._id_set: set[int] = {t.id for t in (*self.graph.leafs, *self.graph.nodes)}
        return self._id_set

    def _enter(self, what: str) -> None:
        """Checks before taking the lock: a closed plan refuses every call; a call from a signal handler that
        interrupted this plan's compute on the same thread would wait for the lock forever."""
        if self._closed:
            raise PlanError(f"{what}() on a closed plan")
        if self._computing == threading.get_ident():
            raise PlanError(f"{what}() re-entered on the thread that is computing this plan (from a signal handler?)")

    def set_input(self, key: str | Tensor, value: Any) -> None:
        """Write an input's values. A symbolic dimension is bound from the array's shape.

        Values are converted to the input's type; integers that do not fit it, and complex, object or string
        arrays, raise PlanError rather than wrap or lose their imaginary part."""
        self._enter("set_input")
        with self._lock:
            self._set_input_locked(key, value)

    def _set_input_locked(self, key: str | Tensor, value: Any) -> None:
        if self._closed:
            raise PlanError("set_input() on a closed plan")
        t = self._tensor(key, INPUT)
        if not t.flags & (INPUT | STATE):
            raise PlanError(f"{t.name!r} is not an input of this plan")
        arr = np.asarray(value)
        if t.dtype.is_quantized or t.dtype.np_dtype is None or t.dtype.name == "BF16":
            expect_bytes = t.nbytes
            if arr.dtype != np.uint8 or arr.nbytes != expect_bytes:
                raise PlanError(f"input {t.name!r} ({t.dtype}) expects {expect_bytes} raw bytes, "
                                f"got {arr.dtype} with {arr.nbytes}")
        else:
            if arr.dtype.kind not in "biuf":
                raise PlanError(f"input {t.name!r} is {t.dtype}: expected real numbers, got {arr.dtype}")
            if not self._is_concrete(t) or arr.shape != t.shape:
                self._bind_shape(t, arr.shape)
            npd = t.dtype.np_dtype
            if npd.kind in "iu":
                if arr.dtype.kind not in "iu":
                    raise PlanError(f"input {t.name!r} is {t.dtype}: expected integer values, got {arr.dtype}")
                if arr.size and not np.can_cast(arr.dtype, npd):
                    info = np.iinfo(npd)
                    if arr.min() < info.min or arr.max() > info.max:
                        bad = arr[(arr < info.min) | (arr > info.max)].flat[0]
                        raise PlanError(f"input {t.name!r} is {t.dtype}: value {bad} is outside "
                                        f"[{info.min}, {info.max}]")
            arr = np.ascontiguousarray(arr, dtype=npd)
        buf, off = self._location(t)
        buf.set_tensor(off + evaluate(t.view_offs, self._pending), arr.reshape(-1).view(np.uint8))

    def _is_concrete(self, t: Tensor) -> bool:
        """No symbol in its shape, strides or offset (cached: a tensor's layout never changes)."""
        c = self._concrete.get(t.id)
        if c is None:
            c = self._concrete[t.id] = not any(isinstance(d, Expr) for d in (*t.shape, *t.strides, t.view_offs))
        return c

    def _bind_shape(self, t: Tensor, given: tuple[int, ...]) -> tuple[int, ...]:
        expected = t.shape
        if len(given) != len(expected):
            raise PlanError(f"input {t.name!r}: expected shape {list(expected)}, got {list(given)}")
        trial = dict(self._pending)
        for d, g in zip(expected, given):
            if isinstance(d, Expr) and len(d.terms) == 1:
                s, c = d.terms[0]
                v, rem = divmod(g - d.const, c)
                if rem == 0 and s.name not in trial:
                    trial[s.name] = v
        try:
            bound = tuple(evaluate(d, trial) for d in expected)
        except KeyError:
            bound = ()
        if bound != tuple(given):
            raise PlanError(f"input {t.name!r}: expected shape {list(expected)} (bound: {trial}), got {list(given)}")
        self._check_bindings(trial)
        self._pending = trial
        return bound

    def _check_bindings(self, b: Mapping[str, int]) -> None:
        for s in self.symbols:
            if s.name in b and not 1 <= b[s.name] <= s.max:
                raise PlanError(f"symbol {s.name}={b[s.name]} is outside 1..{s.max}")

    def compute(self, **bindings: int) -> None:
        """Run every split. Symbols are bound by keyword (e.g. n_kv=17) or from inputs set since the last call."""
        self._enter("compute")
        with self._lock:
            if self._closed:
                raise PlanError("compute() on a closed plan")
            for k, v in bindings.items():
                if isinstance(v, bool) or not isinstance(v, int | np.integer):
                    self._pending = {}  # a refused compute uses up the inputs' bindings too (_compute_locked)
                    raise PlanError(f"symbol {k} must be bound to an integer, got {v!r}")
            self._computing = threading.get_ident()
            t0 = time.perf_counter() if self._split_seconds is not None else 0.0
            try:
                self._compute_locked(bindings)
                if self._split_seconds is not None:
                    self._compute_seconds += time.perf_counter() - t0
            finally:
                self._computing = None

    def _compute_locked(self, bindings: Mapping[str, int]) -> None:
        # the inputs' bindings are used up by this call, whether it is refused (a conflict, a symbol missing or out
        # of range), a split fails, or Ctrl-C stops it: the next set_input may bind other sizes (outputs are then
        # undefined until a compute completes)
        b = self._pending
        self._pending = {}
        for k, v in bindings.items():
            if k in b and b[k] != v:
                raise PlanError(f"symbol {k}={v} conflicts with {b[k]} implied by an input's shape")
            b[k] = int(v)
        names = {s.name for s in self.symbols}
        unknown = set(b) - names
        if unknown:
            raise PlanError(f"unknown symbol(s) {sorted(unknown)}; this plan has {sorted(names) or 'none'}")
        missing = names - set(b)
        if missing:
            raise PlanError(f"symbol(s) {sorted(missing)} must be bound, e.g. compute({next(iter(missing))}=...)")
        self._check_bindings(b)
        self._cancelled = False
        if self._queues:
            _QueuedCompute(self, b).run()
        else:
            split_seconds = self._split_seconds
            for k, run in enumerate(self.runs):
                self._check_cancel(k)
                t0 = time.perf_counter() if split_seconds is not None else 0.0
                for c in run.copies:
                    run_copy(c)
                self._run_split(run, b, run.split.backend.graph_plan_compute)
                if split_seconds is not None:
                    split_seconds[k] += time.perf_counter() - t0
        self.bindings = b
        self._n_computes += 1
        counters.bump("plan_computes")

    def _check_cancel(self, k: int) -> None:
        if self._cancelled:
            raise ComputeCancelled(f"compute cancelled before split {k + 1} of {len(self.runs)}")

    @staticmethod
    def _run_split(run: _SplitRun, b: Mapping[str, int], compute: Any) -> None:
        backend = run.split.backend
        try:
            compute(run.plan, b)
        except GgmlPyError:
            raise
        except Exception as e:  # a Python backend's own error: named like a native plugin's (NodePlan: the node)
            ops = ", ".join(sorted({n.op or "" for n in run.split.nodes}))
            raise BackendError(f"backend {backend.name!r} failed in a split of {len(run.split.nodes)} nodes "
                               f"({ops}): {type(e).__name__}: {e}") from e

    def get_output(self, key: str | Tensor) -> np.ndarray:
        """A copy of a tensor's values after the last compute (outputs, inputs and states).

        Taken under the plan's lock, so it never mixes two computes; with several threads computing one plan, the
        copy is of whichever compute finished last."""
        self._enter("get_output")
        with self._lock:
            if self._closed:
                raise PlanError("get_output() on a closed plan")
            return self._get_output_locked(key)

    def _get_output_locked(self, key: str | Tensor) -> np.ndarray:
        t = self._tensor(key, OUTPUT)
        view = self._out_views.get(t.id)
        if view is not None:
            return view.copy()
        if not (t.flags & (OUTPUT | INPUT | STATE | PARAM) or root(t).flags & (STATE | PARAM)):
            raise PlanError(f"{t.name!r} is an intermediate whose memory may be reused; mark it as an output")
        view, is_host = self._view(t, getattr(self, "bindings", {}))
        if is_host and self._is_concrete(t):
            self._out_views[t.id] = view  # the same memory at every compute
        return np.array(view)

    def _view(self, t: Tensor, b: Mapping[str, int]) -> tuple[np.ndarray, bool]:
        """A tensor's values at bindings `b` as an array over its memory (a copy if it is not in host memory), and
        whether it is in host memory."""
        shape = tuple(evaluate(d, b) for d in t.shape)
        strides = tuple(evaluate(s, b) for s in t.strides)
        buf, off = self._location(t)
        off += evaluate(t.view_offs, b)
        span = nbytes_upper(shape, strides, t.dtype)  # concrete shape: the bytes it spans
        is_host = buf.buffer_type.is_host
        raw = buf.host_view()[off: off + span] if is_host else buf.get_tensor(off, span)
        if t.dtype.is_quantized:
            return np.lib.stride_tricks.as_strided(raw, (*shape[:-1], t.dtype.row_size(shape[-1])),
                                                   (*strides[:-1], 1)), is_host
        npd = t.dtype.np_dtype
        return np.lib.stride_tricks.as_strided(raw.view(npd) if span % npd.itemsize == 0 and raw.nbytes else raw,
                                               shape, strides), is_host

    def input_array(self, key: str | Tensor, **symbols: int) -> np.ndarray:
        """A writable array over an input's memory, for a loop that writes the same inputs before every compute (a
        decode step): what is written there is what the next compute reads, without set_input's conversion, checks
        and binding (bind the symbols with compute(...)). The array has the input's type and its shape at `symbols`
        (needed when the shape is symbolic). Inputs in host memory only (PlanError otherwise: use set_input); the
        array is valid while the plan is open."""
        self._enter("input_array")
        with self._lock:
            t = self._tensor(key, INPUT)
            if not t.flags & INPUT or t.dtype.np_dtype is None or t.dtype.name == "BF16":
                raise PlanError(f"{t.name!r} is not an input of a numpy type (use set_input)")
            missing = {x.name for d in (*t.shape, *t.strides, t.view_offs) if isinstance(d, Expr)
                       for x, _ in d.terms} - set(symbols)
            if missing:
                raise PlanError(f"input {t.name!r} has a symbolic shape: give {sorted(missing)} as keywords")
            self._check_bindings(symbols)
            if not self._location(t)[0].buffer_type.is_host:
                raise PlanError(f"input {t.name!r} is not in host memory (use set_input)")
            return self._view(t, symbols)[0]

    def output_array(self, key: str | Tensor) -> np.ndarray:
        """A read-only array over an output's memory: the values of the last compute, overwritten by the next (copy
        what must outlive it). For a loop that reads the same outputs after every compute without get_output's
        checks; outputs of a concrete shape in host memory only (PlanError otherwise: use get_output)."""
        self._enter("output_array")
        with self._lock:
            t = self._tensor(key, OUTPUT)
            if not t.flags & OUTPUT or not self._is_concrete(t):
                raise PlanError(f"{t.name!r} is not an output of a concrete shape (use get_output)")
            if not self._location(t)[0].buffer_type.is_host:
                raise PlanError(f"output {t.name!r} is not in host memory (use get_output)")
            view = self._view(t, {})[0]
            view.flags.writeable = False
            return view

    def cancel(self) -> bool:
        """Ask the compute of this plan running in another thread to stop: compute() there raises ComputeCancelled
        (a BackendError) before its next split, and each backend stops sooner if it can (a NodePlan between two
        nodes, a native plugin at its next poll). The plan stays usable; outputs are undefined until a compute
        completes. Returns whether a compute was running (a cancel never reaches a later compute)."""
        if self._computing is None:
            return False
        self._cancelled = True
        for run in self.runs:
            run.split.backend.graph_plan_cancel(run.plan)
        return True

    def start_profiling(self) -> None:
        """From now on, every compute adds its time per split and, from backends that time their nodes (native
        plugins, Python backends with a NodePlan), per node, until stop_profiling(). profile_report() reads it."""
        with self._lock:
            self._split_seconds = [0.0] * len(self.runs)
            self._profile_computes0 = self._n_computes
            self._profile_t0 = self._compute_seconds
            for run in self.runs:
                run.split.backend.graph_plan_profile(run.plan, True)

    def profile_report(self) -> dict[str, Any]:
        """Where the time of the computes since start_profiling() went, per compute: in total, per split (with its
        copies), per backend, per op type, and the host's share (time outside the splits: input bindings, checks,
        Python)."""
        with self._lock:
            if self._split_seconds is None:
                raise PlanError("profile_report() without start_profiling()")
            n = max(1, self._n_computes - self._profile_computes0)
            total = self._compute_seconds - self._profile_t0
            by_op: dict[str, float] = {}
            by_backend_op: dict[str, dict[str, float]] = {}
            for run in self.runs:
                secs = run.split.backend.graph_plan_node_seconds(run.plan) or []
                ops = by_backend_op.setdefault(run.split.backend.name, {})
                for node, sec in zip(run.split.nodes, secs):
                    op = node.op or ""
                    by_op[op] = by_op.get(op, 0.0) + sec / n
                    ops[op] = ops.get(op, 0.0) + sec / n
            by_backend: dict[str, float] = {}
            splits = []
            for run, sec in zip(self.runs, self._split_seconds):
                name = run.split.backend.name
                by_backend[name] = by_backend.get(name, 0.0) + sec / n
                splits.append({"backend": name, "nodes": len(run.split.nodes), "copies": len(run.copies),
                               "seconds": sec / n})
            return {"computes": self._n_computes - self._profile_computes0, "seconds_per_compute": total / n,
                    "host_seconds_per_compute": (total - sum(self._split_seconds)) / n, "by_backend": by_backend,
                    "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                    "by_backend_op": {b: dict(sorted(o.items(), key=lambda kv: -kv[1]))
                                      for b, o in by_backend_op.items() if o},
                    "splits": splits, "warnings": list(self.warnings), **self._timeline_report()}

    def _timeline_report(self) -> dict[str, Any]:
        """With asynchronous backends: the last compute's copies and splits in time (seconds from its first entry,
        queues' work at the times their events were passed), and the copies that ran while another backend
        computed."""
        tl = [e for e in self._timeline if e[2] is not None and e[3] is not None]
        if not tl:
            return {}
        t0 = min(e[2] for e in tl)  # type: ignore[type-var]
        timeline = [{"backend": b, "what": w, "start": s - t0, "end": e - t0} for b, w, s, e in tl]  # type: ignore
        overlaps = [{"copy": c["what"], "to": c["backend"], "during": x["what"], "on": x["backend"],
                     "seconds": min(c["end"], x["end"]) - max(c["start"], x["start"])}
                    for c in timeline if c["what"].startswith("copy")
                    for x in timeline if x["what"].startswith("split") and x["backend"] != c["backend"]
                    and min(c["end"], x["end"]) > max(c["start"], x["start"])]
        return {"timeline": timeline, "overlaps": overlaps}

    def stop_profiling(self) -> dict[str, Any]:
        """profile_report(), and the timing turned off."""
        report = self.profile_report()
        with self._lock:
            self._split_seconds = None
            for run in self.runs:
                run.split.backend.graph_plan_profile(run.plan, False)
        return report

    def profile(self, computes: int = 1, **bindings: int) -> dict[str, Any]:
        """Compute `computes` times and say where the time went (profile_report()). Inputs must be set as for
        compute(); without bindings and inputs set since the last compute, the last compute's bindings are used
        again."""
        self._enter("profile")
        if not bindings and not self._pending:
            bindings = dict(getattr(self, "bindings", {}))
        pending = dict(self._pending)
        self.start_profiling()
        try:
            for _ in range(max(1, int(computes))):
                with self._lock:
                    self._pending = dict(pending)  # every compute uses the inputs' bindings
                self.compute(**bindings)
        finally:
            report = self.stop_profiling()
        return report

    # -- reports ------------------------------------------------------------------------------------------------
    def assignment(self) -> list[dict[str, str]]:
        """Backend of every compute node, in execution order."""
        return [{"node": n.name, "op": n.op or "", "backend": run.split.backend.name}
                for run in self.runs for n in run.split.nodes]

    def stats(self) -> dict[str, Any]:
        return {
            "nodes": len(self.graph.nodes),
            "splits": len(self.runs),
            "copies": self.n_copies,
            "inplace": self.alloc.inplace,
            "buffer_sizes": dict(self.alloc.sizes),
            "backends": [b.name for b in self.backends],
            "symbols": {s.name: s.max for s in self.symbols},
            "computes": self._n_computes,
            "prepare_seconds": self.prepare_seconds,
            "counters": counters.snapshot(),
        }

    def close(self) -> None:
        """Free the backends' plans; every later call on this plan raises PlanError. Waits for a running compute."""
        if self._computing == threading.get_ident():
            raise PlanError("close() on the thread that is computing this plan (from a signal handler?)")
        with self._lock:
            self._closed = True
            self._out_views = {}
            for run in self.runs:
                run.split.backend.graph_plan_free(run.plan)
            self.runs = []

    @property
    def closed(self) -> bool:
        return self._closed


class _QueuedCompute:
    """One compute of a plan with asynchronous backends (Backend.is_async: a device with a queue of its own).

    Their splits, and host-to-device copies into their memory, are enqueued; the host waits on a queue's event only
    before it computes a split itself (it may read what the queue wrote, or overwrite memory the queue still reads)
    and when a copy reads the queue's memory. Before computing a split on the host, it enqueues the copies of later
    splits whose sources the host already wrote: the queue moves them while the host computes. The plan's memory plan
    makes that safe: a copy's destination is never reused, and its source stays reserved until its consumer's split,
    which the queue runs after the copy. The compute ends when every queue has drained."""

    def __init__(self, plan: Plan, bindings: Mapping[str, int]) -> None:
        self.plan, self.bindings = plan, bindings
        self.pending: dict[int, tuple[Backend, Any]] = {}  # id(queue) -> the event after its last split
        self.split_seconds = plan._split_seconds
        # while profiling: (backend, what, start, end), start/end a time.monotonic() or a queue's event
        self.timeline: list[tuple[Backend, str, Any, Any]] | None = [] if self.split_seconds is not None else None

    def run(self) -> None:
        plan, runs = self.plan, self.plan.runs
        try:
            for k, run in enumerate(runs):
                plan._check_cancel(k)
                t0 = time.perf_counter() if self.split_seconds is not None else 0.0
                backend = run.split.backend
                if not backend.is_async:
                    # first the later copies: the queue goes on to them without idling while the host waits for it
                    self._copy_ahead(k)
                for c in run.copies:
                    if not c.ahead:
                        self._copy(c, backend)
                label = f"split {k + 1} ({len(run.split.nodes)} nodes)"
                if backend.is_async:
                    ev0 = backend.event_record() if self.timeline is not None else None
                    plan._run_split(run, self.bindings, backend.graph_plan_compute_async)
                    ev = backend.event_record()
                    self.pending[id(backend)] = (backend, ev)
                    if self.timeline is not None:
                        self.timeline.append((backend, label, ev0, ev))
                else:
                    self._drain()
                    h0 = time.monotonic()
                    plan._run_split(run, self.bindings, backend.graph_plan_compute)
                    if self.timeline is not None:
                        self.timeline.append((backend, label, h0, time.monotonic()))
                if self.split_seconds is not None:
                    self.split_seconds[k] += time.perf_counter() - t0
        finally:
            self._drain()  # also after an error: no queue may still use the plan's memory
            for q in plan._queues.values():
                q.event_synchronize(q.event_record())
        if self.timeline is not None:
            plan._timeline = [(b.name, what, self._time(b, t0), self._time(b, t1)) for b, what, t0, t1 in self.timeline]

    @staticmethod
    def _time(b: Backend, t: Any) -> float | None:
        return t if isinstance(t, float) else b.event_synchronize(t)

    def _drain(self) -> None:
        while self.pending:
            _, (q, ev) = self.pending.popitem()
            q.event_synchronize(ev)

    def _copy(self, c: _Copy, consumer: Backend) -> None:
        sb, db = c.src[0], c.dst[0]
        src_queue = self.plan._queues.get(sb.buffer_type.name)
        if src_queue is not None and id(src_queue) in self.pending:  # the queue may still be writing the source
            q, ev = self.pending.pop(id(src_queue))
            q.event_synchronize(ev)
        dst_queue = self.plan._queues.get(db.buffer_type.name)
        if dst_queue is not None and sb.buffer_type.is_host:
            self._enqueue_copy(dst_queue, c)
            return
        h0 = time.monotonic()
        run_copy(c)
        if self.timeline is not None:
            self.timeline.append((src_queue or consumer, f"copy {c.label}", h0, time.monotonic()))

    def _enqueue_copy(self, q: Backend, c: _Copy) -> None:
        (sb, so), (db, do) = c.src, c.dst
        ev0 = q.event_record() if self.timeline is not None else None
        q.set_tensor_async(db, do, sb.host_view()[so: so + c.size])
        counters.bump("copies_enqueued")
        if self.timeline is not None:
            self.timeline.append((q, f"copy {c.label} ({c.size} B)", ev0, q.event_record()))

    def _copy_ahead(self, k: int) -> None:
        """Enqueue the host-to-queue copies of later splits whose sources splits before k already wrote."""
        for c in self.plan._ahead.get(k, ()):
            self._enqueue_copy(self.plan._queues[c.dst[0].buffer_type.name], c)


class _SplitLocations(Mapping[int, tuple[Buffer, int]]):
    """Root locations as one split sees them: copies override sources, statics resolve for its backend."""

    def __init__(self, base: dict[int, tuple[Buffer, int]], backend: Backend) -> None:
        self.base = base
        self.backend = backend
        self.override: dict[int, tuple[Buffer, int]] = {}

    def __getitem__(self, tid: int) -> tuple[Buffer, int]:
        if tid in self.override:
            return self.override[tid]
        if tid in self.base:
            return self.base[tid]
        raise KeyError(tid)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter({**self.base, **self.override})

    def __len__(self) -> int:
        return len({**self.base, **self.override})


@gc_paused()
def prepare(outputs: Tensor | Sequence[Tensor] | Graph, backends: Any = None,
            backend_options: Mapping[str, Mapping[str, Any]] | None = None, **options: Any) -> Plan:
    """Schedule, allocate and lower a graph once; compute it any number of times.

    `backends`: names, Backend objects or a comma-separated string, in order of preference (default: the registry's
    order, `GGML_PY_BACKENDS` if set). Options (e.g. n_threads) go to backends created by name; backend_options
    {NAME: {KEY: VALUE}} to one of them (the CLI's --backend-opt NAME:KEY=VALUE).
    """
    graph = outputs if isinstance(outputs, Graph) else Graph(outputs)
    return Plan(graph, resolve_backends(backends, backend_options, **options))
