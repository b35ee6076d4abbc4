"""Constrained decoding with llguidance (PyPI `llguidance`, the optional extra `ggml_py[structured]`): a grammar
(JSON schema, Lark, regex) compiled against the model's tokenizer into a per-sequence `Constraint`, whose token mask
sets the logits of every token the grammar forbids to -inf before sampling, and which consumes each sampled token.

The llguidance tokenizer (`llg_tokenizer`) is built once per Tokenizer (~0.3 s for 49k tokens) from the tokens'
bytes; control tokens are marked special (llguidance's 0xFF prefix) so a grammar never emits them as text, and the
end-of-generation tokens are its EOS tokens: the mask allows them exactly where the grammar may end.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any

import numpy as np

from ggml_py.errors import GgmlPyError

__all__ = ["Constraint", "GrammarError", "closed_objects", "compile_grammar", "json_schema_grammar", "lark_grammar",
           "llg_tokenizer", "regex_grammar", "require_llguidance"]


class GrammarError(GgmlPyError, ValueError):
    """A grammar or JSON schema that llguidance cannot compile, or a constrained sequence that reached a state the
    grammar does not allow."""


def require_llguidance() -> Any:
    """The llguidance module, or a GrammarError saying how to install it."""
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(f"constrained decoding needs llguidance: pip install \"ggml_py[structured]\" ({e})") \
            from None
    return llguidance


# JSON as compact as json.dumps writes it by default: one space after ',' and ':' and no other whitespace. A free
# whitespace rule lets a small model at a high temperature emit newlines until max_tokens (the output never ends).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# keywords whose value maps names to schemas, and those whose value is data, not a schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that lists `properties` and says nothing of
    `additionalProperties` (or `patternProperties`) takes no other keys. Whatever it then accepts, the schema
    accepts; without it a small model fills objects with keys of its own (it copies the schema into its answer)."""
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: closed_objects(sub) for name, sub in v.items()}
        elif k in _DATA:
            out[k] = v
        else:
            out[k] = closed_objects(v)
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                           "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: dict[str, Any] | bool | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object, OpenAI's json_object), its objects closed
    (`closed_objects`)."""
    llg = require_llguidance()
    if schema is None:
        schema = {"type": "object"}
    elif schema is True:
        schema = {}
    elif not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    schema = closed_objects(schema)
    try:
        return str(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar (llguidance's dialect: docs/serving.md)."""
    return str(require_llguidance().LLMatcher.grammar_from_lark(text))


def regex_grammar(pattern: str) -> str:
    return str(require_llguidance().LLMatcher.grammar_from_regex(pattern))


class _Vocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer: the tokens' bytes, EOS/BOS, and a tokenize call."""

    def __init__(self, tok: Any, n_vocab: int) -> None:
        self._tok = tok
        self.eos_token_id = _eos_ids(tok)[0]
        self.bos_token_id = tok.bos_id
        tokens = []
        for i in range(tok.n_vocab):
            b = tok.token_to_piece(i, True)
            tokens.append(b"\xff" + b if tok.is_control(i) and b else b)
        tokens += [b""] * (n_vocab - len(tokens))  # rows of the logits beyond the vocabulary (padded embeddings)
        self.tokens = tokens
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_control(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):  # TypeError: the wrapper then passes str (it probes with bytes once)
            raise TypeError("str only")
        return list(self._tok.encode(text, add_special=False, parse_special=False))


def _eos_ids(tok: Any) -> list[int]:
    ids = sorted(tok.eog_ids)
    if not ids:
        raise GrammarError("the model's tokenizer has no end-of-generation token: a grammar could never end")
    return ids


_cache: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def llg_tokenizer(tok: Any, n_vocab: int | None = None) -> Any:
    """llguidance's tokenizer for a ggml_py Tokenizer whose logits have `n_vocab` rows (default: the vocabulary's
    size); built once per tokenizer and size (thread-safe)."""
    llg = require_llguidance()
    n = max(n_vocab or tok.n_vocab, tok.n_vocab)
    with _cache_lock:
        hit = _cache.get(tok)
        if hit is not None and hit[0] == n:
            return hit[1]
        vocab = _Vocab(tok, n)
        ll = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=n, eos_token=_eos_ids(tok))
        _cache[tok] = (n, ll)
        return ll


def compile_grammar(tok: Any, grammar: str, n_vocab: int | None = None) -> None:
    """Raise a GrammarError naming the problem when `grammar` (from *_grammar) does not compile for `tok`."""
    llg = require_llguidance()
    err = llg.LLMatcher.validate_grammar(grammar, llg_tokenizer(tok, n_vocab))
    if err:
        raise GrammarError(_short(err))


def _short(msg: str, limit: int = 500) -> str:
    """llguidance's message on one line, without its excerpts of the grammar's source ("  1 | start: x", "  ^")."""
    lines = [ln for ln in str(msg).splitlines() if not re.match(r"\s*(\d+ \|.*|\^)\s*$", ln)]
    msg = " ".join(" ".join(lines).split())
    return msg if len(msg) <= limit else msg[:limit] + "..."


class Constraint:
    """One sequence's grammar state: `allowed()` is the mask of its next token, `consume(t)` advances it.

    Not thread-safe; a mask may be computed on another thread (`prepare`) while the owner waits for it.
    """

    def __init__(self, tok: Any, grammar: str, n_vocab: int | None = None) -> None:
        llg = require_llguidance()
        self.n_vocab = max(n_vocab or tok.n_vocab, tok.n_vocab)
        self._m = llg.LLMatcher(llg_tokenizer(tok, self.n_vocab), grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(_short(self._m.get_error()))
        self._bits = np.zeros((self.n_vocab + 31) // 32, np.int32)
        self._mask: np.ndarray | None = None

    def prepare(self) -> None:
        """Compute the next token's mask now (llguidance releases the GIL while it works)."""
        if self._mask is None:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")  # bit i of word w: token 32w + i
            self._mask = bits[:self.n_vocab].astype(bool)

    def allowed(self) -> np.ndarray:
        """(n_vocab,) bool: the tokens the grammar allows next (its EOS tokens where it may end)."""
        self.prepare()
        assert self._mask is not None
        return self._mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of logits with every token the grammar forbids at -inf (a GrammarError when the
        grammar allows none: its state is an error)."""
        mask = self.allowed()
        if self._m.is_error() or not mask.any():
            raise GrammarError(f"the grammar allows no next token: {_short(self._m.get_error() or 'dead end')}")
        x = np.asarray(logits)
        n = min(x.shape[-1], mask.shape[0])
        out = np.full(x.shape, -np.inf, dtype=x.dtype)
        out[:n] = np.where(mask[:n], x[:n], -np.inf)
        return out

    def consume(self, token: int) -> None:
        """Advance past a sampled token; a GrammarError when the grammar does not allow it."""
        self._mask = None
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} does not fit the grammar: {_short(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """True when the grammar can take no more tokens (it is complete)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())
