"""Scheduling: which backend runs each node, where the splits are cut, which split inputs need a copy.

Backends are ordered by preference. A node goes to the backend where its weights already live if that backend
supports the op, otherwise to the first backend whose `supports_op` accepts it; consecutive nodes of one backend form
a split; a split input living in a buffer type its backend cannot read gets a copy next to it. Memory and lowering
are the plan's (plan.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ggml_py.errors import PlanError
from ggml_py.ir.graph import Graph
from ggml_py.ir.schema import VIEW_OPS
from ggml_py.ir.symbolic import Expr, Sym
from ggml_py.ir.tensor import PARAM, STATE, Tensor
from ggml_py.runtime.backend import Backend, BufferType


def root(t: Tensor) -> Tensor:
    """The tensor whose memory `t` is (itself unless a view)."""
    return t.view_src if t.view_src is not None else t


def symbols_of(tensors: Sequence[Tensor]) -> tuple[Sym, ...]:
    """The symbolic dimensions the tensors use, sorted by name; one bound per name."""
    found: dict[str, Sym] = {}
    for t in tensors:
        for d in (*t.shape, *t.strides, t.view_offs):
            if isinstance(d, Expr):
                for s in d.symbols:
                    other = found.setdefault(s.name, s)
                    if other.max != s.max:
                        raise PlanError(f"symbol {s.name!r} is declared with two bounds ({other.max} and {s.max})")
    return tuple(found[n] for n in sorted(found))


@dataclass
class Schedule:
    backend_of: dict[int, Backend]  # node id -> backend (view ops run no kernel and have none)
    pinned: int  # nodes placed by their weights' home
    groups: list[tuple[Backend, list[Tensor]]]  # the splits, in execution order
    home: dict[int, BufferType]  # root tensor id -> the buffer type it lives in (copies included)
    split_copies: list[list[tuple[Tensor, Tensor]]]  # per split: (root, its copy in the split backend's memory)

    @property
    def copies(self) -> list[Tensor]:
        return [c for pairs in self.split_copies for _, c in pairs]


def assign(graph: Graph, backends: Sequence[Backend]) -> tuple[dict[int, Backend], int]:
    """The backend of every compute node, and how many were placed by where their weights live."""
    names = ", ".join(b.name for b in backends)
    backend_of: dict[int, Backend] = {}
    pinned = 0
    for n in graph.nodes:
        if n.op in VIEW_OPS:
            continue
        able = []
        for b in backends:
            try:
                if b.supports_op(n):
                    able.append(b)
            except Exception as e:
                raise PlanError(f"backend {b.name!r} raised in supports_op for {n.op} ({n.name}): {e}") from e
        if not able:
            srcs = ", ".join(f"{s.dtype} {list(s.shape)}" for s in n.src if s is not None)
            raise PlanError(f"no backend supports {n.op} ({n.name}: {n.dtype} {list(n.shape)} from {srcs}); "
                            f"tried {names}")
        choice = able[0]
        # a node goes where its weights already live, if that backend can run it
        for s in n.src:
            if s is not None and root(s).flags & PARAM:
                homes = [b for b in able if b.default_buffer_type.name in root(s)._static]
                if homes:
                    choice = homes[0]
                    pinned += 1
                    break
        backend_of[n.id] = choice
    return backend_of, pinned


def schedule(graph: Graph, backends: Sequence[Backend]) -> Schedule:
    """Assign, cut splits, and find the split inputs that need a copy."""
    backend_of, pinned = assign(graph, backends)
    groups: list[tuple[Backend, list[Tensor]]] = []
    for n in graph.nodes:
        if n.op in VIEW_OPS:
            continue
        b = backend_of[n.id]
        if groups and groups[-1][0] is b:
            groups[-1][1].append(n)
        else:
            groups.append((b, [n]))

    # where each non-static root lives: the buffer type of its producer, or of its first consumer (inputs)
    home: dict[int, BufferType] = {}
    for b, nodes in groups:
        for n in nodes:
            home.setdefault(root(n).id, b.default_buffer_type)
    for b, nodes in groups:
        for n in nodes:
            for s in n.src:
                if s is not None:
                    home.setdefault(root(s).id, b.default_buffer_type)
    for t in graph.outputs:  # an output that is only a leaf or view
        home.setdefault(root(t).id, backends[0].default_buffer_type)

    # split inputs living in a buffer type the split's backend cannot read get a copy next to it
    copy_of: dict[tuple[int, str], Tensor] = {}
    split_copies: list[list[tuple[Tensor, Tensor]]] = []
    for b, nodes in groups:
        pairs: list[tuple[Tensor, Tensor]] = []
        for n in nodes:
            for s in n.src:
                if s is None:
                    continue
                r = root(s)
                if r.flags & (PARAM | STATE) or b.supports_buffer_type(home[r.id]):
                    continue
                key = (r.id, b.default_buffer_type.name)
                if key not in copy_of:
                    c = Tensor(r.shape, r.dtype, strides=r.strides, name=f"{r.name}#{b.name}")
                    copy_of[key] = c
                    home[c.id] = b.default_buffer_type
                    pairs.append((r, c))
        split_copies.append(pairs)
    return Schedule(backend_of, pinned, groups, home, split_copies)
