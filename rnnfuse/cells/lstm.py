"""ONNX ``LSTM``: gates i, o, f, c; ``c' = f*c + i*g(..)``, ``h' = o*h_act(c')``.

Peephole weights (input ``P``) are not modelled: a step that reads ``c`` inside a gate is declined by the
matcher, and a native LSTM with ``P`` inside a step is declined by :meth:`CellKind.check_native`.
"""

from __future__ import annotations

from ..errors import Decline
from ..symbolic import ACTIVATIONS, Act, Poly
from .kind import CellKind, gate
from .match import check_sources, gate_parts, make_spec
from .spec import act_name


class LstmKind(CellKind):
    op = "LSTM"
    gates = ("i", "o", "f", "c")
    default_acts = (("Sigmoid", ()), ("Tanh", ()), ("Tanh", ()))
    states = ("h", "c")
    extra_inputs = {"P": "peephole weights"}

    def match(self, new, x, states, h, c):
        pc, ph = new[c], new[h]
        hs, cs = states[h], states[c]
        fc, ig = _forget_and_input_terms(pc, cs)
        h_act_atom, o_atom = _output_factors(ph, pc)
        f_act, f_lin, clip_f = gate_parts(fc, "the forget gate")
        o_act, o_lin, clip_o = gate_parts(o_atom, "the output gate")
        a1, a2 = ig
        p1, p2 = gate_parts(a1, "an input/cell gate"), gate_parts(a2, "an input/cell gate")
        if p1[0] == f_act:  # i shares the gates' activation; g is the other factor
            (i_act, i_lin, clip_i), (g_act, g_lin, clip_g) = p1, p2
        else:
            (i_act, i_lin, clip_i), (g_act, g_lin, clip_g) = p2, p1
        if not (f_act == o_act == i_act):
            raise Decline(
                f"gate activations differ (i={act_name(i_act)}, f={act_name(f_act)}, o={act_name(o_act)}); "
                "a native LSTM applies one activation to i, f and o"
            )
        if h_act_atom.kind not in ACTIVATIONS:
            raise Decline(f"the output activation {h_act_atom.kind} is not available in native ops")
        clips = {clip_f, clip_o, clip_i, clip_g}
        if len(clips) != 1:
            raise Decline("gates are clipped differently")
        gates = {"i": i_lin, "o": o_lin, "f": f_lin, "c": g_lin}
        for g, lin in gates.items():
            check_sources(lin, {x.key, hs.key}, f"LSTM gate {g}")
        acts = (f_act, g_act, (h_act_atom.kind, h_act_atom.params))
        return make_spec(self, x, hs, gates, acts, clips.pop())

    def step_polys(self, spec, x, h, c):
        f_act, g_act, h_act = spec.acts
        i = gate(spec.gates["i"], f_act, spec.clip)
        o = gate(spec.gates["o"], f_act, spec.clip)
        f = gate(spec.gates["f"], f_act, spec.clip)
        g = gate(spec.gates["c"], g_act, spec.clip)
        c_new = f.mul(c).add(i.mul(g))
        h_new = o.mul(Poly.atom(Act(h_act[0], h_act[1], c_new)))
        return {"h": h_new, "c": c_new}


def _forget_and_input_terms(pc: Poly, cs):
    """``c' = f*c + i*g``: the atom multiplying c, and the two activations of the other product."""
    if len(pc.terms) != 2 or any(v != 1.0 for v in pc.terms.values()):
        raise Decline(f"the cell state update is not f*c + i*g ({pc!r})")
    fc = ig = None
    for m in pc.terms:
        atoms = [pc.atoms[k] for k in m]
        if len(atoms) == 2 and cs.key in m:
            fc = next(a for a in atoms if a.key != cs.key)
        elif len(atoms) == 2 and all(isinstance(a, Act) for a in atoms):
            ig = atoms
    if fc is None or ig is None:
        raise Decline(f"the cell state update is not f*c + i*g ({pc!r})")
    return fc, ig


def _output_factors(ph: Poly, pc: Poly):
    """``h' = o * act(c')``: the activation of the new cell state, and the output gate."""
    if len(ph.terms) != 1 or list(ph.terms.values())[0] != 1.0:
        raise Decline(f"the hidden output is not o*act(c) ({ph!r})")
    (m,) = ph.terms
    atoms = [ph.atoms[k] for k in m]
    oc = [a for a in atoms if isinstance(a, Act) and a.arg.key == pc.key]
    if len(atoms) != 2 or not oc:
        raise Decline("the hidden output is not o*act(new c)" + (" (peephole or projection?)" if len(atoms) > 2 else ""))
    h_act_atom = oc[0]
    return h_act_atom, next(a for a in atoms if a is not h_act_atom)


LSTM = LstmKind()
