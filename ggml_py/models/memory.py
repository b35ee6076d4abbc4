"""Refusing a model that would not fit in memory: what loading it will need, against what the kernel says is free.

What a model holds: its weights (mapped), a backend's caches of them, the KV cache, and the compute buffer of every
step plan it prepares. A step plan's compute buffer holds its attention masks, (n_tokens, n_kv) F32 each, planned
for the largest n_kv (the context): they grow with n_tokens x n_ctx, and a native backend's buffers are zeroed when
allocated, so they are resident from the start (on a tiny model with a long context they outweigh the KV cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from ggml_py.errors import ModelError
from ggml_py.models.hparams import HParams
from ggml_py.sysmem import available_memory, mib

__all__ = ["available_memory", "mask_count", "mib", "require_memory", "step_buffer_bytes"]

F32_BYTES = 4


def mask_count(hp: HParams) -> int:
    """The attention mask inputs of a step: the causal one when a layer attends globally, the windowed one when a
    layer slides."""
    swa = [hp.is_swa(i) for i in range(hp.n_layer)]
    return int(not all(swa)) + int(any(swa))


def step_buffer_bytes(hp: HParams, n_tokens: int, n_ctx: int, n_logits: int) -> int:
    """An estimate of the compute buffer of one prepared step over `n_tokens` tokens, attending to at most `n_ctx`
    cache rows, whose head computes `n_logits` rows: its attention masks exactly (n_tokens x n_ctx F32 each), plus
    per token the widest activations of a layer (the residual, its norm and either the FFN's gate, up and product or
    q, k, v and the attention output), plus the logits (within ~10% of the allocator's plan on SmolLM2)."""
    attn = hp.n_head * hp.head_dim + hp.n_head_kv * (hp.head_dim + hp.head_dim_v) + hp.n_head * hp.head_dim_v
    width = 2 * hp.n_embd + max(3 * hp.n_ff, attn)
    return F32_BYTES * (n_tokens * n_ctx * mask_count(hp) + n_tokens * width + n_logits * hp.n_vocab)


def require_memory(parts: Sequence[tuple[str, int]], hint: str, limit: int | None = None) -> None:
    """Raise ModelError, naming every part and its size, if the parts together exceed the available memory (or
    `limit` bytes, a budget given by the user, when that is less)."""
    avail = available_memory()
    what = "available memory"
    if limit is not None and (avail is None or limit < avail):
        avail, what = limit, "memory limit"
    need = sum(n for _, n in parts)
    if avail is not None and need > avail:
        detail = ", ".join(f"{what}: {mib(n)}" for what, n in parts if n)
        raise ModelError(f"the model needs {mib(need)} ({detail}), more than the {mib(avail)} of {what}; {hint}")
