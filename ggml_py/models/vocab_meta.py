"""The tokenizer's GGUF keys read strictly: a value of the wrong kind is a ModelError naming the key and what it holds
(llama.cpp reads these as raw data, so a wrong kind would be garbage there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.models.hparams import describe_value


def as_str(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def str_list(meta: Mapping[str, Any], key: str) -> list[str] | None:
    """A GGUF string array (a list of str), or None when absent."""
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, list | tuple):
        if all(type(x) is str for x in v):  # the parser's usual output: copied as is, no per-item conversion
            return list(v)
        if all(isinstance(x, str | bytes) for x in v):
            return [x if type(x) is str else as_str(x) for x in v]
    raise ModelError(f"tokenizer metadata {key!r} must be an array of strings, got {describe_value(v)}")


def num_array(meta: Mapping[str, Any], key: str, kind: str) -> np.ndarray | None:
    """A GGUF numeric array as numpy (kind "f": floats, "i": integers), or None when absent."""
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, np.ndarray):  # how GGUF numeric arrays of any element type arrive
        arr = v
    elif isinstance(v, list | tuple) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
        arr = np.asarray(v)
    else:  # strings, nested arrays (lists of arrays), scalars
        arr = None
    # llama.cpp reads these as raw float / int32 data: integers as scores (or floats as types) would be garbage
    ok = arr is not None and arr.ndim == 1 and (arr.dtype.kind in ("f" if kind == "f" else "iu") or arr.size == 0)
    if not ok:
        what = "floats" if kind == "f" else "integers"
        raise ModelError(f"tokenizer metadata {key!r} must be an array of {what}, got {describe_value(v)}")
    if kind == "f" and arr.size and not np.isfinite(arr.astype(np.float64)).all():
        raise ModelError(f"tokenizer metadata {key!r} contains NaN or infinite values")
    return arr  # type: ignore[return-value]


def meta_int(meta: Mapping[str, Any], key: str) -> int | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, np.ndarray | list) and len(v) == 1 and not isinstance(v[0], list | np.ndarray):
        v = v[0]  # a one-element array, as some converters write
    if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
        raise ModelError(f"tokenizer metadata {key!r} must be an integer, got {describe_value(v)}")
    return int(v)


def meta_bool(meta: Mapping[str, Any], key: str) -> bool | None:
    v = meta.get(key)
    if isinstance(v, bool | np.bool_):
        return bool(v)
    i = meta_int(meta, key)
    return None if i is None else bool(i)
