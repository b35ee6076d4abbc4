"""Tokenizers built from GGUF metadata, matching llama.cpp's token ids.

Two vocab types are supported, named as GGUF's ``tokenizer.ggml.model`` names them:

``gpt2``  byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen2, ...).
    The pre-tokenizer regexes of ``tokenizer.ggml.pre`` are the ones llama.cpp uses for that name (pretokenizers.py).
    Splitting, byte-to-unicode mapping and the merge loop run in the HF ``tokenizers`` library (Rust): its ``Split``
    (isolated) pre-tokenizer applied in sequence is exactly llama.cpp's ``unicode_regex_split`` (every regex splits the
    pieces of the previous one; unmatched gaps stay pieces of their own), its ``ByteLevel`` mapping is GPT-2's
    byte-to-unicode table, and its BPE model merges the lowest-ranked adjacent pair first, leftmost on ties, per word,
    which is llama.cpp's bigram queue. ``ignore_merges`` (llama3) is supported by both. This is many times faster
    than a Python merge loop (~4 ms for 1,000 words) and is checked token-for-token against llama.cpp in
    ``tests/test_tokenizer.py``. One difference is worked around: tokenizers drops characters that have no token
    *before* merging (so their neighbours can merge across them), llama.cpp keeps them in the symbol chain and only
    leaves them out of the output. Text containing a byte without a token (SmolLM2 lacks e.g. 0x04 and the lead
    bytes of code points >= U+40000), and every word of a vocabulary whose merges produce tokens it does not have,
    goes through an exact Python merge loop (``_bpe_word``) instead.
    What HF's tokenizer does differently (added-token matching, normalizers, post-processors) is *not* used: special
    tokens are split out by our own code following llama.cpp (longest special token first, every occurrence, control
    tokens only when ``parse_special``, user-defined tokens always), and BOS/EOS are added by our own code.

``llama``  SentencePiece-style BPE driven by token scores (Llama 1/2, Mistral, TinyLlama, ...).
    Implemented here in Python: spaces become U+2581, a leading space is added to the first text fragment (and after
    each special token) when ``add_space_prefix``, then adjacent symbols are merged highest score first (leftmost on
    ties) while the merged text is a token; symbols that never became tokens fall back to ``<0xXX>`` byte tokens.
    HF's BPE cannot do this (it merges by rank, not by score), hence the own implementation.

Anything else raises :class:`ggml_py.errors.ModelError` naming the supported models and pre-tokenizers.
See docs/tokenizer.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.models.bpe import bpe_word
from ggml_py.models.chat_template import render_chat_template
from ggml_py.models.clean_spaces import clean_up_spaces
from ggml_py.models.hparams import describe_value
from ggml_py.models.pretokenizers import PRE, PreSpec
from ggml_py.models.spm import spm_encode
from ggml_py.models.vocab_meta import as_str, meta_bool, meta_int, num_array, str_list

__all__ = ["Tokenizer", "TokenType", "SUPPORTED_MODELS", "SUPPORTED_PRE"]

log = logging.getLogger(__name__)


class TokenType:
    """GGUF ``tokenizer.ggml.token_type`` values."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Attribute bits (llama.cpp keeps a bit set per token; GGUF stores one type, some are added by text heuristics).
_A_UNDEFINED = 0
_A_UNKNOWN = 1 << 0
_A_UNUSED = 1 << 1
_A_NORMAL = 1 << 2
_A_CONTROL = 1 << 3
_A_USER_DEFINED = 1 << 4
_A_BYTE = 1 << 5
_A_LSTRIP = 1 << 7
_A_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TokenType.UNDEFINED: _A_UNDEFINED,
    TokenType.NORMAL: _A_NORMAL,
    TokenType.UNKNOWN: _A_UNKNOWN,
    TokenType.CONTROL: _A_CONTROL,
    TokenType.USER_DEFINED: _A_USER_DEFINED,
    TokenType.UNUSED: _A_UNUSED,
    TokenType.BYTE: _A_BYTE,
}
_A_SPECIAL = _A_UNKNOWN | _A_CONTROL

SUPPORTED_MODELS: tuple[str, ...] = ("gpt2", "llama")
SUPPORTED_PRE: tuple[str, ...] = tuple(sorted(PRE))

# Token texts llama.cpp treats as end-of-generation (and forces to CONTROL), and the FIM texts it also stops on.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOG_TEXTS = frozenset(
    _EOT_TEXTS + ("<|return|>", "<|call|>", "<|eom_id|>", "[EOS]", "</s>", "<eos>", "<|flush|>", "<|calls|>")
)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_SPM_SPACE = "\u2581"
_C_ISSPACE = " \t\n\v\f\r"


def _valid_text(text: Any) -> str:
    """Text to encode: str, with lone surrogates (bytes that were not UTF-8, e.g. from a command line decoded with
    surrogateescape) replaced by U+FFFD, as llama.cpp does for invalid UTF-8."""
    if not isinstance(text, str):
        raise ModelError(f"text to tokenize must be a str, got {type(text).__name__}")
    if not text.isascii():
        text = _SURROGATES.sub("\ufffd", text)
    return text


_SURROGATES = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """A llama.cpp-compatible tokenizer; build it with :meth:`from_metadata`."""

    def __init__(self) -> None:  # use from_metadata
        self.model: str = ""
        self.pre: str = ""
        self._tokens: list[str] = []
        self._scores: list[float] = []
        self._attrs: list[int] = []
        self._token_to_id: dict[str, int] = {}
        self._pieces: list[bytes | None] = []
        self._special_order: list[int] = []
        self._hf: Any = None
        self._merges: list[tuple[str, str]] = []
        self._ranks: dict[tuple[str, str], int] | None = None
        self._missing_bytes: frozenset[int] = frozenset()
        self._py_bpe_only = False
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eot_id: int | None = None
        self.eom_id: int | None = None
        self.unk_id: int | None = None
        self.pad_id: int | None = None
        self.eog_ids: frozenset[int] = frozenset()
        self.add_bos: bool = False
        self.add_eos: bool = False
        self.add_space_prefix: bool = False
        self.clean_spaces: bool = False
        self.ignore_merges: bool = False
        self.chat_template: str | None = None
        self.source = "the model"  # named in template errors (load_model sets the file's path)

    # -- construction -------------------------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata given as ``{key: value}`` (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
        self = cls()
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError("GGUF metadata has no 'tokenizer.ggml.model'; supported: " + ", ".join(SUPPORTED_MODELS))
        self.model = as_str(model)
        if self.model not in SUPPORTED_MODELS:
            raise ModelError(f"unsupported tokenizer model {self.model!r}; supported: {', '.join(SUPPORTED_MODELS)}")
        tokens = str_list(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelError("GGUF metadata has no 'tokenizer.ggml.tokens'")
        self._tokens = tokens
        n = len(self._tokens)
        for i, t in enumerate(self._tokens):
            if "\x00" in t:  # llama.cpp reads token texts as C strings: they end at a NUL
                t = self._tokens[i] = t[: t.index("\x00")]
            if not t:
                self._tokens[i] = f"[EMPTY_{i}]"
        scores = num_array(meta, "tokenizer.ggml.scores", "f")
        self._scores = scores.astype(np.float64).tolist() if scores is not None else [0.0] * n
        types_arr = num_array(meta, "tokenizer.ggml.token_type", "i")
        types = types_arr.tolist() if types_arr is not None else [TokenType.NORMAL] * n
        if len(self._scores) < n or len(types) < n:
            raise ModelError(f"tokenizer scores/token types are shorter than the vocabulary ({n} tokens)")
        self._attrs = [_TYPE_TO_ATTR.get(t, _A_UNDEFINED) for t in types[:n]]
        for i, t in enumerate(self._tokens):
            self._token_to_id.setdefault(t, i)  # a duplicate keeps its first id
        self._pieces = [None] * n

        if self.model == "llama":
            self.bos_id, self.eos_id, self.unk_id = 1, 2, 0
            self.add_space_prefix, self.clean_spaces, self.add_bos = True, False, True
            self.pre = "default"
        else:
            self.bos_id = self.eos_id = 11
            pre = meta.get("tokenizer.ggml.pre")
            self.pre = as_str(pre) if pre is not None else ""
            if not self.pre:
                log.warning("GGUF has no 'tokenizer.ggml.pre'; using the 'default' pre-tokenizer (quality may suffer)")
                spec = PRE["default"]
            elif self.pre in PRE:
                spec = PRE[self.pre]
            else:
                raise ModelError(
                    f"unsupported pre-tokenizer {self.pre!r} for tokenizer model 'gpt2'; supported: "
                    + ", ".join(SUPPORTED_PRE)
                )
            self.clean_spaces, self.ignore_merges, self.add_bos = spec.clean_spaces, spec.ignore_merges, spec.add_bos
            self._hf = self._build_hf(meta, spec)

        v = meta_bool(meta, "tokenizer.ggml.add_space_prefix")
        if v is not None:
            self.add_space_prefix = v

        for attr, key in (
            ("bos_id", "bos"), ("eos_id", "eos"), ("eot_id", "eot"), ("eom_id", "eom"), ("unk_id", "unknown"),
            ("pad_id", "padding"),
        ):  # fmt: skip
            default = getattr(self, attr)
            if default is not None and not 0 <= default < n:
                default = None
            value = meta_int(meta, f"tokenizer.ggml.{key}_token_id")
            if value is not None and 0 <= value < n:
                default = value
            elif value is not None:
                log.warning("tokenizer.ggml.%s_token_id = %d is out of range; ignored", key, value)
            setattr(self, attr, default)

        v = meta_bool(meta, "tokenizer.ggml.add_bos_token")
        if v is not None:
            self.add_bos = v
        v = meta_bool(meta, "tokenizer.ggml.add_eos_token")
        if v is not None:
            self.add_eos = v
        if self.add_bos and self.bos_id is None:
            raise ModelError("tokenizer.ggml.add_bos_token is true, but there is no BOS token")
        if self.add_eos and self.eos_id is None:
            raise ModelError("tokenizer.ggml.add_eos_token is true, but there is no EOS token")

        self._detect_eog(meta)
        self._special_order = sorted(
            (i for i, a in enumerate(self._attrs) if a & (_A_CONTROL | _A_USER_DEFINED | _A_UNKNOWN)),
            key=lambda i: (-len(self._tokens[i].encode("utf-8", "surrogateescape")), i),
        )
        name = as_str(meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp: phi-3 special tokens swallow following whitespace
            for i in self._special_order:
                self._attrs[i] |= _A_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._token_to_id:
                    i = self._token_to_id[text]
                    self._attrs[i] = self._attrs[i] | _A_RSTRIP if on else self._attrs[i] & ~_A_RSTRIP

        tmpl = meta.get("tokenizer.chat_template")
        if tmpl is not None and not isinstance(tmpl, str):
            raise ModelError("tokenizer metadata 'tokenizer.chat_template' must be a string, got "
                             f"{describe_value(tmpl)}")
        self.chat_template = tmpl
        return self

    def _build_hf(self, meta: Mapping[str, Any], spec: PreSpec) -> Any:
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges_raw = str_list(meta, "tokenizer.ggml.merges")
        if merges_raw is None:
            raise ModelError("GGUF 'gpt2' tokenizer has no 'tokenizer.ggml.merges'")
        vocab = self._token_to_id
        try:
            "".join(vocab).encode("utf-8")
        except UnicodeEncodeError:  # entries that are not valid UTF-8 cannot be handed to tokenizers; never matched
            vocab = {t: i for t, i in vocab.items() if not any("\udc80" <= c <= "\udcff" for c in t)}
        # "a b" -> (a, b), split at the first space after the first character (a may be a space); duplicates keep
        # their first place. Comprehensions: 56-60 ms where one loop doing all of it took 86-96 (49k merges, every load)
        all_merges = list(dict.fromkeys((s[:p], s[p + 1:]) if (p := s.find(" ", 1)) >= 0 else ("", "")
                                        for s in merges_raw))
        merges = [m for m in all_merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
        self._merges = all_merges
        # tokenizers drops characters missing from the vocab *before* merging, and cannot merge into a missing token;
        # llama.cpp keeps such symbols in the chain (they only vanish from the output). Those words go through the
        # exact Python merge loop instead (_bpe_word): for texts with bytes that have no token, or for every word
        # when merges had to be left out.
        self._missing_bytes = frozenset(b for b in range(256) if _BYTE_TO_CHAR[b] not in vocab)
        if len(merges) != len(all_merges):
            log.warning(
                "%d BPE merges reference tokens missing from the vocabulary; using the slow exact merge loop",
                len(all_merges) - len(merges),
            )
            self._py_bpe_only = True
        model = models.BPE(vocab=dict(vocab), merges=merges, ignore_merges=spec.ignore_merges)
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return hf

    def _detect_eog(self, meta: Mapping[str, Any]) -> None:
        tti = self._token_to_id

        def find(texts: Iterable[str]) -> int | None:
            for t in texts:
                if t in tti:
                    return tti[t]
            return None

        def force_control(i: int | None) -> None:
            if i is not None and not self._attrs[i] & _A_CONTROL:
                self._attrs[i] |= _A_CONTROL

        if self.eot_id is None:
            self.eot_id = find(_EOT_TEXTS)
            force_control(self.eot_id)
        if self.eom_id is None:
            self.eom_id = find(("<|eom_id|>",))
            force_control(self.eom_id)
        eog: set[int] = set()
        for key, texts in (("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS)):
            i = meta_int(meta, f"tokenizer.ggml.fim_{key}_token_id")
            if i is None or not 0 <= i < len(self._tokens):
                i = find(texts)
                force_control(i)
            if i is not None:
                eog.add(i)
        for text in _EOG_TEXTS:
            if text in tti:
                eog.add(tti[text])
                force_control(tti[text])
        for i in (self.eos_id, self.eot_id, self.eom_id):
            if i is not None:
                eog.add(i)
        self.eog_ids = frozenset(eog)

    # -- properties -------------------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of tokens."""
        return len(self._tokens)

    @property
    def eot_ids(self) -> frozenset[int]:
        """Alias of :attr:`eog_ids`: every token that ends generation."""
        return self.eog_ids

    def is_eog(self, token_id: int) -> bool:
        """True if ``token_id`` ends generation (EOS, EOT, ``<|im_end|>``, ...), as llama.cpp decides."""
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (rendered only when ``special``)."""
        return bool(self._attrs[self._check_id(token_id)] & _A_CONTROL)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of a token, as stored in the GGUF (not decoded)."""
        return self._tokens[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry ``text``, or None."""
        return self._token_to_id.get(text)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_id] if self.eos_id is not None else ""

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise ModelError(f"token id {token_id} out of range [0, {len(self._tokens)})")
        return i

    # -- encoding -----------------------------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` into raw-text fragments (str) and special token ids (int), as llama.cpp does."""
        frags: list[str | int] = [text]
        for tid in self._special_order:
            attr = self._attrs[tid]
            if not parse_special and attr & _A_SPECIAL:
                continue
            tok = self._tokens[tid]
            if not any(isinstance(f, str) and tok in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                parts = f.split(tok)
                for k, part in enumerate(parts):
                    if k > 0:
                        out.append(tid)
                    if attr & _A_LSTRIP and k < len(parts) - 1:
                        part = part.rstrip(_C_ISSPACE)
                    if attr & _A_RSTRIP and k > 0:
                        part = part.lstrip(_C_ISSPACE)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` adds BOS/EOS where the model asks for them (``tokenizer.ggml.add_bos_token``, ...);
        ``parse_special`` turns the text of control tokens such as ``<|im_start|>`` into their ids.
        """
        text = _valid_text(text)
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        if self.model == "llama":
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                self._spm_encode(f.replace(" ", _SPM_SPACE), out)
                prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                elif self._py_bpe_only or not self._missing_bytes.isdisjoint(f.encode("utf-8", "surrogatepass")):
                    self._bpe_exact(f, out)
                else:  # encode_batch releases the GIL while it works (encode holds it: 2.5 s for 3 MB of text,
                    # during which no other thread of the process, a server's event loop included, runs)
                    out.extend(self._hf.encode_batch([f], add_special_tokens=False)[0].ids)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _bpe_exact(self, text: str, out: list[int]) -> None:
        """Byte-level BPE of one fragment, splitting with tokenizers but merging in Python (llama.cpp's rules)."""
        tti, model = self._token_to_id, self._hf.model
        for word, _ in self._hf.pre_tokenizer.pre_tokenize_str(text):
            if not self._py_bpe_only and all(c in tti for c in word):
                out.extend(t.id for t in model.tokenize(word))
            else:
                self._bpe_word(word, out)

    def _bpe_word(self, word: str, out: list[int]) -> None:
        if self._ranks is None:
            self._ranks = {}
            for r, pair in enumerate(self._merges):
                self._ranks.setdefault(pair, r)
        bpe_word(word, self._token_to_id, self._ranks, self.ignore_merges, out)

    def _spm_byte_token(self, b: int) -> int:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self._token_to_id.get(chr(b)) if b < 0x80 else None
        if tid is None:
            if self.unk_id is None:
                raise ModelError(f"SentencePiece vocabulary has no byte token <0x{b:02X}> and no unknown token")
            tid = self.unk_id
        return tid

    def _spm_encode(self, text: str, out: list[int]) -> None:
        spm_encode(text, self._token_to_id, self._scores, self._spm_byte_token, out)

    # -- decoding -----------------------------------------------------------------------------------------------------

    def _piece(self, i: int) -> bytes:
        p = self._pieces[i]
        if p is None:
            attr, text = self._attrs[i], self._tokens[i]
            if attr & (_A_SPECIAL | _A_USER_DEFINED):
                p = text.encode("utf-8", "surrogateescape")
            elif attr & _A_NORMAL:
                if self.model == "llama":
                    p = text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape")
                else:
                    p = b"".join(
                        bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8", "surrogateescape")
                        for c in text
                    )
            elif attr & _A_BYTE:
                try:
                    p = bytes((int(text[3:5], 16),))
                except ValueError:
                    p = b""
            else:
                p = b""
            self._pieces[i] = p
        return p

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for (may be part of a UTF-8 character). Control tokens give b"" unless
        ``special``."""
        i = self._check_id(token_id)
        if not special and self._attrs[i] & _A_SPECIAL:
            return b""
        return self._piece(i)

    def decode_bytes(
        self, ids: Iterable[int], special: bool = True, remove_special: bool = False, clean_spaces: bool | None = None
    ) -> bytes:
        """Like :meth:`decode` but returns the raw bytes."""
        ids = [self._check_id(t) for t in ids]
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for k, i in enumerate(ids):
            p = self.token_to_piece(i, special)
            if k == 0 and remove_space and p.startswith(b" "):
                p = p[1:]
            parts.append(p)
        data = b"".join(parts)
        if self.clean_spaces if clean_spaces is None else clean_spaces:
            data = clean_up_spaces(data)
        return data

    def decode(
        self, ids: Iterable[int], special: bool = True, remove_special: bool = False, clean_spaces: bool | None = None
    ) -> str:
        """Text of ``ids`` (llama.cpp's ``llama_detokenize``): the first token loses the space SentencePiece added,
        control tokens are rendered when ``special``, ``remove_special`` drops an added BOS/EOS, ``clean_spaces``
        (default: the vocab's setting) removes spaces before punctuation as llama.cpp does for some models.
        Invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, special, remove_special, clean_spaces).decode("utf-8", "replace")

    # -- chat templates -----------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's Jinja chat template
        (``tokenizer.chat_template``) in a sandboxed environment, the way HF transformers and llama-cpp-python do."""
        tmpl = template if template is not None else self.chat_template
        if tmpl is None:
            raise ModelError("the model has no chat template (tokenizer.chat_template); pass template=...")
        where = "the given chat template" if template is not None else f"{self.source}: tokenizer.chat_template"
        return render_chat_template(
            tmpl,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            source=where,
            **extra,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab})"
