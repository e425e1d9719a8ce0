"""One step of a chain as a region of the graph: which nodes belong to it, what older value it may read
besides h (the LSTM cell state), and its symbolic evaluation.
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.dataflow import lead_of, rank_of, shape_derived
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.cells.recognise import fold_offsets
from rnnfuse.symbolic import (BoolMask, Fill, LinAtom, Mask, Poly, State, StepEvaluator, StepInput, SymTensor, loose_key,
                              substitute)
from rnnfuse.symbolic.values import MaskVector

from .chains import Chain
from .lanes import SHARED


def allowed_fn(g: Graph, chain: Chain, k: int, iv):
    """Whether a node belongs to step k of the chain (a predicate: a bound method, so that what it holds
    goes as soon as the last caller lets go of it, not at the next full garbage collection as a closure that
    calls itself through another would)."""
    return _StepNodes(g, chain, k, iv).allowed


class _StepNodes:
    __slots__ = ("g", "t", "prev", "side", "pulled", "nodes", "carried_side", "given", "lane_owner", "lane")

    def __init__(self, g: Graph, chain: Chain, k: int, iv):
        st = chain.steps[k]
        fwd = chain.direction == "forward"
        self.g, self.t, self.prev, self.side = g, st.t, st.t - 1 if fwd else st.t + 1, 1 if fwd else 0
        self.pulled, self.nodes = st.pulled, iv.nodes
        self.carried_side: dict[int, bool] = {}
        self.given = chain.given
        self.lane_owner, self.lane = st.lane_owner, st.lane

    def allowed(self, n: NodeProto) -> bool:
        k = id(n)
        if self.lane_owner is not None and self.lane_owner.get(k, self.lane) not in (self.lane, SHARED):
            return False  # another cell's, beside this one in the step (see .lanes)
        if k in self.pulled:
            return True
        v = self.nodes.get(k)
        if v is None:
            # constants-and-shapes-only nodes (a zero state's matmul) are evaluated wherever they are read; a
            # given constant initial state (a learned c0 broadcast to the batch) is read as an older value
            return bool(n.output) and shape_derived(self.g, n.output[0]) and n.output[0] not in self.given
        return v[self.side] == self.t or (v[self.side] == self.prev and self._carried_side(n))

    def _carried_side(self, n: NodeProto) -> bool:
        """A node placed in the step before, computed from one carried value and constants only and read only
        by this step (an LSTM peephole p*c): it belongs to this step, as h @ R does."""
        k = id(n)
        carried_side, g = self.carried_side, self.g
        if k not in carried_side:
            carried_side[k] = False  # (while its consumers are asked)
            # (other inputs must be true constants: 0 + m*new with a runtime-shaped zero is a state itself)
            dyn = [i for i in n.input if i and g.const(i) is None]
            users = [c for o in n.output if o for c in g.uses(o)]
            carried_side[k] = (n.op_type in _CARRIED_SIDE and len(dyn) == 1 and bool(users)
                               and not any(g.is_graph_output(o) for o in n.output if o)
                               and all(self.allowed(c) for c in users))
        return carried_side[k]


# ops with constants that may sit between a carried value and the step reading it (the recogniser then
# decides what they mean: p*c is a peephole, c @ P is not)
_CARRIED_SIDE = {"Mul", "Add", "Sub", "Div", "Neg", "Unsqueeze", "Squeeze", "Identity", "Reshape", "MatMul", "Gemm", "Einsum"}


# activations a step's h may come out of: when the step also reads that activation's input, the "h" the
# threading found is an input feed of act(h) (cat(x, tanh(h))), not the carried state
_ACTIVATIONS = {"Tanh", "Sigmoid", "Relu", "LeakyRelu", "Elu", "Celu", "Softsign", "Softplus", "HardSigmoid"}


def fed_through(g: Graph, h_in: str | None) -> tuple[str, str] | None:
    """``(input, op)`` when the step's h is an activation of one older tensor."""
    p = g.producer.get(h_in) if h_in is not None else None
    if p is None or p.op_type not in _ACTIVATIONS or not p.input:
        return None
    return p.input[0], p.op_type


class Foreign:
    """The one older value (besides h) a step may read: the LSTM cell state."""

    def __init__(self, t: int, fed: tuple[str, str] | None = None):
        self.t = t
        self.fed = fed
        self.name: str | None = None

    def __call__(self, name: str) -> str:
        if self.fed is not None and name == self.fed[0]:
            raise Decline(f"step {self.t} reads its state both directly and through {self.fed[1]} into the input "
                          f"matmul (an input feed of {self.fed[1]}(h)): a native op's weights read h itself")
        if self.name is None:
            self.name = name
        elif name != self.name:
            raise Decline(f"step {self.t} reads more than two carried values ('{self.name}', '{name}')")
        return "c"

# the state atoms of a chain's cell: hidden state, LSTM cell state, an extra carried output (Keras' masked output)
H_STATE = State("h", None)
C_STATE = State("c", None)
Y_STATE = State("y", None)

class StepEval:
    """Symbolic evaluation of one step: x, mask and h are leaves, the one other older value is state c."""

    def __init__(self, g: Graph, chain: Chain, k: int, iv, h_in: str | None, x_atom: StepInput, x_value=None):
        st = chain.steps[k]
        self.foreign = Foreign(st.t, fed_through(g, h_in))
        leaves = {st.x: x_value if x_value is not None else SymTensor(Poly.atom(x_atom))}
        given = chain.given  # (a constant fill of the batch's shape that is a given initial state: a state)
        if h_in is not None:
            fv = g.fill_value(h_in) if h_in not in given else None
            leaves[h_in] = SymTensor(Poly.atom(H_STATE), lead_of(g, h_in) or 0) if fv is None else Fill(np.array(fv, dtype=np.float32))
        for m, sym in st.masks.items():  # (a float family is the 0/1 Cast of a bool one: see families.mask_source)
            unit = rank_of(g, m) == 2
            if g.model.elem_type(m) == TensorProto.BOOL:
                leaves[m] = BoolMask(sym, False, unit)
            else:
                leaves[m] = SymTensor(Poly.atom(Mask(sym))) if unit else MaskVector(Poly.atom(Mask(sym)))

        seen = self.foreign  # (not through self: the evaluator holding this function would hold self, a cycle)

        def foreign(name: str):
            fv = g.fill_value(name) if name not in given else None
            if fv is not None:  # a zero (or constant) state of runtime shape, e.g. ConstantOfShape(Shape(x))
                return Fill(np.array(fv, dtype=np.float32))
            seen(name)
            return SymTensor(Poly.atom(C_STATE), lead_of(g, name) or 0)

        self.ev = StepEvaluator(g, leaves, may_evaluate=allowed_fn(g, chain, k, iv), foreign=foreign, content_keys=True,
                                not_constant=given)
        shape = g.model.shape(st.x) or []  # ([B, F], or [1, B, F]: the batch size, when the model fixes it)
        rows = shape[-2] if len(shape) >= 2 else None
        self.ev.batch = rows if isinstance(rows, int) and rows > 0 else None

    def poly(self, name: str) -> Poly:
        return self.ev.poly(name)


def same_at_zero_state(p: Poly, zeroed: Poly) -> bool:
    """Whether a first step's maths ``p`` is the reference cell with its initial states at zero (``zeroed``),
    compared loosely, or else by value: a matmul of the zero state leaves its bias alone, which the exporter
    may fold into a constant (hidden size 1: ``b_hh`` is a scalar offset or coefficient) where the reference
    step with its state set to zero keeps a bias-only affine map."""

    def scalar_bias(a):
        if isinstance(a, LinAtom) and not a.lin.terms:
            b = a.lin.bias_sum()
            if b is not None and b.size and np.all(b == b.ravel()[0]):
                return Poly.const(float(b.ravel()[0]))
        return None

    def by_value(q: Poly):
        return loose_key(fold_offsets(substitute(q, scalar_bias)))

    return loose_key(p) == loose_key(zeroed) or by_value(p) == by_value(zeroed)
