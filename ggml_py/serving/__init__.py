"""Requests over models: the continuous-batching engine, offline batched generation, the OpenAI-compatible HTTP
server (server.py, imported on demand: it needs the `server` extra)."""

from ggml_py.serving.batch import generate_batch
from ggml_py.serving.engine import Completion, Engine, GenParams

__all__ = ["Completion", "Engine", "GenParams", "generate_batch"]
