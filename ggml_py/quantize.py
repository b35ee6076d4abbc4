"""Quantize a GGUF model to another weight type: llama-quantize's job, done with ggml_py's own quantizers.

Two parts. `choose_types` decides the type of every tensor for a *file type* such as Q4_K_M: the per-tensor rules of
llama.cpp's `src/llama-quant.cpp` (which tensors may be quantized at all, the Q6_K output head, more bits for some
attn_v / ffn_down layers, the fallbacks for rows that a block does not divide). `quantize_file` then streams the
model, one tensor at a time, into a new GGUF written with `gguf.GGUFWriter`: every metadata key copied,
`general.file_type` and `general.quantization_version` set, tensor order and data alignment kept, the file written
under a temporary name and renamed at the end.

The bytes come from `ggml_py.quants` (bit-identical with `gguf.quants` and with ggml's reference quantizers, see
there); for the types a backend's CPY can write (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) the simd backend's C
conversion is used when it is available, which tests/test_quantize_cmd.py checks gives the same bytes.
See docs/quantize.md.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes, quants
from .dtypes import (
    BF16,
    F16,
    F32,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    DType,
)
from .errors import GgmlPyError

__all__ = ["MIXTURES", "FileType", "ModelFacts", "QuantizeError", "TensorPlan", "choose_types", "file_type",
           "quantize_file"]


class QuantizeError(GgmlPyError):
    """A quantization request cannot be carried out (type, tensor, file)."""


# ------------------------------------------------------------------------------------------------ file types


@dataclass(frozen=True)
class FileType:
    """A llama.cpp file type (`llama_ftype`): its name, the id stored in `general.file_type`, the default type."""

    name: str
    ftype: int
    default: DType


# llama.cpp's file types that ggml_py can write (llama_ftype ids; llama_ftype_get_default_type).
MIXTURES: dict[str, FileType] = {
    ft.name: ft
    for ft in (
        FileType("F32", 0, F32), FileType("F16", 1, F16), FileType("BF16", 32, BF16),
        FileType("Q4_0", 2, Q4_0), FileType("Q4_1", 3, Q4_1), FileType("Q5_0", 8, Q5_0), FileType("Q5_1", 9, Q5_1),
        FileType("Q8_0", 7, Q8_0), FileType("Q2_K", 10, Q2_K),
        FileType("Q3_K_S", 11, Q3_K), FileType("Q3_K_M", 12, Q3_K), FileType("Q3_K_L", 13, Q3_K),
        FileType("Q4_K_S", 14, Q4_K), FileType("Q4_K_M", 15, Q4_K),
        FileType("Q5_K_S", 16, Q5_K), FileType("Q5_K_M", 17, Q5_K), FileType("Q6_K", 18, Q6_K),
        FileType("IQ4_NL", 25, IQ4_NL), FileType("IQ4_XS", 30, IQ4_XS),
    )
}  # fmt: skip
# llama-quantize's short names for the medium mixtures.
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
# llama.cpp file types ggml_py cannot write, and why.
UNSUPPORTED = {
    **{n: "ggml_py has no quantizer for its types" for n in (
        "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
        "TQ1_0", "TQ2_0", "MXFP4_MOE", "NVFP4", "Q1_0", "Q2_0")},
    "Q2_K_S": "it needs an importance matrix, which ggml-py quantize does not take",
}  # fmt: skip
GGML_QUANT_VERSION = 2  # general.quantization_version of the block layouts quants.py writes (GGML_QNT_VERSION)


def file_type(name: str) -> FileType:
    """The FileType for a name such as 'Q4_K_M' (case-insensitive; Q4_K = Q4_K_M, ...); QuantizeError otherwise."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    ft = MIXTURES.get(key)
    if ft is not None:
        return ft
    if key in UNSUPPORTED:
        raise QuantizeError(f"type {key} is not supported: {UNSUPPORTED[key]}")
    raise QuantizeError(f"unknown type {name!r}; supported: {', '.join(MIXTURES)}")


def tensor_type(name: str) -> DType:
    """A single tensor type for --output-type / --token-embedding-type: one ggml_py can write."""
    supported = ", ".join(x.name for x in quants.QUANTIZABLE)
    try:
        t = dtypes.get(name)
    except ValueError:
        raise QuantizeError(f"unknown tensor type {name!r}; supported: {supported}") from None
    if t not in quants.QUANTIZABLE:
        raise QuantizeError(f"ggml_py cannot write {t.name} tensors; supported: {supported}")
    return t


# ------------------------------------------------------------------------------------------- per-tensor rules


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's type rules look at besides tensor names and shapes."""

    arch: str
    n_layer: int
    n_head: int = 1
    n_head_kv: int = 1
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B (a llama with 80 layers and grouped-query attention): attn_v gets more bits."""
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ModelFacts:
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise QuantizeError("the model has no general.architecture")

        def first(key: str, default: int) -> int:
            v = meta.get(f"{arch}.{key}", default)
            if isinstance(v, np.ndarray | list):  # per-layer values: layer 0's, as llama.cpp's n_gqa() takes
                v = v[0] if len(v) else default
            try:
                return int(v)
            except (TypeError, ValueError):
                raise QuantizeError(f"{arch}.{key} is not an integer: {v!r}") from None

        n_head = first("attention.head_count", 1)
        return cls(arch, first("block_count", 0), n_head, first("attention.head_count_kv", n_head),
                   first("expert_count", 0))


@dataclass
class TensorPlan:
    """One tensor of the output: its name, numpy-order shape, type in the input and the type chosen for it."""

    name: str
    shape: tuple[int, ...]
    src: DType
    dst: DType
    fallback: str | None = None  # "Q4_K -> Q5_0": the chosen type did not divide the rows

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def nbytes(self, t: DType | None = None) -> int:
        t = t or self.dst
        return t.row_size(self.shape[-1]) * (self.n_elements // self.shape[-1]) if self.shape[-1] else 0


# Substrings of names llama.cpp never quantizes (small, or read by other ops than a matrix product).
_KEEP_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight",
    "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd",
    "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)  # fmt: skip
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")  # positional embeddings, BERT's token types

# Fallbacks when a type's block does not divide the rows (llama.cpp's tensor_type_fallback); F16 when that does
# not divide them either.
_FALLBACK: dict[DType, DType] = {
    IQ4_XS: IQ4_NL, Q2_K: Q4_0, Q3_K: Q4_0, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0,
}  # fmt: skip


def _n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: the dimensions up to the last one larger than 1, counted from the innermost (numpy's last)."""
    ne = list(reversed(shape))
    n = 1
    for i, d in enumerate(ne):
        if d > 1:
            n = i + 1
    return n


def may_quantize(name: str, shape: Sequence[int]) -> bool:
    """Whether llama.cpp changes this tensor's type at all: matrices (2-D or 3-D) named *weight, norms and a few
    small or positional tensors excepted."""
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return name not in _KEEP_NAMES and not any(s in name for s in _KEEP_SUBSTRINGS)


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category: the first matching role. A fused QKV and MLA's kv_b count as attn_v (llama.cpp
    checks its attn_v rules before its QKV ones, so for these file types a QKV is an attn_v)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for role, key in (("attn_v", "attn_qkv.weight"), ("attn_v", "attn_kv_b.weight"), ("attn_v", "attn_v.weight"),
                      ("attn_k", "attn_k.weight"), ("attn_q", "attn_q.weight"),
                      ("attn_output", "attn_output.weight"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                      ("ffn_down", "ffn_down")):
        if key in name:
            return role
    return "other"


_LAYER = re.compile(r"blk\.([+-]?\d+)\.")


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_cpp_order(names: Iterable[str]) -> list[str]:
    """The order llama.cpp's loader walks tensors in (by layer, non-layer tensors first, then by name): the per-layer
    counters of the rules below advance in this order."""
    return sorted(names, key=lambda n: (_layer_of(n), n))


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class _Counters:
    """llama.cpp's running counts of attn_v and ffn_down tensors seen (its ffn_gate/ffn_up counts serve only IQ3_XS,
    a file type ggml_py does not write)."""

    def __init__(self, n_attn_v: int, n_layer: int) -> None:
        self.n_attn_v, self.n_layer = n_attn_v, n_layer
        self.attn_v = self.ffn_down = 0


def _mixture_type(ft: FileType, t: DType, name: str, shape: Sequence[int], cat: str, facts: ModelFacts,
                  tied: bool, c: _Counters) -> DType:
    """llama.cpp's llama_tensor_get_type_impl for the file types ggml_py writes (the IQ1/IQ2/IQ3/TQ/MXFP4 branches
    are left out with their types)."""
    f = ft.name
    if cat == "output" or (tied and cat == "token_embd"):
        if shape[-1] % t.block_size or facts.arch == "falcon":
            return Q8_0
        return t if t is Q8_0 else Q6_K
    if cat == "token_embd":
        return t
    if cat == "attn_v":
        gqa = facts.n_gqa
        if f == "Q2_K":
            t = Q4_K if gqa >= 4 else Q3_K
        elif f == "Q3_K_M":
            t = Q5_K if c.attn_v < 2 else Q4_K
        elif f == "Q3_K_L":
            t = Q5_K
        elif f in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
            t = Q5_K
        elif f in ("Q4_K_M", "Q5_K_M") and _more_bits(c.attn_v, c.n_attn_v):
            t = Q6_K
        elif f == "Q4_K_S" and c.attn_v < 4:
            t = Q5_K
        if facts.is_70b and t in (Q3_K, Q4_K):
            t = Q5_K
        if facts.n_expert == 8:
            t = Q8_0
        c.attn_v += 1
        return t
    if cat == "attn_k":
        return Q8_0 if facts.n_expert == 8 else t
    if cat == "ffn_down":
        i, n = c.ffn_down, c.n_layer
        if facts.n_expert > 1:
            i = _layer_of(name)
            if not 0 <= i < n:
                raise QuantizeError(f"bad layer {i} for tensor {name} (the model has {n})")
        falcon = facts.arch == "falcon"
        if f == "Q2_K":
            t = Q3_K
        elif f == "Q3_K_M":
            t = Q5_K if i < n // 16 else Q4_K if not falcon or _more_bits(i, n) else Q3_K
        elif f == "Q3_K_L":
            t = Q4_K if falcon else Q5_K
        elif f == "Q4_K_M":
            if falcon:
                t = Q6_K if i < n // 16 else Q5_K if _more_bits(i, n) else Q4_K
            elif _more_bits(i, n):
                t = Q6_K
        elif i < n // 8 and f in ("IQ4_NL", "IQ4_XS"):  # (without an importance matrix)
            t = Q5_K
        elif f == "Q5_K_M" and _more_bits(i, n):
            t = Q6_K
        elif f == "Q4_K_S" and not falcon and i < n // 8:
            t = Q5_K
        c.ffn_down += 1
        return t
    if cat == "attn_output":
        if facts.arch != "falcon":
            if facts.n_expert == 8:
                if f in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS"):
                    t = Q5_K
            elif f == "Q2_K":
                t = Q3_K
            elif f == "Q3_K_M":
                t = Q4_K
            elif f == "Q3_K_L":
                t = Q5_K
        elif f == "Q3_K_L":
            t = Q4_K
    return t


def choose_types(tensors: Sequence[tuple[str, tuple[int, ...], DType]], ft: FileType, facts: ModelFacts, *,
                 pure: bool = False, output_type: DType | None = None,
                 token_embedding_type: DType | None = None) -> list[TensorPlan]:
    """The type of every tensor (name, numpy-order shape, input type) for file type `ft`, as llama.cpp chooses it;
    returned in the input's order."""
    names = [n for n, _, _ in tensors]
    by_name = {n: (tuple(s), d) for n, s, d in tensors}
    tied = "output.weight" not in by_name
    n_attn_v = sum(1 for n in names if _category(n) == "attn_v")
    counters = _Counters(n_attn_v, facts.n_layer)
    chosen: dict[str, TensorPlan] = {}
    for name in llama_cpp_order(names):
        shape, src = by_name[name]
        plan = TensorPlan(name, shape, src, src)
        chosen[name] = plan
        if not may_quantize(name, shape):
            continue
        cat = _category(name)
        if token_embedding_type is not None and cat == "token_embd":
            plan.dst = token_embedding_type
            continue
        if output_type is not None and cat == "output":
            plan.dst = output_type
            continue
        t = ft.default
        if t.is_quantized:
            if not pure:
                if output_type is not None and (cat == "output" or (tied and cat == "token_embd")):
                    t = output_type  # llama.cpp's output rule honours the override for a tied embedding too
                else:
                    t = _mixture_type(ft, t, name, shape, cat, facts, tied, counters)
            if shape[-1] % t.block_size:
                wanted = t
                if t not in _FALLBACK:
                    raise QuantizeError(f"{name}: rows of {shape[-1]} elements are not a multiple of {t.name}'s "
                                        f"block of {t.block_size}, and {t.name} has no fallback type (as in llama.cpp)")
                t = _FALLBACK[t]
                if shape[-1] % t.block_size:
                    t = F16
                plan.fallback = f"{wanted.name} -> {t.name}"
        plan.dst = t
    for plan in chosen.values():
        if plan.dst is not plan.src and plan.shape[-1] % plan.dst.block_size:
            raise QuantizeError(f"{plan.name}: rows of {plan.shape[-1]} elements are not a multiple of "
                                f"{plan.dst.name}'s block of {plan.dst.block_size}")
    return [chosen[n] for n in names]


# ------------------------------------------------------------------------------------------------- conversion

_ROWS_PER_CHUNK_ELEMS = 1 << 22  # elements converted at a time: bounds the float32 temporaries (16 MiB)


class _Converter:
    """float32 rows -> raw rows of a type. Types a backend's CPY writes go through the simd backend's C conversion
    when that backend is available (one prepared plan per row length and type, the number of rows symbolic), all
    others through ggml_py.quants; both give the same bytes (tests/test_quantize_cmd.py checks it)."""

    def __init__(self, use_backend: bool = True) -> None:
        from .registry import get_backend, registry

        self._plans: dict[tuple[int, DType], tuple[Any, Any]] = {}
        self._backend: Any = None
        if use_backend and "simd" in registry.names():
            try:
                self._backend = get_backend("simd")
            except GgmlPyError:  # registered but not usable here: quants.py does everything
                self._backend = None
        self.used: dict[str, str] = {}  # type name -> what converted to it ("simd" or "quants")

    def __call__(self, x: np.ndarray, t: DType) -> np.ndarray:
        from . import ops

        rows, n = x.shape
        if self._backend is None or t is F32 or t not in ops.CPY_DST_TYPES:
            self.used.setdefault(t.name, "quants")
            return quants.quantize_rows(x, t)
        self.used.setdefault(t.name, self._backend.name)
        max_rows = max(1, _ROWS_PER_CHUNK_ELEMS // n)
        entry = self._plans.get((n, t))
        if entry is None:
            from .sched import prepare
            from .symbolic import sym
            from .tensor import input as graph_input

            y = ops.cast(graph_input((sym("rows", max_rows), n), name="x"), t)
            entry = self._plans[(n, t)] = (prepare(y, backends=[self._backend]), y)
        plan, y = entry
        out = np.empty((rows, t.row_size(n)), dtype=np.uint8)
        for r in range(0, rows, max_rows):
            plan.set_input("x", x[r : r + max_rows])
            plan.compute()
            out[r : r + max_rows] = plan.get_output(y).view(np.uint8).reshape(-1, out.shape[1])
        return out

    def close(self) -> None:
        for plan, _ in self._plans.values():
            plan.close()
        self._plans.clear()


def _to_f32(raw: np.ndarray, src: DType, n: int) -> np.ndarray:
    """Raw rows (rows, row bytes) of `src` -> float32 (rows, n)."""
    return quants.dequantize_rows(raw, src, n).astype(np.float32, copy=False)


def convert_tensor(raw: np.ndarray, plan: TensorPlan, convert: Callable[[np.ndarray, DType], np.ndarray]
                   ) -> np.ndarray:
    """A tensor's raw bytes (any shape, read as uint8) in its input type -> raw rows (rows, row bytes) of plan.dst,
    converted by chunks of rows so that no more than a chunk is float32 at a time."""
    n = plan.shape[-1]
    rows = plan.n_elements // n if n else 0
    src_rows = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, plan.src.row_size(n))
    if plan.dst is plan.src:
        return src_rows
    out = np.empty((rows, plan.dst.row_size(n)), dtype=np.uint8)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(n, 1))
    for r in range(0, rows, step):
        x = _to_f32(src_rows[r : r + step], plan.src, n)
        out[r : r + step] = convert(x, plan.dst)
    return out


# ------------------------------------------------------------------------------------------------- the file


@dataclass
class Result:
    """What quantize_file did (also the --json output of `ggml-py quantize`)."""

    input: str
    output: str
    type: str
    file_type: int
    input_bytes: int
    output_bytes: int
    n_tensors: int
    tensor_types: dict[str, int]
    n_requantized: int
    fallbacks: list[str]
    dropped_keys: list[str]
    converters: dict[str, str]
    seconds: float
    tensors: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def _metadata_entries(gf: Any, ft: FileType) -> tuple[list[tuple[str, Any, int, int | None]], list[str]]:
    """The input's metadata as (key, value, GGUF value type, array element type) in file order, with
    general.file_type and general.quantization_version set as llama.cpp sets them; and the keys dropped (empty
    arrays, which gguf.GGUFWriter cannot write)."""
    from .gguf import _SCALARS, T_ARRAY, T_BOOL, T_STRING, T_UINT32

    # the element type of a numeric array from its numpy dtype (gguf.py's table read backwards; bools are np.bool_)
    np_types = {npd.newbyteorder("="): t for t, (_, npd) in _SCALARS.items() if t != T_BOOL}
    np_types[np.dtype(np.bool_)] = T_BOOL
    out: list[tuple[str, Any, int, int | None]] = []
    dropped: list[str] = []
    for key, value in gf.metadata.items():
        vtype = gf.metadata_types[key]
        if key == "general.architecture" or key in _SPLIT_KEYS:
            continue  # the writer puts the architecture first; a whole model is written, not a shard
        if vtype != T_ARRAY:
            out.append((key, value, vtype, None))
            continue
        if len(value) == 0:
            dropped.append(key)
            continue
        if isinstance(value, np.ndarray):
            out.append((key, value.tolist(), vtype, np_types[value.dtype]))
        elif all(isinstance(v, str) for v in value):
            out.append((key, value, vtype, T_STRING))
        else:
            raise QuantizeError(f"metadata key {key!r} holds arrays of arrays, which llama.cpp cannot read and "
                                "ggml-py quantize does not copy")
    for key, value in (("general.quantization_version", GGML_QUANT_VERSION), ("general.file_type", ft.ftype)):
        entry = (key, value, T_UINT32, None)
        at = next((i for i, e in enumerate(out) if e[0] == key), None)
        if at is None:
            out.append(entry)
        else:
            out[at] = entry
    return out, dropped


def _check_paths(inp: str, out: str, force: bool) -> None:
    if os.path.exists(out):
        if os.path.exists(inp) and os.path.samefile(inp, out):
            raise QuantizeError(f"{out}: the output is the input file; write to another path")
        if os.path.isdir(out):
            raise QuantizeError(f"{out}: is a directory")
        if not force:
            raise QuantizeError(f"{out} exists (use --force to replace it)")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise QuantizeError(f"{out}: folder {folder} does not exist")


def quantize_file(inp: str, out: str, type_name: str, *, allow_requantize: bool = False,
                  output_type: str | None = None, token_embedding_type: str | None = None, pure: bool = False,
                  force: bool = False, use_backend: bool = True,
                  progress: Callable[[int, int, TensorPlan], None] | None = None) -> Result:
    """Write `out`: the model `inp` with its weights in file type `type_name` (see docs/quantize.md).

    The output appears only when complete (written as a hidden temporary file in its folder, then renamed); on any
    error or interrupt nothing is left behind. `progress(i, n, plan)` is called before each tensor."""
    import gguf

    from .gguf import open_gguf

    t0 = time.perf_counter()
    ft = file_type(type_name)
    out_t = tensor_type(output_type) if output_type else None
    embd_t = tensor_type(token_embedding_type) if token_embedding_type else None
    _check_paths(inp, out, force)
    with open_gguf(inp) as gf:
        meta = gf.metadata
        if int(meta.get("split.count", 1) or 1) > 1:
            raise QuantizeError(f"{inp} is one shard of a split model ({meta['split.count']} files); merge it first")
        facts = ModelFacts.from_metadata(meta)
        plans = choose_types([(t.name, t.shape, t.dtype) for t in gf.tensors.values()], ft, facts, pure=pure,
                             output_type=out_t, token_embedding_type=embd_t)
        for p in plans:
            if p.dst is p.src:
                continue
            if p.src.is_quantized and not allow_requantize:
                raise QuantizeError(f"{p.name} is {p.src.name} already: converting quantized tensors is disabled "
                                    "(use --allow-requantize; requantizing loses more than quantizing from F32/F16)")
            if p.src not in quants.DEQUANTIZABLE:
                raise QuantizeError(f"{p.name} is {p.src.name}, which ggml_py cannot convert to {p.dst.name}")
        entries, dropped = _metadata_entries(gf, ft)

        folder, base = os.path.split(os.path.abspath(out))
        tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex[:12]}.part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        os.close(fd)
        convert = _Converter(use_backend)
        writer = None
        try:
            writer = gguf.GGUFWriter(tmp, facts.arch)
            writer.data_alignment = gf.alignment
            for key, value, vtype, sub in entries:
                writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                     gguf.GGUFValueType(sub) if sub is not None else None)
            for p in plans:
                byte_shape = (*p.shape[:-1], p.dst.row_size(p.shape[-1]))
                writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes(),
                                       raw_dtype=gguf.GGMLQuantizationType(p.dst.ggml_id))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for i, p in enumerate(plans):
                if progress is not None:
                    progress(i, len(plans), p)
                data = convert_tensor(gf.data(p.name), p, convert)
                writer.write_tensor_data(data)
            writer.close()
            writer = None
            os.replace(tmp, out)
        except BaseException:
            if writer is not None:
                writer.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            convert.close()
        counts: dict[str, int] = {}
        for p in plans:
            counts[p.dst.name] = counts.get(p.dst.name, 0) + 1
        return Result(
            input=inp, output=out, type=ft.name, file_type=ft.ftype, input_bytes=gf.file_size,
            output_bytes=os.path.getsize(out), n_tensors=len(plans), tensor_types=dict(sorted(counts.items())),
            n_requantized=sum(1 for p in plans if p.dst is not p.src and p.src.is_quantized),
            fallbacks=[f"{p.name}: {p.fallback}" for p in plans if p.fallback], dropped_keys=dropped,
            converters=dict(sorted(convert.used.items())), seconds=round(time.perf_counter() - t0, 3),
            tensors=[{"name": p.name, "shape": list(p.shape), "from": p.src.name, "to": p.dst.name} for p in plans],
        )
