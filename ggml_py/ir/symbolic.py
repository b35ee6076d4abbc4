"""Symbolic dimensions: affine integer expressions bound at compute time.

A dimension such as the KV length is declared once with an upper bound (`sym("n_kv", 2048)`); shapes, strides and
offsets that depend on it are affine expressions `c0 + sum(c_i * sym_i)`. Memory is planned for the upper bounds and
the actual values are bound at `plan.compute(n_kv=...)`, so one prepared plan serves every value.
"""

from __future__ import annotations

from collections.abc import Mapping


class Sym:
    """A named symbolic dimension with an inclusive upper bound."""

    __slots__ = ("name", "max")

    def __init__(self, name: str, max: int) -> None:
        if not name.isidentifier():
            raise ValueError(f"symbol name {name!r} must be an identifier")
        if int(max) < 1:
            raise ValueError(f"symbol {name}: upper bound must be >= 1, got {max}")
        self.name = name
        self.max = int(max)

    def __repr__(self) -> str:
        return f"Sym({self.name}<={self.max})"


class Expr:
    """An affine expression over symbols: `const + sum(coef * sym)`. Immutable and hashable."""

    __slots__ = ("const", "terms", "_hash")

    def __init__(self, const: int = 0, terms: tuple[tuple[Sym, int], ...] = ()) -> None:
        self.const = int(const)
        self.terms = tuple(sorted(((s, c) for s, c in terms if c), key=lambda t: t[0].name))
        self._hash = hash((self.const, tuple((s.name, c) for s, c in self.terms)))

    # construction -------------------------------------------------------
    @staticmethod
    def of(x: Dim) -> Expr:
        if isinstance(x, Expr):
            return x
        if isinstance(x, Sym):
            return Expr(0, ((x, 1),))
        return Expr(int(x))

    @property
    def is_const(self) -> bool:
        return not self.terms

    @property
    def symbols(self) -> tuple[Sym, ...]:
        return tuple(s for s, _ in self.terms)

    # arithmetic -----------------------------------------------------------
    def __add__(self, other: Dim) -> Dim:
        o = Expr.of(other)
        terms: dict[Sym, int] = {}
        for s, c in self.terms + o.terms:
            terms[s] = terms.get(s, 0) + c
        return simplify(Expr(self.const + o.const, tuple(terms.items())))

    __radd__ = __add__

    def __neg__(self) -> Dim:
        return simplify(Expr(-self.const, tuple((s, -c) for s, c in self.terms)))

    def __sub__(self, other: Dim) -> Dim:
        return self + (-Expr.of(other))

    def __rsub__(self, other: Dim) -> Dim:
        return Expr.of(other) + (-self)

    def __mul__(self, other: Dim) -> Dim:
        o = Expr.of(other)
        if not o.is_const and not self.is_const:
            raise ValueError(f"product of two symbolic expressions ({self} * {o}) is not affine")
        k, e = (o.const, self) if o.is_const else (self.const, o)
        return simplify(Expr(e.const * k, tuple((s, c * k) for s, c in e.terms)))

    __rmul__ = __mul__

    def __floordiv__(self, k: int) -> Dim:
        if not isinstance(k, int) or any(c % k for _, c in self.terms) or self.const % k:
            raise ValueError(f"cannot divide symbolic expression {self} by {k} exactly")
        return simplify(Expr(self.const // k, tuple((s, c // k) for s, c in self.terms)))

    # evaluation -----------------------------------------------------------
    def eval(self, bindings: Mapping[str, int]) -> int:
        v = self.const
        for s, c in self.terms:
            try:
                v += c * bindings[s.name]
            except KeyError:
                raise KeyError(f"symbol {s.name!r} is not bound") from None
        return v

    def upper(self) -> int:
        """Value with every symbol at its bound (the largest value for non-negative coefficients)."""
        return self.const + sum(c * s.max for s, c in self.terms)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (int, Sym, Expr)):
            o = Expr.of(other)
            return self.const == o.const and [(s.name, c) for s, c in self.terms] == [
                (s.name, c) for s, c in o.terms
            ]
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        parts = [(f"{c}*" if c != 1 else "") + s.name for s, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return "+".join(parts)


Dim = int | Expr


def simplify(e: Expr) -> Dim:
    """Constant expressions become plain ints so ordinary shapes stay ordinary."""
    return e.const if e.is_const else e


def dim(x: int | Sym | Expr) -> Dim:
    """Normalise a user-given dimension."""
    if isinstance(x, Sym):
        return Expr.of(x)
    if isinstance(x, Expr):
        return simplify(x)
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"dimension must be an int or a symbol, got {x!r}")
    return int(x)


def upper(x: Dim) -> int:
    return x.upper() if isinstance(x, Expr) else x


def evaluate(x: Dim, bindings: Mapping[str, int]) -> int:
    return x.eval(bindings) if isinstance(x, Expr) else x


def is_symbolic(x: Dim) -> bool:
    return isinstance(x, Expr)


def sym(name: str, max: int) -> Expr:
    """Declare a symbolic dimension with an upper bound; use it in shapes."""
    return Expr.of(Sym(name, max))
