"""Offline batched generation: many prompts through the request engine on the caller's thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ggml_py.errors import ModelError
from ggml_py.models.batch import DEFAULT_N_BATCH, StageLike
from ggml_py.models.model import Model
from ggml_py.serving.engine import Completion, Engine, GenParams


def generate_batch(model: Model, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128, *,
                   n_parallel: int | None = None, n_ctx: int | None = None, add_special: bool = True,
                   stages: Sequence[StageLike] | None = None, **sampling: Any) -> list[Completion]:
    """Generate for many prompts at once (continuous batching on one prepared plan): a `Completion` (.text, .tokens,
    .finish_reason) per prompt, in prompt order.

    `sampling` takes generate()'s parameters (temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
    stop_at_eos) plus frequency_penalty, presence_penalty and stop (strings); a seed is per prompt (prompt i uses
    seed + i). At most `n_parallel` sequences (default min(len(prompts), 16)) run at once in a cache of `n_ctx` cells
    (default n_parallel x (the longest prompt + max_tokens), at least one position past the prompt: max_tokens 0 gives
    empty completions, finish_reason "length"). `stages`: the model's blocks elsewhere, e.g. a pipeline on a Ray cluster
    (ggml_py/cluster/); n_parallel and n_ctx then default to the pipeline's (its n_seq_max and n_ctx)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ModelError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
    prompts = list(prompts)
    if not prompts:
        return []
    ids = [model.tokenize(p, add_special=add_special) if isinstance(p, str)
           else model.check_ids(p, check_ctx=False).tolist() for p in prompts]
    pipe = stages[0] if stages is not None and len(stages) == 1 else None
    par = n_parallel or getattr(pipe, "n_seq_max", None) or min(len(ids), 16)
    if n_ctx is None:
        n_ctx = getattr(pipe, "n_ctx", None) or par * (max(len(i) for i in ids) + max(max_tokens, 1))
    seed = sampling.pop("seed", None)
    engine = Engine(model, n_parallel=par, n_ctx=n_ctx, max_queue=len(ids), stages=stages,
                    n_batch=getattr(pipe, "n_batch", None) or DEFAULT_N_BATCH)
    try:
        reqs = [engine.submit(i, GenParams(max_tokens=max_tokens, seed=None if seed is None else seed + k,
                                           **sampling)) for k, i in enumerate(ids)]
        engine.run_until_idle()
        return [r.result() for r in reqs]
    finally:
        engine.close()
