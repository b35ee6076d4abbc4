"""The op schema: every op of ggml_py written once.

Each `OpDef` says an op's name, its id in the C ABI, its sources, its parameters (name, type, ABI slot), its shape rule
(as text for the docs; `ggml_py.ir.ops` implements it), whether the allocator may compute it in place over its first
source, the conformance kit's NMSE threshold, its family, whether it is transcendental, (unary family) its formula,
and the memory layout each source must have (`layout`: any strides, contiguous rows, or contiguous).
Everything else is derived from this table or checked against it by a test: the C header's op enum, parameter slots and
X-macro op lists and source layouts (`render_header`), which the simd backend's kernel table, validation, cost classes
and dispatch expand, the allocator's in-place set, the view ops, the parameters a node must carry, the ABI encoding of
a node's parameters, the kit's op list and default thresholds, the kit's windowed and transposed views of every source
that accepts them (testing/view_cases.py), the unary family's builders in ops.py, the numpy backend's kernel table,
and docs/ops.md.

Adding an op (docs/architecture.md, "Adding an op"): one `OpDef` here (a new ABI id is appended, never reused), then
`python -m ggml_py.ir.schema header` to refresh the header, its numpy kernel and its simd kernel. An op of the unary
family is one `_unary(...)` line: its builder, docs and kit cases follow, and its simd kernel is a `UnaryOp`
specialisation in csrc/simd/k_elementwise.cpp (without one the build fails naming the op). Other ops also need a
builder in ops.py, a row in docs/ops.md, kit cases and, in simd, a kernel, a `kernel_of` entry and a validation case.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggml_py.ir import dtypes
from ggml_py.ir.symbolic import Dim, upper

# Parameter kinds. In the ABI every parameter takes 32-bit slots of `ggml_py_op_params`, in declaration order.
F32 = "f32"  # one float slot
I32 = "i32"  # one int32 slot
AXIS = "axis"  # a numpy-order axis; the ABI holds ggml's dim (0 = innermost) in one int32 slot
DIMS = "dims"  # one int per dim in numpy order; the ABI holds MAX_DIMS int32 slots in ggml order (missing = 0)

MAX_DIMS = 4
MAX_OP_PARAMS = 16

# ggml's test-backend-ops thresholds
NMSE_DEFAULT = 1e-7
NMSE_MUL_MAT = 5e-4
# MUL_MAT of F32, F16 or BF16 weights by F32 activations is exact products summed in F32: the simd kernels reach
# 1e-13 at every level (docs/testing.md), ggml's test-backend-ops allows 5e-4. A kernel that rounded the
# activations to F16 (~2e-8) or BF16 (~1e-6), or accumulated in F16, would fail this.
NMSE_MUL_MAT_FLOAT = 1e-10
# The precision tiers a backend may declare (Device caps "precision"; a native plugin's ggml_py_plugin.precision):
# "exact" is held to every threshold; "reduced" (F16/BF16/TF32 products or accumulation, as GPU plugins compute) is
# held to an op's max_nmse where its max_nmse_float would apply: ggml's test-backend-ops bound, 5e-4, for MUL_MAT
# and MUL_MAT_ID of float weights.
PRECISION_TIERS = ("exact", "reduced")
NMSE_SOFT_MAX = 1e-6
NMSE_EXACT = 0.0

# What a source's memory layout must be (OpDef.layout), as ggml's CPU backend requires it (it asserts these, and its
# test-backend-ops feeds views within them). A backend may refuse a node whose source breaks its op's requirement
# (`layout_refusals`); it must compute every other layout. The kit gives each source views its requirement allows:
# a window of a wider input (rows apart by more than their length) for ANY and ROWS, a transposed view for ANY.
ANY = "any"  # any byte strides: permuted, transposed (nb[0] != the element size), windows
ROWS = "rows"  # contiguous rows, nb[0] == the type size (ggml_is_contiguous_rows); the outer strides are free
CONTIGUOUS = "contiguous"  # dense (ggml_is_contiguous); at any offset
LAYOUTS = (ANY, ROWS, CONTIGUOUS)
LAYOUT_TEXT = {ANY: "of any layout", ROWS: "contiguous in its rows", CONTIGUOUS: "contiguous"}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # F32, I32, AXIS or DIMS
    # The ABI minor version that added it (0: in 2.0). A plugin of an earlier minor never learnt its slot, so it is
    # offered only nodes where the parameter holds `neutral`, the value that computes what the op did before.
    since: int = 0
    neutral: float | None = None

    @property
    def n_slots(self) -> int:
        return MAX_DIMS if self.kind == DIMS else 1

    @property
    def is_float(self) -> bool:
        return self.kind == F32


@dataclass(frozen=True)
class OpDef:
    name: str
    abi_id: int | None  # None: a view op, resolved into layouts before any backend sees it
    srcs: tuple[str, ...]  # source roles in ABI order; a trailing "?" marks an optional one (NULL when absent)
    params: tuple[Param, ...] = ()
    rule: str = ""  # the shape rule, for the docs
    inplace: bool = False  # may overwrite its first source when that dies with it (same shape, type, layout)
    max_nmse: float = NMSE_DEFAULT  # the kit's threshold (conversions use per-type ones, see testing/case.py)
    max_nmse_float: float | None = None  # the threshold when no source is block-quantized (None: max_nmse)
    family: str = ""  # ops that share a builder and a kernel: "unary", "binary", "glu", "view"
    aliases: int | None = None  # the source whose memory dst is (CPY's destination, SET_ROWS's dst)
    # evaluates exp, log, tanh, erf, sin or cos per element: a backend's work estimate weighs its elements heavier
    transcendental: bool = False
    doc: str = ""  # what it computes, for the docs (the unary family's builders take it as their docstring)
    # optional sources added by a later ABI minor (role without "?" -> minor): a plugin of an earlier minor would
    # ignore them, so it is offered only nodes without them
    srcs_since: Mapping[str, int] = field(default_factory=dict)
    # the layout each source needs (role without "?" -> ROWS or CONTIGUOUS); a source not named accepts ANY
    layout: Mapping[str, str] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        """The sources' roles without the optional marker."""
        return tuple(r.rstrip("?") for r in self.srcs)

    def requires(self, role: str) -> str:
        """The layout source `role` must have: ANY, ROWS or CONTIGUOUS."""
        if role not in self.roles:
            raise KeyError(f"{self.name} has no source {role!r}")
        return self.layout.get(role, ANY)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def slot(self, name: str) -> int:
        """The first ABI slot of parameter `name`."""
        s = 0
        for p in self.params:
            if p.name == name:
                return s
            s += p.n_slots
        raise KeyError(f"{self.name} has no parameter {name!r}")

    def abi_minor(self, params: Mapping[str, object], present: Sequence[bool]) -> int:
        """The ABI minor version a plugin must speak to compute a node of this op with these parameters and sources
        (`present[j]`: source j is not None); 0 when every 2.x plugin computes it as meant."""
        need = [p.since for p in self.params if p.since and params[p.name] != p.neutral]
        need += [self.srcs_since.get(role.rstrip("?"), 0) for role, here in zip(self.srcs, present) if here]
        return max(need, default=0)

    def encode(self, params: Mapping[str, object], ndim: int) -> list[tuple[int, bool, int | float]]:
        """(slot, is_float, value) of every ABI slot this op's parameters fill; `ndim` is the node's rank."""
        out: list[tuple[int, bool, int | float]] = []
        s = 0
        for p in self.params:
            v = params[p.name]
            if p.kind == F32:
                out.append((s, True, float(v)))  # type: ignore[arg-type]
            elif p.kind == I32:
                out.append((s, False, int(v)))  # type: ignore[call-overload]
            elif p.kind == AXIS:
                out.append((s, False, ndim - 1 - int(v)))  # type: ignore[call-overload]
            else:
                vals = [int(x) for x in v]  # type: ignore[attr-defined]
                for k in range(MAX_DIMS):
                    out.append((s + k, False, vals[len(vals) - 1 - k] if k < len(vals) else 0))
            s += p.n_slots
        return out


def _f(*names: str) -> tuple[Param, ...]:
    return tuple(Param(n, F32) for n in names)


_UNARY_RULE = "`a.shape`"
_BINARY_RULE = "`b` tiles `a`; result `a.shape`"


# Each op's `layout` is what ggml's CPU backend asserts (ggml/src/ggml-cpu/ops.cpp, binary-ops.cpp, unary-ops.cpp,
# ggml-cpu.c; the graph builders of ggml.c), noted at the op: "nb00" is `GGML_ASSERT(nb00 == type size)`, "rows"
# ggml_is_contiguous_rows, "cont" ggml_is_contiguous. Where ggml asks ggml_is_contiguous_1 (rows contiguous, dims
# above 1 dense), ggml_py asks ROWS: its backends take any outer strides.
_ROWS_A = {"a": ROWS}


def _unary(name: str, abi_id: int, doc: str, transcendental: bool = False) -> OpDef:
    """An op of the unary family: elementwise F32 -> F32 without parameters, built by `ops.<name in lower case>(a)`
    (ops.py makes the builder from this entry) and computed by each backend's unary kernel."""
    return OpDef(name, abi_id, ("a",), rule=_UNARY_RULE, inplace=True, family="unary", transcendental=transcendental,
                 doc=doc, layout=_ROWS_A)


OPS_LIST: tuple[OpDef, ...] = (
    # binary: a nb00; b any (binary-ops.cpp reads a strided src1 element by element)
    OpDef("ADD", 1, ("a", "b"), rule=_BINARY_RULE, inplace=True, family="binary", layout=_ROWS_A),
    OpDef("SUB", 2, ("a", "b"), rule=_BINARY_RULE, inplace=True, family="binary", layout=_ROWS_A),
    OpDef("MUL", 3, ("a", "b"), rule=_BINARY_RULE, inplace=True, family="binary", layout=_ROWS_A),
    OpDef("DIV", 4, ("a", "b"), rule=_BINARY_RULE, inplace=True, family="binary", layout=_ROWS_A),
    # cont (scale_f32)
    OpDef("SCALE", 5, ("a",), _f("s", "b"), "`a.shape`; `a * s + b`", inplace=True, layout={"a": CONTIGUOUS}),
    # the unary family: rows (ggml_unary_impl, apply_unary_op)
    _unary("SQR", 6, "`x * x`"),
    _unary("SQRT", 7, "`sqrt(x)`"),
    _unary("NEG", 8, "`-x`"),
    _unary("ABS", 9, "`abs(x)`"),
    _unary("EXP", 10, "`e^x`", transcendental=True),
    _unary("LOG", 11, "natural logarithm `ln(x)`", transcendental=True),
    _unary("SILU", 12, "`x / (1 + e^-x)`", transcendental=True),
    _unary("GELU", 13, "tanh approximation `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` (as ggml)",
           transcendental=True),
    _unary("RELU", 14, "`x > 0 ? x : 0` (as ggml: `relu(NaN) = 0`)"),
    _unary("TANH", 15, "`tanh(x)`", transcendental=True),
    _unary("SIGMOID", 16, "`1 / (1 + e^-x)`", transcendental=True),
    _unary("GELU_ERF", 38, "exact GELU `0.5 * x * (1 + erf(x / sqrt(2)))` (ggml's GELU_ERF)", transcendental=True),
    OpDef("CLAMP", 17, ("a",), _f("min", "max"), "`a.shape`; `min <= max`", inplace=True, layout=_ROWS_A),  # nb00
    # both ggml_is_contiguous_1 (ggml_glu_impl)
    OpDef("SWIGLU", 18, ("a", "b?"), rule="`a.shape`, or `(..., n/2)` without `b`", family="glu",
          transcendental=True, layout={"a": ROWS, "b": ROWS}),
    OpDef("GEGLU", 19, ("a", "b?"), rule="`a.shape`, or `(..., n/2)` without `b`", family="glu",
          transcendental=True, layout={"a": ROWS, "b": ROWS}),
    OpDef("NORM", 20, ("a",), _f("eps"), "`a.shape`, over the last dim"),  # any (norm_f32 has a strided path)
    OpDef("RMS_NORM", 21, ("a",), _f("eps"), "`a.shape`, over the last dim", layout=_ROWS_A),  # nb00
    OpDef("SUM_ROWS", 22, ("a",), rule="`(..., 1)`", layout=_ROWS_A),  # nb00
    OpDef("MEAN", 23, ("a",), rule="`(..., 1)`", layout=_ROWS_A),  # nb00
    OpDef("ARGMAX", 24, ("a",), rule="`a.shape[:-1]`, I32", max_nmse=NMSE_EXACT, layout=_ROWS_A),  # nb00
    # "we don't support permuted src0 or src1" (ggml-cpu.c): nb00 and nb10
    OpDef("MUL_MAT", 25, ("a", "b"), rule="`a (..., M, K)`, `b (..., N, K)` -> `(..., N, M)`",
          max_nmse=NMSE_MUL_MAT, max_nmse_float=NMSE_MUL_MAT_FLOAT, layout={"a": ROWS, "b": ROWS}),
    # both cont (ggml_soft_max_impl)
    OpDef("SOFT_MAX", 26, ("a", "mask?"), _f("scale", "max_bias"), "`a.shape`", inplace=True,
          max_nmse=NMSE_SOFT_MAX, transcendental=True, layout={"a": CONTIGUOUS, "mask": CONTIGUOUS}),
    # cont (diag_mask_f32 copies src0 to dst as one block)
    OpDef("DIAG_MASK_INF", 27, ("a",), (Param("n_past", I32),), "`a.shape`", inplace=True,
          layout={"a": CONTIGUOUS}),
    # ABI 2.2 added YaRN (ggml's ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig) and the frequency
    # factors (llama 3 rope scaling); their neutral values are the rope every 2.x plugin computes
    OpDef("ROPE", 28, ("a", "pos", "freq_factors?"),
          (Param("n_dims", I32), Param("mode", I32), Param("freq_base", F32), Param("freq_scale", F32),
           Param("ext_factor", F32, 2, 0.0), Param("attn_factor", F32, 2, 1.0), Param("beta_fast", F32, 2, 32.0),
           Param("beta_slow", F32, 2, 1.0), Param("n_ctx_orig", I32, 2, 0)),
          "`a (..., T, H, D)`, `pos (T,)`, `freq_factors (n_dims/2,)` -> `a.shape`", transcendental=True,
          srcs_since={"freq_factors": 2},
          # rope_flt: a nb00; pos and freq_factors are read as plain arrays from their data pointers
          layout={"a": ROWS, "pos": CONTIGUOUS, "freq_factors": CONTIGUOUS}),
    # "input tensor rows must be contiguous" (flash_attn_ext_f16): q, k, v nb0; mask cont (ggml_flash_attn_ext)
    OpDef("FLASH_ATTN_EXT", 29, ("q", "k", "v", "mask?"), _f("scale", "max_bias", "softcap"),
          "`q (B, H, Nq, D)`, `k (B, Hk, Nkv, D)`, `v (B, Hk, Nkv, Dv)` -> `(B, Nq, H, Dv)`",
          max_nmse=NMSE_MUL_MAT, layout={"q": ROWS, "k": ROWS, "v": ROWS, "mask": CONTIGUOUS}),
    # get_rows_*: a nb00; idx any (read through nb10, nb11, nb12)
    OpDef("GET_ROWS", 30, ("a", "idx"), rule="`a (..., R, C)`, `idx (..., n)` -> `(..., n, C)`",
          max_nmse=NMSE_EXACT, layout=_ROWS_A),
    # dst and rows: rows (ggml_set_rows); idx any (read through its strides)
    OpDef("SET_ROWS", 31, ("dst", "rows", "idx"), rule="`dst (R, C)`, `rows (n, C)`, `idx (n,)` -> `dst`",
          max_nmse=NMSE_EXACT, aliases=0, layout={"dst": ROWS, "rows": ROWS}),
    # any: ggml's dup walks both tensors by their strides (its quantizing path, dup_to_q, wants a's rows and a dense
    # dst; ggml_py's backends quantize into any layout of whole rows)
    OpDef("CPY", 32, ("a", "dst?"), rule="`dst.shape` (same element count), or `a.shape` as a new tensor",
          max_nmse=NMSE_EXACT, aliases=1),
    OpDef("CONT", 33, ("a",), rule="`a.shape`, contiguous", max_nmse=NMSE_EXACT),  # any (dup)
    # any (concat_f32 reads both through their strides)
    OpDef("CONCAT", 34, ("a", "b"), (Param("axis", AXIS),), "sizes along `axis` added", max_nmse=NMSE_EXACT),
    OpDef("REPEAT", 35, ("a",), rule="the target shape (tiled by `a`)", max_nmse=NMSE_EXACT,
          layout=_ROWS_A),  # nb00 (repeat_f32)
    OpDef("PAD", 36, ("a",), (Param("pads", DIMS),), "`a.shape` plus `pads`", max_nmse=NMSE_EXACT),  # any (pad_f32)
    # top_k_f32 reads each row as a plain array
    OpDef("TOP_K", 37, ("a",), (Param("k", I32),),
          "`a (..., n)` -> `(..., k)` I32: indices of the k largest, largest first, the lower index first on ties, "
          "NaN above everything (as ARGMAX)", max_nmse=NMSE_EXACT, layout=_ROWS_A),
    # the expert-routed product of mixture-of-experts layers (ggml's MUL_MAT_ID): every token's k chosen experts;
    # as and b nb00 (ggml-cpu.c, as MUL_MAT), ids any (read through its strides)
    OpDef("MUL_MAT_ID", 39, ("as", "b", "ids"),
          rule="`as (E, M, K)`, `b (T, S, K)` with `S` dividing `k`, `ids (T, k)` I32 in `0..E-1` -> `(T, k, M)`; "
               "row `(t, i)` is `b[t, i % S] @ as[ids[t, i]].T`, an expert may repeat within a token",
          max_nmse=NMSE_MUL_MAT, max_nmse_float=NMSE_MUL_MAT_FLOAT, layout={"as": ROWS, "b": ROWS}),
    # views: no kernel, no ABI id; backends see their results as layouts (ne, nb, data)
    OpDef("VIEW", None, ("a",), rule="given shape, strides and offset", family="view"),
    OpDef("RESHAPE", None, ("a",), rule="given shape, same element count", family="view"),
    OpDef("PERMUTE", None, ("a",), rule="`a.shape` permuted", family="view"),
    OpDef("TRANSPOSE", None, ("a",), rule="last two dims swapped", family="view"),
)

OPS: dict[str, OpDef] = {o.name: o for o in OPS_LIST}
COMPUTE_OPS: tuple[str, ...] = tuple(o.name for o in OPS_LIST if o.abi_id is not None)
VIEW_OPS: frozenset[str] = frozenset(o.name for o in OPS_LIST if o.family == "view")
INPLACE_OPS: frozenset[str] = frozenset(o.name for o in OPS_LIST if o.inplace)
UNARY_OPS: tuple[str, ...] = tuple(o.name for o in OPS_LIST if o.family == "unary")
BINARY_OPS: tuple[str, ...] = tuple(o.name for o in OPS_LIST if o.family == "binary")
GLU_OPS: tuple[str, ...] = tuple(o.name for o in OPS_LIST if o.family == "glu")
TRANSCENDENTAL_OPS: tuple[str, ...] = tuple(o.name for o in OPS_LIST if o.transcendental)
ABI_IDS: dict[str, int] = {o.name: o.abi_id for o in OPS_LIST if o.abi_id is not None}


def get(name: str | None) -> OpDef:
    try:
        return OPS[name or ""]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(OPS)}") from None


def has_layout(required: str, shape: Sequence[Dim], strides: Sequence[Dim], dtype: dtypes.DType) -> bool:
    """True if a tensor of this shape, byte strides (numpy order) and type has the layout `required` (ANY, ROWS,
    CONTIGUOUS), as ggml judges it: a dim of size 1 has no stride that matters. Symbols count at their bounds."""
    if required == ANY or not shape:
        return True
    ne = [upper(d) for d in shape]
    nb = [upper(s) for s in strides]
    if required == ROWS:
        return ne[-1] == dtype.block_size or nb[-1] == dtype.type_size
    if required != CONTIGUOUS:
        raise ValueError(f"unknown layout {required!r}; one of {', '.join(LAYOUTS)}")
    expect = dtype.type_size
    for i in reversed(range(len(ne))):
        if ne[i] != 1 and nb[i] != expect:
            return False
        expect *= ne[i] // dtype.block_size if i == len(ne) - 1 else ne[i]
    return True


def unmet_layouts(node: Any) -> list[str]:
    """What of a node's sources breaks its op's layout requirements, one line per source (empty: none does): a
    backend may decline such a node in supports_op, as ggml's CPU backend does (the conformance kit says so when a
    backend skips one of its cases for it)."""
    op = OPS.get(node.op or "")
    if op is None or op.abi_id is None:
        return []
    out = []
    for role, s in zip(op.roles, node.src):
        need = op.requires(role)
        if s is not None and not has_layout(need, s.shape, s.strides, s.dtype):
            out.append(f"{op.name}'s {role} must be {LAYOUT_TEXT[need]} (strides {list(s.strides)} for "
                       f"{s.dtype}{list(s.shape)})")
    return out


# -- the C header's generated regions ---------------------------------------------------------------------------------
BEGIN = "/* GGML_PY_SCHEMA_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */"
END = "/* GGML_PY_SCHEMA_END */"
NAMES_BEGIN = "/* GGML_PY_OP_NAMES_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */"
NAMES_END = "/* GGML_PY_OP_NAMES_END */"
LISTS_BEGIN = "/* GGML_PY_OP_LISTS_BEGIN: generated by `python -m ggml_py.ir.schema header`, do not edit */"
LISTS_END = "/* GGML_PY_OP_LISTS_END */"


def _by_id(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(names, key=lambda n: ABI_IDS[n]))


# The header's X-macro lists: GGML_PY_OPS_<key>(X) expands to X(NAME) for every op of the list, in id order. C code
# iterates them (a switch's case labels, a kernel table) instead of naming the ops of a family by hand.
C_LISTS: dict[str, tuple[str, ...]] = {
    "COMPUTE": _by_id(COMPUTE_OPS),
    "UNARY": _by_id(UNARY_OPS),
    "BINARY": _by_id(BINARY_OPS),
    "GLU": _by_id(GLU_OPS),
    "TRANSCENDENTAL": _by_id(TRANSCENDENTAL_OPS),
}


def _c_enum(name: str, items: Sequence[tuple[str, int]]) -> list[str]:
    lines = [f"enum {name} {{"]
    lines += [f"    {k} = {v}," for k, v in items[:-1]] + [f"    {items[-1][0]} = {items[-1][1]}", "};"]
    return lines


def render_abi_schema() -> str:
    """The header text between BEGIN and END: type ids, op ids and each op's parameter slots."""
    types = sorted(dtypes.ALL, key=lambda t: t.ggml_id)
    out = ["/* Element types: ggml's type ids (also GGUF's). */"]
    out += _c_enum("ggml_py_type", [(f"GGML_PY_TYPE_{t.name}", t.ggml_id) for t in types])
    ops = sorted((o for o in OPS_LIST if o.abi_id is not None), key=lambda o: o.abi_id or 0)
    out += ["", "/* Op ids: only ever appended to. Sources (src[0], src[1], ...; '?' = optional, NULL when absent;",
            " * [rows]: must have contiguous rows, [contiguous]: must be contiguous, see GGML_PY_LAYOUT_<OP>):"]
    out += [f" *   {o.name:<15} {', '.join(_src_text(o, r) for r in o.srcs)}"
            + (f"  (dst aliases src[{o.aliases}])" if o.aliases is not None else "") for o in ops]
    added = [f"{o.name} {role} (ABI 2.{v})" for o in ops for role, v in o.srcs_since.items()]
    if added:
        out.append(" * Sources added by a later minor version: " + "; ".join(added) + ".")
    out += [" */"]
    out += _c_enum("ggml_py_op", [("GGML_PY_OP_NONE", 0), *((f"GGML_PY_OP_{o.name}", o.abi_id or 0) for o in ops),
                                  ("GGML_PY_OP_COUNT", max(o.abi_id or 0 for o in ops) + 1)])
    out += ["", "/* Op parameters: GGML_PY_P_<OP>_<PARAM> is the first slot of ggml_py_op_params it fills, read",
            " * as .f[] (float) or .i[] (int32) as noted; DIMS fill MAX_DIMS int slots in ggml order (innermost",
            " * first). */"]
    for o in ops:
        for p in o.params:
            kind = {F32: "f", I32: "i", AXIS: "i, ggml dim", DIMS: "i, MAX_DIMS slots"}[p.kind]
            if p.since:
                kind += f"; ABI 2.{p.since}, neutral {p.neutral:g}"
            out.append(f"#define GGML_PY_P_{o.name}_{p.name.upper()} {o.slot(p.name)} /* {kind} */")
    out += ["", "/* Source layouts: what each source's memory must be, as ggml's CPU backend requires it. A plugin may",
            " * decline a node whose source lacks its layout and must compute every other layout (the conformance kit",
            " * feeds windows of wider inputs to every source that is not CONTIGUOUS, transposed views to every ANY",
            " * one). GGML_PY_LAYOUT_<OP> holds source j's layout at bits 2j and 2j+1:",
            " * (GGML_PY_LAYOUT_<OP> >> (2 * j)) & 3. ROWS: nb[0] == the type (block) size, other strides free. */",
            *(f"#define GGML_PY_LAYOUT_{k.upper()} {i}" for i, k in enumerate(LAYOUTS))]
    for o in ops:
        bits = sum(LAYOUTS.index(o.requires(r)) << (2 * j) for j, r in enumerate(o.roles))
        what = ", ".join(f"{r} {o.requires(r)}" for r in o.roles if o.requires(r) != ANY)
        out.append(f"#define GGML_PY_LAYOUT_{o.name} {bits}" + (f" /* {what} */" if what else ""))
    return "\n".join(out)


def _src_text(o: OpDef, role: str) -> str:
    need = o.requires(role.rstrip("?"))
    return role if need == ANY else f"{role} [{need}]"


def render_op_names() -> str:
    """The header text between NAMES_BEGIN and NAMES_END: an initializer of op names indexed by op id (C only)."""
    ops = {o.abi_id: o.name for o in OPS_LIST if o.abi_id is not None}
    names = [f'"{ops.get(i, "NONE" if i == 0 else "?")}"' for i in range(max(ops) + 1)]
    rows = [", ".join(names[i:i + 8]) for i in range(0, len(names), 8)]
    return "#define GGML_PY_OP_NAMES_INIT { \\\n    " + ", \\\n    ".join(rows) + " }"


def render_op_lists() -> str:
    """The header text between LISTS_BEGIN and LISTS_END: the X-macro lists of C_LISTS (C only)."""
    out = ["/* Op lists (X-macros): GGML_PY_OPS_<LIST>(X) expands to X(NAME) for every op of the list, in id order:",
           " *   #define CASE(NAME) case GGML_PY_OP_##NAME:",
           " *   switch (op) { GGML_PY_OPS_UNARY(CASE) return unary(op); ... }",
           " * COMPUTE: every op with an id. UNARY, BINARY, GLU: the schema's families (ops that share a builder and a",
           " * kernel). TRANSCENDENTAL: ops that evaluate exp, log, tanh, erf, sin or cos per element. */"]
    for key, names in C_LISTS.items():
        items = [f"X({n})" for n in names]
        rows = [" ".join(items[i:i + 8]) for i in range(0, len(items), 8)]
        out.append(f"#define GGML_PY_OPS_{key}(X) \\\n    " + " \\\n    ".join(rows))
    return "\n".join(out)


def _replace_region(text: str, begin: str, end: str, body: str) -> str:
    try:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise ValueError(f"the header has no {begin} ... {end} region") from None
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_header(text: str) -> str:
    """The header text with its generated regions refreshed from this schema."""
    text = _replace_region(text, BEGIN, END, render_abi_schema())
    text = _replace_region(text, NAMES_BEGIN, NAMES_END, render_op_names())
    return _replace_region(text, LISTS_BEGIN, LISTS_END, render_op_lists())


def header_path() -> Path:
    return Path(__file__).parents[1] / "include" / "ggml_py" / "backend_abi.h"


def render_ops_table() -> str:
    """Every op as a markdown table: its family, sources, parameters, shape rule and formula, kit NMSE."""
    rows = ["| op | family | sources | params | shape rule; what it computes | kit NMSE |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in OPS_LIST:
        what = "; ".join(x for x in (o.rule, o.doc) if x)
        params = ", ".join(f"`{p.name}`" for p in o.params)
        nmse = "" if o.abi_id is None else f"{o.max_nmse:g}"
        rows.append(f"| `{o.name}` | {o.family} | {', '.join(o.srcs)} | {params} | {what} | {nmse} |")
    return "\n".join(rows)


def _main(argv: Sequence[str]) -> int:
    if list(argv) in (["header"], ["header", "--check"]):
        path = header_path()
        old = path.read_text()
        new = render_header(old)
        if "--check" in argv:
            print("up to date" if new == old else f"{path} is out of date: run python -m ggml_py.ir.schema header")
            return 0 if new == old else 1
        path.write_text(new)
        return 0
    if list(argv) == ["ops"]:
        print(render_ops_table())
        return 0
    print("usage: python -m ggml_py.ir.schema header [--check] | ops", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
