"""Liveness-based memory planning for the intermediates of a graph (in the spirit of ggml-alloc).

Offsets are planned before any memory exists: each tensor gets a range in its buffer type's compute buffer, freed
ranges are reused (best fit, with merging), elementwise ops write in place over a source that dies with them, views
take no memory, and inputs and outputs are never reused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ggml_py.ir.schema import INPLACE_OPS  # ops that may overwrite their first source (same shape, type and layout)
from ggml_py.ir.tensor import INPUT, OUTPUT, PARAM, STATE, Tensor


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass
class FreeList:
    """Best-fit allocator over one growing address space; tracks the high-water mark."""

    alignment: int
    free: list[list[int]] = field(default_factory=list)  # sorted [offset, size] blocks
    top: int = 0  # end of the space used so far
    peak: int = 0

    def alloc(self, size: int) -> int:
        size = _align(max(size, 1), self.alignment)
        best = None
        for i, (_, sz) in enumerate(self.free):
            if sz >= size and (best is None or sz < self.free[best][1]):
                best = i
        if best is not None:
            off, sz = self.free[best]
            if sz == size:
                del self.free[best]
            else:
                self.free[best] = [off + size, sz - size]
            return off
        # grow, absorbing a free block that ends at the top
        if self.free and self.free[-1][0] + self.free[-1][1] == self.top:
            off = self.free.pop()[0]
        else:
            off = self.top
        self.top = off + size
        self.peak = max(self.peak, self.top)
        return off

    def release(self, off: int, size: int) -> None:
        size = _align(max(size, 1), self.alignment)
        self.free.append([off, size])
        self.free.sort()
        merged: list[list[int]] = []
        for blk in self.free:
            if merged and merged[-1][0] + merged[-1][1] == blk[0]:
                merged[-1][1] += blk[1]
            else:
                merged.append(blk)
        self.free = merged


@dataclass
class Allocation:
    """Planned offsets: tensor id -> (buffer type name, offset); sizes per buffer type; in-place reuses."""

    offsets: dict[int, tuple[str, int]]
    sizes: dict[str, int]
    inplace: int


def plan_memory(
    nodes: Sequence[Tensor],
    leafs: Sequence[Tensor],
    buffer_type_of: Callable[[Tensor], str],
    alignment_of: Callable[[str], int],
    size_of: Callable[[Tensor], int],
    extra_users: Callable[[Tensor], int] = lambda t: 0,
) -> Allocation:
    """Plan compute-buffer offsets for `leafs` (inputs) and `nodes` (in execution order).

    PARAM and STATE tensors are persistent and not planned here; views take their root's memory.
    """
    spaces: dict[str, FreeList] = {}
    sizes: dict[int, int] = {}  # planned bytes of each live range, by owning tensor id
    offsets: dict[int, tuple[str, int]] = {}

    def space(bt: str) -> FreeList:
        if bt not in spaces:
            spaces[bt] = FreeList(alignment_of(bt))
        return spaces[bt]

    def root(t: Tensor) -> Tensor:
        return t.view_src if t.view_src is not None else t

    # remaining users of each root's memory (a user of a view uses the root)
    users: dict[int, int] = {}
    for n in nodes:
        for s in {root(s).id for s in n.src if s is not None}:
            users[s] = users.get(s, 0) + 1
    for n in (*nodes, *leafs):
        users[n.id] = users.get(n.id, 0) + extra_users(n)

    def planned(t: Tensor) -> bool:
        return not (t.flags & (PARAM | STATE)) and t.view_src is None

    for t in leafs:
        if planned(t):
            bt = buffer_type_of(t)
            offsets[t.id] = (bt, space(bt).alloc(size_of(t)))
            sizes[t.id] = size_of(t)

    inplace = 0
    for n in nodes:
        if planned(n):
            bt = buffer_type_of(n)
            a = n.src[0] if n.src else None
            ra = root(a) if a is not None else None
            if (n.op in INPLACE_OPS and a is not None and ra is a and a.id in offsets and users.get(a.id) == 1
                    and not a.flags & (INPUT | OUTPUT) and a.dtype is n.dtype and tuple(a.shape) == tuple(n.shape)
                    and tuple(a.strides) == tuple(n.strides) and offsets[a.id][0] == bt
                    and not any(s is a for s in n.src[1:])):
                offsets[n.id] = offsets[a.id]
                users[a.id] = 0
                inplace += 1
                # the memory now belongs to n: carry a's size so release frees the right amount
                sizes[n.id] = sizes.pop(a.id, size_of(a))
            else:
                offsets[n.id] = (bt, space(bt).alloc(size_of(n)))
                sizes[n.id] = size_of(n)
        for s in {root(s).id: root(s) for s in n.src if s is not None}.values():
            users[s.id] -= 1
            if users[s.id] == 0 and planned(s) and not s.flags & (INPUT | OUTPUT) and s.id in offsets:
                bt, off = offsets[s.id]
                space(bt).release(off, sizes.pop(s.id, size_of(s)))
    return Allocation(offsets, {bt: fl.peak for bt, fl in spaces.items()}, inplace)

