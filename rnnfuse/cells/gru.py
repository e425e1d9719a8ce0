"""ONNX ``GRU``: gates z, r, h; ``h' = (1-z)*n + z*h`` with the candidate ``n`` in one of two forms.

The update gate may also be written the other way round, ``h' = z*n + (1-z)*h`` (hand-written GRUs, JAX
examples, the minimal gated unit): that is the native cell with the z rows of W and R and both z biases
negated, since ``1 - a(x) = a(-x)`` for the gate activations that have that symmetry (sigmoid, and
hard_sigmoid with beta 0.5). ``extra["update_takes_candidate"]`` marks it; the step polynomials keep the
graph's own z (so the proof compares like with like), and only the ONNX weights are negated.

``linear_before_reset=1``: ``n = g(x @ Wh + Wbh + r * (h @ Rh + Rbh))`` -- the recurrent part is kept in
``extra["rec_h"]``. ``linear_before_reset=0``: ``n = g(x @ Wh + (r*h) @ Rh + b)`` -- the candidate's Lin reads
the gated row r*h, whose key is ``extra["gated_key"]``.
"""

from __future__ import annotations

from ..errors import Decline
from ..graph import attr
from ..symbolic import ACTIVATIONS, GATED_ROW, Act, LinAtom, Poly
from .kind import CellKind, activate, bias_of, gate, split_biases, weight_block
from .match import (IDENTITY, SOFTPLUS_SAFE, SOFTPLUS_WHY, check_sources, gate_parts, make_spec, split_scalar_offset,
                    with_uniform_bias)


class GruKind(CellKind):
    op = "GRU"
    gates = ("z", "r", "h")
    default_acts = (("Sigmoid", ()), ("Tanh", ()))
    states = ("h",)

    def looks_like(self, new_h: Poly) -> bool:
        return new_h.single_atom() is None

    def extra_attributes(self, spec):
        return {"linear_before_reset": int(spec.extra.get("linear_before_reset", 0))}

    def describe_extras(self, spec):
        return [f"linear_before_reset={spec.extra.get('linear_before_reset', 0)}"]

    def match(self, new, x, states, h, c):
        p = new[h]
        hs = states[h]
        try:
            z, n, flipped = _update_and_candidate(p, hs)
        except Decline as d:
            z, n, flipped = _blend_of_linear_candidate(p, hs, d)
        z_act, z_lin, clip_z = gate_parts(z, "the update gate")
        if flipped and not _complement_is_reflection(z_act):
            raise Decline(f"the update gate takes the candidate (z*n + (1-z)*h) and its activation {z_act[0]} "
                          "has no exact 1 - a(x) = a(-x), so it cannot become a native z by negated weights")
        (arg, clip_n), n_act = (_unclipped(n.arg), (n.kind, n.params)) if isinstance(n, Act) else ((n, None), IDENTITY)
        if n_act[0] not in ACTIVATIONS and n_act != IDENTITY:
            raise Decline(f"the candidate activation {n_act[0]} is not available in native ops")
        if n_act[0] == "Softplus" and (clip_n is None or clip_n > SOFTPLUS_SAFE):
            raise Decline(f"the candidate activation is Softplus: {SOFTPLUS_WHY}")
        # a candidate bias whose entries are all equal is a scalar term outside both forms' affine parts; it adds
        # to the input part's bias (outside the reset product in either form)
        arg, offset = split_scalar_offset(arg)
        if len(arg.terms) >= 2:  # x @ Wh + r * (h @ Rh) (+ b * r for a uniform Rbh); else one affine map
            h_lin, r, extra = _candidate_linear_before_reset(arg)
        else:
            h_lin, r, extra = _candidate_gated_state(arg, hs)
        if offset:
            h_lin = with_uniform_bias(h_lin, offset)
        r_act, r_lin, clip_r = gate_parts(r, "the reset gate")
        if extra["linear_before_reset"]:
            check_sources(h_lin, {x.key}, "the candidate's input part")
            check_sources(extra["rec_h"], {hs.key}, "the candidate's recurrent part")
        else:
            check_sources(h_lin, {x.key, extra["gated_key"]}, "the candidate")
        if z_act != r_act:
            raise Decline("update and reset gates use different activations")
        if len({clip_z, clip_r, clip_n}) != 1:
            raise Decline("gates are clipped differently")
        check_sources(z_lin, {x.key, hs.key}, "the update gate")
        check_sources(r_lin, {x.key, hs.key}, "the reset gate")
        gates = {"z": z_lin, "r": r_lin, "h": h_lin}
        if flipped:
            extra["update_takes_candidate"] = True
        spec = make_spec(self, x, hs, gates, (z_act, n_act), clip_z, extra)
        rec = extra.get("rec_h")
        if rec is not None and rec.ncols != spec.hidden:
            raise Decline("the recurrent candidate part has the wrong width")
        return spec

    def step_polys(self, spec, x, h, c):
        f_act, g_act = spec.acts
        z = gate(spec.gates["z"], f_act, spec.clip)
        if spec.extra.get("update_takes_candidate"):
            z = Poly.const(1.0).sub(z)  # the graph's z takes the candidate: the native z is 1 - z
        r = gate(spec.gates["r"], f_act, spec.clip)
        arg = Poly.atom(LinAtom(spec.gates["h"]))
        if spec.extra.get("linear_before_reset"):
            arg = arg.add(r.mul(Poly.atom(LinAtom(spec.extra["rec_h"]))))
        n = activate(g_act, arg, spec.clip)
        return {"h": n.sub(z.mul(n)).add(z.mul(h))}

    def gate_blocks(self, spec, g, dtype):
        if g == "z" and spec.extra.get("update_takes_candidate"):
            # native z = a(-(x@W + h@R + b)) = 1 - a(x@W + h@R + b): every z block negated (exact in floats)
            return tuple(-block for block in super().gate_blocks(spec, g, dtype))
        if g != "h":
            return super().gate_blocks(spec, g, dtype)
        H, I = spec.hidden, spec.input_size
        lin = spec.gates["h"]
        w = weight_block(lin, spec.x_key, (H, I), dtype)
        if spec.extra.get("linear_before_reset"):
            rec = spec.extra["rec_h"]
            return w, weight_block(rec, spec.h_key, (H, H), dtype), bias_of(lin, H, dtype), bias_of(rec, H, dtype)
        r = weight_block(lin, spec.extra.get("gated_key"), (H, H), dtype)
        return (w, r) + split_biases(lin, H, dtype)

    def onnx_gate(self, node, g, x_part, h_part, gates, extra):
        if g != "h":
            return super().onnx_gate(node, g, x_part, h_part, gates, extra)
        if not int(attr(node, "linear_before_reset", 0) or 0):
            raise Decline("a native GRU step with linear_before_reset=0 inside a loop")
        gates[g] = x_part
        extra.update(linear_before_reset=1, rec_h=h_part)


def _update_and_candidate(p: Poly, hs):
    """The update gate z, the candidate n, and whether z takes the candidate.

    ``(1-z)*n + z*h`` = ``n + z*h - z*n`` (z keeps the state, ONNX's form) or ``z*n + (1-z)*h`` =
    ``h + z*n - z*h`` (z takes the candidate: the flipped form)."""
    blend = f"an update-gate blend (1-z)*n + z*h or z*n + (1-z)*h ({p!r})"
    singles, with_h, products = [], [], []
    for m, coef in p.terms.items():
        atoms = [p.atoms[k] for k in m]
        if len(atoms) == 1:
            singles.append((atoms[0], coef))
        elif len(atoms) == 2 and hs.key in m and any(a.key != hs.key for a in atoms):
            with_h.append((next(a for a in atoms if a.key != hs.key), coef))
        elif len(atoms) == 2:
            products.append((atoms, coef))
        else:
            raise Decline(f"the new state is not {blend}")
    if len(with_h) == 1 and not singles and len(products) == 1 and products[0][1] == with_h[0][1] == 1.0 \
            and with_h[0][0].key in {a.key for a in products[0][0]}:
        raise Decline(f"the update gate multiplies both the candidate and the state (z*n + z*h), not a blend ({p!r})")
    if len(p.terms) != 3 or len(singles) != 1 or len(with_h) != 1 or len(products) != 1:
        raise Decline(f"the new state is not {blend}")
    (single, s_coef), (z, zh_coef), (pair, zn_coef) = singles[0], with_h[0], products[0]
    flipped = single.key == hs.key
    if (s_coef, zh_coef, zn_coef) != ((1.0, -1.0, 1.0) if flipped else (1.0, 1.0, -1.0)):
        raise Decline(f"the new state is not {blend}")
    others = [a for a in pair if a.key != z.key]
    if len(others) != 1:
        raise Decline(f"the gate that keeps the state is not the update gate that takes the candidate ({p!r})")
    n = others[0]
    if not flipped and n.key != single.key:
        raise Decline(f"the new state is not {blend}")
    if not isinstance(n, Act) or not isinstance(z, Act):
        raise Decline(f"the new state is not {blend}")
    return z, n, flipped


def _blend_of_linear_candidate(p: Poly, hs, why: Decline):
    """:func:`_update_and_candidate` for a candidate without activation (Keras' activation=None): ``n`` is then
    the affine map itself, one term (``x@W + (r*h)@R + b``) or several (``x@W + r*(h@R + b)``), so the blend
    has more terms. z is the gate multiplying h; n what the blend holds beside it; the blend re-built from them
    must be ``p``. Else ``why`` stands."""
    with_h = [(m, c) for m, c in p.terms.items() if len(m) == 2 and hs.key in m and m != (hs.key, hs.key)]
    z = p.atoms[next(k for k in with_h[0][0] if k != hs.key)] if len(with_h) == 1 else None
    if z is None or not isinstance(z, Act) or with_h[0][1] not in (1.0, -1.0):
        raise why
    flipped = with_h[0][1] == -1.0  # h + z*n - z*h
    rest = {m: c for m, c in p.terms.items() if m != with_h[0][0] and not (flipped and m == (hs.key,))}
    if flipped:  # the terms of z*n, z taken out of each
        if p.terms.get((hs.key,)) != 1.0 or any(z.key not in m for m in rest):
            raise why
        rest = {tuple(k for i, k in enumerate(m) if i != m.index(z.key)): c for m, c in rest.items()}
    n = Poly({m: c for m, c in rest.items() if z.key not in m}, p.atoms)
    zp, h = Poly.atom(z), Poly.atom(hs)
    blend = h.add(zp.mul(n)).sub(zp.mul(h)) if flipped else n.sub(zp.mul(n)).add(zp.mul(h))
    if not n.terms or n.is_const() or blend.key != p.key:
        raise why
    return z, n, flipped


def _complement_is_reflection(act) -> bool:
    """Whether ``1 - a(x) == a(-x)``: then a gate used as ``1 - z`` is the native gate with negated weights."""
    name, params = act
    return name == "Sigmoid" or (name == "HardSigmoid" and len(params) == 2 and params[1] == 0.5)


def _unclipped(arg: Poly):
    """The candidate's argument without a symmetric clip, and the clip."""
    sa = arg.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        lo, hi = sa[0].params
        if lo != -hi:
            raise Decline("the candidate has an asymmetric clip")
        return sa[0].arg, hi
    return arg, None


def _candidate_linear_before_reset(arg: Poly):
    """``x @ Wh + r * (h @ Rh + Rbh)`` -> (the x part, r, extra). A recurrent bias whose entries are all equal
    (hidden size 1, constant initialisers) is a separate ``b * r`` term."""
    x_lin = r = rec = None
    r_scaled: list = []  # (atom, coefficient) of single-gate terms: b * r
    for m, coef in arg.terms.items():
        atoms = [arg.atoms[k] for k in m]
        if len(atoms) == 1 and isinstance(atoms[0], Act):
            r_scaled.append((atoms[0], coef))
            continue
        if coef != 1.0:
            raise Decline("the candidate input has a scaled term")
        if len(atoms) == 1 and isinstance(atoms[0], LinAtom):
            x_lin = atoms[0].lin
        elif len(atoms) == 2:
            la = [a for a in atoms if isinstance(a, LinAtom)]
            ra = [a for a in atoms if isinstance(a, Act)]
            if la and ra:
                rec, r = la[0].lin, ra[0]
    if x_lin is None or r is None:
        raise Decline(f"the candidate is not act(x@W + r*(h@R + b)) ({arg!r})")
    if len(r_scaled) > 1 or (r_scaled and r_scaled[0][0].key != r.key):
        raise Decline(f"the candidate is not act(x@W + r*(h@R + b)) ({arg!r})")
    if r_scaled:
        rec = with_uniform_bias(rec, r_scaled[0][1])
    return x_lin, r, {"linear_before_reset": 1, "rec_h": rec}


def _candidate_gated_state(arg: Poly, hs):
    """``x @ Wh + (r*h) @ Rh + b`` -> (the candidate's Lin, r, extra)."""
    sa = arg.single_atom()
    if not (sa and sa[1] == 1.0 and isinstance(sa[0], LinAtom)):
        if _gate_times_input(arg):
            raise Decline(f"the reset gate multiplies the candidate's input part too (r*(x@W + ...)); a native GRU "
                          f"resets only the recurrent part ({arg!r})")
        raise Decline(f"the candidate is not an activation of an affine map ({arg!r})")
    h_lin = sa[0].lin
    gated_srcs = [s for s in h_lin.sources() if s[0] == GATED_ROW]
    if len(gated_srcs) != 1:
        raise Decline("the candidate does not read the reset-gated state r*h")
    gated = gated_srcs[0]
    # the gated row is r*h: find r among its atoms
    keys = gated[1]
    if len(keys) != 2 or hs.key not in keys:
        raise Decline("the candidate's gated state is not r*h")
    row_poly = h_lin.rows.get(gated)
    r_key = next(k for k in keys if k != hs.key)
    r = row_poly.atoms.get(r_key) if row_poly is not None else None
    if r is None:
        raise Decline("cannot find the reset gate")
    return h_lin, r, {"linear_before_reset": 0, "gated_key": gated}



def _gate_times_input(arg: Poly) -> bool:
    """``act(..) * lin`` where the lin reads the step input: a gate applied to the candidate's input part."""
    if len(arg.terms) != 1:
        return False
    (m,) = arg.terms
    atoms = [arg.atoms[k] for k in m]
    lins = [a for a in atoms if isinstance(a, LinAtom)]
    return len(atoms) == 2 and len(lins) == 1 and any(isinstance(a, Act) for a in atoms) and \
        any(s[0] == "X" for s in lins[0].lin.sources())


GRU = GruKind()
