"""Symbolic evaluation of one recurrence step: a subgraph becomes polynomials over cell "atoms".

A step of a recurrent layer, whatever exporter wrote it, computes elementwise combinations of a few kinds of
things. Evaluating the step's nodes over these abstract values gives one canonical form per output, so the
same maths written with other node orders, Gemm vs MatMul+Add, Split vs Slice, Where vs Mul/Add of casts,
Concat([x, h])·W vs x·W + h·R, all land on the same polynomial:

* :class:`Lin` -- an affine map of leaf rows: ``sum(src_k @ W_k) + sum(b_j)``; weights are exact slices
  (views) of the model's constants, never recomputed.
* atoms -- ``State`` (a carried state h/c), ``Mask`` (the 0/1 float of a step mask), ``X`` (the step input),
  ``LinAtom`` (a Lin used elementwise) and ``Act`` (an activation applied to a polynomial).
* :class:`Poly` -- a polynomial with scalar coefficients over atoms (a dict from sorted atom-key tuples).

Anything outside this algebra (a vector coefficient, a matmul of a non-leaf, an unsupported op on the
recurrent path) raises :class:`~rnnfuse.errors.Decline` with the reason, so a near-miss cell is never fused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from .errors import Decline
from .graph import Graph, attr

# --------------------------------------------------------------------------------------------------------
# constants with identity


class ConstRef:
    """A constant tensor (usually a weight) plus a hashable key describing where its values come from."""

    __slots__ = ("key", "arr")

    def __init__(self, key, arr: np.ndarray):
        self.key = key
        self.arr = arr

    @staticmethod
    def of(arr: np.ndarray, hint: str = "") -> "ConstRef":
        a = np.ascontiguousarray(arr)
        h = hashlib.blake2b(a.tobytes(), digest_size=12).hexdigest()
        return ConstRef(("D", h, a.shape, str(a.dtype)), a)

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

    def scaled(self, c: float) -> "ConstRef":
        if c == 1.0:
            return self
        return ConstRef((self.key, "s", float(c)), (self.arr * np.asarray(c, dtype=self.arr.dtype)).astype(self.arr.dtype))

    @property
    def ncols(self) -> int:
        return int(self.arr.shape[-1])


def content_key(graph: Graph, name: str, arr: np.ndarray):
    """A key for a named constant that equal bytes share (per-step copies of one weight)."""
    cache = graph.model.annotations.setdefault("content_keys", {})
    k = cache.get(name)
    if k is None:
        a = np.ascontiguousarray(arr)
        k = ("D", hashlib.blake2b(a.tobytes(), digest_size=12).hexdigest(), a.shape, str(a.dtype))
        cache[name] = k
    return k


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
        ws = [w for s, w in self.terms if s == src]
        if len(ws) > 1:
            raise Decline("the same input is multiplied by two weight matrices in one gate")
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


class Atom:
    __slots__ = ("key", "ncols")


class State(Atom):
    __slots__ = ("sym",)

    def __init__(self, sym: str, ncols: int | None):
        self.sym, self.ncols, self.key = sym, ncols, ("S", sym)


class Mask(Atom):
    """1.0 where the step's mask is true, 0.0 where it is false; one value per batch row."""

    __slots__ = ("sym",)

    def __init__(self, sym: str):
        self.sym, self.ncols, self.key = sym, 1, ("M", sym)


class X(Atom):
    __slots__ = ("sym",)

    def __init__(self, sym: str, ncols: int | None):
        self.sym, self.ncols, self.key = sym, ncols, ("X", sym)


class LinAtom(Atom):
    __slots__ = ("lin",)

    def __init__(self, lin: Lin):
        self.lin, self.ncols, self.key = lin, lin.ncols, ("L", lin.key)


class Act(Atom):
    """An elementwise activation ``kind(params)`` applied to polynomial ``arg``."""

    __slots__ = ("kind", "params", "arg")

    def __init__(self, kind: str, params: tuple, arg: "Poly"):
        self.kind, self.params, self.arg = kind, tuple(float(p) for p in params), arg
        self.ncols = arg.ncols
        self.key = ("A", kind, self.params, arg.key)


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
        """Merge affine terms with equal coefficients into one Lin (x·W + h·R + b is one gate input)."""
        lins = [(m, c) for m, c in self.terms.items() if len(m) == 1 and m[0][0] == "L"]
        if len(lins) < 2:
            return self
        by_coeff: dict[float, list] = {}
        for m, c in lins:
            by_coeff.setdefault(c, []).append(m)
        if all(len(v) == 1 for v in by_coeff.values()):
            return self
        t = dict(self.terms)
        atoms = dict(self.atoms)
        for c, ms in by_coeff.items():
            if len(ms) < 2:
                continue
            lin = atoms[ms[0][0]].lin
            for m in ms[1:]:
                lin = lin.plus(atoms[m[0]].lin)
            for m in ms:
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
            elif len(m) == 1 and m[0][0] == "L" and lin is None:
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
    if isinstance(a, X):
        return "x"
    if isinstance(a, LinAtom):
        srcs = ",".join(sorted(_src_name(s) for s in a.lin.sources())) or "const"
        return f"lin({srcs})"
    if isinstance(a, Act):
        return f"{a.kind}({a.arg!r})"
    return "?"


def _src_name(s) -> str:
    if s[0] in ("S", "X"):
        return s[1]
    return "gated"


# --------------------------------------------------------------------------------------------------------
# evaluator values


class Val:
    pass


class C(Val):
    """A constant (numpy array)."""

    __slots__ = ("arr", "ref")

    def __init__(self, arr: np.ndarray, ref: ConstRef | None = None):
        self.arr = np.asarray(arr)
        self.ref = ref

    def constref(self) -> ConstRef:
        if self.ref is None:
            self.ref = ConstRef.of(self.arr)
        return self.ref


class Fill(C):
    """A tensor of runtime shape filled with one value (``ConstantOfShape(Shape(...))`` zero states)."""


class RowConst(C):
    """A constant that varies along units only but has the runtime batch shape ``[B, N]``
    (``0 @ W + b`` on a zero state of runtime shape). Held as ``[1, N]``: slices and shapes see two axes."""

    def __init__(self, arr: np.ndarray, ref: ConstRef | None = None):
        arr = np.asarray(arr)
        super().__init__(arr.reshape(1, -1) if arr.ndim < 2 else arr, ref)


class ShapeV(Val):
    """The shape of a symbolic [*(1,)*lead, B, N] value: known dims, None for the batch."""

    __slots__ = ("dims",)

    def __init__(self, dims: list):
        self.dims = dims


class Sym(Val):
    """A symbolic [*(1,)*lead, B, N] tensor given by a polynomial."""

    __slots__ = ("poly", "lead")

    def __init__(self, poly: Poly, lead: int = 0):
        self.poly, self.lead = poly, lead


class Row(Val):
    """A concatenation of leaf rows (``[x, h]``) usable as the left operand of a weight matmul."""

    __slots__ = ("segments", "lead")

    def __init__(self, segments: tuple, lead: int = 0):
        self.segments, self.lead = segments, lead  # (src_key, width, poly of the segment)


class Bool(Val):
    """The step mask (``neg`` for its negation), shape [B, 1] (``unit``) or [B]."""

    __slots__ = ("sym", "neg", "unit")

    def __init__(self, sym: str, neg: bool, unit: bool):
        self.sym, self.neg, self.unit = sym, neg, unit


class Opaque(Val):
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


# activations whose ONNX RNN names and params rnnfuse knows
ACTIVATIONS = {
    "Sigmoid": (),
    "Tanh": (),
    "Relu": (),
    "HardSigmoid": ("alpha", "beta"),
    "LeakyRelu": ("alpha",),
    "ThresholdedRelu": ("alpha",),
    "Elu": ("alpha",),
    "Softsign": (),
    "Softplus": (),
}
_ACT_DEFAULTS = {"HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.01,), "ThresholdedRelu": (1.0,), "Elu": (1.0,)}


# --------------------------------------------------------------------------------------------------------
# the evaluator


class StepEvaluator:
    """Evaluates tensors of one step over symbolic values, on demand and memoised.

    ``leaves`` seeds tensor names with values (states, step inputs, masks). ``may_evaluate(node)`` limits
    which producers belong to the step (a chain step must not walk into the previous step). A name that is
    neither a leaf, nor constant, nor produced by an allowed node evaluates to :class:`Opaque`.
    """

    def __init__(
        self,
        graph: Graph,
        leaves: dict[str, Val],
        may_evaluate: Callable[[onnx.NodeProto], bool] | None = None,
        foreign: Callable[[str], Val] | None = None,
        content_keys: bool = False,
    ):
        self.graph = graph
        self.memo: dict[str, Val] = dict(leaves)
        self.may_evaluate = may_evaluate or (lambda n: True)
        self.opset = graph.model.opset
        self.visited_nodes: set[int] = set()
        self.foreign = foreign
        self.content_keys = content_keys

    def _const_key(self, name: str, arr: np.ndarray):
        if not self.content_keys:
            return ("I", name)
        return content_key(self.graph, name, arr)

    # ---- public
    def value(self, name: str) -> Val:
        if name in self.memo:
            return self.memo[name]
        # iterative post-order to avoid deep recursion on long bodies
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in self.memo:
                stack.pop()
                continue
            c = self.graph.const(cur) if cur else None
            if c is not None:
                self.memo[cur] = C(c, ConstRef(self._const_key(cur, c), c))
                stack.pop()
                continue
            g = self.graph.scope_of(cur)
            node = g.producer.get(cur) if g is self.graph else None
            if node is not None and node.op_type in ("ConstantOfShape", "Expand"):
                fv = self.graph.fill_value(cur)
                if fv is not None:  # a constant of runtime shape (zero states): its value is all that matters
                    self.memo[cur] = Fill(np.array(fv, dtype=np.float32))
                    stack.pop()
                    continue
            if node is None or not self.may_evaluate(node):
                if self.foreign is not None:
                    self.memo[cur] = self.foreign(cur)
                else:
                    fv = self.graph.fill_value(cur)
                    self.memo[cur] = (
                        Fill(np.array(fv, dtype=np.float32))
                        if fv is not None
                        else Opaque(f"'{cur}' is computed at runtime outside the step")
                    )
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in self.memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self.visited_nodes.add(id(node))
            ins = [self.memo[i] if i else None for i in node.input]
            try:
                outs = self._eval_node(node, ins)
            except Decline as d:
                outs = [Opaque(f"{node.op_type} '{node.name or node.output[0]}': {d.reason}")] * len(node.output)
            for o, v in zip(node.output, outs):
                if o:
                    self.memo[o] = v
        return self.memo[name]

    def poly(self, name: str) -> Poly:
        """The polynomial of an elementwise [B, N] tensor, or Decline with the reason it has none."""
        return as_poly(self.value(name), name)

    # ---- nodes
    def _eval_node(self, node: onnx.NodeProto, ins: list[Val | None]) -> list[Val]:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise Decline(f"custom op {node.domain}::{op} in the step")
        for k, v in enumerate(ins):
            if isinstance(v, Opaque):
                if op in ("MatMul", "Gemm") and k == 1 and v.why.startswith("'"):
                    return [Opaque(f"the weights {v.why.split(' ')[0]} of {op} '{node.name or node.output[0]}' are computed at runtime, not constants")] * len(node.output)
                return [v] * len(node.output)  # keep the first reason, unprefixed
        if any(isinstance(v, ShapeV) for v in ins):
            return _shape_op(self, node, ins)
        if all(isinstance(v, C) or v is None for v in ins):
            if any(isinstance(v, (Fill, RowConst)) for v in ins):
                return _fill_op(self, node, ins)
            from .fold import evaluate

            res = evaluate(node, [v.arr if v is not None else None for v in ins], self.opset)
            if res is None:
                raise Decline(f"cannot evaluate constant {op}")
            return [C(r) for r in res]
        h = _HANDLERS.get(op)
        if h is None:
            raise Decline(f"unsupported op {op} on the recurrent path")
        return h(self, node, ins)


_FILL_KEEPS = {"Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Flatten", "Split", "Slice", "Gather", "Expand", "Tile", "Concat"}


def _fill_op(ev, node, ins):
    """Constant folding when a runtime-shaped fill is involved: only its value matters."""
    op = node.op_type
    if op == "Shape":
        v = ins[0]
        dims = [None] * max(np.asarray(v.arr).ndim, 2)
        if isinstance(v, RowConst):
            dims[-1] = int(v.arr.shape[-1])
        start, end = attr(node, "start", 0), attr(node, "end", None)
        dims = dims[start:end]
        return [C(np.array(dims, dtype=np.int64))] if all(d is not None for d in dims) else [ShapeV(dims)]
    if any(isinstance(v, RowConst) for v in ins) and op not in ("MatMul", "Gemm"):
        from .fold import evaluate

        res = evaluate(node, [v.arr if v is not None else None for v in ins], ev.opset)
        if res is None:
            raise Decline(f"cannot evaluate constant {op}")
        return [RowConst(r) for r in res]
    fills = [v for v in ins if isinstance(v, Fill)]
    if op in _FILL_KEEPS:
        vals = {float(v.arr) for v in fills}
        if len(vals) == 1 and (op != "Concat" or all(isinstance(v, Fill) for v in ins if v is not None)):
            return [Fill(fills[0].arr)] * len(node.output)
        raise Decline(f"{op} of a runtime-shaped constant")
    if op in ("MatMul", "Gemm"):
        a = ins[0]
        if not isinstance(a, Fill) or float(a.arr) != 0.0 or isinstance(ins[1], Fill):
            raise Decline(f"{op} of a runtime-shaped constant")
        if op == "Gemm" and len(ins) > 2 and ins[2] is not None:
            bias = np.asarray(ins[2].arr) * np.asarray(attr(node, "beta", 1.0), dtype=ins[2].arr.dtype)
            return [RowConst(bias.reshape(1, -1) if bias.ndim == 1 else bias)]
        return [Fill(np.array(0.0, dtype=np.float32))]
    from .fold import evaluate

    res = evaluate(node, [v.arr if v is not None else None for v in ins], ev.opset)
    if res is None:
        raise Decline(f"cannot evaluate constant {op}")
    return [Fill(r) if np.asarray(r).ndim == 0 else RowConst(r) for r in res]


def _shape_op(ev, node, ins):
    """Ops on the shape of a cell value (torch's chunk computes split sizes from Shape)."""
    v = ins[0]
    if node.op_type in ("Gather", "Slice") and isinstance(v, ShapeV):
        from .fold import evaluate

        idx = np.arange(len(v.dims))
        res = evaluate(node, [idx] + [x.arr if isinstance(x, C) else None for x in ins[1:]], ev.opset)
        if res is None:
            raise Decline("an unsupported use of a shape")
        sel = np.asarray(res[0])
        dims = [v.dims[int(i)] for i in sel.ravel()]
        if all(d is not None for d in dims):
            return [C(np.array(dims, dtype=np.int64).reshape(sel.shape))]
        return [ShapeV(dims)]
    if node.op_type in ("Cast", "Identity") and isinstance(v, ShapeV):
        return [v]
    raise Decline(f"{node.op_type} of a runtime shape")


def _shape(ev, node, ins):
    v = ins[0]
    if isinstance(v, (Sym, Row)):
        n = v.poly.ncols if isinstance(v, Sym) else sum(w or 0 for _, w, _ in v.segments) or None
        dims = [1] * v.lead + [None, n]
        start, end = attr(node, "start", 0), attr(node, "end", None)
        dims = dims[start:end]
        return [C(np.array(dims, dtype=np.int64))] if all(d is not None for d in dims) else [ShapeV(dims)]
    raise Decline("the shape of an unsupported value")


# ---- coercions


def as_poly(v: Val, what: str = "value") -> Poly:
    if isinstance(v, Sym):
        return v.poly  # leading unit axes ([1, B, H]) do not change the maths
    if isinstance(v, C):
        return const_poly(v)
    if isinstance(v, Row):
        if len(v.segments) == 1 and not v.lead:
            return v.segments[0][2]
        raise Decline("a concatenation of inputs is used elementwise")
    if isinstance(v, Opaque):
        raise Decline(v.why)
    if isinstance(v, Bool):
        raise Decline("a boolean mask is used as a number without Cast")
    raise Decline(f"{what} has no symbolic form")


def const_poly(v: C) -> Poly:
    arr = v.arr
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.floating):
        raise Decline("a non-float constant in cell maths")
    flat = arr.ravel()
    if flat.size == 0:
        raise Decline("an empty constant")
    if np.all(flat == flat[0]):
        return Poly.const(float(flat[0]))
    # a vector along the last axis (a bias), possibly with leading unit dims or identical rows
    vec = _as_vector(arr)
    if vec is None:
        raise Decline("a constant that varies along the batch axis")
    ref = v.constref() if arr.ndim == 1 else ConstRef.of(vec)
    return Poly.atom(LinAtom(Lin.make([], [ref], int(vec.shape[0]))))


def _as_vector(arr: np.ndarray) -> np.ndarray | None:
    if arr.ndim == 1:
        return arr
    flat = arr.reshape(-1, arr.shape[-1])
    if np.all(flat == flat[0:1]):
        return flat[0]
    return None


def as_row(v: Val) -> Row:
    """The left operand of a weight matmul: a leaf, a gated state (r*h) or a concatenation of those."""
    if isinstance(v, Row):
        return v
    if isinstance(v, Sym):
        p = v.poly
        if not p.terms:  # identically zero (r * h with a zero initial h): contributes nothing
            return Row(((("Z",), None, Poly.const(0.0)),), v.lead)
        if len(p.terms) == 1:
            (m, c), = p.terms.items()
            if c == 1.0 and m:
                atoms = [p.atoms[k] for k in m]
                if len(atoms) == 1 and isinstance(atoms[0], (State, X)):
                    a = atoms[0]
                    return Row(((a.key, a.ncols, p),), v.lead)
                if any(isinstance(a, State) for a in atoms) and all(isinstance(a, (State, Act)) for a in atoms):
                    key = ("P", m)
                    width = max((a.ncols or 0) for a in atoms) or None
                    return Row(((key, width, p),), v.lead)
        raise Decline(f"a matmul whose left operand is not a step input or state ({p!r})")
    if isinstance(v, Opaque):
        raise Decline(v.why)
    if isinstance(v, Fill) and float(v.arr) == 0.0:
        return Row(((("Z",), None, Poly.const(0.0)),))  # a zero state of runtime shape, e.g. concat([x, 0])
    if isinstance(v, C) and not isinstance(v, RowConst) and v.arr.ndim == 2 and v.arr.size and not v.arr.any():
        return Row(((("Z",), None, Poly.const(0.0)),))  # a zero state of static shape [B, N]
    if isinstance(v, C):
        raise Decline("a matmul of two constants")
    raise Decline("a matmul of an unsupported value")


def _weight(v: Val, what: str) -> ConstRef:
    if isinstance(v, C):
        return v.constref()
    if isinstance(v, Opaque):
        raise Decline(f"{what} is not a constant: weights are computed at runtime ({v.why})")
    raise Decline(f"{what} is not a constant: weights are computed at runtime")


def _matmul(row: Row, w: ConstRef) -> Lin:
    if w.arr.ndim != 2:
        raise Decline(f"a matmul with a rank-{w.arr.ndim} weight")
    terms = []
    rows = {}
    r0 = 0
    unknown = [i for i, seg in enumerate(row.segments) if seg[1] is None]
    if len(unknown) == 1 and len(row.segments) > 1:  # e.g. [x, h] with h's width only implied by W
        known = sum(seg[1] for seg in row.segments if seg[1] is not None)
        k = unknown[0]
        seg = row.segments[k]
        row = Row(row.segments[:k] + ((seg[0], int(w.arr.shape[0]) - known, seg[2]),) + row.segments[k + 1:], row.lead)
    for src, width, seg_poly in row.segments:
        if src[0] == "Z":
            r0 += width if width is not None else int(w.arr.shape[0]) - r0
            continue
        if src[0] == "P":
            rows[src] = seg_poly
        if width is None:
            if len(row.segments) != 1:
                raise Decline("a concatenation of inputs of unknown width")
            width = w.arr.shape[0]
        terms.append((src, w.rows(r0, r0 + width)))
        r0 += width
    if r0 != w.arr.shape[0]:
        raise Decline(f"matmul widths do not match ({r0} vs {w.arr.shape[0]})")
    return Lin.make(terms, [], w.ncols, rows)


# ---- handlers


def _sym(p: Poly, lead: int = 0) -> Sym:
    return Sym(p, lead)


def _lead(*vals) -> int:
    """Leading unit axes of an elementwise result: broadcasting keeps the most."""
    leads = [v.lead for v in vals if isinstance(v, (Sym, Row))]
    return max(leads) if leads else 0


def _binary(ev, node, ins):
    a, b = ins
    lead = _lead(a, b)
    pa, pb = _poly_l(a), _poly_l(b)
    op = node.op_type
    if op == "Add":
        return [_sym(pa.add(pb), lead)]
    if op == "Sub":
        return [_sym(pa.sub(pb), lead)]
    if op == "Mul":
        if pb.is_const():
            return [_sym(_scale(pa, pb.const_value()), lead)]
        if pa.is_const():
            return [_sym(_scale(pb, pa.const_value()), lead)]
        return [_sym(pa.mul(pb), lead)]
    if op == "Div":
        if not pb.is_const() or pb.const_value() == 0.0:
            raise Decline("division by a non-constant")
        return [_sym(_scale(pa, 1.0 / pb.const_value()), lead)]
    raise Decline(op)


def _poly_l(v: Val) -> Poly:
    if isinstance(v, _MaskVec):
        raise Decline("a [B] mask broadcast against [B, H] (batch would align with units)")
    if isinstance(v, Sym):
        return v.poly
    return as_poly(v)


def _scale(p: Poly, c: float) -> Poly:
    """``c * p``; ``clip(a*L + b, 0, k) / k`` becomes HardSigmoid(a/k, b/k)(L)."""
    sa = p.single_atom()
    if sa is not None:
        atom, coeff = sa
        if isinstance(atom, Act) and atom.kind == "Clip" and atom.params[0] == 0.0 and atom.params[1] > 0:
            k = atom.params[1]
            if abs(coeff * c * k - 1.0) < 1e-6:
                hs = _hard_sigmoid(atom.arg, 1.0 / k)
                if hs is not None:
                    return hs
    return p.scale(c)


def _hard_sigmoid(arg: Poly, s: float) -> Poly | None:
    lo = arg.as_lin_offset()
    if lo is None:
        return None
    lin, a, b = lo
    return Poly.atom(Act("HardSigmoid", (a * s, b * s), Poly.atom(LinAtom(lin))))


def _neg(ev, node, ins):
    return [_sym(_poly_l(ins[0]).scale(-1.0), _lead(ins[0]))]


def _identity(ev, node, ins):
    return [ins[0]]


def _dropout(ev, node, ins):
    """Dropout at inference (no training_mode, or a constant false one) is the identity."""
    if len(ins) > 2 and ins[2] is not None:
        if not isinstance(ins[2], C) or bool(np.asarray(ins[2].arr).any()):
            raise Decline("a Dropout in training mode")
    if len(node.output) > 1 and node.output[1]:
        raise Decline("a Dropout whose mask is used")
    return [ins[0]]


def _activation(kind: str):
    def h(ev, node, ins):
        names = ACTIVATIONS[kind]
        defaults = _ACT_DEFAULTS.get(kind, ())
        params = tuple(attr(node, n, d) for n, d in zip(names, defaults))
        p = _poly_l(ins[0])
        return [_sym(Poly.atom(Act(kind, params, p)), _lead(ins[0]))]

    return h


def _clip_poly(p: Poly, lo: float, hi: float) -> Poly:
    if lo == 0.0 and hi == 1.0:
        hs = _hard_sigmoid(p, 1.0)
        if hs is not None:
            return hs
    if lo == 0.0 and hi == float("inf"):
        return Poly.atom(Act("Relu", (), p))
    return Poly.atom(Act("Clip", (lo, hi), p))


def _scalar(v: Val | None, what: str) -> float | None:
    if v is None:
        return None
    if not isinstance(v, C):
        raise Decline(f"{what} is not a constant")
    flat = v.arr.ravel()
    if flat.size == 0 or not np.all(flat == flat[0]):
        raise Decline(f"{what} is not a scalar")
    return float(flat[0])


def _clip(ev, node, ins):
    if ev.opset < 11:
        lo, hi = attr(node, "min", float("-inf")), attr(node, "max", float("inf"))
    else:
        lo = _scalar(ins[1] if len(ins) > 1 else None, "Clip min")
        hi = _scalar(ins[2] if len(ins) > 2 else None, "Clip max")
        lo = float("-inf") if lo is None else lo
        hi = float("inf") if hi is None else hi
    return [_sym(_clip_poly(_poly_l(ins[0]), lo, hi), _lead(ins[0]))]


def _minmax(ev, node, ins):
    if len(ins) != 2:
        raise Decline(f"{node.op_type} with {len(ins)} inputs")
    a, b = ins
    if isinstance(a, C):
        a, b = b, a
    c = _scalar(b, f"{node.op_type} operand")
    p = _poly_l(a)
    sa = p.single_atom()
    if node.op_type == "Max":
        # Max(Clip(x, -inf, hi), lo) -> Clip(x, lo, hi);  Max(x, 0) -> Relu
        if sa and isinstance(sa[0], Act) and sa[0].kind == "Clip" and sa[1] == 1.0 and sa[0].params[0] == float("-inf"):
            return [_sym(_clip_poly(sa[0].arg, c, sa[0].params[1]), _lead(a))]
        return [_sym(_clip_poly(p, c, float("inf")), _lead(a))]
    if sa and isinstance(sa[0], Act) and sa[1] == 1.0:
        if sa[0].kind == "Clip" and sa[0].params[1] == float("inf"):
            return [_sym(_clip_poly(sa[0].arg, sa[0].params[0], c), _lead(a))]
        if sa[0].kind == "Relu":
            return [_sym(_clip_poly(sa[0].arg, 0.0, c), _lead(a))]
    return [_sym(_clip_poly(p, float("-inf"), c), _lead(a))]


def _matmul_h(ev, node, ins):
    a, b = ins
    row = as_row(a)
    return [_sym(Poly.atom(LinAtom(_matmul(row, _weight(b, "the matmul weight")))), row.lead)]


def _gemm(ev, node, ins):
    a, b = ins[0], ins[1]
    if attr(node, "transA", 0):
        raise Decline("Gemm with transA")
    w = _weight(b, "the Gemm weight")
    if attr(node, "transB", 0):
        w = w.T()
    row = as_row(a)
    lin = _matmul(row, w)
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    p = Poly.atom(LinAtom(lin))
    if alpha != 1.0:
        p = Poly.atom(LinAtom(lin.scaled(alpha)))
    if len(ins) > 2 and ins[2] is not None:
        if isinstance(ins[2], C):
            arr = ins[2].arr if beta == 1.0 else (ins[2].arr * np.asarray(beta, dtype=ins[2].arr.dtype)).astype(ins[2].arr.dtype)
            cp = const_poly(C(arr) if beta != 1.0 else ins[2])
        else:
            cp = _poly_l(ins[2]).scale(beta) if beta != 1.0 else _poly_l(ins[2])  # C may be h @ R (tf2onnx)
        p = p.add(cp)
    return [_sym(p)]


def _cast(ev, node, ins):
    v = ins[0]
    to = attr(node, "to")
    if isinstance(v, Bool):
        if to == onnx.TensorProto.BOOL:
            return [v]
        p = Poly.atom(Mask(v.sym))
        p = Poly.const(1.0).sub(p) if v.neg else p
        return [_sym(p, 0) if v.unit else _MaskVec(p)]
    if isinstance(v, Sym):
        src = ev.graph.model.elem_type(node.input[0])
        if to in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16) and (src is None or src == to):
            return [v]
        raise Decline("a cast of a cell value to another type")
    raise Decline("an unsupported cast")


class _MaskVec(Sym):
    """A 0/1 mask of shape [B] (no trailing unit axis): only usable after Unsqueeze/Reshape to [B, 1]."""


def _not(ev, node, ins):
    v = ins[0]
    if isinstance(v, Bool):
        return [Bool(v.sym, not v.neg, v.unit)]
    raise Decline("Not of a non-mask value")


def _where(ev, node, ins):
    cond, a, b = ins
    if isinstance(cond, C) and cond.arr.dtype == np.bool_ and cond.arr.size and (cond.arr.all() or not cond.arr.any()):
        return [a if cond.arr.all() else b]  # a constant condition (Keras on torch: ``t < T`` with T static)
    if not isinstance(cond, Bool):
        raise Decline("Where with a condition that is not the step mask")
    if not cond.unit:
        raise Decline("a [B] mask broadcast against [B, H] (batch would align with units)")
    m = Poly.atom(Mask(cond.sym))
    pa, pb = _poly_l(a), _poly_l(b)
    if cond.neg:
        pa, pb = pb, pa
    lead = _lead(a, b)
    return [_sym(m.mul(pa).add(Poly.const(1.0).sub(m).mul(pb)), lead)]


def _norm_axis(ev, node, v: Val, axis: int) -> int:
    """Map an axis of a [*(1,)*lead, B, N] value to -1 (units), 0 (batch) or -2 (a leading unit axis)."""
    lead = v.lead if isinstance(v, (Sym, Row)) else 0
    rank = lead + 2
    a = axis + rank if axis < 0 else axis
    if a == rank - 1:
        return -1
    if a == rank - 2:
        return 0
    return -2


def _split(ev, node, ins):
    v = ins[0]
    axis = _norm_axis(ev, node, v, attr(node, "axis", 0))
    if axis != -1:
        raise Decline("a split that is not along the unit axis")
    p = _poly_l(v)
    n = p.ncols
    if ev.opset < 13:
        sizes = attr(node, "split")
    else:
        sizes = [int(s) for s in ins[1].arr] if len(ins) > 1 and isinstance(ins[1], C) else None
    k = len(node.output)
    if sizes is None:
        if n is None:
            raise Decline("a split of unknown width")
        step = -(-n // k)
        sizes = [min(step, n - i * step) for i in range(k)]
    outs, s0 = [], 0
    for s in sizes:
        outs.append(_sym(p.cols(s0, s0 + s), _lead(v)))
        s0 += s
    return outs


def _slice(ev, node, ins):
    v = ins[0]
    if ev.opset < 10:
        starts, ends = attr(node, "starts"), attr(node, "ends")
        axes = attr(node, "axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        def ints(i, default=None):
            if len(ins) <= i or ins[i] is None:
                return default
            if not isinstance(ins[i], C):
                raise Decline("a slice with runtime bounds")
            return [int(x) for x in ins[i].arr.ravel()]

        starts, ends = ints(1), ints(2)
        axes = ints(3, list(range(len(starts))))
        steps = ints(4, [1] * len(starts))
    p = _poly_l(v)
    out = p
    for s, e, a, st in zip(starts, ends, axes, steps):
        na = _norm_axis(ev, node, v, a)
        if na == -1:
            n = p.ncols
            if st != 1:
                raise Decline("a strided slice of units")
            if n is None:
                if s < 0 or e < 0:
                    raise Decline("a slice of unknown width")
                n = e
            s0, e0, _ = slice(s, e).indices(n)
            out = out.cols(s0, e0)
        else:
            if not (s == 0 and st == 1 and e >= 2**31 - 1):
                raise Decline("a slice along the batch axis")
    return [_sym(out, _lead(v))]


def _gather(ev, node, ins):
    v, idx = ins
    if not isinstance(idx, C):
        raise Decline("a gather with runtime indices")
    axis = _norm_axis(ev, node, v, attr(node, "axis", 0))
    if axis != -1 or idx.arr.ndim != 1:
        raise Decline("a gather that is not a unit selection")
    ind = [int(i) for i in idx.arr]
    if ind != list(range(ind[0], ind[0] + len(ind))):
        raise Decline("a gather of non-contiguous units")
    return [_sym(_poly_l(v).cols(ind[0], ind[0] + len(ind)), _lead(v))]


def _concat(ev, node, ins):
    axis = attr(node, "axis")
    ref = next(v for v in ins if not isinstance(v, C))
    na = _norm_axis(ev, node, ref, axis)
    if na != -1:
        raise Decline("a concatenation that is not along the unit axis")
    segs = []
    for v in ins:
        segs.extend(as_row(v).segments)
    return [Row(tuple(segs), _lead(*ins))]


def _axes_of(ev, node, ins):
    if ev.opset < 13:
        return attr(node, "axes")
    if len(ins) > 1 and ins[1] is not None:
        if not isinstance(ins[1], C):
            raise Decline("runtime axes")
        return [int(a) for a in ins[1].arr.ravel()]
    return None


def _unsqueeze(ev, node, ins):
    v = ins[0]
    axes = _axes_of(ev, node, ins)
    if isinstance(v, _MaskVec):
        if axes in ([1], [-1]):
            return [Sym(v.poly, 0)]
        raise Decline("an unsupported reshape of the mask")
    if isinstance(v, Bool):
        if not v.unit and axes in ([1], [-1]):
            return [Bool(v.sym, v.neg, True)]
        raise Decline("an unsupported reshape of the mask")
    if isinstance(v, (Sym, Row)) and axes is not None and all(a == 0 for a in axes) and len(axes) == 1:
        return [Sym(v.poly, v.lead + 1) if isinstance(v, Sym) else Row(v.segments, v.lead + 1)]
    raise Decline("an unsqueeze that is not a leading axis")


def _squeeze(ev, node, ins):
    v = ins[0]
    axes = _axes_of(ev, node, ins)
    if isinstance(v, (Sym, Row)) and v.lead and (axes is None or all(0 <= a < v.lead for a in axes)):
        k = v.lead if axes is None else len(set(axes))
        return [Sym(v.poly, v.lead - k) if isinstance(v, Sym) else Row(v.segments, v.lead - k)]
    if isinstance(v, Bool) and v.unit and axes in ([1], [-1]):
        return [Bool(v.sym, v.neg, False)]
    raise Decline("a squeeze of a [B, N] value")


def _reshape(ev, node, ins):
    v, shp = ins
    if not isinstance(shp, C):
        raise Decline("a reshape to a runtime shape")
    shape = [int(s) for s in shp.arr]
    if isinstance(v, _MaskVec) and len(shape) == 2 and shape[1] == 1:
        return [Sym(v.poly, 0)]
    if isinstance(v, Bool) and len(shape) == 2 and shape[1] == 1:
        return [Bool(v.sym, v.neg, True)]
    if isinstance(v, Sym) and len(shape) == 2:
        n = v.poly.ncols
        if shape[1] in (n, -1 if n is None else n) and shape[0] in (-1, 0) and v.lead == 0:
            return [v]
        if v.lead == 0 and shape[1] == n:
            return [v]
    if isinstance(v, Sym) and len(shape) == 3 and shape[0] == 1 and v.lead == 0:
        return [Sym(v.poly, 1)]
    raise Decline("a reshape of a cell value")


def _expand(ev, node, ins):
    """Expand to a constant shape only broadcasts (tf2onnx writes x + zeros as Expand(x, shape))."""
    v, shp = ins
    if not isinstance(shp, C) or not isinstance(v, Sym):
        raise Decline("an Expand to a runtime shape")
    shape = [int(d) for d in shp.arr.ravel()]
    n = v.poly.ncols
    if len(shape) < 2 or (n is not None and shape[-1] not in (1, n)) or any(d != 1 for d in shape[:-2]):
        raise Decline("an Expand that changes a cell value's shape")
    return [Sym(v.poly, max(v.lead, len(shape) - 2))]


def _tile(ev, node, ins):
    """Tile of the [B, 1] step mask along units (Keras' ``_expand_mask``): the same mask, broadcast."""
    v, reps = ins
    if isinstance(v, Bool) and v.unit and isinstance(reps, C):
        r = [int(d) for d in reps.arr.ravel()]
        if len(r) == 2 and r[0] == 1:
            return [v]
    raise Decline("a Tile of a cell value")


_HANDLERS: dict[str, Callable] = {
    "Add": _binary,
    "Sub": _binary,
    "Mul": _binary,
    "Div": _binary,
    "Neg": _neg,
    "Identity": _identity,
    "Dropout": _dropout,
    "Clip": _clip,
    "Max": _minmax,
    "Min": _minmax,
    "MatMul": _matmul_h,
    "Gemm": _gemm,
    "Cast": _cast,
    "Not": _not,
    "Where": _where,
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Shape": _shape,
    "Expand": _expand,
    "Tile": _tile,
}
for _k in ACTIVATIONS:
    _HANDLERS[_k] = _activation(_k)


def register_handler(op_type: str, handler: Callable) -> None:
    """Give the evaluator the semantics of an op defined in a higher layer (native cells: :mod:`rnnfuse.cells`)."""
    _HANDLERS[op_type] = handler


# --------------------------------------------------------------------------------------------------------
# substitution and loose comparison (chains whose first step saw a zero initial state)


def substitute(p: Poly, fn: Callable[[Atom], Poly | None]) -> Poly:
    """Replace atoms by polynomials (``fn`` returns None to keep an atom); recurses into arguments."""
    cache: dict = {}

    def atom_poly(a: Atom) -> Poly:
        if a.key in cache:
            return cache[a.key]
        r = fn(a)
        if r is None:
            if isinstance(a, Act):
                r = Poly.atom(Act(a.kind, a.params, substitute(a.arg, fn)))
            else:
                r = Poly.atom(a)
        cache[a.key] = r
        return r

    out = Poly.const(0.0)
    for mono, c in p.terms.items():
        term = Poly.const(c)
        for k in mono:
            term = term.mul(atom_poly(p.atoms[k]))
        out = out.add(term)
    return out


def zero_states(p: Poly, syms: set[str]) -> Poly:
    """``p`` with the given states set to zero (their matmul terms dropped too)."""

    def fn(a: Atom):
        if isinstance(a, State) and a.sym in syms:
            return Poly.const(0.0)
        if isinstance(a, LinAtom):
            keep = [(s, w) for s, w in a.lin.terms if not (s[0] == "S" and s[1] in syms) and not (s[0] == "P" and any(k[0] == "S" and k[1] in syms for k in s[1]))]
            if len(keep) == len(a.lin.terms):
                return None
            if not keep and not a.lin.biases:
                return Poly.const(0.0)
            return Poly.atom(LinAtom(Lin.make(keep, a.lin.biases, a.lin.ncols)))
        return None

    return substitute(p, fn)


def loose_key(p: Poly):
    """Like ``p.key`` but biases compare by value (a folded ``0 @ W + b`` equals ``b``)."""

    def akey(a: Atom):
        if isinstance(a, LinAtom):
            s = a.lin.bias_sum()
            return ("L", tuple(sorted(repr((t[0], t[1].key)) for t in a.lin.terms)), None if s is None else s.tobytes())
        if isinstance(a, Act):
            return ("A", a.kind, a.params, loose_key(a.arg))
        return a.key

    items = []
    for mono, c in p.terms.items():
        items.append((tuple(sorted(repr(akey(p.atoms[k])) for k in mono)), c))
    return tuple(sorted(items, key=repr))
