"""A computation graph: the nodes reachable from some outputs, in dependency order."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from ggml_py import counters
from ggml_py.errors import PlanError
from ggml_py.ir.schema import OPS
from ggml_py.ir.tensor import INPUT, OUTPUT, PARAM, STATE, Tensor


class Graph:
    """Nodes (tensors with an op) in topological order and leafs (inputs, weights, states)."""

    def __init__(self, outputs: Tensor | Sequence[Tensor]) -> None:
        outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
        if not outs:
            raise ValueError("a graph needs at least one output tensor")
        for t in outs:
            if not isinstance(t, Tensor):
                raise TypeError(f"graph outputs must be Tensors, got {type(t).__name__}")
            t.flags |= OUTPUT
        self.outputs: list[Tensor] = outs
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        seen: set[int] = set()
        # iterative post-order DFS: deep graphs (hundreds of layers) must not hit the recursion limit
        for root in outs:
            if root.id in seen:
                continue
            stack: list[tuple[Tensor, int]] = [(root, 0)]
            open_: set[int] = {root.id}  # on the current path: meeting one again is a cycle (src edited by hand)
            while stack:
                t, i = stack.pop()
                srcs = [s for s in t.src if s is not None]
                if t.view_src is not None and t.view_src not in srcs:
                    srcs.append(t.view_src)
                if i < len(srcs):
                    stack.append((t, i + 1))
                    s = srcs[i]
                    if s.id in open_:
                        raise PlanError(f"the graph has a cycle: {s.name!r} ({s.op}) depends on itself")
                    if s.id not in seen:
                        open_.add(s.id)
                        stack.append((s, 0))
                    continue
                open_.discard(t.id)
                if t.id in seen:
                    continue
                seen.add(t.id)
                (self.leafs if t.is_leaf else self.nodes).append(t)
        self.nodes = _siblings_together(self.nodes)
        counters.bump("graphs_built")

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterable[Tensor]:
        return iter(self.nodes)

    @property
    def inputs(self) -> list[Tensor]:
        return [t for t in self.leafs if t.flags & INPUT]

    def find(self, name: str) -> Tensor:
        """The tensor called `name` (the first in leafs-then-nodes order if several share it)."""
        if not hasattr(self, "_by_name"):
            self._by_name: dict[str, Tensor] = {}
            for t in (*self.leafs, *self.nodes):
                self._by_name.setdefault(t.name, t)
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the graph") from None

    def structure_key(self) -> tuple:
        """Equal for two graphs with the same ops, shapes, types, layouts and params (values of leafs aside)."""
        index = {t.id: i for i, t in enumerate((*self.leafs, *self.nodes))}

        def ref(t: Tensor | None) -> int:
            return -1 if t is None else index[t.id]

        key: list[tuple] = []
        for t in self.leafs:
            key.append(("LEAF", t.dtype.name, repr(t.shape), repr(t.strides), t.flags & (INPUT | PARAM | STATE)))
        for t in self.nodes:
            key.append((t.op, t.dtype.name, repr(t.shape), repr(t.strides), repr(sorted(t.params.items())),
                        tuple(ref(s) for s in t.src), ref(t.view_src), repr(t.view_offs), t.flags & OUTPUT))
        return tuple(key)

    def to_dot(self) -> str:
        """Graphviz DOT text: leafs as boxes, nodes as ellipses, edges from sources to users."""
        lines = ["digraph ggml_py {", "  rankdir=TB;"]
        for t in self.leafs:
            kind = "weight" if t.flags & PARAM else "state" if t.flags & STATE else "input"
            lines.append(f'  t{t.id} [shape=box,label="{t.name}\\n{kind} {list(t.shape)} {t.dtype}"];')
        for t in self.nodes:
            style = ",style=bold" if t.flags & OUTPUT else ""
            lines.append(f'  t{t.id} [label="{t.name}\\n{t.op} {list(t.shape)} {t.dtype}"{style}];')
            for s in t.src:
                if s is not None:
                    lines.append(f"  t{s.id} -> t{t.id};")
        lines.append("}")
        return "\n".join(lines)


def _deps(t: Tensor) -> list[Tensor]:
    deps = [s for s in t.src if s is not None and not s.is_leaf]
    if t.view_src is not None and not t.view_src.is_leaf:
        deps.append(t.view_src)
    return deps


def _written_root(t: Tensor) -> int | None:
    """The id of the tensor whose memory t writes besides its own (SET_ROWS's, CPY's destination), -1 for an op not
    known here (it may write anything), None for the others."""
    op = OPS.get(t.op or "")
    if op is None:
        return -1
    return t.view_src.id if op.aliases is not None and t.view_src is not None else None


def _read_roots(t: Tensor) -> set[int]:
    return {(s.view_src if s.view_src is not None else s).id for s in t.src if s is not None}


def _siblings_together(nodes: list[Tensor]) -> list[Tensor]:
    """The same topological order, except that a node whose op and one computed source it shares with an earlier
    node is moved up to right after that node when everything it depends on is already done there (a layer's q, k
    and v products, its gate and up): a backend sees them side by side and can compute them as one (simd reads
    their common input once and waits for its threads once; the allocator keeps their outputs apart). A node that
    writes into another tensor's memory stays in place, and nothing that reads that memory moves past it (a KV
    cache read as a leaf after a SET_ROWS into it: an order the graph's edges do not state)."""
    consumers: dict[int, list[Tensor]] = {}
    for t in nodes:
        for s in {s.id: s for s in _deps(t)}.values():
            consumers.setdefault(s.id, []).append(t)
    pos = {t.id: i for i, t in enumerate(nodes)}
    writers = [(i, r) for i, t in enumerate(nodes) if (r := _written_root(t)) is not None]
    out: list[Tensor] = []
    done: set[int] = set()
    w = 0  # writers[w] is the first writer not emitted yet

    def may_move(sib: Tensor) -> bool:
        if _written_root(sib) is not None or not all(d.id in done for d in _deps(sib)):
            return False
        reads, at = _read_roots(sib), pos[sib.id]
        for i, r in itertools.islice(writers, w, None):  # the writers not emitted yet, in order
            if i >= at:
                return True
            if r == -1 or r in reads:
                return False
        return True

    for t in nodes:
        if t.id in done:
            continue
        out.append(t)
        done.add(t.id)
        while w < len(writers) and nodes[writers[w][0]].id in done:
            w += 1
        for s in _deps(t):
            for sib in consumers[s.id]:
                if sib.id not in done and sib.op == t.op and may_move(sib):
                    out.append(sib)
                    done.add(sib.id)
    return out
