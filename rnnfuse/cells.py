"""Cell recognition: the polynomials of one step -> a :class:`CellSpec` for a native LSTM, GRU or RNN op.

One recogniser serves every front end. It reads the cell's maths from the canonical polynomials built by
:mod:`rnnfuse.symbolic` (so node order, Gemm vs MatMul, Split vs Slice do not matter), extracts the gate
weights as exact slices of the model's constants, then *re-derives* the step polynomials from the spec and
requires them to be identical to what the graph computes. Anything the spec does not capture (an extra
term, a peephole, a scaled state, a coupled gate) makes the two differ, and the cell is declined.

ONNX gate orders: LSTM i, o, f, c; GRU z, r, h; RNN one gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import Decline
from .graph import attr
from .symbolic import (
    ACTIVATIONS,
    Act,
    C,
    ConstRef,
    Lin,
    LinAtom,
    Poly,
    State,
    Sym,
    Row,
    X,
    as_row,
)

GATES = {"LSTM": ("i", "o", "f", "c"), "GRU": ("z", "r", "h"), "RNN": ("i",)}
DEFAULT_ACTS = {
    "LSTM": (("Sigmoid", ()), ("Tanh", ()), ("Tanh", ())),
    "GRU": (("Sigmoid", ()), ("Tanh", ())),
    "RNN": (("Tanh", ()),),
}


@dataclass
class CellSpec:
    """Everything a native op needs, with weights kept as exact references to the model's constants."""

    op: str  # LSTM | GRU | RNN
    hidden: int
    input_size: int
    x_key: tuple
    h_key: tuple
    gates: dict  # gate name -> Lin over x (and h); for GRU lbr=1, 'h' is the x part only
    acts: tuple  # ONNX activation list for one direction: ((kind, params), ...)
    clip: float | None = None
    linear_before_reset: int = 0
    rec_h: Lin | None = None  # GRU lbr=1: h @ Rh + Rbh, multiplied by r
    gated_key: tuple | None = None  # GRU lbr=0: the key of the r*h row
    notes: list = field(default_factory=list)

    # ---- description
    def describe(self) -> str:
        extra = []
        if self.op == "GRU":
            extra.append(f"linear_before_reset={self.linear_before_reset}")
        if tuple(self.acts) != DEFAULT_ACTS[self.op]:
            extra.append("activations=" + ",".join(_act_name(a) for a in self.acts))
        if self.clip is not None:
            extra.append(f"clip={self.clip:g}")
        return f"{self.op}(hidden={self.hidden}" + "".join(", " + e for e in extra) + ")"

    def signature(self) -> tuple:
        """What must agree for two cells to share one bidirectional op."""
        return (self.op, self.hidden, self.input_size, tuple(self.acts), self.clip, self.linear_before_reset)

    # ---- weights in ONNX layout (one direction)
    def weights(self, dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        Ws, Rs, Bs = self.weight_parts(dtype)
        W = np.concatenate(Ws, 0)[None].astype(dtype, copy=False)
        R = np.concatenate(Rs, 0)[None].astype(dtype, copy=False)
        B = np.concatenate(Bs, 0)[None].astype(dtype, copy=False)
        return W, R, B

    def weight_parts(self, dtype=np.float32) -> tuple[list, list, list]:
        """Per-gate blocks of W [H, I], R [H, H] and the bias halves, in ONNX order (views where possible)."""
        H, I = self.hidden, self.input_size
        Ws, Rs, Wbs, Rbs = [], [], [], []
        for g in GATES[self.op]:
            lin = self.gates[g]
            w = lin.weight_for(self.x_key)
            Ws.append(w.arr.T if w is not None else np.zeros((H, I), dtype))
            if self.op == "GRU" and g == "h":
                if self.linear_before_reset:
                    r = self.rec_h.weight_for(self.h_key)
                    Rs.append(r.arr.T if r is not None else np.zeros((H, H), dtype))
                    Wbs.append(_bias(lin, H, dtype))
                    Rbs.append(_bias(self.rec_h, H, dtype))
                    continue
                r = lin.weight_for(self.gated_key) if self.gated_key is not None else None
            else:
                r = lin.weight_for(self.h_key)
            Rs.append(r.arr.T if r is not None else np.zeros((H, H), dtype))
            wb, rb = _split_biases(lin, H, dtype)
            Wbs.append(wb)
            Rbs.append(rb)
        return Ws, Rs, Wbs + Rbs

    def has_bias(self) -> bool:
        return any(l.biases for l in self.gates.values()) or (self.rec_h is not None and bool(self.rec_h.biases))

    # ---- the maths in polynomial form
    def step_polys(self, x: Poly, h: Poly, c: Poly | None) -> dict[str, Poly]:
        """Polynomials of the new states (``'h'`` and, for LSTM, ``'c'``) for symbolic x, h, c."""
        f_kind, g_kind = self.acts[0], self.acts[1] if len(self.acts) > 1 else None

        def gate(lin: Lin, act) -> Poly:
            arg = Poly.atom(LinAtom(lin))
            if self.clip is not None:
                arg = Poly.atom(Act("Clip", (-self.clip, self.clip), arg))
            return Poly.atom(Act(act[0], act[1], arg))

        if self.op == "RNN":
            return {"h": gate(self.gates["i"], f_kind)}
        if self.op == "LSTM":
            i = gate(self.gates["i"], f_kind)
            o = gate(self.gates["o"], f_kind)
            f = gate(self.gates["f"], f_kind)
            g = gate(self.gates["c"], g_kind)
            c_new = f.mul(c).add(i.mul(g))
            h_new = o.mul(Poly.atom(Act(self.acts[2][0], self.acts[2][1], c_new)))
            return {"h": h_new, "c": c_new}
        z = gate(self.gates["z"], f_kind)
        r = gate(self.gates["r"], f_kind)
        if self.linear_before_reset:
            arg = Poly.atom(LinAtom(self.gates["h"])).add(r.mul(Poly.atom(LinAtom(self.rec_h))))
        else:
            arg = Poly.atom(LinAtom(self.gates["h"]))
        if self.clip is not None:
            arg = Poly.atom(Act("Clip", (-self.clip, self.clip), arg))
        n = Poly.atom(Act(g_kind[0], g_kind[1], arg))
        h_new = n.sub(z.mul(n)).add(z.mul(h))
        return {"h": h_new}


def _act_name(a) -> str:
    kind, params = a
    return kind + (f"({','.join(f'{p:g}' for p in params)})" if params else "")


def _bias(lin: Lin, H: int, dtype) -> np.ndarray:
    s = lin.bias_sum()
    return np.zeros(H, dtype) if s is None else (lin.biases[0].arr if len(lin.biases) == 1 else s.astype(dtype))


def _split_biases(lin: Lin, H: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Input and recurrent bias: kept apart when the graph has them apart (torch), else all in Wb."""
    bs = lin.biases
    if not bs:
        return np.zeros(H, dtype), np.zeros(H, dtype)
    if len(bs) == 1:
        return bs[0].arr, np.zeros(H, dtype)
    if len(bs) == 2:
        return bs[0].arr, bs[1].arr
    return lin.bias_sum().astype(dtype), np.zeros(H, dtype)


# --------------------------------------------------------------------------------------------------------
# recognition


def _gate_parts(p: Poly, what: str):
    """``act(lin)`` or ``act(clip(lin))`` -> (act, lin, clip)."""
    sa = p.single_atom() if isinstance(p, Poly) else None
    atom = sa[0] if sa and sa[1] == 1.0 else p if isinstance(p, Act) else None
    if not isinstance(atom, Act) or atom.kind == "Clip":
        raise Decline(f"{what} is not an activation of an affine map")
    return _act_arg(atom, what)


def _act_arg(atom: Act, what: str):
    arg = atom.arg
    clip = None
    sa = arg.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        lo, hi = sa[0].params
        if lo != -hi or hi <= 0:
            raise Decline(f"{what} has an asymmetric clip [{lo:g}, {hi:g}]")
        clip = hi
        arg = sa[0].arg
        sa = arg.single_atom()
    if not (sa and sa[1] == 1.0 and isinstance(sa[0], LinAtom)):
        lo = arg.as_lin_offset()
        if lo is not None and lo[1] == 1.0:
            # lin + b with a scalar b: a bias whose entries are all equal (hidden size 1, TF's forget_bias)
            lin, _, b = lo
            ref = ConstRef.of(np.full(lin.ncols, b, dtype=np.float32))
            return (atom.kind, atom.params), Lin.make(lin.terms, lin.biases + (ref,), lin.ncols, lin.rows), clip
        states = sorted({a.sym for a in arg.atoms.values() if isinstance(a, State)})
        if states:
            raise Decline(f"{what} reads state {', '.join(states)} elementwise (peephole weights?): {atom.kind} of {arg!r}")
        raise Decline(f"{what} is {atom.kind} of {arg!r}, not of an affine map of x and h")
    if atom.kind not in ACTIVATIONS:
        raise Decline(f"{what} uses activation {atom.kind}, which native ops do not have")
    return (atom.kind, atom.params), sa[0].lin, clip


def _check_sources(lin: Lin, allowed: set, what: str) -> None:
    bad = lin.sources() - allowed
    if bad:
        raise Decline(f"{what} reads {', '.join(sorted(map(_srcdesc, bad)))}, which a native op cannot")


def _srcdesc(s) -> str:
    if s[0] == "S":
        return f"state {s[1]}"
    if s[0] == "X":
        return f"input {s[1]}"
    return "a gated state"


def _same(a: Poly, b: Poly) -> bool:
    return a.key == b.key or fold_offsets(a).key == fold_offsets(b).key


def fold_offsets(p: Poly) -> Poly:
    """``act(lin + b)`` with a scalar b written as ``act(lin + [b, b, ...])``: one canonical form."""
    from .symbolic import substitute

    def fn(a):
        if isinstance(a, Act):
            inner = fold_offsets(a.arg)
            lo = inner.as_lin_offset()
            if lo is not None and lo[1] == 1.0 and lo[2] != 0.0:
                lin, _, b = lo
                ref = ConstRef.of(np.full(lin.ncols, b, dtype=np.float32))
                inner = Poly.atom(LinAtom(Lin.make(lin.terms, lin.biases + (ref,), lin.ncols, lin.rows)))
            return Poly.atom(Act(a.kind, a.params, inner))
        return None

    return substitute(p, fn)


class Recognised:
    def __init__(self, spec: CellSpec, h: str, c: str | None):
        self.spec, self.h, self.c = spec, h, c


def recognise(new: dict[str, Poly], x: X, states: dict[str, State]) -> Recognised:
    """Find the native cell whose step maths equal ``new`` (state symbol -> polynomial of its new value)."""
    syms = list(states)
    reasons = []
    tries = []
    if len(syms) == 1:
        tries = [("RNN", syms[0], None), ("GRU", syms[0], None)]
    elif len(syms) == 2:
        tries = [("LSTM", syms[0], syms[1]), ("LSTM", syms[1], syms[0])]
    else:
        raise Decline(f"{len(syms)} recurrent states (a native cell has 1 or 2)")
    for op, h, c in tries:
        try:
            spec = _MATCHERS[op](new, x, states, h, c)
            polys = spec.step_polys(Poly.atom(x), Poly.atom(states[h]), Poly.atom(states[c]) if c else None)
            if not _same(polys["h"], new[h]) or (c and not _same(polys["c"], new[c])):
                raise Decline(f"the step computes more than a {op} cell")
            return Recognised(spec, h, c)
        except Decline as d:
            reasons.append((op, d.reason))
    # report the most specific reason
    if len(syms) == 1:
        rnn_reason = reasons[0][1]
        gru_reason = reasons[1][1]
        single = new[syms[0]].single_atom()
        return _raise(gru_reason if not single else rnn_reason)
    return _raise(reasons[0][1])


def _raise(msg):
    raise Decline(msg)


def _match_rnn(new, x, states, h, c) -> CellSpec:
    p = new[h]
    hs = states[h]
    sa = p.single_atom()
    if not sa or sa[1] != 1.0:
        raise Decline(f"the new state is not one activation ({p!r})")
    atom = sa[0]
    if isinstance(atom, LinAtom):  # a linear (activation=None) RNN
        act, lin, clip = ("Affine", (1.0, 0.0)), atom.lin, None
    else:
        act, lin, clip = _gate_parts(Poly.atom(atom), "the RNN gate")
    _check_sources(lin, {x.key, hs.key}, "the RNN gate")
    return _spec("RNN", x, hs, {"i": lin}, (act,), clip)


def _spec(op, x, hs, gates, acts, clip, **kw) -> CellSpec:
    H = next(iter(gates.values())).ncols
    for g, lin in gates.items():
        if lin.ncols != H:
            raise Decline(f"gate {g} has width {lin.ncols}, others {H}")
    if hs.ncols is not None and hs.ncols != H:
        raise Decline(f"state width {hs.ncols} differs from gate width {H}")
    I = None
    for lin in gates.values():
        w = lin.weight_for(x.key)
        if w is not None:
            if I is not None and w.arr.shape[0] != I:
                raise Decline("gates read inputs of different widths")
            I = int(w.arr.shape[0])
    if I is None:
        I = x.ncols
    if I is None:
        raise Decline("the cell never reads its input")
    for lin in gates.values():
        r = lin.weight_for(hs.key)
        if r is not None and r.arr.shape[0] != H:
            raise Decline("a recurrent weight of the wrong shape")
    return CellSpec(op, H, I, x.key, hs.key, gates, tuple(acts), clip, **kw)


def _match_lstm(new, x, states, h, c) -> CellSpec:
    pc, ph = new[c], new[h]
    hs, cs = states[h], states[c]
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
    if len(ph.terms) != 1 or list(ph.terms.values())[0] != 1.0:
        raise Decline(f"the hidden output is not o*act(c) ({ph!r})")
    (m,) = ph.terms
    atoms = [ph.atoms[k] for k in m]
    oc = [a for a in atoms if isinstance(a, Act) and a.arg.key == pc.key]
    if len(atoms) != 2 or not oc:
        raise Decline("the hidden output is not o*act(new c)" + (" (peephole or projection?)" if len(atoms) > 2 else ""))
    h_act_atom = oc[0]
    o_atom = next(a for a in atoms if a is not h_act_atom)
    f_act, f_lin, clip_f = _gate_parts(fc, "the forget gate")
    o_act, o_lin, clip_o = _gate_parts(o_atom, "the output gate")
    a1, a2 = ig
    p1, p2 = _gate_parts(a1, "an input/cell gate"), _gate_parts(a2, "an input/cell gate")
    if p1[0] == f_act:  # i shares the gates' activation; g is the other factor
        (i_act, i_lin, clip_i), (g_act, g_lin, clip_g) = p1, p2
    else:
        (i_act, i_lin, clip_i), (g_act, g_lin, clip_g) = p2, p1
    if not (f_act == o_act == i_act):
        raise Decline(
            f"gate activations differ (i={_act_name(i_act)}, f={_act_name(f_act)}, o={_act_name(o_act)}); "
            "a native LSTM applies one activation to i, f and o"
        )
    if h_act_atom.kind not in ACTIVATIONS:
        raise Decline(f"the output activation {h_act_atom.kind} is not available in native ops")
    clips = {clip_f, clip_o, clip_i, clip_g}
    if len(clips) != 1:
        raise Decline("gates are clipped differently")
    gates = {"i": i_lin, "o": o_lin, "f": f_lin, "c": g_lin}
    for g, lin in gates.items():
        _check_sources(lin, {x.key, hs.key}, f"LSTM gate {g}")
    acts = (f_act, g_act, (h_act_atom.kind, h_act_atom.params))
    return _spec("LSTM", x, hs, gates, acts, clips.pop())


def _match_gru(new, x, states, h, c) -> CellSpec:
    p = new[h]
    hs = states[h]
    if len(p.terms) != 3:
        raise Decline(f"the new state is not (1-z)*n + z*h ({p!r})")
    z = n = None
    for m, coef in p.terms.items():
        atoms = [p.atoms[k] for k in m]
        if len(atoms) == 2 and hs.key in m and coef == 1.0:
            z = next(a for a in atoms if a.key != hs.key)
    if z is None:
        raise Decline(f"the new state is not (1-z)*n + z*h ({p!r})")
    for m, coef in p.terms.items():
        atoms = [p.atoms[k] for k in m]
        if len(atoms) == 1 and coef == 1.0:
            n = atoms[0]
    if not isinstance(n, Act) or not isinstance(z, Act):
        raise Decline(f"the new state is not (1-z)*n + z*h ({p!r})")
    z_act, z_lin, clip_z = _gate_parts(z, "the update gate")
    # the candidate: act(x@Wh + r*(h@Rh + Rbh)) [lbr=1]  or  act(x@Wh + (r*h)@Rh) [lbr=0]
    arg = n.arg
    clip_n = None
    sa = arg.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        lo, hi = sa[0].params
        if lo != -hi:
            raise Decline("the candidate has an asymmetric clip")
        clip_n, arg = hi, sa[0].arg
    if n.kind not in ACTIVATIONS:
        raise Decline(f"the candidate activation {n.kind} is not available in native ops")
    g_act = (n.kind, n.params)
    if len(arg.terms) == 2:  # linear_before_reset = 1
        x_lin = r = rec = None
        for m, coef in arg.terms.items():
            atoms = [arg.atoms[k] for k in m]
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
        r_act, r_lin, clip_r = _gate_parts(r, "the reset gate")
        _check_sources(x_lin, {x.key}, "the candidate's input part")
        _check_sources(rec, {hs.key}, "the candidate's recurrent part")
        lbr, gated = 1, None
        h_lin = x_lin
    else:
        sa = arg.single_atom()
        if not (sa and sa[1] == 1.0 and isinstance(sa[0], LinAtom)):
            raise Decline(f"the candidate is not an activation of an affine map ({arg!r})")
        h_lin = sa[0].lin
        gated_srcs = [s for s in h_lin.sources() if s[0] == "P"]
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
        r_act, r_lin, clip_r = _gate_parts(r, "the reset gate")
        _check_sources(h_lin, {x.key, gated}, "the candidate")
        lbr, rec = 0, None
    if z_act != r_act:
        raise Decline("update and reset gates use different activations")
    if len({clip_z, clip_r, clip_n}) != 1:
        raise Decline("gates are clipped differently")
    _check_sources(z_lin, {x.key, hs.key}, "the update gate")
    _check_sources(r_lin, {x.key, hs.key}, "the reset gate")
    gates = {"z": z_lin, "r": r_lin, "h": h_lin}
    spec = _spec("GRU", x, hs, gates, (z_act, g_act), clip_z, linear_before_reset=lbr, rec_h=rec, gated_key=gated)
    if rec is not None and rec.ncols != spec.hidden:
        raise Decline("the recurrent candidate part has the wrong width")
    return spec


_MATCHERS = {"RNN": _match_rnn, "LSTM": _match_lstm, "GRU": _match_gru}


# --------------------------------------------------------------------------------------------------------
# native ops appearing inside a step (TorchScript loops hold a one-step LSTM)


def spec_from_native(node, W: np.ndarray, R: np.ndarray, B: np.ndarray | None, x_key, h_key, direction_index=0) -> CellSpec:
    op = node.op_type
    H = int(attr(node, "hidden_size") or R.shape[-1])
    gnames = GATES[op]
    k = len(gnames)
    Wd, Rd = W[direction_index], R[direction_index]
    Bd = B[direction_index] if B is not None else None
    I = int(Wd.shape[1])
    wref = ConstRef.of(Wd).T()  # [I, kH]
    rref = ConstRef.of(Rd).T()
    bref = ConstRef.of(Bd) if Bd is not None else None
    lbr = int(attr(node, "linear_before_reset", 0) or 0)
    gates = {}
    rec_h = None
    for gi, g in enumerate(gnames):
        cols = (gi * H, (gi + 1) * H)
        wb = [bref.rows(*cols)] if bref is not None else []
        rb = [bref.rows(k * H + cols[0], k * H + cols[1])] if bref is not None else []
        if op == "GRU" and g == "h":
            if lbr:
                gates[g] = Lin.make([(x_key, wref.cols(*cols))], wb, H)
                rec_h = Lin.make([(h_key, rref.cols(*cols))], rb, H)
                continue
            raise Decline("a native GRU step with linear_before_reset=0 inside a loop")
        gates[g] = Lin.make([(x_key, wref.cols(*cols)), (h_key, rref.cols(*cols))], wb + rb, H)
    acts = attr(node, "activations")
    if acts:
        per = len(DEFAULT_ACTS[op])
        alphas = list(attr(node, "activation_alpha", []) or [])
        betas = list(attr(node, "activation_beta", []) or [])
        parsed = []
        for a in acts[:per]:
            names = ACTIVATIONS.get(a)
            if names is None:
                raise Decline(f"native activation {a}")
            params = []
            if "alpha" in names:
                params.append(alphas.pop(0))
            if "beta" in names:
                params.append(betas.pop(0))
            parsed.append((a, tuple(params)))
        acts_t = tuple(parsed)
    else:
        acts_t = DEFAULT_ACTS[op]
    clip = attr(node, "clip")
    if op == "LSTM" and len(node.input) > 7 and node.input[7]:
        raise Decline("peephole weights")
    return CellSpec(op, H, I, x_key, h_key, gates, acts_t, clip, linear_before_reset=lbr, rec_h=rec_h)


def native_step_polys(ev, node, ins):
    """Evaluate a native recurrent op with one time step over symbolic inputs."""
    op = node.op_type
    if attr(node, "direction", "forward") == "bidirectional":
        raise Decline("a bidirectional native op inside a step")
    if attr(node, "layout", 0):
        raise Decline("a native op with layout=1 inside a step")
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    vals = dict(zip(names, ins + [None] * (8 - len(ins))))
    for k in ("W", "R"):
        if not isinstance(vals[k], C):
            raise Decline(f"the {k} weights of the inner {op} are computed at runtime")
    if vals["B"] is not None and not isinstance(vals["B"], C):
        raise Decline("the inner op's bias is computed at runtime")
    if vals["sequence_lens"] is not None:
        raise Decline("an inner op with sequence_lens")
    if vals.get("P") is not None:
        raise Decline("peephole weights")
    xv, hv, cv = vals["X"], vals["initial_h"], vals["initial_c"]
    xrow = as_row(xv) if isinstance(xv, (Sym, Row)) else None
    if xrow is None or xrow.lead != 1 or len(xrow.segments) != 1:
        raise Decline("the inner op's input is not the step input")
    x_poly = xrow.segments[0][2]
    x_atom = next(iter(x_poly.atoms.values()))
    if not isinstance(hv, Sym) or hv.lead != 1:
        raise Decline("the inner op's initial_h is not the carried state")
    hsa = hv.poly.single_atom()
    if not hsa or not isinstance(hsa[0], State) or hsa[1] != 1.0:
        raise Decline("the inner op's initial_h is not the carried state")
    h_atom = hsa[0]
    c_poly = None
    if op == "LSTM":
        if not isinstance(cv, Sym) or cv.lead != 1:
            raise Decline("the inner op's initial_c is not the carried state")
        c_poly = cv.poly
    B = vals["B"].arr if vals["B"] is not None else None
    spec = spec_from_native(node, vals["W"].arr, vals["R"].arr, B, x_atom.key, h_atom.key)
    polys = spec.step_polys(x_poly, Poly.atom(h_atom), c_poly)
    outs = [Sym(polys["h"], 2), Sym(polys["h"], 1)]
    if op == "LSTM":
        outs.append(Sym(polys["c"], 1))
    return outs[: len(node.output)]
