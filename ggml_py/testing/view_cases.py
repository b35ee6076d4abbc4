"""The kit's view cases, derived from the schema: every source of every op gets the non-contiguous layouts its
`OpDef.layout` says a backend must accept, so a new op (or a new source) gets them without a line here.

For each op, source and type combination (a case's types string; for an I32/I64 source, its own type), the first case
of the other families whose op node reads that source as a plain contiguous leaf (for a window, preferably one of 3 or
more dims) is rebuilt with the leaf laid out anew (`Ctx.views`, case.py), same values, same graph otherwise:

- "window" for a source whose layout is ANY or ROWS (rows contiguous, further apart than their length: a view of a
  wider input, at an offset), when it has at least two rows;
- "transposed" for an ANY source of two or more dims (its innermost dim strided: nb[0] is a row's length), or
  "strided" when every such source of the op's cases is 1-D (every other element of a longer input);
- nothing for a CONTIGUOUS source.

A case's id is its base's with `,<source>:<layout>` appended, e.g. `ADD[F32](a=[7,33],b=[7,33],b:transposed)`.
The per-op table of the docs is layouts.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ggml_py.ir import schema
from ggml_py.ir.dtypes import I32, I64
from ggml_py.ir.graph import Graph
from ggml_py.ir.tensor import Tensor
from ggml_py.testing.case import RELAYOUTS, Case, Ctx

if TYPE_CHECKING:  # the runner imports the cases, this module among them
    from ggml_py.testing.runner import Result

__all__ = ["view_cases", "view_of"]



def view_of(case: Case | Result) -> tuple[str, str] | None:
    """(source, layout) of a view case or of its result (its case string ends with `,<source>:<layout>`), else None."""
    role, sep, how = case.case.rpartition(",")[2].partition(":")
    return (role, how) if sep and how in RELAYOUTS else None


def _wanted(need: str, t: Tensor) -> tuple[str, ...]:
    """The layouts the kit gives a source of this requirement, shape and type (those it can show a difference in:
    two rows at least, two columns and two rows for a transpose; a quantized row keeps its blocks together)."""
    if need == schema.CONTIGUOUS or not all(isinstance(d, int) for d in t.shape):
        return ()
    shape = [int(d) for d in t.shape]
    out = []
    if len(shape) >= 2 and int(np.prod(shape[:-1])) >= 2:
        out.append("window")
    if need == schema.ANY and not t.dtype.is_quantized:
        if len(shape) >= 2 and min(shape[-2:]) >= 2:
            out.append("transposed")
        elif len(shape) == 1 and shape[0] >= 2:
            out.append("strided")
    return tuple(out)


def _plain_sources(case: Case) -> tuple[Tensor, list[int | None]] | None:
    """The case's node of its op and, per source, the index of the leaf it is (None: absent), when every source is
    a contiguous leaf the builder made itself; else None (a case with views or symbols already is no base)."""
    if case.bindings:
        return None
    ctx = Ctx(np.random.default_rng(case.seed), dry=True)
    made = case.make(ctx)
    outs = [made] if isinstance(made, Tensor) else list(made)
    node = next((n for n in Graph(outs).nodes if n.op == case.op), None)
    if node is None:
        return None
    index = {id(x): i for i, x in enumerate(ctx.leaves)}
    where: list[int | None] = []
    for s in node.src:
        if s is not None and (id(s) not in index or s.is_symbolic or not s.is_contiguous()):
            return None
        where.append(None if s is None else index[id(s)])
    return node, where


def _derived(base: Case, role: str, j: int, leaf: int, how: str) -> Case:
    def make(c: Ctx) -> Tensor | Sequence[Tensor]:
        c.views[leaf] = how
        out = base.make(c)
        outs = [out] if isinstance(out, Tensor) else list(out)
        view = c.made_views.get(leaf)
        if view is None or not any(n.op == base.op and n.src[j] is view for n in Graph(outs).nodes):
            raise AssertionError(f"kit: {base.id} no longer reads leaf {leaf} as its {role}")
        return out

    return Case(base.op, f"{base.case},{role}:{how}", base.types, make, max_nmse=base.max_nmse,
                note=f"{role} is a {how} view (schema: {schema.OPS[base.op].requires(role)})")


def view_cases(bases: Sequence[Case]) -> list[Case]:
    """The view cases derived from `bases` (the kit's other cases), in their order."""
    chosen: dict[tuple[str, str, str, str], Case] = {}
    ndim: dict[tuple[str, str, str, str], int] = {}  # the chosen base's source rank
    strided: dict[tuple[str, str, str], Case] = {}
    for case in bases:
        found = _plain_sources(case)
        if found is None:
            continue
        node, where = found
        op = schema.OPS[case.op]
        for j, (role, s, leaf) in enumerate(zip(op.roles, node.src, where)):
            if s is None or leaf is None:
                continue
            # indices are read alike whatever the data's type: their views once per index type, not per combination
            types = s.dtype.name if s.dtype in (I32, I64) else case.types
            for how in _wanted(op.requires(role), s):
                key = (case.op, role, types)
                if how == "strided":  # only where no case of these types has the source in two dims
                    strided.setdefault(key, _derived(case, role, j, leaf, how))
                    continue
                # the first base, unless a later one has the source in 3 dims where the first had 2: its window
                # has strided matrices too (nb[2] is not ne[1] * nb[1])
                k = (*key, how)
                if k not in chosen or (how == "window" and s.ndim >= 3 > ndim[k]):
                    chosen[k], ndim[k] = _derived(case, role, j, leaf, how), s.ndim
    two_d = {k[:3] for k in chosen if k[3] == "transposed"}
    made = [*chosen.values(), *(c for k, c in strided.items() if k not in two_d)]
    order: dict[str, int] = {}
    for i, c in enumerate(bases):
        order.setdefault(c.op, i)
    return sorted(made, key=lambda c: order[c.op])
