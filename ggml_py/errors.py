"""One exception family for everything ggml_py raises on purpose."""

from __future__ import annotations


class GgmlPyError(Exception):
    """Base class of every error ggml_py raises deliberately."""


class ShapeError(GgmlPyError, ValueError):
    """An op was given operands whose shapes or types do not fit."""


class GGUFError(GgmlPyError):
    """A GGUF file is missing, malformed or unsupported."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class BackendError(GgmlPyError):
    """A backend is unknown, failed to load, or cannot run what it was given."""


class PlanError(GgmlPyError):
    """A graph could not be prepared, or a prepared plan was used wrongly."""


class UnavailableError(GgmlPyError):
    """Something outside this process that a computation needs is gone or did not answer (a pipeline stage on
    another node): the request was not at fault, and trying again later may work (HTTP 503)."""


class ModelError(GgmlPyError):
    """A model cannot be built or run (architecture, context, tokens)."""


class TemplateError(ModelError):
    """A chat template failed to render: bad syntax, raise_exception, a render limit, an error in its code."""
