"""Describe a GGUF model: architecture, sizes, tensor types, tokenizer."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ggml_py.commands._model_args import add_model_arguments
from ggml_py.errors import GgmlPyError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, positional=True)


def describe(path: str) -> dict[str, Any]:
    from ggml_py.formats.gguf import open_gguf
    from ggml_py.models import SUPPORTED_ARCHITECTURES, get_architecture
    from ggml_py.models.tokenizer import Tokenizer

    with open_gguf(path) as gf:
        meta = gf.metadata
        types: dict[str, int] = {}
        type_bytes: dict[str, int] = {}
        n_params = 0
        for t in gf.tensors.values():
            types[t.dtype.name] = types.get(t.dtype.name, 0) + 1
            type_bytes[t.dtype.name] = type_bytes.get(t.dtype.name, 0) + t.nbytes
            n_params += t.n_elements
        arch = gf.architecture
        out: dict[str, Any] = {
            "path": path, "file_size": os.path.getsize(path), "gguf_version": gf.version,
            "architecture": arch, "supported": arch in SUPPORTED_ARCHITECTURES,
            "name": meta.get("general.name"), "n_tensors": len(gf.tensors), "n_params": n_params,
            "tensor_types": dict(sorted(types.items())), "tensor_type_bytes": dict(sorted(type_bytes.items())),
            "file_type": meta.get("general.file_type"),
        }
        if arch in SUPPORTED_ARCHITECTURES:
            emb = gf.tensors.get("token_embd.weight")
            try:
                hp = get_architecture(arch).hparams(meta, path, emb.shape[0] if emb else 0)
                out["hparams"] = dataclasses.asdict(hp)  # nested ones (rope_yarn) as objects in --json
                out["rope_freqs"] = "rope_freqs.weight" in gf.tensors
                out["tied_output"] = "output.weight" not in gf.tensors
                kv_per_token = 2 * hp.n_layer * hp.n_head_kv * hp.head_dim * 2
                out["kv_cache_bytes_per_token_f16"] = kv_per_token
            except GgmlPyError as e:
                out["hparams_error"] = str(e)
        try:
            tok = Tokenizer.from_metadata(meta)
            out["tokenizer"] = {"model": tok.model, "pre": tok.pre, "n_vocab": tok.n_vocab, "bos_id": tok.bos_id,
                                "eos_id": tok.eos_id, "eog_ids": sorted(tok.eog_ids), "add_bos": tok.add_bos,
                                "chat_template": tok.chat_template is not None}
        except GgmlPyError as e:
            out["tokenizer"] = {"error": str(e)}
    return out


def _rope_scaling(hp: dict[str, Any], rope_freqs: bool) -> str:
    """The rope scaling in words: ", YaRN x4 of context 4096", ", linear x8", ", llama3 frequency factors"."""
    y, factor = hp["rope_yarn"], 1.0 / hp["rope_freq_scale"]
    kind = (f" YaRN x{factor:g} of context {y['n_ctx_orig']}" if y["ext_factor"]
            else f" linear x{factor:g}" if factor != 1.0 else "")
    return ("," + kind if kind else "") + (", llama3 frequency factors" if rope_freqs else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ggml_py.models import default_model_path

    info = describe(args.model or default_model_path())
    if not args.json:
        mb = info["file_size"] / 2**20
        print(f"{info['path']}")
        print(f"  architecture  {info['architecture']} ({'supported' if info['supported'] else 'NOT supported'})"
              f", name {info['name']!r}")
        print(f"  size          {mb:.1f} MiB, {info['n_params'] / 1e6:.1f} M parameters in {info['n_tensors']} tensors")
        print("  tensor types  " + ", ".join(f"{k} x{v}" for k, v in info["tensor_types"].items()))
        hp = info.get("hparams")
        if hp:
            print(f"  layers {hp['n_layer']}, embd {hp['n_embd']}, ff {hp['n_ff']}, heads {hp['n_head']}/"
                  f"{hp['n_head_kv']} kv, head dim {hp['head_dim']}, rope {hp['n_rot']} dims base "
                  f"{hp['rope_freq_base']:g}{_rope_scaling(hp, info['rope_freqs'])}, context {hp['n_ctx_train']}, "
                  f"vocab {hp['n_vocab']}, output {'tied' if info['tied_output'] else 'separate'}")
        t = info["tokenizer"]
        if "error" in t:
            print(f"  tokenizer     error: {t['error']}")
        else:
            print(f"  tokenizer     {t['model']} (pre {t['pre']!r}), {t['n_vocab']} tokens, bos {t['bos_id']}, "
                  f"eos {t['eos_id']}, chat template {'yes' if t['chat_template'] else 'no'}")
    return info
