"""The algebra of one recurrence step: constants with identity, affine maps, atoms and polynomials.

* :class:`ConstRef` -- a constant (usually a weight) plus a hashable key saying where its values come from.
* :class:`Lin` -- an affine map of leaf rows: ``sum(src_k @ W_k) + sum(b_j)``; weights are exact slices
  (views) of the model's constants, never recomputed.
* atoms -- :class:`State` (a carried state h/c), :class:`Mask` (the 0/1 float of a step mask),
  :class:`StepInput` (the step input x; :class:`StepInputPart`, columns of it), :class:`LinAtom` (a Lin used elementwise) and :class:`Act` (an
  activation applied to a polynomial).
* :class:`Poly` -- a polynomial with scalar coefficients over atoms (a dict from sorted atom-key tuples).

Walks over a polynomial's atoms (substitution, the sources it reads) are :mod:`.poly_walks`.

Keys are tuples whose first element says what kind of leaf or atom they name (the tags below). The tags
are single letters because keys are sorted by their text: other letters would reorder terms, and with them
the text of decline reasons.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
import numpy as np

from ..errors import Decline

# what a key names (first element of a source key of a Lin term, or of an atom key)
STATE = "S"  # a carried state: ("S", symbol)
STEP_INPUT = "X"  # the step input: ("X", symbol)
STEP_INPUT_PART = "C"  # columns of the step input: ("C", symbol, start, stop, total)
GATED_ROW = "P"  # a product of a state and gates used as a matmul operand (GRU's r*h): ("P", monomial)
ZERO_ROW = "Z"  # a matmul operand known to be zero: ("Z",)
MASK = "M"  # the 0/1 float of a step mask: ("M", symbol)
# the step input scaled by the step mask, (a + b*m) * x, as a matmul operand (a cell that zeroes its input at
# padded steps): ("W", mask symbol, input symbol, a, b); it is the input itself where a + b*m = 1
MASKED_INPUT = "W"
AFFINE = "L"  # an affine map used elementwise: ("L", lin key)
ACTIVATION = "A"  # an activation of a polynomial: ("A", name, params, argument key)
CONTENT = "D"  # a constant named by its bytes: ("D", digest, shape, dtype)
INITIALIZER = "I"  # a constant named by its tensor name: ("I", name)


def content_digest(arr: np.ndarray) -> tuple:
    """The key arrays of equal bytes, shape and type share: ``(CONTENT, digest, shape, dtype)``."""
    a = np.ascontiguousarray(arr)
    return (CONTENT, hashlib.blake2b(a.tobytes(), digest_size=12).hexdigest(), a.shape, str(a.dtype))


class ConstRef:
    """A constant tensor (usually a weight) plus a hashable key describing where its values come from."""

    __slots__ = ("key", "arr")

    def __init__(self, key, arr: np.ndarray):
        self.key = key
        self.arr = arr

    @staticmethod
    def of(arr: np.ndarray, hint: str = "") -> "ConstRef":
        a = np.ascontiguousarray(arr)
        return ConstRef(content_digest(a), a)

    def T(self) -> "ConstRef":
        return ConstRef((self.key, "T"), self.arr.T)

    def cols(self, start: int, stop: int) -> "ConstRef":
        if start == 0 and stop == self.arr.shape[-1]:
            return self
        return ConstRef((self.key, "c", start, stop), self.arr[..., start:stop])

    def rows(self, start: int, stop: int) -> "ConstRef":
        if start == 0 and stop == self.arr.shape[0]:
            return self
        return ConstRef((self.key, "r", start, stop), self.arr[start:stop])

    def placed_rows(self, start: int, total: int) -> "ConstRef":
        """This [n, k] weight as rows ``start .. start + n`` of a [total, k] one whose other rows are zero."""
        if start == 0 and total == self.arr.shape[0]:
            return self
        arr = np.zeros((total,) + self.arr.shape[1:], self.arr.dtype)
        arr[start:start + self.arr.shape[0]] = self.arr
        return ConstRef((self.key, "at", start, total), arr)

    def scaled(self, c: float) -> "ConstRef":
        if c == 1.0:
            return self
        return ConstRef((self.key, "s", float(c)), (self.arr * np.asarray(c, dtype=self.arr.dtype)).astype(self.arr.dtype))

    def then(self, w: "ConstRef") -> "ConstRef":
        """``self @ w``: a weight (or a bias row) followed by another weight, rounded once."""
        arr = (self.arr.astype(np.float64) @ w.arr.astype(np.float64)).astype(w.arr.dtype)
        return ConstRef((self.key, "@", w.key), arr)

    @property
    def ncols(self) -> int:
        return int(self.arr.shape[-1])


# --------------------------------------------------------------------------------------------------------
# affine maps


@dataclass(frozen=True)
class Lin:
    """``sum(src @ W for src, W in terms) + sum(biases)``, shape [B, ncols]."""

    terms: tuple  # of (src_key, ConstRef[in, ncols])
    biases: tuple  # of ConstRef[ncols]
    ncols: int
    key: tuple = field(compare=False, default=())
    rows: dict = field(compare=False, default_factory=dict)  # src_key -> Poly of a gated row (r*h)

    @staticmethod
    def make(terms, biases, ncols, rows=None) -> "Lin":
        terms = tuple(sorted(terms, key=lambda t: repr((t[0], t[1].key))))
        biases = tuple(sorted(biases, key=lambda b: repr(b.key)))
        key = (tuple((s, w.key) for s, w in terms), tuple(b.key for b in biases))
        return Lin(terms, biases, ncols, key, dict(rows or {}))

    def cols(self, start: int, stop: int) -> "Lin":
        return Lin.make(
            [(s, w.cols(start, stop)) for s, w in self.terms], [b.cols(start, stop) for b in self.biases], stop - start,
            self.rows,
        )

    def plus(self, other: "Lin") -> "Lin":
        if self.ncols != other.ncols:
            raise Decline(f"adding affine maps of widths {self.ncols} and {other.ncols}")
        return Lin.make(self.terms + other.terms, self.biases + other.biases, self.ncols, {**self.rows, **other.rows})

    def scaled(self, c: float) -> "Lin":
        return Lin.make([(s, w.scaled(c)) for s, w in self.terms], [b.scaled(c) for b in self.biases], self.ncols, self.rows)

    def sources(self) -> set:
        return {s for s, _ in self.terms}

    def weight_for(self, src) -> ConstRef | None:
        """The weight ``src`` is multiplied by; two weights on one source (input feeding: ``cat(x, h) @ W``
        beside ``h @ R``) are one weight, their sum (``h@A + h@B = h@(A+B)``: exact algebra, rounded once)."""
        ws = [w for s, w in self.terms if s == src]
        if len(ws) > 1:
            if any(w.arr.shape != ws[0].arr.shape for w in ws):
                raise Decline("the same input is multiplied by weight matrices of different shapes in one gate")
            total = ws[0].arr.astype(np.float64)
            for w in ws[1:]:
                total = total + w.arr
            return ConstRef(("sum",) + tuple(w.key for w in ws), total.astype(ws[0].arr.dtype))
        return ws[0] if ws else None

    def bias_sum(self) -> np.ndarray | None:
        if not self.biases:
            return None
        out = self.biases[0].arr.astype(np.float64)
        for b in self.biases[1:]:
            out = out + b.arr
        return out


# --------------------------------------------------------------------------------------------------------
# atoms and polynomials


# how deep atoms may nest (an activation of a polynomial over activations ...): a cell nests a handful, a head
# inside a loop body a few dozen at most. Keys are nested tuples, sorted by their text and walked by recursive
# functions: a 10,000-op elementwise head in a Loop's body ran Python out of stack. Deeper maths is declined.
MAX_NESTING = 64


class Atom:
    __slots__ = ("key", "ncols")
    depth = 1  # atoms nested in this one, itself included (a leaf: 1)


class State(Atom):
    __slots__ = ("sym",)

    def __init__(self, sym: str, ncols: int | None):
        self.sym, self.ncols, self.key = sym, ncols, (STATE, sym)


class Mask(Atom):
    """1.0 where the step's mask is true, 0.0 where it is false; one value per batch row."""

    __slots__ = ("sym",)

    def __init__(self, sym: str):
        self.sym, self.ncols, self.key = sym, 1, (MASK, sym)


class StepInput(Atom):
    __slots__ = ("sym",)

    def __init__(self, sym: str, ncols: int | None):
        self.sym, self.ncols, self.key = sym, ncols, (STEP_INPUT, sym)


class StepInputPart(Atom):
    """Columns ``[start, stop)`` of the step input ``sym`` (``total`` wide): one of several sequences a step reads
    side by side, which the native op reads concatenated on features. Only a weight matmul reads it (as the
    whole input times the weight placed at its rows, zeros elsewhere); anywhere else it is an atom no cell
    knows, and the step is declined."""

    __slots__ = ("sym", "start", "stop", "total")

    def __init__(self, sym: str, start: int, stop: int, total: int):
        self.sym, self.start, self.stop, self.total = sym, start, stop, total
        self.ncols, self.key = stop - start, (STEP_INPUT_PART, sym, start, stop, total)


class LinAtom(Atom):
    __slots__ = ("lin", "depth")

    def __init__(self, lin: Lin):
        self.depth = _nested(1 + max((p.depth for p in lin.rows.values()), default=0))  # (gated rows: r*h)
        self.lin, self.ncols, self.key = lin, lin.ncols, (AFFINE, lin.key)


class Act(Atom):
    """An elementwise activation ``kind(params)`` applied to polynomial ``arg``."""

    __slots__ = ("kind", "params", "arg", "depth")

    def __init__(self, kind: str, params: tuple, arg: "Poly"):
        self.depth = _nested(1 + arg.depth)
        self.kind, self.params, self.arg = kind, tuple(float(p) for p in params), arg
        self.ncols = arg.ncols
        self.key = (ACTIVATION, kind, self.params, arg.key)


def _nested(depth: int) -> int:
    if depth > MAX_NESTING:
        raise Decline(f"the maths nest more than {MAX_NESTING} atoms deep (activations of activations ...)")
    return depth


class Poly:
    """Polynomial over atoms with float coefficients: ``{(atom_key, ...): coeff}`` plus an atom table."""

    __slots__ = ("terms", "atoms", "_key")

    def __init__(self, terms: dict, atoms: dict):
        self.terms = {m: c for m, c in terms.items() if c != 0.0}
        self.atoms = {k: atoms[k] for m in self.terms for k in m}
        self._key = None

    # construction
    @staticmethod
    def const(c: float) -> "Poly":
        return Poly({(): float(c)}, {})

    @staticmethod
    def atom(a: Atom) -> "Poly":
        return Poly({(a.key,): 1.0}, {a.key: a})

    @property
    def key(self):
        if self._key is None:
            self._key = tuple(sorted(((m, c) for m, c in self.terms.items()), key=repr))
        return self._key

    @property
    def depth(self) -> int:
        return max((a.depth for a in self.atoms.values()), default=0)

    @property
    def ncols(self) -> int | None:
        n = None
        for a in self.atoms.values():
            if a.ncols is not None and a.ncols != 1:
                n = a.ncols if n is None else max(n, a.ncols)
        if n is None and any(a.ncols == 1 for a in self.atoms.values()):
            return 1
        return n

    def is_const(self) -> bool:
        return all(m == () for m in self.terms)

    def const_value(self) -> float:
        return self.terms.get((), 0.0)

    # algebra
    def add(self, other: "Poly") -> "Poly":
        t = dict(self.terms)
        for m, c in other.terms.items():
            t[m] = t.get(m, 0.0) + c
        return Poly(t, {**self.atoms, **other.atoms}).canon()

    def scale(self, c: float) -> "Poly":
        return Poly({m: v * c for m, v in self.terms.items()}, self.atoms)

    def sub(self, other: "Poly") -> "Poly":
        return self.add(other.scale(-1.0))

    def mul(self, other: "Poly") -> "Poly":
        t: dict = {}
        for m1, c1 in self.terms.items():
            for m2, c2 in other.terms.items():
                m = tuple(sorted(m1 + m2, key=repr))
                t[m] = t.get(m, 0.0) + c1 * c2
        return Poly(t, {**self.atoms, **other.atoms}).canon()

    def canon(self) -> "Poly":
        """Merge affine terms with equal coefficients into one Lin (x·W + h·R + b is one gate input); terms of
        opposite coefficients merge too, the negative ones' weights negated (exact): ``x·W - h·U`` is
        ``x·W + h·(-U)``."""
        lins = [(m, c) for m, c in self.terms.items() if len(m) == 1 and m[0][0] == AFFINE]
        if len(lins) < 2:
            return self
        by_size: dict[float, list] = {}
        for m, c in lins:
            by_size.setdefault(abs(c), []).append((m, c))
        if all(len(v) == 1 for v in by_size.values()):
            return self
        t = dict(self.terms)
        atoms = dict(self.atoms)
        for size, mcs in by_size.items():
            if len(mcs) < 2:
                continue
            c = size if any(c > 0 for _, c in mcs) else -size  # (all negative: kept as a negative coefficient)
            lin = None
            for m, ci in mcs:
                part = atoms[m[0]].lin if ci == c else atoms[m[0]].lin.scaled(-1.0)
                lin = part if lin is None else lin.plus(part)
                t.pop(m)
            a = LinAtom(lin)
            atoms[a.key] = a
            t[(a.key,)] = t.get((a.key,), 0.0) + c
        return Poly(t, atoms)

    # views
    def single_atom(self) -> tuple[Atom, float] | None:
        """``(atom, coeff)`` if the polynomial is ``coeff * atom``."""
        if len(self.terms) == 1:
            (m, c), = self.terms.items()
            if len(m) == 1:
                return self.atoms[m[0]], c
        return None

    def as_lin_offset(self) -> tuple[Lin, float, float] | None:
        """``(lin, a, b)`` if the polynomial is ``a * lin + b``."""
        lin, a, b = None, None, 0.0
        for m, c in self.terms.items():
            if m == ():
                b = c
            elif len(m) == 1 and m[0][0] == AFFINE and lin is None:
                lin, a = self.atoms[m[0]].lin, c
            else:
                return None
        return (lin, a, b) if lin is not None else None

    def cols(self, start: int, stop: int) -> "Poly":
        """Columns [start, stop) of every atom (masks broadcast and are unchanged)."""
        mapping = {}
        atoms = {}
        for k, a in self.atoms.items():
            na = _atom_cols(a, start, stop)
            mapping[k] = na.key
            atoms[na.key] = na
        t = {}
        for m, c in self.terms.items():
            nm = tuple(sorted((mapping[k] for k in m), key=repr))
            t[nm] = t.get(nm, 0.0) + c
        return Poly(t, atoms).canon()

    def __repr__(self) -> str:
        return " + ".join(f"{c:g}*" + "*".join(describe(self.atoms[k]) for k in m) if m else f"{c:g}" for m, c in self.terms.items()) or "0"


def _atom_cols(a: Atom, start: int, stop: int) -> Atom:
    if isinstance(a, LinAtom):
        return LinAtom(a.lin.cols(start, stop))
    if isinstance(a, Act):
        return Act(a.kind, a.params, a.arg.cols(start, stop))
    if isinstance(a, Mask):
        return a
    if a.ncols is not None and start == 0 and stop == a.ncols:
        return a
    raise Decline(f"a slice of {describe(a)} is used (a state or input split into parts)")


def describe(a: Atom) -> str:
    if isinstance(a, State):
        return a.sym
    if isinstance(a, Mask):
        return "mask"
    if isinstance(a, StepInput):
        return "x"
    if isinstance(a, StepInputPart):
        return f"x[{a.start}:{a.stop}]"
    if isinstance(a, LinAtom):
        srcs = ",".join(sorted(_src_name(s) for s in a.lin.sources())) or "const"
        return f"lin({srcs})"
    if isinstance(a, Act):
        return f"{a.kind}({a.arg!r})"
    return "?"


def _src_name(s) -> str:
    if s[0] in (STATE, STEP_INPUT):
        return s[1]
    return "gated"
