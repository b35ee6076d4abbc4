"""RoPE scaling as llama.cpp reads it from a GGUF file and turns it into the parameters of ggml_rope_ext.

llama.cpp's src/llama-model.cpp (load_hparams) reads `<arch>.rope.scaling.type` (default "linear"), `.factor` (or
the old `rope.scale_linear`; 0 or absent: none), `.original_context_length` (absent or 0: the training context) and
`.attn_factor` (default 1) for every architecture; src/llama-context.cpp then derives:
- freq_scale = 1 / factor, but 1 for type "none" (hparams.py);
- ext_factor = 1 for "yarn", else 0;
- attn_factor: for YaRN, get_mscale(factor) = 1 + 0.1 ln(factor) (1 when factor <= 1), divided by the same
  1 + 0.1 ln(factor) that ggml's kernel multiplies cos and sin by whenever ext_factor != 0, so that the gain counts
  once; times `rope.scaling.attn_factor` whatever the type;
- beta_fast 32, beta_slow 1: the `rope.scaling.yarn_*` keys and `yarn_log_multiplier` are read only for other
  architectures (deepseek2, grok, ...), none of ggml_py's, so they are not read here either. (llama-cpp-python passes
  attn_factor 1, beta_fast 32, beta_slow 1 itself, the same values.)
llama.cpp derives attn_factor in float32; so does yarn(), so the ROPE parameter is llama.cpp's to the bit.
llama 3's scaling is no key but a tensor, `rope_freqs.weight` (weights.py). LongRoPE (type "longrope", Phi-3 128k,
with `rope_factors_long/short` chosen by context length) is refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ggml_py.errors import ModelError

SUPPORTED = ("none", "linear", "yarn")
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Yarn:
    """ggml_rope_ext's YaRN parameters, ops.rope's keywords of the same names. attn_factor also carries
    `rope.scaling.attn_factor`, which applies to every scaling type."""

    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    def rope_args(self) -> dict[str, float | int]:
        return asdict(self)


def scaling_type(value: object, path: str) -> str:
    """The `rope.scaling.type` of a file (absent: "linear", as llama.cpp), refused unless ggml_py computes it."""
    if value is None:
        return "linear"
    if isinstance(value, str) and value in SUPPORTED:
        return value
    what = " (LongRoPE, Phi-3 128k)" if isinstance(value, str) and value == "longrope" else ""
    raise ModelError(f"{path}: rope scaling type {value!r} is not supported{what} (supported: {', '.join(SUPPORTED)})")


def yarn(stype: str, freq_scale: float, attn_factor: float, n_ctx_orig: int, path: str) -> Yarn:
    """The YaRN parameters llama.cpp gives ggml_rope_ext for scaling type `stype` with `freq_scale` (1 / factor),
    the file's `rope.scaling.attn_factor` and the original context (module docstring)."""
    if stype == "yarn" and n_ctx_orig > INT32_MAX:  # an int32 op parameter (llama.cpp's would wrap negative)
        raise ModelError(f"{path}: YaRN's original context {n_ctx_orig} (rope.scaling.original_context_length, else "
                         f"context_length) exceeds {INT32_MAX}")
    one, attn = np.float32(1.0), np.float32(1.0)
    if stype == "yarn":
        factor = one / np.float32(freq_scale)
        gain = one + np.float32(0.1) * np.log(factor)
        attn = (gain if factor > one else one) * (one / gain)
    attn *= np.float32(attn_factor)
    return Yarn(ext_factor=1.0 if stype == "yarn" else 0.0, attn_factor=float(attn), n_ctx_orig=int(n_ctx_orig))
