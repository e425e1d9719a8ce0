"""ONNX ``RNN``: one gate, ``h' = f(x @ Wi + h @ Ri + Wbi + Rbi)``."""

from __future__ import annotations

from ..errors import Decline
from ..symbolic import LinAtom, Poly
from .kind import CellKind, gate
from .match import IDENTITY, check_sources, gate_parts, make_spec, with_diagonal_weights


class RnnKind(CellKind):
    op = "RNN"
    gates = ("i",)
    default_acts = (("Tanh", ()),)
    states = ("h",)

    def looks_like(self, new_h: Poly) -> bool:
        return (new_h.single_atom() is not None or new_h.as_lin_offset() is not None
                or with_diagonal_weights(new_h) is not None)

    def match(self, new, x, states, h, c):
        p = new[h]
        hs = states[h]
        sa = p.single_atom()
        linear = p.as_lin_offset()
        if sa and sa[1] == 1.0 and not isinstance(sa[0], LinAtom):
            act, lin, clip = gate_parts(Poly.atom(sa[0]), "the RNN gate")
        elif linear is not None:
            # a linear RNN, a * (x @ W + h @ R + b) + c (activation None, or scaled and shifted): ONNX's
            # Affine(alpha=a, beta=c) applied to the gate, exactly
            lin, a, b = linear
            act, clip = ("Affine", (a, b)), None
        elif (diagonal := with_diagonal_weights(p)) is not None:
            # a linear RNN reading its state elementwise, u * h + x @ W + b (a running sum h + W x_t, a leaky
            # linear integrator): R = diag(u) (exact zeros off it) under the identity activation
            lin, act, clip = diagonal, IDENTITY, None
        else:
            raise Decline(f"the new state is not one activation ({p!r})")
        check_sources(lin, {x.key, hs.key}, "the RNN gate")
        return make_spec(self, x, hs, {"i": lin}, (act,), clip)

    def step_polys(self, spec, x, h, c):
        return {"h": gate(spec.gates["i"], spec.acts[0], spec.clip)}


RNN = RnnKind()
