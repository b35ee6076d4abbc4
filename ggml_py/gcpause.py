"""The cyclic garbage collector paused while a model loads or a plan is prepared.

Both allocate some 10^5 objects that live as long as the model or plan (tokenizer tables, node structs), and
allocation counts trigger collections: full passes over everything alive, a model's vocabulary included, that find
nothing to free and cost tens of milliseconds of a cold start's time to first token. Reference counting still frees
everything meanwhile; only cycles wait for the next collection after the block."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # blocks open, in any thread
_reenable = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()
