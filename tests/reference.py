"""A plain numpy reference of ONNX ``LSTM`` / ``GRU`` / ``RNN`` for one direction, plus Keras-style masking.

This is only used to check the hand-written test recurrences in :mod:`tests.builders` (rnnfuse itself is
checked by comparing the fused model with the original under onnxruntime).

Conventions follow the ONNX operator spec for one direction:

* ``X`` is ``[T, B, F]`` (time-major, in time order);
* ``W`` is ``[G*H, F]``, ``R`` is ``[G*H, H]`` and ``B`` is ``[2*G*H]`` (``Wb`` then ``Rb``) in ONNX gate
  order (LSTM ``i, o, f, c``; GRU ``z, r, h``; RNN one gate); a leading ``num_directions`` axis of 1 is
  accepted and dropped;
* ``activations`` is a list of ``(name, params)`` pairs (or bare names, taking ONNX defaults):
  LSTM ``f, g, h``; GRU ``f, g``; RNN ``f``;
* ``clip`` bounds every gate's pre-activation to ``[-clip, clip]`` (the input of the activations ``f`` and
  ``g``; onnxruntime does not clip the cell state before ``h``);
* ``direction="reverse"`` processes time from the last step to the first; outputs are returned in time
  order either way (like ``Y`` of the native ops).

Masking (``mask`` a bool ``[T, B]`` in time order): at a step whose mask is false nothing is computed for
that row: every state keeps its value, and the per-step output is either the previous output *in
processing order* (``fill="carry"``, starting from ``initial_output``, zeros by default) or zeros
(``fill="zero"``). The final states are the states after the last valid step (the initial states for a row
with no valid step).
"""

from __future__ import annotations

import numpy as np

GATES = {"LSTM": ("i", "o", "f", "c"), "GRU": ("z", "r", "h"), "RNN": ("i",)}
DEFAULT_ACTIVATIONS = {
    "LSTM": ("Sigmoid", "Tanh", "Tanh"),
    "GRU": ("Sigmoid", "Tanh"),
    "RNN": ("Tanh",),
}
ACT_DEFAULT_PARAMS = {
    "HardSigmoid": (0.2, 0.5),
    "LeakyRelu": (0.01,),
    "ThresholdedRelu": (1.0,),
    "Elu": (1.0,),
    "Affine": (1.0, 0.0),
    "ScaledTanh": (1.0, 1.0),
}


def activation(name: str, params=()):
    """The elementwise function of an ONNX RNN activation name with its (alpha[, beta]) parameters."""
    p = tuple(params) if params else ACT_DEFAULT_PARAMS.get(name, ())
    if name == "Sigmoid":
        return lambda x: 1.0 / (1.0 + np.exp(-x))
    if name == "Tanh":
        return np.tanh
    if name == "Relu":
        return lambda x: np.maximum(x, 0.0)
    if name == "HardSigmoid":
        a, b = p
        return lambda x: np.clip(a * x + b, 0.0, 1.0)
    if name == "LeakyRelu":
        (a,) = p
        return lambda x: np.where(x >= 0, x, a * x)
    if name == "ThresholdedRelu":
        (a,) = p
        return lambda x: np.where(x > a, x, 0.0)
    if name == "Elu":
        (a,) = p
        return lambda x: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0.0)) - 1.0))
    if name == "Softsign":
        return lambda x: x / (1.0 + np.abs(x))
    if name == "Softplus":
        return lambda x: np.logaddexp(0.0, x)
    if name == "Affine":
        a, b = p
        return lambda x: a * x + b
    if name == "ScaledTanh":
        a, b = p
        return lambda x: a * np.tanh(b * x)
    raise ValueError(f"unknown activation {name}")


def _acts(op: str, activations) -> list:
    if activations is None:
        activations = DEFAULT_ACTIVATIONS[op]
    out = []
    for a in activations:
        if isinstance(a, str):
            out.append(activation(a))
        else:
            out.append(activation(a[0], a[1]))
    want = len(DEFAULT_ACTIVATIONS[op])
    if len(out) != want:
        raise ValueError(f"{op} needs {want} activations, got {len(out)}")
    return out


def rnn_reference(
    op: str,
    X,
    W,
    R,
    B=None,
    initial_h=None,
    initial_c=None,
    *,
    activations=None,
    clip: float | None = None,
    linear_before_reset: int = 0,
    direction: str = "forward",
    mask=None,
    fill: str = "carry",
    initial_output=None,
):
    """Run one direction of an ONNX recurrent op. Returns ``(Y [T,B,H], Y_h [B,H], Y_c [B,H] or None)``.

    All arithmetic is float64; results are float32.
    """
    if op not in GATES:
        raise ValueError(op)
    X = np.asarray(X, dtype=np.float64)
    W = np.asarray(W, dtype=np.float64)
    R = np.asarray(R, dtype=np.float64)
    if W.ndim == 3:
        W = W[0]
    if R.ndim == 3:
        R = R[0]
    G = len(GATES[op])
    H = R.shape[-1]
    T, Bn, F = X.shape
    if W.shape != (G * H, F) or R.shape != (G * H, H):
        raise ValueError(f"bad weight shapes {W.shape} {R.shape} for {op} H={H} F={F}")
    if B is None:
        Bv = np.zeros(2 * G * H)
    else:
        Bv = np.asarray(B, dtype=np.float64).reshape(-1)
    Wb, Rb = Bv[: G * H], Bv[G * H :]

    def sl(a, k):
        return a[k * H : (k + 1) * H]

    h = np.zeros((Bn, H)) if initial_h is None else np.asarray(initial_h, dtype=np.float64).reshape(Bn, H).copy()
    c = None
    if op == "LSTM":
        c = np.zeros((Bn, H)) if initial_c is None else np.asarray(initial_c, dtype=np.float64).reshape(Bn, H).copy()
    acts = _acts(op, activations)
    f_act = acts[0]
    g_act = acts[1] if len(acts) > 1 else None
    h_act = acts[2] if len(acts) > 2 else None

    def clipped(v):
        return np.clip(v, -clip, clip) if clip is not None else v

    if mask is not None:
        mask = np.asarray(mask).astype(bool).reshape(T, Bn)
    prev_out = np.zeros((Bn, H)) if initial_output is None else np.broadcast_to(
        np.asarray(initial_output, dtype=np.float64), (Bn, H)
    ).copy()
    Y = np.zeros((T, Bn, H))
    order = range(T) if direction == "forward" else range(T - 1, -1, -1)
    if direction not in ("forward", "reverse"):
        raise ValueError(direction)
    for t in order:
        x = X[t]
        if op == "RNN":
            h_new = f_act(clipped(x @ W.T + h @ R.T + Wb + Rb))
            c_new = None
        elif op == "LSTM":
            pre = {}
            for k, g in enumerate(GATES["LSTM"]):
                pre[g] = clipped(x @ sl(W, k).T + h @ sl(R, k).T + sl(Wb, k) + sl(Rb, k))
            i, o, f = f_act(pre["i"]), f_act(pre["o"]), f_act(pre["f"])
            cc = g_act(pre["c"])
            c_new = f * c + i * cc
            h_new = o * h_act(c_new)
        else:  # GRU
            z = f_act(clipped(x @ sl(W, 0).T + h @ sl(R, 0).T + sl(Wb, 0) + sl(Rb, 0)))
            r = f_act(clipped(x @ sl(W, 1).T + h @ sl(R, 1).T + sl(Wb, 1) + sl(Rb, 1)))
            if linear_before_reset:
                n_pre = x @ sl(W, 2).T + sl(Wb, 2) + r * (h @ sl(R, 2).T + sl(Rb, 2))
            else:
                n_pre = x @ sl(W, 2).T + (r * h) @ sl(R, 2).T + sl(Wb, 2) + sl(Rb, 2)
            n = g_act(clipped(n_pre))
            h_new = (1.0 - z) * n + z * h
            c_new = None
        if mask is None:
            h = h_new
            c = c_new
            Y[t] = h_new
            continue
        m = mask[t][:, None]
        h = np.where(m, h_new, h)
        if c is not None:
            c = np.where(m, c_new, c)
        if fill == "carry":
            out = np.where(m, h_new, prev_out)
        elif fill == "zero":
            out = np.where(m, h_new, 0.0)
        else:
            raise ValueError(fill)
        prev_out = out
        Y[t] = out
    f32 = np.float32
    return Y.astype(f32), h.astype(f32), (c.astype(f32) if c is not None else None)


def split_weights(op: str, W, R, B=None) -> dict:
    """Per-gate matrices for writing a cell by hand: ``{gate: (Wx [F,H], Wh [H,H], bx [H], bh [H])}``."""
    W = np.asarray(W)
    R = np.asarray(R)
    if W.ndim == 3:
        W, R = W[0], R[0]
    G = len(GATES[op])
    H = R.shape[-1]
    Bv = np.zeros(2 * G * H, W.dtype) if B is None else np.asarray(B).reshape(-1)
    out = {}
    for k, g in enumerate(GATES[op]):
        s = slice(k * H, (k + 1) * H)
        out[g] = (W[s].T.copy(), R[s].T.copy(), Bv[s].copy(), Bv[G * H :][s].copy())
    return out
