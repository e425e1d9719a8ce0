"""ONNX ``LSTM``: gates i, o, f, c; ``c' = f*c + i*g(..)``, ``h' = o*h_act(c')``.

Peepholes (ONNX input ``P``, ``[D, 3H]`` in the order i, o, f): the input and forget gates may add ``p ⊙ c``
of the previous cell state, the output gate ``p ⊙ c'`` of the new one, each with its own vector (a gate
without a peephole has zeros). The matcher reads them from the gate arguments; any other way a gate reads
the cell state (the output gate reading the old c, a matrix ``c @ P``, a peephole inside the clip) is
declined with what differed. A native LSTM with ``P`` met inside a step is still declined.

Coupled input and forget gates (CIFG, ``c' = (1 - i)*c + i*g`` or ``f*c + (1 - f)*g``): the gate written as
one minus the other is, for a sigmoid or a hard sigmoid centred on 0.5, the same activation of the other's
negated affine map, so an ordinary LSTM computes it with those weights (ONNX's ``input_forget`` would say the
same, but OpenVINO ignores it: measured, it computes a free forget gate).
"""

from __future__ import annotations

import numpy as np

from ..errors import Decline
from ..symbolic import ACTIVATIONS, Act, LinAtom, Poly, State
from .kind import CellKind, activate, gate
from .match import IDENTITY, SOFTPLUS_WHY, check_sources, gate_parts, make_spec, split_scalar_offset, with_uniform_bias
from .spec import act_name

PEEPHOLE_GATES = ("i", "o", "f")  # ONNX's order of P


class LstmKind(CellKind):
    op = "LSTM"
    gates = ("i", "o", "f", "c")
    default_acts = (("Sigmoid", ()), ("Tanh", ()), ("Tanh", ()))
    states = ("h", "c")
    extra_inputs = {"P": "peephole weights"}

    def match(self, new, x, states, h, c):
        pc, ph = new[c], new[h]
        hs, cs = states[h], states[c]
        one_minus = _coupled_gates(pc, cs)
        fc, ig, coupled = one_minus if one_minus else (*_forget_and_input_terms(pc, cs), None)
        h_act_atom, o_atom = _output_factors(ph, pc)
        old_c, new_c = Poly.atom(cs), pc
        peep = {}
        fc, peep["f"] = _peephole(fc, "the forget gate", old_c, new_c, cs)
        o_atom, peep["o"] = _peephole(o_atom, "the output gate", new_c, old_c, cs)
        a1, a2 = ig
        a1, p1_peep = _peephole(a1, "an input/cell gate", old_c, new_c, cs)
        a2, p2_peep = _peephole(a2, "an input/cell gate", old_c, new_c, cs)
        f_act, f_lin, clip_f = gate_parts(fc, "the forget gate")
        o_act, o_lin, clip_o = gate_parts(o_atom, "the output gate")
        p1, p2 = gate_parts(a1, "an input/cell gate"), gate_parts(a2, "an input/cell gate")
        if (p1[0] == f_act) if p1_peep is None and p2_peep is None else p1_peep is not None:
            # i shares the gates' activation (and is the one that may have a peephole); g is the other factor
            (i_act, i_lin, clip_i), (g_act, g_lin, clip_g), peep["i"], g_peep = p1, p2, p1_peep, p2_peep
        else:
            (i_act, i_lin, clip_i), (g_act, g_lin, clip_g), peep["i"], g_peep = p2, p1, p2_peep, p1_peep
        if g_peep is not None:
            raise Decline("both factors of i*g read the cell state (a peephole on the cell candidate?)")
        if not (f_act == o_act == i_act):
            raise Decline(
                f"gate activations differ (i={act_name(i_act)}, f={act_name(f_act)}, o={act_name(o_act)}); "
                "a native LSTM applies one activation to i, f and o"
            )
        if h_act_atom.kind not in ACTIVATIONS and (h_act_atom.kind, h_act_atom.params) != IDENTITY:
            raise Decline(f"the output activation {h_act_atom.kind} is not available in native ops")
        if h_act_atom.kind == "Softplus":  # (its argument, the cell state, is never clipped)
            raise Decline(f"the output activation is Softplus: {SOFTPLUS_WHY}")
        clips = {clip_f, clip_o, clip_i, clip_g}
        if len(clips) != 1:
            raise Decline("gates are clipped differently")
        gates = {"i": i_lin, "o": o_lin, "f": f_lin, "c": g_lin}
        for g, lin in gates.items():
            check_sources(lin, {x.key, hs.key}, f"LSTM gate {g}")
        acts = (f_act, g_act, (h_act_atom.kind, h_act_atom.params))
        peep = {g: m for g, m in peep.items() if m is not None}
        extra = {"peepholes": peep} if peep else {}
        if coupled == ONE_MINUS_F:  # f = 1 - a(z) = a(-z): the op's forget weights are z's negated
            if "f" in peep:
                raise Decline("a forget gate written 1 - a gate, with a peephole")
            extra["forget_one_minus"], gates["f"] = f_lin, f_lin.scaled(-1.0)
        elif coupled:
            extra["coupled"] = coupled
        return make_spec(self, x, hs, gates, acts, clips.pop(), extra)

    def describe_extras(self, spec):
        peep = spec.extra.get("peepholes")
        out = ["peepholes=" + ",".join(g for g in PEEPHOLE_GATES if g in peep)] if peep else []
        coupled = spec.extra.get("coupled")
        if coupled:
            out.append("forget gate = 1 - input gate" if coupled == "f" else "input gate = 1 - forget gate")
        if "forget_one_minus" in spec.extra:
            out.append("forget gate written 1 - a gate")
        return out

    def step_polys(self, spec, x, h, c):
        f_act, g_act, h_act = spec.acts
        peep = spec.extra.get("peepholes", {})

        def pre(g, cell_state):  # the gate's argument: x@W + h@R + b (+ p*c)
            arg = Poly.atom(LinAtom(spec.gates[g]))
            return arg.add(peep[g].mul(cell_state)) if g in peep else arg

        i = activate(f_act, pre("i", c), spec.clip)
        f = activate(f_act, pre("f", c), spec.clip)
        # coupled gates: the one written as one minus the other is, for the symmetric activations a coupling
        # is read with, that activation of the other's negated map (see _coupled_gates), which the weights hold
        coupled = spec.extra.get("coupled")
        if coupled == "f":
            f = Poly.const(1.0).sub(i)
        elif coupled == "i":
            i = Poly.const(1.0).sub(f)
        elif "forget_one_minus" in spec.extra:  # (as the graph spells it: one minus the gate of z)
            f = Poly.const(1.0).sub(activate(f_act, Poly.atom(LinAtom(spec.extra["forget_one_minus"])), spec.clip))
        g = gate(spec.gates["c"], g_act, spec.clip)
        c_new = f.mul(c).add(i.mul(g))
        o = activate(f_act, pre("o", c_new), spec.clip)
        h_new = o.mul(activate(h_act, c_new, None))
        return {"h": h_new, "c": c_new}

    def extra_arrays(self, spec, dtype=np.float32) -> dict:
        """``P`` ([3H], gates i, o, f) when the cell has peepholes."""
        peep = spec.extra.get("peepholes")
        if not peep:
            return {}
        H = spec.hidden
        parts = []
        for g in PEEPHOLE_GATES:
            m = peep.get(g)
            if m is None:
                parts.append(np.zeros(H, dtype))
            elif m.is_const():
                parts.append(np.full(H, m.const_value(), dtype))
            else:
                (atom, _), = [m.single_atom()]
                parts.append(np.asarray(atom.lin.bias_sum(), dtype=dtype))
        return {"P": np.concatenate(parts)}

    def extra_input_shape(self, name: str, spec_hidden: int) -> tuple:
        return (3 * spec_hidden,)


def _peephole(atom, what: str, own_c: Poly, other_c: Poly, cs: State):
    """``act(lin + p ⊙ c)`` -> (``act(lin)``, the multiplier of c: a bias-only LinAtom poly, a scalar, or None).

    ``own_c`` is the cell state a native peephole of this gate reads (old c for i and f, new c for o)."""
    if not isinstance(atom, Act) or atom.kind == "Clip":
        return atom, None
    arg = atom.arg
    if cs.key not in _atom_keys_deep(arg):
        return atom, None
    sa = arg.single_atom()
    if sa and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        raise Decline(f"{what} reads the cell state inside a clip (peephole with clip is not modelled)")
    lin_terms = {m: coef for m, coef in arg.terms.items() if len(m) == 1 and arg.atoms[m[0]].__class__ is LinAtom}
    if len(lin_terms) != 1 or next(iter(lin_terms.values())) != 1.0:
        raise Decline(f"{what} reads the cell state elementwise, not as x@W + h@R + b + p*c ({arg!r})")
    (lin_m,) = lin_terms
    # (a scalar besides, TF's forget_bias of 1, adds to the gate's bias like any other)
    rest, offset = split_scalar_offset(Poly({m: coef for m, coef in arg.terms.items() if m != lin_m}, arg.atoms))
    lin_atom = arg.atoms[lin_m[0]] if not offset else LinAtom(with_uniform_bias(arg.atoms[lin_m[0]].lin, offset))
    mult = _multiplier(rest, own_c)
    if mult is None:
        if _multiplier(rest, other_c) is not None:
            which = "previous" if other_c.single_atom() is not None else "new"
            raise Decline(f"{what}'s peephole reads the {which} cell state; a native LSTM's "
                          f"{'output gate reads the new' if which == 'previous' else 'input and forget gates read the previous'} one")
        raise Decline(f"{what} reads the cell state, but not as a diagonal peephole p*c ({arg!r})")
    return Act(atom.kind, atom.params, Poly.atom(lin_atom)), mult


def _multiplier(rest: Poly, c: Poly) -> Poly | None:
    """``m`` with ``rest == m * c`` for a per-unit constant m (a bias-only affine map, or a scalar), else None."""
    if not rest.terms or not c.terms:
        return None
    vectors = [a for k, a in rest.atoms.items() if k not in c.atoms and isinstance(a, LinAtom) and not a.lin.terms]
    if len(vectors) == 1:
        mult = Poly.atom(vectors[0])
    elif not vectors:
        m0 = next(iter(c.terms))
        if m0 not in rest.terms:
            return None
        mult = Poly.const(rest.terms[m0] / c.terms[m0])
    else:
        return None
    return mult if mult.mul(c).key == rest.key else None


def _atom_keys_deep(p: Poly) -> set:
    """Keys of every atom in ``p``, inside activation arguments too."""
    out = set()
    for a in p.atoms.values():
        out.add(a.key)
        if isinstance(a, Act):
            out |= _atom_keys_deep(a.arg)
    return out


def _forget_and_input_terms(pc: Poly, cs):
    """``c' = f*c + i*g``: the atom multiplying c, and the two activations of the other product."""
    sa = pc.single_atom()
    if sa and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        raise Decline(f"the cell state itself is clipped to [{sa[0].params[0]:g}, {sa[0].params[1]:g}]; ONNX's clip "
                      "bounds the gate inputs, not the cell state")
    if len(pc.terms) != 2 or any(v != 1.0 for v in pc.terms.values()):
        raise Decline(f"the cell state update is not f*c + i*g ({pc!r})")
    fc = ig = None
    for m in pc.terms:
        atoms = [pc.atoms[k] for k in m]
        if len(atoms) == 2 and cs.key in m:
            fc = next(a for a in atoms if a.key != cs.key)
        elif len(atoms) == 2 and all(isinstance(a, (Act, LinAtom)) for a in atoms) and \
                any(isinstance(a, Act) for a in atoms):
            ig = atoms  # a gate and the candidate (an affine map itself when it has no activation)
    if fc is None or ig is None:
        raise Decline(f"the cell state update is not f*c + i*g ({pc!r})")
    return fc, ig


def _coupled_gates(pc: Poly, cs: State):
    """A cell whose input and forget gates are coupled (CIFG: ``c' = (1 - i)*c + i*g``, or ``f*c + (1 - f)*g``)
    read as an ordinary LSTM's ``f*c + i*g``: ``(the forget gate atom, [the input gate, the candidate], which
    gate is the dependent one: "f" or "i")``, or None when ``pc`` has not that form; a forget gate of its own
    written as one minus a gate (``c - a*c + i*g``) is read alike, as ``(a, [i, g], ONE_MINUS_F)``. The gate written as one minus the other is that other gate's
    activation of its negated affine map, ``1 - sigmoid(z) = sigmoid(-z)`` (so the native op needs no
    ``input_forget``, which OpenVINO ignores: measured, it computes a free forget gate).
    Declined when the gates' activation has no such mirror."""
    if len(pc.terms) != 3:
        return None
    one = {m[0]: coef for m, coef in pc.terms.items() if len(m) == 1}
    two = {m: coef for m, coef in pc.terms.items() if len(m) == 2}
    if len(one) != 1 or len(two) != 2 or set(one.values()) != {1.0}:
        return None
    (single,) = one
    with_c = [m for m in two if cs.key in m]
    without = [m for m in two if cs.key not in m]
    if len(with_c) != 1 or len(without) != 1:
        return None
    (mc,), (mg,) = with_c, without
    gate_key = next((k for k in mc if k != cs.key), None)  # (None: c * c)
    if gate_key is None:
        return None
    if gate_key not in mg:  # c - a*c + i*g: a forget gate of its own, written 1 - a (jax's f = 1 - sigmoid(z))
        ig = [pc.atoms[k] for k in mg]
        if single == cs.key and two[mc] == -1.0 and two[mg] == 1.0 and len(ig) == 2 and all(
                isinstance(a, (Act, LinAtom)) for a in ig) and any(isinstance(a, Act) for a in ig):
            _mirrored(pc.atoms[gate_key], "the forget gate (1 - a gate)")  # (declines an activation with no mirror)
            return pc.atoms[gate_key], ig, ONE_MINUS_F
        return None
    other_key = next((k for k in mg if k != gate_key), None)
    if other_key is None:
        return None
    gate, other = pc.atoms[gate_key], pc.atoms[other_key]
    if single == cs.key and two[mc] == -1.0 and two[mg] == 1.0:  # c - i*c + i*g: f = 1 - i
        i_atom, g_atom = gate, other
        return _mirrored(i_atom, "the forget gate (1 - the input gate)"), [i_atom, g_atom], "f"
    if single == other_key and two[mc] == 1.0 and two[mg] == -1.0:  # f*c + g - f*g: i = 1 - f
        return gate, [_mirrored(gate, "the input gate (1 - the forget gate)"), other], "i"
    return None


ONE_MINUS_F = "1-f"  # (a forget gate of its own written one minus a gate: see _coupled_gates)


def _mirrored(gate, what: str) -> Act:
    """``1 - gate`` as one gate: the same activation of the negated affine map (sigmoid, and a hard sigmoid
    centred on 0.5, are symmetric: ``1 - a(z) = a(-z)``)."""
    if not isinstance(gate, Act):
        raise Decline(f"{what} is not one minus an activation")
    act, lin, clip = gate_parts(gate, what)
    name, params = act
    if not (name == "Sigmoid" or (name == "HardSigmoid" and len(params) == 2 and params[1] == 0.5)):
        raise Decline(f"{what} is 1 - {act_name(act)}(z), which is no {act_name(act)} of an affine map")
    arg = Poly.atom(LinAtom(lin.scaled(-1.0)))
    if clip is not None:  # (a symmetric clip: clip(-z) = -clip(z))
        arg = Poly.atom(Act("Clip", (-clip, clip), arg))
    return Act(name, params, arg)


def _output_factors(ph: Poly, pc: Poly):
    """``h' = o * act(c')``: the activation of the new cell state, and the output gate. ``o * c'`` (no output
    activation) is the identity, Affine(1, 0), of c'."""
    for a in ph.atoms.values():
        if isinstance(a, Act) and len(ph.terms) == len(pc.terms) > 1 and Poly.atom(a).mul(pc).key == ph.key:
            return Act(*IDENTITY, pc), a
    if len(ph.terms) != 1 or list(ph.terms.values())[0] != 1.0:
        raise Decline(f"the hidden output is not o*act(c) ({ph!r})")
    (m,) = ph.terms
    atoms = [ph.atoms[k] for k in m]
    oc = [a for a in atoms if isinstance(a, Act) and a.arg.key == pc.key]
    near = [a for a in atoms if isinstance(a, Act) and set(a.arg.atoms) & set(pc.atoms)]
    if len(atoms) == 2 and not oc and near:
        raise Decline(f"the output activation {near[0].kind} is not of the new cell state ({pc!r}) but of {near[0].arg!r}")
    if len(atoms) != 2 or not oc:
        raise Decline("the hidden output is not o*act(new c)" + (" (peephole or projection?)" if len(atoms) > 2 else ""))
    h_act_atom = oc[0]
    return h_act_atom, next(a for a in atoms if a is not h_act_atom)


LSTM = LstmKind()
