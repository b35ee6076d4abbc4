"""The KL-divergence base file: one model's next-token distributions at the scored positions of a perplexity run,
kept so that another model (another quant of it) can be compared with them later (`ggml-py perplexity
--kl-divergence-base FILE`, then `--kl-divergence`).

The file is a plain numpy .npz (ZIP, stored, not compressed), so `np.load(FILE)` reads it:

- `meta` (0-d str): JSON with format, n_ctx, n_chunks, first (positions before it are context only), n_scored,
  n_vocab, add_bos, bos_id, vocab_sha256, model, text, text_sha256;
- `tokens` (int32, n_chunks x n_ctx): the text's tokens chunk by chunk, as tokenized (before BOS replaces the first);
- `logprobs` (float16, n_chunks x n_scored x n_vocab): log-softmax of every scored position over the whole vocabulary;
- `nll` (float64, n_chunks x n_scored): -log p(next token), exact (PPL(base) escapes the float16 rounding);
- `top` (int32, n_chunks x n_scored): the most likely token, from the float32 logits (float16 may tie).

llama.cpp's own file stores the same distributions as 16-bit integers over the top 16 nats of each row, the same
size; float16 keeps every token (see perplexity_stats.py). SmolLM2's vocabulary of 49152 costs 96 KiB a position,
24.5 MB a chunk of 512. Writing and reading stream one chunk at a time: memory stays at one chunk whatever the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from ggml_py.errors import ModelError

FORMAT = "ggml_py.kld_base/1"


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides how text becomes token ids: the tokenizer model, its pre-tokenizer, every token's text,
    BOS/EOS. Two files of one model in different quant types share it; another vocabulary does not."""
    h = hashlib.sha256()
    h.update(json.dumps([tokenizer.model, tokenizer.pre, tokenizer.bos_id, tokenizer.eos_id,
                         tokenizer.add_bos, tokenizer.add_eos]).encode())
    for i in range(tokenizer.n_vocab):
        h.update(tokenizer.token_text(i).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def _header_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    import io

    buf = io.BytesIO()
    # write_array_header_2_0 writes the magic string too: the bytes of a .npy up to its data
    np.lib.format.write_array_header_2_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": shape})
    return buf.getvalue()


class BaseWriter:
    """Writes a base file chunk by chunk: `add(tokens, logprobs, nll, top)` n_chunks times, then `close()`. The file
    is a hidden .part beside `path` until closed, so an interrupted run leaves no half file under the name."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ModelError(f"--kl-divergence-base {path} is a directory; give a file name")
        if not os.path.isdir(folder):
            raise ModelError(f"cannot write {path}: the folder {folder} does not exist")
        self.path = path
        self.meta = dict(meta, format=FORMAT)
        self.n_chunks, self.n_scored, self.n_vocab = meta["n_chunks"], meta["n_scored"], meta["n_vocab"]
        fd, self._part = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=folder)
        os.close(fd)
        self._zip = zipfile.ZipFile(self._part, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._stream: IO[bytes] | None = self._zip.open("logprobs.npy", "w", force_zip64=True)
        self._stream.write(_header_bytes(np.float16, (self.n_chunks, self.n_scored, self.n_vocab)))
        self._tokens: list[np.ndarray] = []
        self._nll: list[np.ndarray] = []
        self._top: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, logprobs: np.ndarray, nll: np.ndarray, top: np.ndarray) -> None:
        assert self._stream is not None and logprobs.shape == (self.n_scored, self.n_vocab)
        self._stream.write(np.ascontiguousarray(logprobs, np.float16).tobytes())
        self._tokens.append(np.asarray(tokens, np.int32))
        self._nll.append(np.asarray(nll, np.float64))
        self._top.append(np.asarray(top, np.int32))

    def close(self) -> None:
        """Finish the file and move it to its name (all n_chunks must have been added)."""
        assert self._stream is not None and len(self._nll) == self.n_chunks
        self._stream.close()
        self._stream = None
        for name, arr in (("tokens", np.stack(self._tokens)), ("nll", np.stack(self._nll)),
                          ("top", np.stack(self._top)), ("meta", np.array(json.dumps(self.meta)))):
            with self._zip.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
        self._zip.close()
        try:
            os.replace(self._part, self.path)
        except OSError as e:
            self.abort()
            raise ModelError(f"cannot write {self.path}: {e.strerror or e}") from None

    def abort(self) -> None:
        """Remove the partial file (on an error or interrupt)."""
        try:
            if self._stream is not None:
                self._stream.close()
            self._zip.close()
        except Exception:  # the file goes anyway
            pass
        if os.path.exists(self._part):
            os.unlink(self._part)


class BaseReader:
    """Reads a base file: `meta`, `tokens`, `nll`, `top` at once, the log-probabilities chunk by chunk."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ModelError(f"the KL-divergence base {path} does not exist (write it first with "
                             f"--kl-divergence-base {path} and no --kl-divergence)")
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
            with self._zip.open("meta.npy") as f:
                self.meta: dict[str, Any] = json.loads(str(np.lib.format.read_array(f, allow_pickle=False)))
            if self.meta.get("format") != FORMAT:
                raise ValueError(self.meta.get("format"))
            arrays = {}
            for name in ("tokens", "nll", "top"):
                with self._zip.open(f"{name}.npy") as f:
                    arrays[name] = np.lib.format.read_array(f, allow_pickle=False)
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError):
            raise ModelError(f"{path} is not a KL-divergence base written by `ggml-py perplexity "
                             f"--kl-divergence-base` ({FORMAT})") from None
        self.tokens, self.nll, self.top = arrays["tokens"], arrays["nll"], arrays["top"]
        self.n_chunks, self.n_ctx = int(self.meta["n_chunks"]), int(self.meta["n_ctx"])
        self.n_scored, self.n_vocab = int(self.meta["n_scored"]), int(self.meta["n_vocab"])

    def logprobs(self) -> Iterator[np.ndarray]:
        """The stored log-probabilities, one chunk (n_scored, n_vocab) float16 at a time."""
        with self._zip.open("logprobs.npy") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
            if tuple(shape) != (self.n_chunks, self.n_scored, self.n_vocab) or dtype != np.float16:
                raise ModelError(f"{self.path}: its log-probabilities are {dtype} {shape}, not float16 "
                                 f"{(self.n_chunks, self.n_scored, self.n_vocab)}")
            size = self.n_scored * self.n_vocab * 2
            for _ in range(self.n_chunks):
                data = f.read(size)
                if len(data) != size:
                    raise ModelError(f"{self.path} is truncated")
                yield np.frombuffer(data, np.float16).reshape(self.n_scored, self.n_vocab)

    def close(self) -> None:
        self._zip.close()
