"""The chat-template sandbox: a model file's Jinja chat template rendered with bounded time, steps and sizes.

A security boundary: the template comes from the model file, so it is untrusted code. jinja2's SandboxedEnvironment
stops attribute escapes; the bounds here stop everything else a template could ask for (huge strings, endless loops,
huge integers). See docs/tokenizer.md.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ggml_py.errors import TemplateError


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError as JinjaTemplateError

    raise JinjaTemplateError(message)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


# Limits of one chat template render. jinja2's sandbox stops attribute escapes but bounds nothing else (only range()
# at 100,000 items), so a template from a model file could ask for `'x' * 10**10`. These bounds are far above what a
# real chat template needs (a few kB of output, a loop over the messages) and far below what hurts.
TEMPLATE_MAX_CHARS = 8 * 2**20  # any string or list the template builds, and the whole output
TEMPLATE_MAX_STEPS = 1_000_000  # loop iterations plus calls (functions, macros, methods, filters)
TEMPLATE_MAX_SECONDS = 5.0
_MAX_INT_BITS = 1 << 16  # integers a template computes with ** or * (10**10**10 would take forever)


class _Budget:
    """What one render may still spend; checked at every loop iteration, call and filter."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS

    def tick(self) -> None:
        self.steps += 1
        if self.steps > TEMPLATE_MAX_STEPS:
            raise _LimitError(f"more than {TEMPLATE_MAX_STEPS} loop iterations and calls")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise _LimitError(f"rendering took longer than {TEMPLATE_MAX_SECONDS:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("ggml_py_template_budget", default=None)


class _LimitError(Exception):
    """A template exceeded a render limit."""


def _tick() -> None:
    b = _BUDGET.get()
    if b is not None:  # None: jinja folding constants at compile time (bounded by the same size checks)
        b.tick()


def _check_size(v: Any) -> Any:
    if isinstance(v, str | list | tuple | bytes) and len(v) > TEMPLATE_MAX_CHARS:
        raise _LimitError(f"a value of {len(v)} items exceeds the limit of {TEMPLATE_MAX_CHARS}")
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > _MAX_INT_BITS:
        raise _LimitError(f"an integer of {v.bit_length()} bits exceeds the limit of {_MAX_INT_BITS}")
    return v


def _check_int_args(args: Sequence[Any], kwargs: Mapping[str, Any], what: str) -> None:
    """Widths and counts passed to string methods and filters (center, ljust, zfill, indent, ...)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_CHARS:
            raise _LimitError(f"{what}: argument {a} exceeds the limit of {TEMPLATE_MAX_CHARS}")


def _binop_size(op: str, a: Any, b: Any) -> None:
    """Refuse, before computing it, a result of `a op b` beyond the limits."""
    seq = str | list | tuple | bytes
    if op == "*":
        if isinstance(a, int) and isinstance(b, seq):
            a, b = b, a
        if isinstance(a, seq) and isinstance(b, int):
            if len(a) * max(b, 0) > TEMPLATE_MAX_CHARS:
                raise _LimitError(f"{type(a).__name__} of {len(a)} times {b} exceeds the limit of "
                                  f"{TEMPLATE_MAX_CHARS}")
        elif isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
            raise _LimitError(f"an integer product beyond {_MAX_INT_BITS} bits")
    elif op == "**" and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0:
        if b * a.bit_length() > _MAX_INT_BITS:
            raise _LimitError(f"{a} ** {b} exceeds the limit of {_MAX_INT_BITS} bits")
    elif op == "+" and isinstance(a, seq) and isinstance(b, seq) and len(a) + len(b) > TEMPLATE_MAX_CHARS:
        raise _LimitError(f"a concatenation of {len(a) + len(b)} items exceeds the limit of {TEMPLATE_MAX_CHARS}")


def _bounded_iter(it: Any) -> Iterator[Any]:
    """Every `{% for %}` iterates through this (see _BoundedEnv._parse): one budget step per item."""
    from jinja2 import Undefined

    if isinstance(it, Undefined):
        return iter(())  # a for over an undefined name renders nothing, as plain jinja does
    return _bounded_gen(it)


def _bounded_gen(it: Any) -> Iterator[Any]:
    for x in it:
        _tick()
        yield x


def _bounded_concat(*parts: Any) -> str:
    """The `~` operator (jinja would join without looking at sizes)."""
    _tick()
    total = 0
    out = []
    for p in parts:
        s = p if isinstance(p, str) else str(p)
        total += len(s)
        if total > TEMPLATE_MAX_CHARS:
            raise _LimitError(f"a ~ concatenation exceeds the limit of {TEMPLATE_MAX_CHARS} characters")
        out.append(s)
    return "".join(out)


def _bounded_range(*args: int) -> range:
    r = range(*args)
    if len(r) > TEMPLATE_MAX_STEPS:
        raise _LimitError(f"range of {len(r)} items exceeds the limit of {TEMPLATE_MAX_STEPS}")
    return r


# A width or precision of 8+ digits in a format string ('%0999999999d', '{:>99999999}'): 10M+ characters.
_HUGE_WIDTH = re.compile(r"\d{8,}")
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_WIDTH_FILTERS = frozenset({"center", "indent", "wordwrap", "slice", "batch"})  # an int argument sizes the result


def _check_format(fmt: Any, what: str) -> None:
    if isinstance(fmt, str) and _HUGE_WIDTH.search(fmt):
        raise _LimitError(f"{what}: a width in the format string exceeds the limit of {TEMPLATE_MAX_CHARS}")


def _check_join(sep: Any, items: Any, what: str) -> None:
    if isinstance(sep, str) and hasattr(items, "__len__") and len(sep) * len(items) > TEMPLATE_MAX_CHARS:
        raise _LimitError(f"{what}: joining {len(items)} items with a separator of {len(sep)} characters exceeds "
                          f"the limit of {TEMPLATE_MAX_CHARS}")


def _check_replace(s: Any, old: Any, new: Any, what: str) -> None:
    """'s'|replace('', s) squares the length."""
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = len(s) + 1 if not old else s.count(old)
        if len(s) + n * (len(new) - len(old)) > TEMPLATE_MAX_CHARS:
            raise _LimitError(f"{what}: the result would exceed the limit of {TEMPLATE_MAX_CHARS}")


def _check_method(obj: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Before a method of a str/list runs: the ones whose result size an argument decides."""
    name = getattr(obj, "__name__", "")
    target = obj.__self__
    what = f"{name}()"
    if name in _WIDTH_METHODS:
        _check_int_args(args, kwargs, what)
    elif name == "join" and args:
        _check_join(target, args[0], what)
    elif name == "replace" and len(args) >= 2:
        _check_replace(target, args[0], args[1], what)
    elif name in ("format", "format_map"):
        _check_format(target, what)


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # the filtered value comes after the context/environment jinja passes to marked filters
    skip = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tick()
        what = f"filter {name!r}"
        value, rest = (args[skip - 1] if len(args) >= skip else None), args[skip:]
        if name in _WIDTH_FILTERS:
            _check_int_args(rest, kwargs, what)
        if name == "format":
            _check_format(value, what)
        elif name == "join":
            _check_join(rest[0] if rest else kwargs.get("d", ""), value, what)
        elif name == "replace" and len(rest) >= 2:
            _check_replace(value, rest[0], rest[1], what)
        return _check_size(fn(*args, **kwargs))

    return wrapper


_JINJA_ENV: Any = None


def _jinja_env() -> Any:
    global _JINJA_ENV
    if _JINJA_ENV is None:
        _JINJA_ENV = _make_env()
    return _JINJA_ENV


def _make_env() -> Any:
    import json

    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _BoundedEnv(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox, with every loop, call, filter, `*`, `**`, `+` and `~` counted and bounded."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _binop_size(operator, left, right)
            if operator == "%":
                _check_format(left, "the % operator")
            return _check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _tick()
            if isinstance(getattr(__obj, "__self__", None), str | list | tuple | bytes):
                _check_method(__obj, args, kwargs)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for node in tree.find_all(nodes.For):
                node.iter = nodes.Call(nodes.Name("_ggml_py_iter", "load"), [node.iter], [], None, None)
            for node in list(tree.find_all(nodes.Concat)):
                node.__class__ = nodes.Call  # in place: the parent keeps its reference
                parts = node.nodes  # type: ignore[attr-defined]
                del node.nodes  # type: ignore[attr-defined]
                node.node, node.args, node.kwargs = nodes.Name("_ggml_py_concat", "load"), parts, []
                node.dyn_args = node.dyn_kwargs = None
            return tree

    env = _BoundedEnv(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    env.globals["_ggml_py_iter"] = _bounded_iter
    env.globals["_ggml_py_concat"] = _bounded_concat
    return env


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    source: str = "the chat template",
    **extra: Any,
) -> str:
    """Render a Jinja chat template (sandboxed; ``raise_exception``, ``strftime_now``, ``tojson`` available).

    The render is bounded: every string or list it builds and its output at `TEMPLATE_MAX_CHARS`, loop iterations
    plus calls at `TEMPLATE_MAX_STEPS`, time at `TEMPLATE_MAX_SECONDS`. Any failure (a syntax error,
    ``raise_exception``, a limit, ``1 // 0``, ...) raises :class:`ggml_py.errors.TemplateError` naming `source`.
    """
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        compiled = _jinja_env().from_string(template)
        out: list[str] = []
        size = 0
        for chunk in compiled.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        ):
            size += len(chunk)
            if size > TEMPLATE_MAX_CHARS:
                raise _LimitError(f"output exceeds the limit of {TEMPLATE_MAX_CHARS} characters")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    except _LimitError as e:
        raise TemplateError(f"{source}: render limit: {e}") from None
    except (Exception, RecursionError, MemoryError) as e:  # anything the template's code can raise
        raise TemplateError(f"{source}: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)
