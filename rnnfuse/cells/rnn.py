"""ONNX ``RNN``: one gate, ``h' = f(x @ Wi + h @ Ri + Wbi + Rbi)``."""

from __future__ import annotations

from ..errors import Decline
from ..symbolic import LinAtom, Poly
from .kind import CellKind, gate
from .match import check_sources, gate_parts, make_spec


class RnnKind(CellKind):
    op = "RNN"
    gates = ("i",)
    default_acts = (("Tanh", ()),)
    states = ("h",)

    def looks_like(self, new_h: Poly) -> bool:
        return new_h.single_atom() is not None

    def match(self, new, x, states, h, c):
        p = new[h]
        hs = states[h]
        sa = p.single_atom()
        if not sa or sa[1] != 1.0:
            raise Decline(f"the new state is not one activation ({p!r})")
        atom = sa[0]
        if isinstance(atom, LinAtom):  # a linear (activation=None) RNN
            act, lin, clip = ("Affine", (1.0, 0.0)), atom.lin, None
        else:
            act, lin, clip = gate_parts(Poly.atom(atom), "the RNN gate")
        check_sources(lin, {x.key, hs.key}, "the RNN gate")
        return make_spec(self, x, hs, {"i": lin}, (act,), clip)

    def step_polys(self, spec, x, h, c):
        return {"h": gate(spec.gates["i"], spec.acts[0], spec.clip)}


RNN = RnnKind()
