"""Step masks computed from the step's own input: ``(x[t] != 0).any(-1)``, ``x[:, t].abs().sum(-1) > 0``.

A hand-written loop that skips padding without a mask input decides, at each step, from the step's input
alone whether a row is padding (Keras' ``Masking`` written per step). Such a mask is a function of x_t and
constants, the same at every step: when every node of it treats each batch row on its own
(:mod:`rnnfuse.row_wise`), it is the slice at step t of the same function applied once to every step of x,
``M = f(x)``. :class:`DerivedMask` is that family of per-step masks: a candidate mask of the chain like any
mask family (:func:`.families.mask_leaves`), and for a chain being fused its ``source`` builds ``M`` and makes
each step read its slice of ``M`` (the same values), so that what validation overrides is what the original
steps read too.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.row_wise import ROW_RANK, check_row_wise, replay, unflatten
from rnnfuse.signature import Signer

from .families import StepMask

# nodes of one step's input walked at most (a cell reads x_t through a matmul or two; a mask is a few nodes)
_WALK_LIMIT = 64


class DerivedMask(StepMask):
    """The bool masks ``f(x_t)`` of the steps ``t`` of one data family, ``f`` the same row-wise function (what
    a step reads of its mask, ``.float()`` or ``~m`` say, the step analysis reads as it reads any mask's)."""

    def __init__(self, src: str, axis: int, x: str, out: str, nodes: list[NodeProto], steps: dict[int, str]):
        self.src, self.axis = src, axis  # the data the steps slice, and its time axis
        self.x, self.out, self.nodes = x, out, nodes  # one step's input, its mask, the nodes between them
        self.steps = steps  # step -> its mask
        self.built: str | None = None

    def __repr__(self) -> str:
        return f"f({self.src}[t]) -> {self.out}"

    def slices(self, steps: set) -> tuple[int, dict] | None:
        return (0, dict(self.steps)) if set(steps) == set(self.steps) else None

    def source(self, g: Graph, axis: int, length: int, off: int, anchor: NodeProto | None) -> str:
        """The bool ``M = f(x)`` laid out like the data (``[T, B(, 1)]``, ``[B, T(, 1)]`` for time axis 1);
        each step's bool mask becomes ``Gather(M, t, axis)``."""
        if self.built is not None:
            return self.built
        if axis != self.axis or off != 0:
            raise Decline("a mask computed from the step input read by chains laid out differently")
        from rnnfuse.emit import Builder  # (emit imports the graph layer only; a top-level import would cycle)

        b = Builder(g, g.producer.get(self.steps[min(self.steps)]) or anchor, "rnnfuse/step_mask")
        env = replay(b, self.nodes, {self.x: b.op("Flatten", self.src, axis=2)}, "rows")  # every (t, b) row
        mask = unflatten(b, env[self.out], self.src)
        lead = (g.model.shape(self.src) or [None, None])[:2]
        tail = (g.model.shape(self.out) or [None] * (g.model.rank(self.out) or 1))[1:]
        g.model.declare(mask, (TensorProto.BOOL, list(lead) + list(tail)))
        for t, m in self.steps.items():
            p = g.producer[m]
            g.remove_node(p)
            g.add_node("Gather", [mask, b.const(np.array(t, np.int64), "t")], outputs=[m],
                       name="rnnfuse/step_mask/Gather", anchor=p, axis=axis)
        self.built = mask
        return mask


def derived_masks(g: Graph, src: str, axis: int, fam: dict[int, str], signer: Signer) -> list[DerivedMask]:
    """The masks every step of the data family ``fam`` (step -> x_t, slices of ``src`` along ``axis``) computes
    the same way from its x_t alone, each row on its own."""
    if g.model.rank(src) != 3:
        return []
    found: dict[int, dict[int, str]] = {}  # signature -> step -> mask
    template: dict[int, tuple] = {}
    for t, x in fam.items():
        for m, nodes in _row_masks(g, x):
            ids = {id(n) for n in nodes}
            try:
                sig = signer.sign(m, {x: "x"}, lambda p, ids=ids: id(p) in ids, _no_other_input, set())
            except Decline:
                continue
            found.setdefault(sig, {})[t] = m
            template.setdefault(sig, (x, m, nodes))
    return [DerivedMask(src, axis, *template[sig], steps) for sig, steps in found.items() if set(steps) == set(fam)]


def _no_other_input(name: str) -> str:
    raise Decline(f"a step mask reads '{name}'")


_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def _row_masks(g: Graph, x: str) -> list[tuple[str, list[NodeProto]]]:
    """The bool masks computed from ``x`` (a step's ``[B, F]`` input) and constants alone, row by row, that
    something else reads (themselves, or as a float cast or negation): each with the nodes computing it from
    ``x``, in evaluation order."""
    rows: dict[str, int] = {x: ROW_RANK}
    walked: list[NodeProto] = []
    ids: set[int] = set()
    stack = [x]
    while stack and len(walked) < _WALK_LIMIT:
        for c in g.uses(stack.pop()):
            if id(c) in ids or any(i and i not in rows and g.const(i) is None for i in c.input):
                continue  # (a node also reading a value not computed yet is met again from that value)
            try:
                rank = check_row_wise(g, c, rows, g.const, "a step mask", reductions=True)
            except Decline:
                continue
            ids.add(id(c))
            walked.append(c)
            for o in c.output:
                rows[o] = rank
                stack.append(o)

    def read_outside(v: str) -> bool:
        return any(id(u) not in ids for u in g.uses(v))

    roots: dict[str, None] = {}
    for n in walked:
        m = n.output[0]
        if g.model.elem_type(m) != TensorProto.BOOL:
            continue
        if read_outside(m) or any(u.op_type == "Cast" and attr(u, "to") in _FLOATS and id(u) in ids
                                  and read_outside(u.output[0]) for u in g.uses(m)):
            roots[_mask_root(g, m, ids)] = None
    # one value per row: [B] or [B, 1] (a [B, F] comparison of the features is no step mask)
    return [(m, _cone(g, m, ids, walked)) for m in roots
            if rows[m] == 1 or (g.model.shape(m) or [None, None])[1:] == [1]]


# what turns one mask into another without reading anything else: the step evaluator reads these on a mask
_MASK_VIEWS = frozenset({"Not", "Identity", "Cast", "Unsqueeze", "Squeeze"})


def _mask_root(g: Graph, m: str, ids: set[int]) -> str:
    """The bool ``m`` is a view of (its negation, a cast back to bool, an added unit axis): the mask itself, so
    that ``m`` and ``Not(m)`` read beside it are one mask, not two."""
    while True:
        p = g.producer.get(m)
        if p is None or id(p) not in ids or p.op_type not in _MASK_VIEWS or g.model.elem_type(p.input[0]) != TensorProto.BOOL:
            return m
        m = p.input[0]


def _cone(g: Graph, m: str, ids: set[int], walked: list[NodeProto]) -> list[NodeProto]:
    """The walked nodes ``m`` is computed from, in evaluation order."""
    need: set[int] = set()
    stack = [m]
    while stack:
        p = g.producer.get(stack.pop())
        if p is not None and id(p) in ids and id(p) not in need:
            need.add(id(p))
            stack.extend(i for i in p.input if i)
    return [n for n in walked if id(n) in need]
