"""ggml_py: a pluggable-backend tensor runtime. Build a graph once, prepare it once, execute it every step.

    import ggml_py as gp
    x = gp.input((4, 8), name="x")
    w = gp.weight(np.ones((16, 8), np.float32), name="w")
    y = gp.ops.silu(gp.ops.mul_mat(w, x))
    plan = gp.prepare(y, backends=["simd", "numpy"])
    plan.set_input("x", data); plan.compute(); out = plan.get_output(y)
"""

from __future__ import annotations

from ggml_py.errors import BackendError, GgmlPyError, GGUFError, ModelError, PlanError, ShapeError
from ggml_py.ir import dtypes, ops
from ggml_py.ir.dtypes import (
    BF16,
    F16,
    F32,
    I32,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    DType,
)
from ggml_py.ir.graph import Graph
from ggml_py.ir.symbolic import sym
from ggml_py.ir.tensor import Tensor, input, state, weight
from ggml_py.runtime.plan import Plan, prepare
from ggml_py.runtime.registry import get_backend, registry

__version__ = "0.1.0"

__all__ = [
    "BF16", "F16", "F32", "I32", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
    "Q6_K", "Q8_0", "DType",
    "BackendError", "GGUFError", "GgmlPyError", "ModelError", "PlanError", "ShapeError",
    "Graph", "Plan", "Tensor", "dtypes", "generate_batch", "get_backend", "get_include", "input", "load_model", "ops",
    "prepare",
    "registry", "state", "sym", "weight",
]


def get_include() -> str:
    """The folder holding ggml_py/backend_abi.h, the C ABI a native backend plugin builds against."""
    from ggml_py.runtime.native import get_include as _get_include

    return _get_include()


def load_model(path: str | None = None, **kwargs: object) -> object:
    """Load a GGUF language model; see ggml_py.models.load_model."""
    from ggml_py.models import load_model as _load

    return _load(path, **kwargs)  # type: ignore[arg-type]


def generate_batch(model: object, prompts: object, max_tokens: int = 128, **kwargs: object) -> list[object]:
    """Generate for many prompts at once on one prepared plan; see ggml_py.serving.generate_batch."""
    from ggml_py.serving import generate_batch as _generate_batch

    return _generate_batch(model, prompts, max_tokens, **kwargs)  # type: ignore[arg-type]
