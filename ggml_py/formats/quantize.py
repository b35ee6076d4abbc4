"""Quantize a GGUF model to another weight type: llama-quantize's job, done with ggml_py's own quantizers.

Two parts. `quantize_policy.choose_types` decides the type of every tensor for a *file type* such as Q4_K_M
(llama.cpp's per-tensor rules). `quantize_file` here streams the model, one tensor at a time, into a new GGUF written
with `gguf.GGUFWriter`: every metadata key copied, `general.file_type` and `general.quantization_version` set,
tensor order and data alignment kept, the file written under a temporary name and renamed at the end. `write_gguf`,
the writing half, takes the tensors' bytes from a callback: `ggml-py bench write-model` streams random weights
through it.

The bytes come from `ggml_py.formats.quants` (bit-identical with `gguf.quants` and with ggml's reference quantizers, see
there); for the types a backend's CPY can write (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) the preferred backend's
conversion is used (simd's C code by default), which tests/test_quantize_cmd.py checks gives the same bytes.
See docs/quantize.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_py.errors import GgmlPyError
from ggml_py.formats import quants
from ggml_py.formats.quantize_policy import (
    GGML_QUANT_VERSION,
    FileType,
    ModelFacts,
    QuantizeError,
    TensorPlan,
    choose_types,
    file_type,
    tensor_type,
)
from ggml_py.ir.dtypes import (
    F32,
    DType,
)

__all__ = ["MetadataEntry", "Result", "TensorData", "check_output_path", "convert_tensor", "quantize_file",
           "write_gguf"]


# ------------------------------------------------------------------------------------------------- conversion

_ROWS_PER_CHUNK_ELEMS = 1 << 22  # elements converted at a time: bounds the float32 temporaries (16 MiB)


class _Converter:
    """float32 rows -> raw rows of a type. Types a backend's CPY writes go through the preferred backend (the first
    of the default order: GGML_PY_BACKENDS, else by score), one prepared plan per row length and type with the
    number of rows symbolic; all others through ggml_py.formats.quants. Both give the same bytes
    (tests/test_quantize_cmd.py checks it)."""

    def __init__(self, use_backend: bool = True) -> None:
        from ggml_py.runtime.registry import resolve_backends

        self._plans: dict[tuple[int, DType], tuple[Any, Any]] = {}
        self._backend: Any = None
        if use_backend:
            try:
                self._backend = resolve_backends(None)[0]
            except GgmlPyError:  # no usable backend here: quants.py does everything
                self._backend = None
        self.used: dict[str, str] = {}  # type name -> what converted to it (a backend's name, or "quants")

    def __call__(self, x: np.ndarray, t: DType) -> np.ndarray:
        from ggml_py.ir import ops

        rows, n = x.shape
        if self._backend is None or t is F32 or t not in ops.CPY_DST_TYPES:
            self.used.setdefault(t.name, "quants")
            return quants.quantize_rows(x, t)
        self.used.setdefault(t.name, self._backend.name)
        max_rows = max(1, _ROWS_PER_CHUNK_ELEMS // n)
        entry = self._plans.get((n, t))
        if entry is None:
            from ggml_py.ir.symbolic import sym
            from ggml_py.ir.tensor import input as graph_input
            from ggml_py.runtime.plan import prepare

            y = ops.cast(graph_input((sym("rows", max_rows), n), name="x"), t)
            entry = self._plans[(n, t)] = (prepare(y, backends=[self._backend]), y)
        plan, y = entry
        out = np.empty((rows, t.row_size(n)), dtype=np.uint8)
        for r in range(0, rows, max_rows):
            plan.set_input("x", x[r : r + max_rows])
            plan.compute()
            out[r : r + max_rows] = plan.get_output(y).view(np.uint8).reshape(-1, out.shape[1])
        return out

    def close(self) -> None:
        for plan, _ in self._plans.values():
            plan.close()
        self._plans.clear()


def _to_f32(raw: np.ndarray, src: DType, n: int) -> np.ndarray:
    """Raw rows (rows, row bytes) of `src` -> float32 (rows, n)."""
    return quants.dequantize_rows(raw, src, n).astype(np.float32, copy=False)


def convert_tensor(raw: np.ndarray, plan: TensorPlan, convert: Callable[[np.ndarray, DType], np.ndarray]
                   ) -> np.ndarray:
    """A tensor's raw bytes (any shape, read as uint8) in its input type -> raw rows (rows, row bytes) of plan.dst,
    converted by chunks of rows so that no more than a chunk is float32 at a time."""
    n = plan.shape[-1]
    rows = plan.n_elements // n if n else 0
    src_rows = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, plan.src.row_size(n))
    if plan.dst is plan.src:
        return src_rows
    out = np.empty((rows, plan.dst.row_size(n)), dtype=np.uint8)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(n, 1))
    for r in range(0, rows, step):
        x = _to_f32(src_rows[r : r + step], plan.src, n)
        out[r : r + step] = convert(x, plan.dst)
    return out


# ------------------------------------------------------------------------------------------------- the file


# One metadata entry of a GGUF to write: key, value, GGUF value type, array element type (None for scalars).
MetadataEntry = tuple[str, Any, int, int | None]
# What write_gguf writes for a tensor, given its plan and the converter (float32 rows, type -> raw rows): an array of
# its raw bytes (p.nbytes() of them), or any object with `nbytes` and `tofile(file)` that writes them (to stream a
# tensor in pieces: gguf.GGUFWriter.write_tensor_data needs no more of it).
TensorData = Callable[[TensorPlan, Callable[[np.ndarray, DType], np.ndarray]], Any]


@dataclass
class Result:
    """What quantize_file did (also the --json output of `ggml-py quantize`)."""

    input: str
    output: str
    type: str
    file_type: int
    input_bytes: int
    output_bytes: int
    n_tensors: int
    tensor_types: dict[str, int]
    n_requantized: int
    fallbacks: list[str]
    dropped_keys: list[str]
    converters: dict[str, str]
    seconds: float
    tensors: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def _metadata_entries(gf: Any, ft: FileType) -> tuple[list[MetadataEntry], list[str]]:
    """The input's metadata as (key, value, GGUF value type, array element type) in file order, with
    general.file_type and general.quantization_version set as llama.cpp sets them; and the keys dropped (empty
    arrays, which gguf.GGUFWriter cannot write)."""
    from ggml_py.formats.gguf import T_ARRAY, T_STRING, T_UINT32, array_element_type
    out: list[MetadataEntry] = []
    dropped: list[str] = []
    for key, value in gf.metadata.items():
        vtype = gf.metadata_types[key]
        if key == "general.architecture" or key in _SPLIT_KEYS:
            continue  # the writer puts the architecture first; a whole model is written, not a shard
        if vtype != T_ARRAY:
            out.append((key, value, vtype, None))
            continue
        if len(value) == 0:
            dropped.append(key)
            continue
        if isinstance(value, np.ndarray):
            out.append((key, value.tolist(), vtype, array_element_type(value.dtype)))
        elif all(isinstance(v, str) for v in value):
            out.append((key, value, vtype, T_STRING))
        else:
            raise QuantizeError(f"metadata key {key!r} holds arrays of arrays, which llama.cpp cannot read and "
                                "ggml-py quantize does not copy")
    for key, value in (("general.quantization_version", GGML_QUANT_VERSION), ("general.file_type", ft.ftype)):
        entry = (key, value, T_UINT32, None)
        at = next((i for i, e in enumerate(out) if e[0] == key), None)
        if at is None:
            out.append(entry)
        else:
            out[at] = entry
    return out, dropped


def check_output_path(out: str, force: bool, inp: str | None = None) -> None:
    """Refuse to write `out` where it would replace the input `inp`, a folder, or (without `force`) any file, or
    where its folder does not exist."""
    if os.path.exists(out):
        if inp is not None and os.path.exists(inp) and os.path.samefile(inp, out):
            raise QuantizeError(f"{out}: the output is the input file; write to another path")
        if os.path.isdir(out):
            raise QuantizeError(f"{out}: is a directory")
        if not force:
            raise QuantizeError(f"{out} exists (use --force to replace it)")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise QuantizeError(f"{out}: folder {folder} does not exist")


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a temporary file existed (a BaseException, like KeyboardInterrupt: no
    `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# signals whose default action ends the process without unwinding the stack: a temporary file would stay behind
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _die_after_cleanup() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP raise `_Terminated` (so the block's cleanup runs) where they would have
    killed the process outright; leaving the block by it, the process then dies of that same signal, as it would
    have without us. Only signals left at their default action, and only on the main thread (where Python runs
    signal handlers); a program's own handler is left alone."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def raise_terminated(signum: int, frame: object) -> None:
            for sig in previous:  # once: a second signal must not interrupt the cleanup the first one started
                signal.signal(sig, signal.SIG_IGN)
            raise _Terminated(signum)

        for sig in _CLEANUP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                previous[sig] = signal.signal(sig, raise_terminated)
    try:
        yield
    except _Terminated as e:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()
        os.kill(os.getpid(), e.signum)  # the default action now: the process ends here
        raise  # not reached unless the signal is blocked
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write(tmp: str, out: str, arch: str, alignment: int | None, entries: list[MetadataEntry],
           plans: list[TensorPlan], tensor_data: TensorData, use_backend: bool,
           progress: Callable[[int, int, TensorPlan], None] | None) -> dict[str, str]:
    """Write the file as `tmp` (created here), then rename it to `out`; on any error or interrupt `tmp` is removed.
    Returns the converter of each type written (type name -> a backend's name or "quants")."""
    import gguf

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
    os.close(fd)
    convert = _Converter(use_backend)
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        if alignment is not None:
            writer.data_alignment = alignment
        for key, value, vtype, sub in entries:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                 gguf.GGUFValueType(sub) if sub is not None else None)
        for p in plans:
            byte_shape = (*p.shape[:-1], p.dst.row_size(p.shape[-1]))
            writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes(),
                                   raw_dtype=gguf.GGMLQuantizationType(p.dst.ggml_id))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, p in enumerate(plans):
            if progress is not None:
                progress(i, len(plans), p)
            writer.write_tensor_data(tensor_data(p, convert))
        writer.close()
        writer = None
        os.replace(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        convert.close()
    return convert.used


def write_gguf(out: str, arch: str, entries: list[MetadataEntry], plans: list[TensorPlan], tensor_data: TensorData,
               *, alignment: int | None = None, use_backend: bool = True,
               progress: Callable[[int, int, TensorPlan], None] | None = None) -> dict[str, str]:
    """Write a GGUF at `out`: architecture `arch`, the metadata `entries` in order, then the tensors of `plans` (in
    their types `dst`) in order, each one's bytes from `tensor_data(plan, convert)`; `alignment` None keeps the
    writer's default (32). The file appears only when complete (a hidden temporary file in its folder, renamed at
    the end); on any error or interrupt nothing is left behind (see quantize_file). Returns the converter used for
    each type (type name -> a backend's name, or "quants")."""
    folder, base = os.path.split(os.path.abspath(out))
    tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex[:12]}.part")
    with _die_after_cleanup():
        return _write(tmp, out, arch, alignment, entries, plans, tensor_data, use_backend, progress)


def quantize_file(inp: str, out: str, type_name: str, *, allow_requantize: bool = False,
                  output_type: str | None = None, token_embedding_type: str | None = None, pure: bool = False,
                  force: bool = False, use_backend: bool = True,
                  progress: Callable[[int, int, TensorPlan], None] | None = None) -> Result:
    """Write `out`: the model `inp` with its weights in file type `type_name` (see docs/quantize.md).

    The output appears only when complete (written as a hidden temporary file in its folder, then renamed); on any
    error or interrupt nothing is left behind: Ctrl-C raises KeyboardInterrupt after removing it, SIGTERM and SIGHUP
    (when at their default action, called on the main thread) remove it and then end the process as they would
    have. `progress(i, n, plan)` is called before each tensor."""
    from ggml_py.formats.gguf import open_gguf

    t0 = time.perf_counter()
    ft = file_type(type_name)
    out_t = tensor_type(output_type) if output_type else None
    embd_t = tensor_type(token_embedding_type) if token_embedding_type else None
    check_output_path(out, force, inp)
    with open_gguf(inp) as gf:
        meta = gf.metadata
        if int(meta.get("split.count", 1) or 1) > 1:
            raise QuantizeError(f"{inp} is one shard of a split model ({meta['split.count']} files); merge it first")
        facts = ModelFacts.from_metadata(meta)
        plans = choose_types([(t.name, t.shape, t.dtype) for t in gf.tensors.values()], ft, facts, pure=pure,
                             output_type=out_t, token_embedding_type=embd_t)
        for p in plans:
            if p.dst is p.src:
                continue
            if p.src.is_quantized and not allow_requantize:
                raise QuantizeError(f"{p.name} is {p.src.name} already: converting quantized tensors is disabled "
                                    "(use --allow-requantize; requantizing loses more than quantizing from F32/F16)")
            if p.src not in quants.DEQUANTIZABLE:
                raise QuantizeError(f"{p.name} is {p.src.name}, which ggml_py cannot convert to {p.dst.name}")
        entries, dropped = _metadata_entries(gf, ft)

        used = write_gguf(out, facts.arch, entries, plans,
                          lambda p, convert: convert_tensor(gf.data(p.name), p, convert),
                          alignment=gf.alignment, use_backend=use_backend, progress=progress)
        counts: dict[str, int] = {}
        for p in plans:
            counts[p.dst.name] = counts.get(p.dst.name, 0) + 1
        return Result(
            input=inp, output=out, type=ft.name, file_type=ft.ftype, input_bytes=gf.file_size,
            output_bytes=os.path.getsize(out), n_tensors=len(plans), tensor_types=dict(sorted(counts.items())),
            n_requantized=sum(1 for p in plans if p.dst is not p.src and p.src.is_quantized),
            fallbacks=[f"{p.name}: {p.fallback}" for p in plans if p.fallback], dropped_keys=dropped,
            converters=dict(sorted(used.items())), seconds=round(time.perf_counter() - t0, 3),
            tensors=[{"name": p.name, "shape": list(p.shape), "from": p.src.name, "to": p.dst.name} for p in plans],
        )
