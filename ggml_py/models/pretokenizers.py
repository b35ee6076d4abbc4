"""Byte-level BPE pre-tokenizers by GGUF `tokenizer.ggml.pre` name: the split regexes in llama.cpp's order and the
per-name vocabulary flags (facts from llama.cpp's src/llama-vocab.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _RE_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = _RE_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class PreSpec:
    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


_PRE_DEFAULT = PreSpec((r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_LLAMA3 = PreSpec((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_GPT2 = PreSpec((_RE_GPT2,))
_PRE_STARCODER = PreSpec((r"\p{N}", _RE_GPT2))
_PRE_QWEN2 = PreSpec((_RE_QWEN2,), clean_spaces=False)

#: ``tokenizer.ggml.pre`` name -> pre-tokenizer (regexes in llama.cpp's order, plus the per-name vocab flags).
PRE: dict[str, PreSpec] = {
    "default": _PRE_DEFAULT,
    "llama3": _PRE_LLAMA3,
    "llama-v3": _PRE_LLAMA3,
    "llama-bpe": _PRE_LLAMA3,
    "falcon3": _PRE_LLAMA3,
    "dbrx": PreSpec((_RE_LLAMA3,)),
    "smaug-bpe": PreSpec((_RE_LLAMA3,)),
    "gpt2": _PRE_GPT2,
    "gpt-2": _PRE_GPT2,
    "phi-2": _PRE_GPT2,
    "mpt": _PRE_GPT2,
    "olmo": _PRE_GPT2,
    "smollm": PreSpec((r"\p{N}", _RE_GPT2), clean_spaces=False),
    "starcoder": _PRE_STARCODER,
    "refact": _PRE_STARCODER,
    "codeshell": _PRE_STARCODER,
    "command-r": PreSpec((r"\p{N}", _RE_GPT2), clean_spaces=False),
    "qwen2": _PRE_QWEN2,
    "deepseek-r1-qwen": _PRE_QWEN2,
    "stablelm2": PreSpec((_RE_QWEN2,)),
    "falcon": PreSpec((r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]")),
}

