"""The type of every tensor for a file type such as Q4_K_M: the per-tensor rules of llama.cpp's
`src/llama-quant.cpp` (which tensors may be quantized at all, the Q6_K output head, more bits for some attn_v /
ffn_down layers, the fallbacks for rows that a block does not divide). See docs/quantize.md."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_py.errors import GgmlPyError
from ggml_py.formats import quants
from ggml_py.ir import dtypes
from ggml_py.ir.dtypes import (
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

__all__ = ["MIXTURES", "FileType", "ModelFacts", "QuantizeError", "TensorPlan", "choose_types", "file_type",
           "tensor_type"]


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
