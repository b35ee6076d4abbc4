"""Token ids to text as they stream in, holding back incomplete UTF-8 sequences."""

from __future__ import annotations

import codecs

from ggml_py.models.tokenizer import Tokenizer


class StreamDecoder:
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences.

    >>> dec = StreamDecoder(tok)
    >>> for t in ids: print(dec.push(t), end="")
    >>> print(dec.flush())
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that is complete so far (possibly "")."""
        return self._dec.decode(self.tokenizer.token_to_piece(token_id, self.special))

    def push_bytes(self, data: bytes) -> str:
        """Add raw piece bytes."""
        return self._dec.decode(data)

    def flush(self) -> str:
        """End of stream: whatever is pending (an incomplete sequence becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)
