"""Hyper-parameters of a decoder-only transformer, read from the `<arch>.*` GGUF keys.

Every architecture reads the same core keys (sizes, heads, norms, rope); an architecture module passes what differs
(its rope mode, its sliding-window layout, its attention scale, ...) to `read_hparams`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.models.rope_scaling import Yarn, scaling_type, yarn


def describe_value(v: Any) -> str:
    """What a metadata value is, for an error message: "an array of int32 [3]", "a str ('abc')"."""
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype} {list(v.shape)}"
    if isinstance(v, list):
        return "an array of " + (type(v[0]).__name__ if v else "nothing")
    return f"a {type(v).__name__} ({v!r:.40})"


def _int_array(v: Any) -> list[int] | None:
    """A GGUF array of integers (any width) as a list; None for anything else (floats, bools, strings, nested)."""
    if isinstance(v, np.ndarray):
        return v.tolist() if v.ndim == 1 and v.dtype.kind in "iu" else None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    return None


def _per_layer(v: Any, key: str, path: str, minimum: int = 1) -> int:
    """Keys such as head_count_kv may be arrays (one value per layer, GGUF integers of any width: numpy arrays);
    ggml_py needs them uniform."""
    if isinstance(v, list | np.ndarray):
        items = _int_array(v)
        if not items:
            raise ModelError(f"{path}: {key} must be an integer or a non-empty array of integers (one per layer), "
                             f"got {describe_value(v)}")
        if any(x != items[0] for x in items):
            raise ModelError(f"{path}: {key} varies per layer ({items[:8]}...), which ggml_py does not support")
        v = items[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelError(f"{path}: {key} must be {what}, got {v!r}")
    return int(v)


def _positive(v: Any, key: str, path: str, hi: float = math.inf) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= hi or not math.isfinite(v):
        what = "a positive number" if hi == math.inf else f"a number in (0, {hi:g}]"
        raise ModelError(f"{path}: {key} must be {what}, got {v!r}")
    return float(v)


F32_MAX = float(np.finfo(np.float32).max)
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS (it asserts block_count <= 512); per-layer tables are this long at most


def reciprocal(v: float, key: str, path: str) -> float:
    """1 / v for a positive hyper-parameter the graph divides by (an op parameter, float32): refused with ModelError
    naming the key when it is 0 or so small that its reciprocal is no float32."""
    if not v > 0 or 1.0 / v > F32_MAX:
        raise ModelError(f"{path}: {key} {v!r} is too small to divide by (its reciprocal is no float32)")
    return 1.0 / v


class Meta:
    """The `<arch>.*` metadata keys of one file, read with validation and errors naming the file and the key."""

    def __init__(self, meta: dict[str, Any], arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def int_key(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:
            raise ModelError(f"{self.path}: missing metadata key {self.arch + '.' + key!r}")
        return _per_layer(v, key, self.path)

    def float_key(self, key: str, default: float | None = None, hi: float = math.inf) -> float:
        """A positive finite number, at most `hi`."""
        v = self.get(key, default)
        if v is None:
            raise ModelError(f"{self.path}: missing metadata key {self.arch + '.' + key!r}")
        return _positive(v, key, self.path, hi)

    def optional_int(self, key: str) -> int:
        """A non-negative integer (uniform per-layer arrays too); absent is 0 (an optional feature left off)."""
        v = self.get(key)
        return 0 if v is None else _per_layer(v, key, self.path, minimum=0)

    def bool_key(self, key: str, default: bool) -> bool:
        """A GGUF bool; absent is `default`."""
        v = self.get(key, default)
        if not isinstance(v, bool | np.bool_):
            raise ModelError(f"{self.path}: {self.arch + '.' + key} must be a bool, got {describe_value(v)}")
        return bool(v)

    def optional_float(self, key: str, hi: float = math.inf) -> float:
        """A positive finite number at most `hi`, or 0 (absent, or written as 0: an optional feature left off)."""
        v = self.get(key)
        if v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v == 0):
            return 0.0
        return _positive(v, key, self.path, hi)


@dataclass(frozen=True)
class HParams:
    """What the graph of one step needs to know about the model."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_mode: int  # ops.ROPE_NORMAL (adjacent pairs) or ops.ROPE_NEOX (halves)
    rope_freq_base: float
    rope_freq_scale: float
    attn_scale: float  # multiplies q·k before the softmax
    rope_yarn: Yarn = Yarn()  # every layer's YaRN parameters (and rope.scaling.attn_factor): rope_scaling.py
    n_swa: int = 0  # sliding window: a query at p sees keys at p - n_swa < j <= p on the sliding layers; 0 = none
    swa_layers: tuple[bool, ...] = ()  # per layer: does it use the sliding window
    rope_freq_base_swa: float = 10000.0  # the sliding layers' own rope (gemma3: local layers 10k, global 1M)
    rope_freq_scale_swa: float = 1.0
    embd_scale: float = 1.0  # the token embeddings are multiplied by this (gemma: sqrt(n_embd))
    final_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0
    # mixture of experts (moe.py); n_expert 0: a dense FFN
    n_expert: int = 0
    n_expert_used: int = 0  # k, the experts each token goes through
    n_ff_exp: int = 0  # rows of one expert's gate and up matrices
    expert_weights_norm: bool = False  # the k chosen weights divided by their sum
    expert_gating: str = "softmax"  # the router's scores: "softmax" or "sigmoid" of its logits
    residual_scale: float = 1.0  # the attention and FFN outputs are multiplied by this before their residual adds
    logit_scale: float = 1.0  # the logits are multiplied by this (granite: 1 / its logit_scale key)
    rope_layers: tuple[bool, ...] = ()  # per layer: does it rotate q and k; () = every layer does

    def is_swa(self, il: int) -> bool:
        return self.n_swa > 0 and bool(self.swa_layers) and self.swa_layers[il]

    def uses_rope(self, il: int) -> bool:
        return not self.rope_layers or self.rope_layers[il]

    def rope(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer il."""
        if self.is_swa(il):
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale


def read_experts(m: Meta, hp: HParams, *, required: bool, norm: bool, ff_key: bool) -> dict[str, Any]:
    """The HParams fields of a mixture-of-experts file (empty when it has no experts and they are optional), from
    `expert_count`, `expert_used_count` and, with `ff_key`, `expert_feed_forward_length` (absent: n_ff /
    expert_used_count, as llama.cpp's qwen3moe); without it an expert has n_ff rows. `norm`: the family normalises
    the chosen weights. llama.cpp fixes that per architecture and reads neither `expert_weights_norm` nor
    `expert_weights_scale` for the families that use this (a file with a scale of 2.5 gives llama.cpp the logits of
    the file without it), so neither is read here."""
    n_expert, n_used = m.optional_int("expert_count"), m.optional_int("expert_used_count")
    if not n_expert and not required:
        return {}
    if not 0 < n_used <= n_expert:
        raise ModelError(f"{m.path}: expert_used_count {n_used} must be in 1..expert_count ({n_expert})")
    n_ff_exp = (m.optional_int("expert_feed_forward_length") or hp.n_ff // n_used) if ff_key else hp.n_ff
    return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, expert_weights_norm=norm)


def swa_pattern(m: Meta, n_layer: int, default_period: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp reads `attention.sliding_window_pattern`: an array with one value per layer
    (booleans, or integers of any width: non-zero slides, as llama.cpp reads them), or a period N (every Nth layer,
    the last of each group of N, is global); N = 0 means every layer slides. llama.cpp refuses a float array."""
    key = "attention.sliding_window_pattern"
    v = m.get(key, default_period)
    if isinstance(v, list | np.ndarray):
        flags = v.tolist() if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "biu" else v
        if not isinstance(flags, list) or not all(isinstance(x, int) for x in flags):  # bool is an int
            raise ModelError(f"{m.path}: {key} must be a period or an array of booleans or integers (one per "
                             f"layer), got {describe_value(v)}")
        if len(flags) != n_layer:
            raise ModelError(f"{m.path}: {key} must have one value per layer ({n_layer}), got {len(flags)}")
        return tuple(bool(x) for x in flags)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ModelError(f"{m.path}: {key} must be a non-negative integer, got {v!r}")
    return tuple(v == 0 or il % v < v - 1 for il in range(n_layer))


def read_hparams(meta: dict[str, Any], arch: str, path: str, n_vocab: int, *, rope_mode: int,
                 **arch_specific: Any) -> HParams:
    """The core keys every architecture has, plus the architecture's own values in `arch_specific` (HParams
    fields). rope scaling: none, linear or YaRN (rope_scaling.py)."""
    m = Meta(meta, arch, path)
    n_layer = m.int_key("block_count")
    if n_layer > MAX_LAYERS:  # before any per-layer table is built: 2^32 - 1 layers would exhaust memory here
        raise ModelError(f"{path}: block_count {n_layer} exceeds {MAX_LAYERS} layers (llama.cpp's limit too)")
    n_embd = m.int_key("embedding_length")
    n_head = m.int_key("attention.head_count")
    n_head_kv = m.int_key("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if n_embd % n_head and not m.has("attention.key_length"):
        raise ModelError(f"{path}: embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_dim = m.int_key("attention.key_length", n_embd // n_head)
    head_dim_v = m.int_key("attention.value_length", head_dim)
    n_rot = m.int_key("rope.dimension_count", head_dim)
    if n_rot % 2 or n_rot > head_dim:
        raise ModelError(f"{path}: rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
    scale = 1.0
    stype = scaling_type(m.get("rope.scaling.type"), path)
    factor = m.get("rope.scaling.factor", m.get("rope.scale_linear"))
    if factor is not None and (not isinstance(factor, int | float) or isinstance(factor, bool)
                               or not math.isfinite(factor) or factor < 0):
        raise ModelError(f"{path}: rope scaling factor must be a finite number >= 0 (0: none), got {factor!r}")
    if factor and stype != "none" and float(factor) != 1.0:
        scale = reciprocal(float(factor), "rope scaling factor", path)
    n_ctx_train = m.int_key("context_length")
    rope_yarn = yarn(stype, scale, m.float_key("rope.scaling.attn_factor", 1.0),
                     m.optional_int("rope.scaling.original_context_length") or n_ctx_train, path)
    values: dict[str, Any] = dict(
        arch=arch, n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_embd=n_embd,
        n_layer=n_layer, n_ff=m.int_key("feed_forward_length"), n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_rot=n_rot,
        # an eps of 1 already swamps a unit-variance activation; 1e300 would make every norm output 0 in float32
        rms_eps=m.float_key("attention.layer_norm_rms_epsilon", 1e-5, hi=1.0), rope_mode=rope_mode,
        rope_freq_base=m.float_key("rope.freq_base", 10000.0, hi=1e30), rope_freq_scale=scale,
        attn_scale=1.0 / math.sqrt(head_dim), rope_yarn=rope_yarn,
    )
    values.update(arch_specific)
    return HParams(**values)
