"""The architectures that are data: pre-norm decoders built from the shared blocks (blocks.py) that differ only in
what they declare here. A family with graph code of its own (gemma3) has a module instead.

Each spec is checked against llama.cpp's src/models/<name>.cpp and src/llama-arch.cpp (rope type per architecture):
- llama (SmolLM2, TinyLlama, Llama 2/3/3.x, Mistral-style files): q/k/v (+ optional biases), rope NORM, SiLU gated
  FFN; Llama 3.1-3.3's rope scaling is the optional `rope_freqs.weight` (llama.cpp's LLM_TENSOR_ROPE_FREQS).
  HF checkpoints rotate halves, but `convert_hf_to_gguf.py` permutes Q and K per head so that ggml's adjacent-pair
  rotation gives the same result: a GGUF llama must run with NORM rope (tests/model_factory.py reproduces that).
  With `llama.attention.sliding_window` (Mistral v0.1 style) every layer attends to the last `sliding_window`
  positions; llama.cpp ignores that key for this architecture, so on prompts longer than the window the two differ:
  ggml_py follows the model's own configuration. `xverse` is the same graph under another GGUF name (llama.cpp's
  src/models/xverse.cpp: RMS norms, q/k/v, NORM rope, SiLU gated FFN, untied head).
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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ggml_py.ir import ops
from ggml_py.models.architecture import Architecture
from ggml_py.models.blocks import pre_norm_layer
from ggml_py.models.hparams import HParams, Meta, read_experts, read_hparams
from ggml_py.models.weights import Layer, TensorReader, attention_tensors, expert_tensors, ffn_tensors

_OUTPUT_BIAS = {"output.bias": "a bias on the output head"}
_LONGROPE = "LongRoPE frequency factors (128k-context Phi-3)"


@dataclass(frozen=True)
class DenseSpec:
    """A pre-norm decoder (x += attn(norm(x)); x += ffn(norm(x))) described by data.

    name: the GGUF `general.architecture`; aliases: other GGUF names of the same graph (their keys are read under
    their own prefix). rope_mode: ops.ROPE_NORMAL or ops.ROPE_NEOX. qk_norm: per-head RMS norms of q and k.
    fused_gate_up: ffn_up holds [gate; up]. sliding_window: `<name>.attention.sliding_window`, when present and
    non-zero, makes every layer attend to that many positions. rope_freqs: reads llama 3's rope frequency factors
    (`rope_freqs.weight`). unsupported: tensor names refused at load.
    experts: "" (a dense FFN), "optional" (experts when `expert_count` > 0: llama's Mixtral files) or "required";
    expert_norm: the chosen experts' weights normalised to sum 1; expert_ff_key: an expert's size is
    `expert_feed_forward_length` (else feed_forward_length); qk_norm_whole: the q/k norms span all heads (olmoe)."""

    name: str
    rope_mode: int
    qk_norm: bool = False
    qk_norm_whole: bool = False
    experts: str = ""
    expert_norm: bool = True
    expert_ff_key: bool = False
    fused_gate_up: bool = False
    activation: str = "silu"
    sliding_window: bool = False
    rope_freqs: bool = False
    unsupported: Mapping[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    def architecture(self, name: str | None = None) -> Architecture:
        """The Architecture of this spec under GGUF name `name` (default: the spec's own)."""
        arch = name or self.name

        def hparams(meta: dict[str, Any], path: str, n_vocab: int) -> HParams:
            hp = read_hparams(meta, arch, path, n_vocab, rope_mode=self.rope_mode)
            m = Meta(meta, arch, path)
            n_swa = m.optional_int("attention.sliding_window") if self.sliding_window else 0
            if n_swa:  # absent or 0: no window
                # every layer slides, with the model's one rope
                hp = replace(hp, n_swa=n_swa, swa_layers=(True,) * hp.n_layer,
                             rope_freq_base_swa=hp.rope_freq_base, rope_freq_scale_swa=hp.rope_freq_scale)
            if self.experts:
                hp = replace(hp, **read_experts(m, hp, required=self.experts == "required", norm=self.expert_norm,
                                                ff_key=self.expert_ff_key))
            return hp

        def layer_tensors(r: TensorReader, hp: HParams, i: int) -> Layer:
            ffn = expert_tensors(r, hp, i) if hp.n_expert else ffn_tensors(r, hp, i, fused_gate_up=self.fused_gate_up)
            return Layer(**attention_tensors(r, hp, i, qk_norm=self.qk_norm,  # type: ignore[arg-type]
                                             qk_norm_whole=self.qk_norm_whole), **ffn)

        return Architecture(name=arch, hparams=hparams, layer_tensors=layer_tensors,
                            layer=pre_norm_layer(self.activation), unsupported=dict(self.unsupported),
                            rope_freqs=self.rope_freqs)


DENSE: tuple[DenseSpec, ...] = (
    DenseSpec("llama", ops.ROPE_NORMAL, sliding_window=True, aliases=("xverse",), rope_freqs=True,
              experts="optional"),
    DenseSpec("qwen2", ops.ROPE_NEOX, unsupported=_OUTPUT_BIAS),
    DenseSpec("qwen3", ops.ROPE_NEOX, qk_norm=True),
    DenseSpec("qwen3moe", ops.ROPE_NEOX, qk_norm=True, experts="required", expert_ff_key=True),
    DenseSpec("olmoe", ops.ROPE_NEOX, qk_norm=True, qk_norm_whole=True, experts="required", expert_norm=False),
    DenseSpec("phi3", ops.ROPE_NEOX, fused_gate_up=True,
              unsupported={"rope_factors_long.weight": _LONGROPE, "rope_factors_short.weight": _LONGROPE,
                           **_OUTPUT_BIAS}),
)
