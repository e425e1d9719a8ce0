"""Step masks computed from the step's own input: ``(x[t] != 0).any(-1)``, ``x[:, t].abs().sum(-1) > 0``, or
from its slice of a mask that is not bool: ``mask[:, t] > 0`` of a float ``[B, T]`` mask, ``mask[:, t:t+1].bool()``.

A hand-written loop that skips padding without a mask input decides, at each step, from the step's input
alone whether a row is padding (Keras' ``Masking`` written per step). Such a mask is a function of x_t and
constants, the same at every step: when every node of it treats each batch row on its own
(:mod:`rnnfuse.row_wise`), it is the slice at step t of the same function applied once to every step of x,
``M = f(x)``. :class:`DerivedMask` is that family of per-step masks: a candidate mask of the chain like any
mask family (:func:`.families.mask_leaves`), and for a chain being fused its ``source`` builds ``M`` and makes
each step read its slice of ``M`` (the same values), so that what validation overrides is what the original
steps read too. A float or integer mask input is the same case with ``x`` that tensor (one value a row).
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.builder import Builder
from rnnfuse.dims import static_dim
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.row_wise import ROW_RANK, UNIT_ROWS, mask_on_every_step, row_masks
from rnnfuse.signature import Signer

from .families import StepMask, is_row_family


# the ops that compute a bool from a float (a mask computed from x_t has one)
_BOOL_MAKERS = ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "IsNaN", "IsInf", "Cast")


class DerivedMask(StepMask):
    """The bool masks ``f(x_t)`` of the steps ``t`` of one per-step family, ``f`` the same row-wise function
    (what a step reads of its mask, ``.float()`` or ``~m`` say, the step analysis reads as it reads any
    mask's). ``x_t`` is the chain's own step input, or its step's slice of another tensor holding one value a
    row (a float mask compared with 0)."""

    def __init__(self, src: str, axis: int, x_rank: int, x: str, out: str, nodes: list[NodeProto], rank: int,
                 steps: dict[int, str]):
        self.src, self.axis = src, axis  # the tensor the steps slice, and its time axis
        self.x_rank = x_rank  # what one step's slice is (see row_wise.row_masks)
        self.x, self.out, self.nodes = x, out, nodes  # one step's slice, its mask, the nodes between them
        self.rank = rank  # the mask's: [B, 1] (2) or [B] (1)
        self.steps = steps  # step -> its mask
        self.built: tuple[int, str] | None = None  # (time axis, the mask) once built
        self.proof_source = (src, axis)

    def __repr__(self) -> str:
        return f"f({self.src}[t]) -> {self.out}"

    def slices(self, steps: set, g=None, data=None) -> tuple[int, dict] | None:
        return (0, dict(self.steps)) if set(steps) == set(self.steps) else None

    def source(self, g: Graph, axis: int, length: int, off: int, anchor: NodeProto | None) -> str:
        """The bool ``M = f(S)`` with time along ``axis`` (the chain data's), ``S`` the sliced tensor
        (``[T, B(, 1)]`` or ``[B, T(, 1)]``: ``M`` is ``f(S)`` transposed where ``S``'s time axis is another, a
        ``[B, T]`` float mask beside time-major x); each step's bool mask becomes ``Gather(M, t, axis)``, so
        that what validation overrides (``M``) is what the original steps read too."""
        if self.built is not None:
            if self.built[0] != axis:
                raise Decline("a step mask read by chains laid out differently")
            return self.built[1]
        if off != 0:
            raise Decline("a step mask read from another step than its chain's")
        steps = static_dim(g, self.src, self.axis)
        if steps is not None and steps != length:
            raise Decline(f"the step masks are slices of '{self.src}' ({steps} steps), the chain has {length}")

        b = Builder(g, g.producer.get(self.steps[min(self.steps)]) or anchor, "rnnfuse/step_mask")
        mask = mask_on_every_step(b, self.nodes, [self.x], self.src, self.out, self.rank, {}, self.x_rank)
        if axis != self.axis:
            perm = list(range(self.rank + 1))
            perm[axis], perm[self.axis] = self.axis, axis
            dims = list(g.model.shape(mask) or [None] * (self.rank + 1))
            mask = b.op("Transpose", mask, perm=perm)
            g.model.declare(mask, (9, [dims[i] for i in perm]))
        self.read_steps(g, b, mask, axis, length, {t: g.producer[m] for t, m in self.steps.items()})
        self.built = (axis, mask)
        return mask


def derived_masks(g: Graph, fams: dict, data: tuple[str, int], signer: Signer) -> list[DerivedMask]:
    """The masks every step of the data family ``fams[data]`` (``data`` = (source, time axis)) computes the
    same way, each row on its own, from its x_t alone, or from its slice of a tensor holding one value a row
    per step (a float or integer ``[B, T]`` mask input: ``mask[:, t] > 0``, :func:`.families.is_row_family`)
    sliced at the same steps."""
    if not g.nodes_of(*_BOOL_MAKERS):
        return []  # (a graph computing no bool value has no such mask: no walk from each step's input)
    fam = fams[data]
    sliced = [(data, fam, ROW_RANK)] if g.model.rank(data[0]) == 3 else []
    for key, other in fams.items():
        if key == data or set(other) != set(fam):
            continue
        if is_row_family(g, key[0]):
            # a step's [B, 1] slice as taken, or its [B] value (Gather, or a squeezed slice)
            one = g.producer.get(next(iter(other.values())))
            sliced.append((key, other, UNIT_ROWS if one is not None and one.op_type == "Slice" else 1))
        elif g.model.rank(key[0]) == 3:
            sliced.append((key, other, ROW_RANK))  # (x_t beside a map of it the chain reads: a mask of x_t)
    out = []
    for (src, axis), steps_of, x_rank in sliced:
        found: dict[int, dict[int, str]] = {}  # signature -> step -> mask
        template: dict[int, tuple] = {}
        for t, x in steps_of.items():
            for m, nodes, rank in row_masks(g, [x], g.const, x_rank):
                ids = {id(n) for n in nodes}
                try:
                    sig = signer.sign(m, {x: "x"}, lambda p, ids=ids: id(p) in ids, _no_other_input, set())
                except Decline:
                    continue
                found.setdefault(sig, {})[t] = m
                template.setdefault(sig, (x, m, nodes, rank))
        out += [DerivedMask(src, axis, x_rank, *template[sig], steps) for sig, steps in found.items()
                if set(steps) == set(fam)]
    return out


def _no_other_input(name: str) -> str:
    raise Decline(f"a step mask reads '{name}'")
