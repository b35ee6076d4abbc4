"""The architectures that are data: decoders built from the shared blocks (blocks.py) that differ only in what they
declare here. A family with graph code of its own (gemma3) has a module instead.

Each spec is checked against llama.cpp's src/models/<name>.cpp and src/llama-arch.cpp (rope type per architecture):
- llama (SmolLM2, TinyLlama, Llama 2/3/3.x, Mistral-style files): q/k/v (+ optional biases), rope NORM, SiLU gated
  FFN; Llama 3.1-3.3's rope scaling is the optional `rope_freqs.weight` (llama.cpp's LLM_TENSOR_ROPE_FREQS).
  HF checkpoints rotate halves, but `convert_hf_to_gguf.py` permutes Q and K per head so that ggml's adjacent-pair
  rotation gives the same result: a GGUF llama must run with NORM rope (tests/model_factory.py reproduces that).
  With `llama.attention.sliding_window` (Mistral v0.1 style) every layer attends to the last `sliding_window`
  positions; llama.cpp ignores that key for this architecture, so on prompts longer than the window the two differ:
  ggml_py follows the model's own configuration. `xverse`, `internlm2` (InternLM 2/2.5) and `ernie4_5` (ERNIE 4.5
  dense) are the same graph under other GGUF names (llama.cpp's src/models/xverse.cpp, internlm2.cpp, ernie4-5.cpp:
  RMS norms, q/k/v with optional biases, NORM rope, SiLU gated FFN).
- exaone (EXAONE 3.x): the llama block with NEOX rope and optional q/k/v/output biases (src/models/exaone.cpp), i.e.
  qwen2's graph; llama.cpp's exaone also applies `rope_freqs` factors, refused here.
- qwen2 (Qwen 2, 2.5): the llama block with q/k/v biases and NEOX rope (the converter keeps HF's halves).
- qwen3: no biases, a per-head RMS norm of q and of k (attn_q_norm, attn_k_norm) before NEOX rope.
- phi3 (Phi-3, 3.5, Phi-4 mini): fused q/k/v (attn_qkv: rows [q; k; v], accepted for any family), fused gate/up
  (ffn_up: rows [gate; up], 2 * n_ff), NEOX rope. `phi3.attention.sliding_window` is ignored, as llama.cpp does; the
  128k-context files' LongRoPE factors are refused.
- mixture of experts (moe.py, llama.cpp's build_moe_ffn with a softmax router): llama with `expert_count` > 0
  (Mixtral: ffn_gate_inp and ffn_{gate,up,down}_exps of feed_forward_length rows, the top-k weights normalised);
  qwen3moe (qwen3's attention, experts of `expert_feed_forward_length` rows, normalised); olmoe (NEOX rope, RMS norms
  of q and k over all heads at once, experts of feed_forward_length rows, the top-k weights NOT normalised).
  llama.cpp fixes the normalisation per architecture and reads neither `expert_weights_norm` nor
  `expert_weights_scale` for these three (hparams.read_experts).
- granite (IBM Granite 3.x dense): the llama block with muP multipliers (llama.cpp's src/models/granite.cpp):
  `embedding_scale` on the embeddings, `residual_scale` on the attention and FFN outputs before their residual adds,
  `attention.scale` as the softmax scale (0 or absent: 1/sqrt(head size); the others absent or 0: no scaling), and
  the logits divided by `logit_scale` (required, as llama.cpp requires it). NORM rope. llama.cpp reads
  `rope.scaling.finetuned` (default true) as a switch: false, and no layer rotates q, k; such a file is refused here
  (no step would read its positions).
- minicpm (MiniCPM 1/2, dense): granite's graph, as llama.cpp runs it (no graph of its own there): the same
  multipliers, each absent key taking llama.cpp's default (embedding 12, residual 1.4/sqrt(n_layer), logit
  256/n_embd); no attention.scale is read, and rope is always on.
- olmo2 (OLMo 2, and Olmo 3's files under the same name): no pre-norms; RMS norms of the attention and FFN outputs
  (post_attention_norm, post_ffw_norm) before their residual adds, and of q and k over the whole projection width
  (attn_q_norm: n_head * head size values, attn_k_norm: n_head_kv * head size) before NEOX rope; untied head.
  With `attention.sliding_window` (Olmo 3), layers slide except the last of each group of
  `attention.sliding_window_pattern` (default 4), and the sliding layers rope without the file's rope scaling and
  with the main `rope.freq_base` (llama.cpp's olmo2 graph reads no other base there).
- smollm3 (SmolLM3): the llama block where every 4th layer (il + 1 divisible by 4) applies no rope. llama.cpp
  hard-codes that step (`n_no_rope_layer_step = 4` in src/llama-model.cpp): no GGUF key carries it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ggml_py.errors import ModelError
from ggml_py.ir import ops
from ggml_py.models.architecture import Architecture
from ggml_py.models.blocks import dense_layer
from ggml_py.models.hparams import HParams, Meta, read_experts, read_hparams, reciprocal, swa_pattern
from ggml_py.models.weights import (
    Layer,
    QKNorm,
    TensorReader,
    attention_tensors,
    expert_tensors,
    ffn_tensors,
    post_norm_tensors,
)

_OUTPUT_BIAS = {"output.bias": "a bias on the output head"}
_LONGROPE = "LongRoPE frequency factors (128k-context Phi-3)"
_LONGROPE_MINICPM = "LongRoPE frequency factors (MiniCPM 3/4 long context)"
_ROPE_FREQS = {"rope_freqs.weight": "rope frequency factors (llama 3.1 style rope scaling)"}
_FFN_BIAS = {f"ffn_{t}.bias": "FFN biases" for t in ("gate", "up", "down")}


@dataclass(frozen=True)
class SlidingWindow:
    """How a family reads `<name>.attention.sliding_window` (present and non-zero: layers attend to that many
    positions): period, the default of `attention.sliding_window_pattern` (0: every layer slides; N: all but the
    last of each group of N); scaled_rope: do the sliding layers keep the file's rope scaling."""

    period: int = 0
    scaled_rope: bool = True


@dataclass(frozen=True)
class MupScales:
    """muP multipliers read from `embedding_scale` (the embeddings), `residual_scale` (the attention and FFN outputs
    before their residual adds) and `logit_scale` (the logits are divided by it): attention_scale also reads
    `attention.scale` (the softmax scale; absent or 0: 1/sqrt(head size)). defaults(hp) gives (embedding,
    residual, logit) for absent keys; without it `logit_scale` is required and the others default to no scaling."""

    attention_scale: bool = True
    defaults: Callable[[HParams], tuple[float, float, float]] | None = None

    def apply(self, hp: HParams, m: Meta) -> HParams:
        embd, resid, logit = self.defaults(hp) if self.defaults else (1.0, 1.0, None)

        def multiplier(key: str, default: float) -> float:  # written as 0: no scaling, as llama.cpp's graph reads it
            return (m.optional_float(key) or 1.0) if m.has(key) else default

        attn = m.optional_float("attention.scale") if self.attention_scale else 0.0
        return replace(hp, embd_scale=multiplier("embedding_scale", embd),
                       residual_scale=multiplier("residual_scale", resid), attn_scale=attn or hp.attn_scale,
                       logit_scale=reciprocal(m.float_key("logit_scale", logit), f"{m.arch}.logit_scale", m.path))


def _minicpm_defaults(hp: HParams) -> tuple[float, float, float]:
    """llama.cpp's values for MiniCPM files without the keys (older conversions): muP's scale_emb 12, scale_depth
    1.4 over sqrt(n_layer), dim_model_base 256 over n_embd."""
    return 12.0, 1.4 / math.sqrt(hp.n_layer), 256.0 / hp.n_embd


@dataclass(frozen=True)
class DenseSpec:
    """A decoder (x += attn(norm(x)); x += ffn(norm(x)), blocks.dense_layer) described by data.

    name: the GGUF `general.architecture`; aliases: other GGUF names of the same graph (their keys are read under
    their own prefix). rope_mode: ops.ROPE_NORMAL or ops.ROPE_NEOX. qk_norm: RMS norms of q and k, per head
    ("head") or over the whole projection ("full"). fused_gate_up: ffn_up holds [gate; up]. pre_norms /
    post_norms: the blocks normalise their inputs (attn_norm, ffn_norm) / their outputs (post_attention_norm,
    post_ffw_norm). sliding_window: how the family reads the window keys (None: it has none). mup: the muP
    multipliers it reads (granite, minicpm). rope_switch: `rope.scaling.finetuned` false would turn rope off in
    every layer (granite): refused. no_rope_step: every no_rope_step-th layer has no rope (smollm3). rope_freqs:
    reads llama 3's rope frequency factors (`rope_freqs.weight`). experts: "" (a dense FFN), "optional" (experts
    when `expert_count` > 0: llama's Mixtral files) or "required"; expert_norm: the chosen experts' weights
    normalised to sum 1; expert_ff_key: an expert's size is `expert_feed_forward_length` (else
    feed_forward_length). unsupported: tensor names refused at load."""

    name: str
    rope_mode: int
    qk_norm: QKNorm | None = None
    fused_gate_up: bool = False
    activation: str = "silu"
    pre_norms: bool = True
    post_norms: bool = False
    sliding_window: SlidingWindow | None = None
    mup: MupScales | None = None
    rope_switch: bool = False
    no_rope_step: int = 0
    rope_freqs: bool = False
    experts: str = ""
    expert_norm: bool = True
    expert_ff_key: bool = False
    unsupported: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    def read_hparams(self, meta: dict[str, Any], arch: str, path: str, n_vocab: int) -> HParams:
        """The hyper-parameters of a file of this family whose keys are under `arch`."""
        hp = read_hparams(meta, arch, path, n_vocab, rope_mode=self.rope_mode)
        m = Meta(meta, arch, path)
        sw = self.sliding_window
        n_swa = m.optional_int("attention.sliding_window") if sw else 0
        if sw and n_swa:  # absent or 0: no window
            hp = replace(hp, n_swa=n_swa, swa_layers=swa_pattern(m, hp.n_layer, sw.period),
                         rope_freq_base_swa=hp.rope_freq_base,
                         rope_freq_scale_swa=hp.rope_freq_scale if sw.scaled_rope else 1.0)
        if self.mup:
            hp = self.mup.apply(hp, m)
        if self.rope_switch and not m.bool_key("rope.scaling.finetuned", True):
            # no layer would read the positions, and every step writes them: refused rather than built
            raise ModelError(f"{path}: {arch}.rope.scaling.finetuned false (no rope in any layer) is not supported")
        if self.no_rope_step:
            hp = replace(hp, rope_layers=tuple((il + 1) % self.no_rope_step != 0 for il in range(hp.n_layer)))
        if self.experts:
            hp = replace(hp, **read_experts(m, hp, required=self.experts == "required", norm=self.expert_norm,
                                            ff_key=self.expert_ff_key))
        return hp

    def layer_tensors(self, r: TensorReader, hp: HParams, i: int) -> Layer:
        ffn = (expert_tensors(r, hp, i) if hp.n_expert
               else ffn_tensors(r, hp, i, fused_gate_up=self.fused_gate_up, pre_norm=self.pre_norms))
        t = {**attention_tensors(r, hp, i, qk_norm=self.qk_norm, pre_norm=self.pre_norms), **ffn,
             **(post_norm_tensors(r, hp, i) if self.post_norms else {})}
        return Layer(**t)  # type: ignore[arg-type]

    def architecture(self, name: str | None = None) -> Architecture:
        """The Architecture of this spec under GGUF name `name` (default: the spec's own)."""
        arch = name or self.name
        return Architecture(name=arch, hparams=lambda meta, path, n_vocab: self.read_hparams(meta, arch, path, n_vocab),
                            layer_tensors=self.layer_tensors, layer=dense_layer(self.activation),
                            unsupported=dict(self.unsupported), rope_freqs=self.rope_freqs)


DENSE: tuple[DenseSpec, ...] = (
    DenseSpec("llama", ops.ROPE_NORMAL, sliding_window=SlidingWindow(), aliases=("xverse", "internlm2", "ernie4_5"),
              rope_freqs=True, experts="optional"),
    DenseSpec("qwen2", ops.ROPE_NEOX, unsupported=_OUTPUT_BIAS),
    DenseSpec("qwen3", ops.ROPE_NEOX, qk_norm="head"),
    DenseSpec("qwen3moe", ops.ROPE_NEOX, qk_norm="head", experts="required", expert_ff_key=True),
    DenseSpec("olmoe", ops.ROPE_NEOX, qk_norm="full", experts="required", expert_norm=False),
    # qwen2's graph, but its rope_freqs (llama 3 style factors, which llama.cpp's exaone applies) are refused
    DenseSpec("exaone", ops.ROPE_NEOX, unsupported=_ROPE_FREQS),
    DenseSpec("phi3", ops.ROPE_NEOX, fused_gate_up=True,
              unsupported={"rope_factors_long.weight": _LONGROPE, "rope_factors_short.weight": _LONGROPE,
                           **_OUTPUT_BIAS}),
    DenseSpec("granite", ops.ROPE_NORMAL, mup=MupScales(), rope_switch=True, unsupported={**_ROPE_FREQS, **_FFN_BIAS}),
    # llama.cpp's minicpm runs granite's graph; it reads no attention.scale and always ropes
    DenseSpec("minicpm", ops.ROPE_NORMAL, mup=MupScales(attention_scale=False, defaults=_minicpm_defaults),
              unsupported={**_ROPE_FREQS, "rope_factors_long.weight": _LONGROPE_MINICPM,
                           "rope_factors_short.weight": _LONGROPE_MINICPM}),
    DenseSpec("olmo2", ops.ROPE_NEOX, qk_norm="full", pre_norms=False, post_norms=True,
              sliding_window=SlidingWindow(period=4, scaled_rope=False)),
    DenseSpec("smollm3", ops.ROPE_NORMAL, no_rope_step=4),
)
