"""The process side of a stage: what runs inside its Ray actor, on the node that holds the model file.

`StageHost` is a plain class (Ray wraps it with `ray.remote` when a pipeline starts, so importing this module does
not import Ray): it maps the node's own copy of the GGUF file, checks it is the coordinator's (size and SHA-256),
loads the model there (weights are mapped, only the stage's blocks are ever read) and prepares the stage's plan on
the first step. Nothing but the spec crosses the network at start, and per step the meta and the hidden states.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np

from ggml_py.errors import ModelError
from ggml_py.models.stage import Stage, StepMeta
from ggml_py.sysmem import peak_rss_bytes, rss_bytes

ABI_STAGE = 3  # the version of what a stage host and a coordinator say to each other (bumped on any change)


@dataclass(frozen=True)
class StageSpec:
    """Everything a node needs to run one stage: a few hundred bytes, never weights or plans."""

    path: str  # the model file on that node
    size: int
    sha256: str
    layers: tuple[int, int]  # blocks [start, stop)
    n_ctx: int
    n_seq_max: int
    n_batch: int
    kv_type: str = "F16"
    backends: str | None = None  # as load_model takes them; None: the node's default order
    n_threads: int | None = None
    memory_limit: int | None = None  # bytes the stage may hold (weights, KV, compute buffer); None: what is free


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def frame(meta: np.ndarray, x: np.ndarray) -> bytes:
    """What a stage is sent: a packed StepMeta followed by the step's input, as one bytes object. Ray hands bytes
    over as they are where it pickles an array (an echo chain on loopback: 0.63 against 0.81 ms a hop)."""
    return meta.tobytes() + np.ascontiguousarray(x).tobytes()


def unframe(msg: bytes) -> tuple[np.ndarray, memoryview]:
    """The packed meta of a message and the bytes after it."""
    size = StepMeta.packed_size(np.frombuffer(msg, np.int32, StepMeta.N_COUNTS))
    return np.frombuffer(msg, np.int32, size), memoryview(msg)[4 * size:]


class StageFailure(Exception):
    """A stage's step raised: which stage, and what (it crosses back to the coordinator, which names the stage)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(index, message)
        self.index, self.message = index, message

    def __str__(self) -> str:
        return self.message


class StageHost:
    """One stage of a pipeline in its own process."""

    def __init__(self, spec: StageSpec, index: int) -> None:
        from ggml_py.models import load_model

        self.spec, self.index = spec, index
        self._busy_since = 0.0  # when the step in progress started (0: none is)
        where = f"stage {index} on {socket.gethostname()}"
        try:
            size = os.path.getsize(spec.path)
        except OSError as e:
            raise ModelError(f"{where}: the model file {spec.path} is not there: {e}") from None
        if size != spec.size or file_sha256(spec.path) != spec.sha256:
            raise ModelError(f"{where}: {spec.path} is not the coordinator's model file (size or SHA-256 differ)")
        # the model's own single-sequence cache is never used here: the stage has one of its own blocks only; what
        # the stage holds (its blocks' weights included) is checked by the Stage against the memory it may use
        self.model = load_model(spec.path, backends=spec.backends, n_threads=spec.n_threads, n_ctx=1,
                                kv_type=spec.kv_type, progress=False, check_memory=False)
        try:
            self.stage = Stage(self.model, range(*spec.layers), spec.n_ctx, spec.n_seq_max, spec.n_batch,
                               count_weights=True, memory_limit=spec.memory_limit)
        except BaseException:
            self.model.close()
            raise

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(),
                "ggml_py": metadata.version("ggml_py"), "stage_abi": ABI_STAGE,
                "layers": list(self.spec.layers), "backends": self.model.backend_names,
                "plans_prepared": self.stage.plans_prepared, "steps": self.stage.steps,
                "compute_s": self.stage.compute_s, "step_s": self.stage.step_s, "memory_parts": self.stage.memory_parts,
                "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                "busy_s": time.perf_counter() - self._busy_since if self._busy_since else 0.0}

    def step(self, msg: bytes) -> bytes:
        """One step: `msg` is a frame(packed StepMeta, input: token ids on the first stage, else the hidden states).
        Returns the logits' bytes (the last stage) or a frame(the same meta, this stage's hidden states)."""
        self._busy_since = time.perf_counter()
        try:
            packed, body = unframe(msg)
            first = self.stage.first
            x = np.frombuffer(body, np.int32 if first else np.float32)
            out = self.stage.step(StepMeta.unpack(packed), x if first else x.reshape(int(packed[0]), -1))
            return out.tobytes() if self.stage.last else frame(packed, out)
        except Exception as e:
            raise StageFailure(self.index, f"{type(e).__name__}: {e}") from None
        finally:
            self._busy_since = 0.0

    def reset(self) -> None:
        self.stage.reset()

    def close(self) -> None:
        self.stage.close()
        self.model.close()
