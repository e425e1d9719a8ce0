"""A native LSTM/GRU/RNN op inside a step (TorchScript loops hold a one-step LSTM): its maths as polynomials.

The symbolic evaluator knows ONNX's elementwise and matmul ops; the semantics of native cells live here, in
the cells layer, and are registered with the evaluator as the handler for each kind's op type.
"""

from __future__ import annotations

from ..errors import Decline
from ..graph import attr
from ..symbolic import Const, ConstRef, Poly, ConcatRows, State, SymTensor, as_rows, input_product_lin, register_handler
from .kinds import KINDS


def native_step_polys(ev, node, ins):
    """Evaluate a native recurrent op with one time step over symbolic inputs."""
    kind = KINDS[node.op_type]
    op = kind.op
    if attr(node, "direction", "forward") == "bidirectional":
        raise Decline("a bidirectional native op inside a step")
    if attr(node, "layout", 0):
        raise Decline("a native op with layout=1 inside a step")
    names = kind.inputs
    vals = dict(zip(names, list(ins[: len(names)]) + [None] * (len(names) - len(ins))))
    for k in ("W", "R"):
        if not isinstance(vals[k], Const):
            raise Decline(f"the {k} weights of the inner {op} are computed at runtime")
    if vals["B"] is not None and not isinstance(vals["B"], Const):
        raise Decline("the inner op's bias is computed at runtime")
    if vals["sequence_lens"] is not None:
        raise Decline("an inner op with sequence_lens")
    kind.check_native(node, vals)
    x_lin = None
    try:
        x_poly, x_atom, fed = _step_input(vals["X"])
    except Decline:
        # several step inputs, summed or side by side (a residual stack's upper cell: X = y1_t + x_t, or
        # cat(y1_t, x_t)): its product with W, as read
        xv = vals["X"]
        x_lin = input_product_lin(xv, ConstRef.of(vals["W"].arr[0]).T())
        if x_lin is None:
            raise
        x_poly, x_atom, fed = (xv.poly if isinstance(xv, SymTensor) else None), None, None
    h_atom = _carried_state(vals["initial_h"])
    state_polys = {"h": Poly.atom(h_atom)}
    for s in kind.states[1:]:
        v = vals[f"initial_{s}"]
        if not isinstance(v, SymTensor) or v.lead != 1:
            raise Decline(f"the inner op's initial_{s} is not the carried state")
        state_polys[s] = v.poly
    B = vals["B"].arr if vals["B"] is not None else None
    W = vals["W"].arr
    if fed is not None:  # X = cat(x_t, h): the h columns of W are recurrent weights (they add to R's)
        if fed != h_atom.key:
            raise Decline("the inner op's input appends a value other than its own hidden state")
        width = int(x_atom.ncols) if x_atom.ncols is not None else None
        if width is None or W.shape[-1] <= width:
            raise Decline("the inner op's input appends the hidden state with an unknown split")
        spec = kind.spec_from_onnx(node, W[..., :width], vals["R"].arr, B, x_atom.key, h_atom.key,
                                   fed=(h_atom.key, W[..., width:]))
    else:
        spec = kind.spec_from_onnx(node, W, vals["R"].arr, B, x_atom.key if x_atom else None, h_atom.key, x_lin=x_lin)
    polys = spec.step_polys(x_poly, state_polys["h"], state_polys.get("c"))
    outs = [SymTensor(polys["h"], 2)] + [SymTensor(polys[s], 1) for s in kind.states]
    return outs[: len(node.output)]


def _step_input(xv):
    """The step input (its polynomial and atom) and the key of a state appended to it (input feeding), or None."""
    xrow = as_rows(xv) if isinstance(xv, (SymTensor, ConcatRows)) else None
    if xrow is None or xrow.lead != 1 or len(xrow.segments) not in (1, 2):
        raise Decline("the inner op's input is not the step input")
    x_poly = xrow.segments[0][2]
    x_atom = next(iter(x_poly.atoms.values()), None)
    if x_atom is None or x_atom.key[0] != "X":
        raise Decline("the inner op's input is not the step input")
    fed = None
    if len(xrow.segments) == 2:
        src, _, seg_poly = xrow.segments[1]
        sa = seg_poly.single_atom()
        if src[0] != "S" or not sa or sa[1] != 1.0:
            raise Decline("the inner op's input appends something other than a carried state")
        fed = src
    return x_poly, x_atom, fed


def _carried_state(hv) -> State:
    if not isinstance(hv, SymTensor) or hv.lead != 1:
        raise Decline("the inner op's initial_h is not the carried state")
    hsa = hv.poly.single_atom()
    if not hsa or not isinstance(hsa[0], State) or hsa[1] != 1.0:
        raise Decline("the inner op's initial_h is not the carried state")
    return hsa[0]


for _op in KINDS:
    register_handler(_op, native_step_polys)
