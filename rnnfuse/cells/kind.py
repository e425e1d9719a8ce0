"""What a native recurrent op kind is, in the terms the rest of rnnfuse asks about.

One subclass per ONNX op (:mod:`.lstm`, :mod:`.gru`, :mod:`.rnn`) says: its gates in ONNX order, its default
activations, its states, how to recognise it from a step's polynomials, the polynomials of its step, its
weight layout and extra inputs, and its attributes. The emitter, the validator and the bidirectional merge
ask the kind instead of branching on the op name, so a new variant touches its kind only.
"""

from __future__ import annotations

import numpy as np

from ..errors import Decline
from ..graph import attr
from ..symbolic import ACTIVATIONS, Act, ConstRef, Lin, LinAtom, Poly
from .spec import CellSpec

# ONNX inputs every kind shares, in order; the kind's initial states and extra inputs follow
COMMON_INPUTS = ("X", "W", "R", "B", "sequence_lens")
# activations whose ONNX encoding takes alpha and beta / alpha only (onnxruntime's convention)
_ALPHA_BETA = ("HardSigmoid", "Affine", "ScaledTanh")
_ALPHA = ("LeakyRelu", "ThresholdedRelu", "Elu")


class CellKind:
    op: str = ""
    gates: tuple = ()  # ONNX gate order
    default_acts: tuple = ()  # ((name, params), ...) for one direction
    states: tuple = ("h",)  # carried states; each has an initial_<s> input and a Y_<s> output
    extra_inputs: dict = {}  # ONNX inputs after the initial states -> why rnnfuse does not take them

    # ---- ONNX interface
    @property
    def inputs(self) -> tuple:
        return COMMON_INPUTS + tuple(f"initial_{s}" for s in self.states) + tuple(self.extra_inputs)

    @property
    def n_outputs(self) -> int:
        """``Y`` plus one final value per state."""
        return 1 + len(self.states)

    def output_of(self, state: str) -> int:
        """Index of the output holding the final value of ``state``."""
        return 1 + self.states.index(state)

    def attributes(self, spec: CellSpec, direction: str) -> dict:
        """Attributes of the native op; activations only when they differ from this kind's defaults."""
        attrs = dict(hidden_size=spec.hidden, direction=direction)
        names, alphas, betas = activation_lists(spec.acts)
        default = [a for a, _ in self.default_acts]
        if names != default or alphas:
            k = 2 if direction == "bidirectional" else 1
            attrs["activations"] = names * k
            if alphas:
                attrs["activation_alpha"] = alphas * k
            if betas:
                attrs["activation_beta"] = betas * k
        if spec.clip is not None:
            attrs["clip"] = float(spec.clip)
        attrs.update(self.extra_attributes(spec))
        return attrs

    def drop_default_activations(self, attrs: dict) -> dict:
        """``attrs`` of a native op being rewritten, without an ``activations`` list that only spells out this
        kind's defaults (tf2onnx writes them; OpenVINO then treats the op as non-default and skips its
        sequence kernel)."""
        acts = attrs.get("activations")
        if not acts or attrs.get("activation_alpha") or attrs.get("activation_beta"):
            return attrs
        default = [a.lower() for a, _ in self.default_acts]
        names = [(a.decode() if isinstance(a, bytes) else a).lower() for a in acts]
        if names == default * (len(names) // len(default)) and len(names) in (len(default), 2 * len(default)):
            attrs = {k: v for k, v in attrs.items() if k not in ("activations", "activation_alpha", "activation_beta")}
        return attrs

    def extra_attributes(self, spec: CellSpec) -> dict:
        return {}

    def extra_arrays(self, spec: CellSpec, dtype=np.float32) -> dict:
        """Values of the extra inputs (after the initial states) this spec needs, one direction each:
        input name -> array without the direction axis. Inputs not given stay empty."""
        return {}

    def extra_input_shape(self, name: str, hidden: int) -> tuple:
        """Shape of one direction of an extra input (zeros stand in for a direction that has none)."""
        raise Decline(self.extra_inputs.get(name, name))

    def describe_extras(self, spec: CellSpec) -> list[str]:
        return []

    # ---- recognition
    def match(self, new: dict, x, states: dict, h: str, c: str | None) -> CellSpec:
        """The spec whose step could compute ``new`` (Decline with the reason when the form does not fit)."""
        raise NotImplementedError

    def looks_like(self, new_h: Poly) -> bool:
        """Whether the new hidden state has this kind's outer form: its decline reason is the one to report."""
        return True

    # ---- semantics
    def step_polys(self, spec: CellSpec, x: Poly, h: Poly, c: Poly | None) -> dict[str, Poly]:
        raise NotImplementedError

    # ---- weights in ONNX layout
    def gate_blocks(self, spec: CellSpec, gate: str, dtype) -> tuple:
        """``(W [H, I], R [H, H], Wb [H], Rb [H])`` of one gate."""
        H, I = spec.hidden, spec.input_size
        lin = spec.gates[gate]
        wb, rb = split_biases(lin, H, dtype)
        return weight_block(lin, spec.x_key, (H, I), dtype), weight_block(lin, spec.h_key, (H, H), dtype), wb, rb

    def spec_from_onnx(self, node, W: np.ndarray, R: np.ndarray, B: np.ndarray | None, x_key, h_key,
                       direction_index: int = 0, fed=None, x_lin: Lin | None = None) -> CellSpec:
        """The spec of a native op of this kind (one direction), weights read from its ONNX layout.

        ``fed = (state key, W_fed)``: the op's input also appends that state (input feeding); ``W_fed`` is the
        matching column block of W, read as one more recurrent term. ``x_lin``: the op's input times W (its
        ``[I, G*H]`` transpose) where the input is no single step input (a sum of them: X = y1_t + x_t)."""
        H = int(attr(node, "hidden_size") or R.shape[-1])
        Wd, Rd = W[direction_index], R[direction_index]
        Bd = B[direction_index] if B is not None else None
        wref, rref = ConstRef.of(Wd).T(), ConstRef.of(Rd).T()  # [I, G*H], [H, G*H]
        bref = ConstRef.of(Bd) if Bd is not None else None
        gates, extra = {}, {}
        G = len(self.gates)
        for gi, g in enumerate(self.gates):
            cols = (gi * H, (gi + 1) * H)
            wb = [bref.rows(*cols)] if bref is not None else []
            rb = [bref.rows(G * H + cols[0], G * H + cols[1])] if bref is not None else []
            x_terms = [(x_key, wref.cols(*cols))] if x_lin is None else list(x_lin.cols(*cols).terms)
            wb = wb + (list(x_lin.cols(*cols).biases) if x_lin is not None else [])
            if fed is not None:  # part of the input term (outside a GRU's reset product, as ONNX computes it)
                x_terms.append((fed[0], ConstRef.of(fed[1][direction_index]).T().cols(*cols)))
            x_part = Lin.make(x_terms, wb, H)
            h_part = Lin.make([(h_key, rref.cols(*cols))], rb, H)
            self.onnx_gate(node, g, x_part, h_part, gates, extra)
        return CellSpec(self, H, int(Wd.shape[1]), x_key, h_key, gates, read_activations(node, self), attr(node, "clip"),
                        extra)

    def onnx_gate(self, node, gate: str, x_part: Lin, h_part: Lin, gates: dict, extra: dict) -> None:
        """Store one gate read from ONNX weights: by default ``x @ W + h @ R + Wb + Rb``."""
        gates[gate] = x_part.plus(h_part)

    def check_native(self, node, inputs: dict) -> None:
        """Decline a native op of this kind that uses inputs rnnfuse does not model."""
        for name, why in self.extra_inputs.items():
            if inputs.get(name) is not None:
                raise Decline(why)


# --------------------------------------------------------------------------------------------------------
# shared pieces


def gate(lin: Lin, act, clip: float | None) -> Poly:
    """``act(clip(lin))``: one gate of a native cell."""
    return activate(act, Poly.atom(LinAtom(lin)), clip)


def activate(act, arg: Poly, clip: float | None) -> Poly:
    """``act(clip(arg))``. Affine(a, b) is the polynomial ``a * arg + b``: the symbolic evaluator never builds an
    Affine atom, so a linear gate (an Elman cell without activation, Keras' activation=None) reads as the graph's."""
    if clip is not None:
        arg = Poly.atom(Act("Clip", (-clip, clip), arg))
    if act[0] == "Affine":
        return arg.scale(act[1][0]).add(Poly.const(act[1][1]))
    return Poly.atom(Act(act[0], act[1], arg))


def weight_block(lin: Lin, src, shape: tuple, dtype) -> np.ndarray:
    """The ONNX-layout block ``[out, in]`` of ``lin``'s weight for ``src`` (zeros when it does not read it)."""
    w = lin.weight_for(src) if src is not None else None
    return w.arr.T if w is not None else np.zeros(shape, dtype)


def bias_of(lin: Lin, H: int, dtype) -> np.ndarray:
    s = lin.bias_sum()
    return np.zeros(H, dtype) if s is None else (lin.biases[0].arr if len(lin.biases) == 1 else s.astype(dtype))


def split_biases(lin: Lin, H: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Input and recurrent bias: kept apart when the graph has them apart (torch), else all in Wb."""
    bs = lin.biases
    if not bs:
        return np.zeros(H, dtype), np.zeros(H, dtype)
    if len(bs) == 1:
        return bs[0].arr, np.zeros(H, dtype)
    if len(bs) == 2:
        return bs[0].arr, bs[1].arr
    return lin.bias_sum().astype(dtype), np.zeros(H, dtype)


def activation_lists(acts) -> tuple[list[str], list[float], list[float]]:
    """ONNX ``activations`` and alpha/beta lists (onnxruntime's convention: only for activations that use them)."""
    names, alphas, betas = [], [], []
    for name, params in acts:
        names.append(name)
        if name in _ALPHA_BETA:
            alphas.append(float(params[0]))
            betas.append(float(params[1]))
        elif name in _ALPHA:
            alphas.append(float(params[0]))
    return names, alphas, betas


def read_activations(node, kind: CellKind) -> tuple:
    """The activations of a native op's first direction, with their parameters."""
    acts = attr(node, "activations")
    if not acts:
        return kind.default_acts
    alphas = list(attr(node, "activation_alpha", []) or [])
    betas = list(attr(node, "activation_beta", []) or [])
    parsed = []
    for a in acts[: len(kind.default_acts)]:
        names = ACTIVATIONS.get(a)
        if names is None:
            raise Decline(f"native activation {a}")
        params = []
        if "alpha" in names:
            params.append(alphas.pop(0))
        if "beta" in names:
            params.append(betas.pop(0))
        parsed.append((a, tuple(params)))
    return tuple(parsed)
