"""The vocabulary kind matchers share: reading ``act(clip(lin))`` gates, checking what a gate reads, sizing a spec."""

from __future__ import annotations

import numpy as np

from ..errors import Decline
from ..symbolic import ACTIVATIONS, STATE, STEP_INPUT, Act, ConstRef, Lin, LinAtom, Poly, State
from .spec import CellSpec


def gate_parts(p, what: str):
    """``act(lin)`` or ``act(clip(lin))`` (a Poly or an Act atom) -> ``((name, params), lin, clip)``."""
    sa = p.single_atom() if isinstance(p, Poly) else None
    atom = sa[0] if sa and sa[1] == 1.0 else p if isinstance(p, (Act, LinAtom)) else None
    if isinstance(atom, Act) and atom.kind == "Clip":
        return _clip_gate(atom, what)
    if isinstance(atom, LinAtom):  # no activation (Keras' activation=None): the identity, Affine(1, 0)
        return IDENTITY, atom.lin, None
    if not isinstance(atom, Act):
        raise Decline(f"{what} is not an activation of an affine map")
    return _act_arg(atom, what)


# a native op's linear activation (ONNX Affine with alpha 1, beta 0)
IDENTITY = ("Affine", (1.0, 0.0))


def _clip_gate(atom: Act, what: str):
    """A gate clipped to [0, c] (Keras' relu6) is Relu of the gate clipped to [-c, c], one clipped to [-c, c] (a
    hard tanh) the identity of it, Affine(1, 0): ONNX's clip bounds a gate's input, before its activation."""
    lo, hi = atom.params
    lin = _affine_map(atom.arg)
    if lin is None or not hi > 0 or lo not in (0.0, -hi):
        raise Decline(f"{what} is not an activation of an affine map")
    return (("Relu", ()) if lo == 0 else IDENTITY), lin, hi


def _affine_map(arg: Poly) -> Lin | None:
    """``arg`` as one affine map of x and h: a single map, or one plus a scalar (a bias whose entries are all
    equal: hidden size 1, TF's forget_bias); else None."""
    sa = arg.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], LinAtom):
        return sa[0].lin
    offset = arg.as_lin_offset()
    if offset is not None:
        # (a constant multiple of an affine map is one, its weights and bias scaled: jax's forget gate
        # sigmoid(-z); -1 flips signs exactly. The recogniser compares the same fold: recognise.fold_scales)
        lin, k, b = offset
        if not k:
            return None
        lin = lin if k == 1.0 else lin.scaled(k)
        return with_uniform_bias(lin, b) if b else lin
    return with_diagonal_weights(arg)


def with_diagonal_weights(arg: Poly) -> Lin | None:
    """``arg`` = affine maps plus ``u * s`` terms (``u`` a constant row or a scalar, ``s`` a carried state):
    ``s @ diag(u)``, a weight whose off-diagonal entries are zeros (IndRNN's ``relu(W x_t + u * h + b)``: an RNN
    whose R is diagonal; each sum gains only exact zeros). None for any other polynomial."""
    lin, scaled, bias = None, [], 0.0  # scaled: (state, its factor: a row, or a scalar for the whole width)
    for m, c in arg.terms.items():
        atoms = [arg.atoms[k] for k in m]
        if not atoms:
            bias = c
        elif len(atoms) == 1 and isinstance(atoms[0], LinAtom):
            part = atoms[0].lin if c == 1.0 else atoms[0].lin.scaled(c)
            lin = part if lin is None else lin.plus(part)
        elif len(atoms) == 1 and isinstance(atoms[0], State):
            scaled.append((atoms[0], np.float64(c), None))
        else:
            row = next((a for a in atoms if isinstance(a, LinAtom) and not a.lin.terms and not a.lin.rows), None)
            state = next((a for a in atoms if isinstance(a, State)), None)
            if (len(atoms) != 2 or row is None or not row.lin.biases or state is None
                    or state.ncols not in (None, row.ncols)):
                return None
            u = c * sum(b.arr.astype(np.float64) for b in row.lin.biases)
            scaled.append((state, u.reshape(-1), row.lin.biases[0].arr.dtype))
    if lin is None or not scaled:
        return None
    diagonal = []
    for state, u, dtype in scaled:
        if state.ncols not in (None, lin.ncols) or (np.ndim(u) and len(u) != lin.ncols):
            return None
        u = np.broadcast_to(u, (lin.ncols,))
        diagonal.append((state.key, ConstRef.of(np.diag(u).astype(dtype or np.float32))))
    lin = Lin.make(lin.terms + tuple(diagonal), lin.biases, lin.ncols, lin.rows)
    return with_uniform_bias(lin, bias) if bias else lin


def _act_arg(atom: Act, what: str):
    arg = atom.arg
    clip = None
    sa = arg.single_atom()
    if sa and sa[1] == 1.0 and isinstance(sa[0], Act) and sa[0].kind == "Clip":
        lo, hi = sa[0].params
        # (a relu of z clipped to [lo, hi] with lo <= 0 is the relu of z clipped to [-hi, hi]: Keras'
        # relu(max_value=3), written Relu, Min and Max)
        if (lo != -hi or hi <= 0) and not (atom.kind == "Relu" and lo <= 0 < hi):
            raise Decline(f"{what} has an asymmetric clip [{lo:g}, {hi:g}]")
        clip = hi
        arg = sa[0].arg
    lin = _affine_map(arg)
    if lin is None:
        states = sorted({a.sym for a in arg.atoms.values() if isinstance(a, State)})
        if states:
            raise Decline(f"{what} reads state {', '.join(states)} elementwise, other than scaled by constants "
                          f"(a diagonal weight): {atom.kind} of {arg!r}")
        raise Decline(f"{what} is {atom.kind} of {arg!r}, not of an affine map of x and h")
    if atom.kind not in ACTIVATIONS:
        raise Decline(f"{what} uses activation {atom.kind}, which native ops do not have")
    if atom.kind == "Softplus" and (clip is None or clip > SOFTPLUS_SAFE):
        raise Decline(f"{what} uses Softplus: {SOFTPLUS_WHY}; exact only with a clip of at most {SOFTPLUS_SAFE:g}")
    return (atom.kind, atom.params), lin, clip


def with_uniform_bias(lin: Lin, b: float) -> Lin:
    """``lin + b`` for a scalar ``b``: the symbolic algebra keeps a bias whose entries are all equal (hidden size
    1, TF's forget_bias, Keras' constant initialisers) as a separate scalar term; as a native op's bias it is a
    vector of b."""
    ref = ConstRef.of(np.full(lin.ncols, b, dtype=np.float32))
    return Lin.make(lin.terms, lin.biases + (ref,), lin.ncols, lin.rows)


def split_scalar_offset(arg: Poly) -> tuple[Poly, float]:
    """``arg`` without its constant term, and that term (0.0 when there is none)."""
    b = arg.terms.get((), 0.0)
    return (Poly({m: c for m, c in arg.terms.items() if m != ()}, arg.atoms), b) if () in arg.terms else (arg, 0.0)


# onnxruntime's native Softplus is log(1 + exp(x)) in float: inf from x > ~88.7 where the ONNX op stays finite
SOFTPLUS_SAFE = 80.0
SOFTPLUS_WHY = "onnxruntime's native Softplus overflows to inf above about 88 (log(1+exp(x)))"


def check_sources(lin: Lin, allowed: set, what: str) -> None:
    """Decline when a gate reads anything but ``allowed`` (a native op's gates read x and h only)."""
    bad = lin.sources() - allowed
    if bad:
        raise Decline(f"{what} reads {', '.join(sorted(map(_source_description, bad)))}, which a native op cannot")


def _source_description(s) -> str:
    if s[0] == STATE:
        return f"state {s[1]}"
    if s[0] == STEP_INPUT:
        return f"input {s[1]}"
    return "a gated state"


def make_spec(kind, x, hs, gates, acts, clip, extra=None) -> CellSpec:
    """A spec with hidden and input sizes read from the gate weights, declining inconsistent widths."""
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
    return CellSpec(kind, H, I, x.key, hs.key, gates, tuple(acts), clip, dict(extra or {}))
