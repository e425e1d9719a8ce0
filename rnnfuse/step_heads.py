"""A per-step output computed *from* the cell's new h inside the step: a head applied after the native op.

``for t: h, c = cell(x[t], (h, c)); ys.append(fc(h))`` (TorchScript), ``lax.scan`` whose step returns
``dense(h)`` (jax2onnx), a step output ``h @ V + x_t @ U``: the loop's scan output is not h but a function of
the new h (and of the step input). When that function treats every batch row on its own and reads nothing
that changes from step to step except h_t and x_t, applying it to every step at once is the same maths:
``head(Y[t]) for each t`` = ``head(Y)`` with the time and batch axes flattened into rows. The native op
computes Y, and the head's nodes, copied out of the step, run once on ``Flatten(Y)`` (and ``Flatten(X)``).

Row independence is proven per op (:mod:`rnnfuse.row_wise`), not assumed: every node between h_t / x_t and
the output must be a row-wise op on ``[rows, features]`` tensors (elementwise with constants that do not span
rows, a matmul by a constant matrix, a softmax or a concat / split / slice along the feature axis, ...). A head may
also read the h the step read, before the update (char-RNN's ``i2o(cat(x_t, h))``): that is Y one step later,
the initial h first. A head that reads the cell state c (no native output holds c per step), the iteration
number, or a runtime tensor of the outer graph is declined with that reason; a head
that feeds back into the state is not a head at all (the state's maths then include it and the cell is not
recognised).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto, helper

from .elem_types import fixed_by_op, typed_like
from .dataflow import literal_value
from .errors import Decline
from .graph import Graph
from .protos import has_subgraph
from .row_wise import ROW_RANK, check_row_wise, folded_from_shapes, replay
from .symbolic import BoolMask, Const, SymTensor

@dataclass
class StepHead:
    """Body nodes computing one per-step output from the new h (and x_t), row-wise; see the module doc."""

    nodes: list[NodeProto]  # in evaluation order
    out: str  # the body tensor of the per-step output
    h: set[str] = field(default_factory=set)  # body tensors equal to the new h ([B, H])
    # body tensors equal to the h the step read (the step before's, the initial state at the first): char-RNN's
    # ``i2o(cat(x_t, h))`` beside ``h = tanh(i2h(cat(x_t, h)))``; read as Y one step later, h0 first
    h_prev: set[str] = field(default_factory=set)
    x: set[str] = field(default_factory=set)  # body tensors equal to the step input x_t ([B, F])
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # constants of the step the nodes read
    refs: dict[str, str] = field(default_factory=dict)  # body name -> constant of the outer graph it is
    x_source: str = ""  # the outer tensor x_t is element t of
    x_axis: int = 0  # its time axis (0: [T, B, F]; 1: [B, T, F])
    x_reversed: bool = False  # the step reads x from its last step to its first
    # body tensors equal to the new h of another cell of the step (a head over cells side by side, e.g.
    # cat([h1, h2])) -> that cell's Y, time-major in processing order: first the layer's index, then (once
    # the layer is emitted, see rnnfuse.rewrite) the tensor
    layer_h: dict = field(default_factory=dict)
    rank: dict[str, int] = field(default_factory=dict)  # tensor the nodes compute -> its rank as a row tensor (0: constant)
    folded: set[str] = field(default_factory=set)  # constants of ``consts`` rnnfuse folded (no literal)
    # a head too big to validate whole: the body tensors validation compares in its place (probe_points);
    # empty for a head validated whole
    probes: list[str] = field(default_factory=list)


def find_head(body: Graph, ev, out: str, h_key, other_keys: dict, x_reads: set[str], x_source: str, x_axis: int,
              x_reversed: bool, invariants: dict[str, str], counters: set[str], layer_keys: dict | None = None,
              h_prev_key=None) -> StepHead:
    """The head computing the body tensor ``out`` from the new h, or Decline with the reason it is none.

    ``ev``: the step's evaluator (its memo holds the values found so far); ``h_key``: the polynomial key of
    the new h; ``other_keys``: key -> name of the other states' new values (c); ``x_reads``: the body tensors
    that read x_t; ``invariants``: loop-carried values passed through unchanged -> their outer tensor;
    ``counters``: the iteration number and its copies; ``layer_keys``: the polynomial key of another cell's new
    h (as ``ev`` sees it) -> that cell's layer, for a head reading several cells' h; ``h_prev_key``: the key of
    the h the step reads (its state atom), for a head reading it."""
    head = StepHead([], out, x_source=x_source, x_axis=x_axis, x_reversed=x_reversed)

    def const_of(name: str):
        v = ev.memo.get(name)
        return v.arr if isinstance(v, Const) else body.const(invariants.get(name, name))
    order: list[NodeProto] = []
    seen: set[str] = set()
    rows: dict[str, int] = {}  # tensor -> its rank as a row tensor (0: a constant)
    stack: list[tuple[str, bool]] = [(out, False)]
    while stack:
        name, expanded = stack.pop()
        if expanded:
            n = body.producer[name]
            rank = check_row_wise(body, n, rows, const_of)
            row_out = rank if any(rows.get(i) for i in n.input if i) else 0  # constants alone: no row axis
            for o in n.output:
                rows[o] = head.rank[o] = row_out
            order.append(n)
            continue
        if name in seen or not name:
            continue
        seen.add(name)
        role = _leaf(body, ev, name, (h_key, h_prev_key), other_keys, x_reads, invariants, counters, head,
                     layer_keys or {})
        if role is not None:
            rows[name] = ROW_RANK if role else 0
            continue
        n = body.producer[name]
        if has_subgraph(n):  # (a control-flow op, or another domain's op holding a graph)
            raise Decline(f"the per-step output '{out}' is computed by a {n.op_type} inside the step")
        stack.append((name, True))
        stack.extend((i, False) for i in n.input if i and i not in seen)
    if not head.h and not head.h_prev:
        raise Decline(f"the per-step output '{out}' does not read the hidden state")
    done: set[int] = set()
    for n in order:  # a node reached twice is computed once
        if id(n) not in done:
            done.add(id(n))
            head.nodes.append(n)
    head.probes = probe_points(head)
    return head


# A head of more nodes than this is validated at its probe points, not whole: the check model holds a head
# twice (inside the original loop, and replayed), and a 100,000-op head was 7.5 s of onnxruntime loads. Below
# it the whole check costs little (a 2,000-op head: a check model of ~4,000 nodes, tenths of a second), so it
# runs: correctness first, as for unrolled chains (rnnfuse.rewrite.WHOLE_MODEL_LIMIT).
PROBED_ABOVE = 2000
# the head's nodes whose outputs a probe check compares, in evaluation order (the first read only leaves)
PROBE_NODES = 8


def probe_points(head: StepHead) -> list[str]:
    """The body tensors a big head is validated at in place of its output ([] for a head validated whole).

    They are every row leaf the head reads (h_t, x_t, another cell's h: how each reaches the rows) and the
    row outputs of its first ``PROBE_NODES`` nodes (the copying, constants re-homed). The rest needs no run:
    each node is a row-wise op (proven by :func:`check_row_wise` when the head was found), copied with its
    attributes by :func:`replay`, and reads only values shown equal so -- leaves, constants, earlier nodes.

    Validated whole instead: a head whose output is not ``[rows, features]`` (its reshape back to the steps is
    then not the probes' own), or that reads a constant rnnfuse folded (a literal is copied as it is; a value
    folded by rnnfuse's own evaluator is onnxruntime's to confirm)."""
    if len(head.nodes) <= PROBED_ABOVE or head.rank.get(head.out) != ROW_RANK or head.folded or head.h_prev:
        return []  # (the h a step read is a body input, no node output to compare: validated whole)
    points = sorted(head.h) + sorted(head.x) + sorted(head.layer_h)
    return points + [o for n in head.nodes[:PROBE_NODES] for o in n.output if head.rank.get(o) == ROW_RANK]


def _probe_types(b, head: StepHead, row_type: int) -> dict[str, int] | None:
    """The element type of each probe point, as the ops fix it (rnnfuse.elem_types) from the rows' (the
    cell's h: the native op's type; x_t: its source's) and the constants': no shape inference of a body this
    big. None when one is not known so (the head is then validated whole)."""
    known: dict[str, int | None] = {name: row_type for name in [*head.h, *head.layer_h]}
    x_type = b.g.model.elem_type(head.x_source) if head.x else None
    known.update((name, x_type) for name in head.x)
    for name, arr in head.consts.items():
        known[name] = helper.np_dtype_to_tensor_dtype(arr.dtype)
    for name, outer in head.refs.items():
        c = b.g.const(outer)
        known[name] = helper.np_dtype_to_tensor_dtype(np.asarray(c).dtype) if c is not None else None
    for n in head.nodes[:PROBE_NODES]:
        src = typed_like(n)
        et = known.get(src) if src else fixed_by_op(n)
        for o in n.output:
            known[o] = et
    types = {name: known.get(name) for name in head.probes}
    return None if None in types.values() else types


def _leaf(body: Graph, ev, name: str, h_keys: tuple, other_keys: dict, x_reads: set[str], invariants: dict[str, str],
          counters: set[str], head: StepHead, layer_keys: dict) -> bool | None:
    """True: a row leaf (h_t, h_{t-1}, x_t); False: a constant; None: computed by a body node to walk into.
    ``h_keys``: the keys of the new h and of the h the step read."""
    h_key, h_prev_key = h_keys
    v = ev.memo.get(name)
    if isinstance(v, SymTensor):
        key = v.poly.key
        if key == h_key or key in layer_keys or (h_prev_key is not None and key == h_prev_key):
            if v.lead:
                raise Decline(f"the per-step output reads the new hidden state as a [1, B, H] tensor '{name}'")
            if body.model.rank(name) != 2:  # a batch-1 Squeeze to [H] has h's maths but no row axis
                raise Decline(f"the per-step output reads the new hidden state as a rank-{body.model.rank(name)} "
                              f"tensor '{name}', not [B, H] rows")
            if key == h_key:
                head.h.add(name)
            elif key == h_prev_key:
                head.h_prev.add(name)
            else:
                head.layer_h[name] = layer_keys[key]
            return True
        if key in other_keys:
            raise Decline(f"a per-step output reads the new {other_keys[key]} at every step (no native output holds it)")
    if name in x_reads:
        head.x.add(name)
        return True
    if name in counters:
        raise Decline("a per-step output reads the iteration number")
    outer = invariants.get(name, name)
    if not body.defines(outer) and body.parent is not None and body.parent.const(outer) is not None:
        head.refs[name] = outer  # a constant of the outer graph (a weight carried through unchanged)
        return False
    c = body.const(name)
    if c is None and isinstance(v, Const):  # computed from constants and pass-through values alone
        c = v.arr
    if c is not None and folded_from_shapes(body, name):
        raise Decline(f"a per-step output reads '{name}', folded from a step's shape (not every step's at once)")
    if c is not None:
        head.consts[name] = np.asarray(c)
        if literal_value(body, name) is None:
            head.folded.add(name)  # (a value rnnfuse computed: onnxruntime never checks it in a probe check)
        return False
    if name in body.input_names:
        if name in invariants:
            raise Decline(f"a per-step output reads '{invariants[name]}', computed at runtime outside the loop")
        if isinstance(v, BoolMask):  # (a scanned mask: no carried state, whatever the body input list says)
            raise Decline(f"a per-step output reads the step mask '{name}' in a head (a head runs after the op on "
                          "its Y, which holds the kept h at masked steps; only where(m, head, 0) is read after it)")
        raise Decline(f"a per-step output reads the carried state '{name}' before the step updates it "
                      "(the previous step's value)")
    if name not in body.producer:
        raise Decline(f"a per-step output reads '{name}', computed at runtime outside the loop")
    return None


# --------------------------------------------------------------------------- emission


def apply_head(b, head: StepHead, y: str, probes: dict | None = None, row_type: int = 0, h_init: str = "") -> str:
    """``head`` on every step of ``y`` ([T, B, H], time-major, in processing order): [T, B, K]. ``h_init``: the
    native op's initial h ([1, B, H]), what a head reading the h a step read sees first.

    ``b`` is the emitter's :class:`~rnnfuse.emit.Builder`: the copied nodes are added beside the native op.
    ``probes`` (a dict): gains each of the head's probe points -> (its rows on every step, [T, B, ...] as the
    output; its element type), the rows being of type ``row_type``; none when a type is not known."""
    env: dict[str, str] = {}
    rows = b.op("Flatten", y, axis=2)  # [T*B, H]: every step's rows, step after step
    for name in head.h:
        env[name] = rows
    if head.h_prev:  # every step's rows of the h it read: h0, then Y but its last step
        before = b.op("Concat", h_init, b.op("Slice", y, b.i64(0), b.i64(-1), b.i64(0)), axis=0)
        prev_rows = b.op("Flatten", before, axis=2)
        for name in head.h_prev:
            env[name] = prev_rows
    for name, other_y in head.layer_h.items():  # (another cell's Y, in the same order)
        env[name] = b.op("Flatten", other_y, axis=2)
    if head.x:
        x = head.x_source
        if head.x_axis == 1:
            x = b.op("Transpose", x, perm=[1, 0, 2])
        if head.x_reversed:
            x = b.flip0(x)
        xr = b.op("Flatten", x, axis=2)
        for name in head.x:
            env[name] = xr
    for name, arr in head.consts.items():
        env[name] = b.const(arr, "head")
    env.update(head.refs)
    replay(b, head.nodes, env, "head")
    # back to [T, B, K]: the steps and batch rows of y
    shape = b.op("Concat", b.op("Slice", b.op("Shape", y), b.i64(0), b.i64(2), b.i64(0)), b.i64(-1), axis=0)
    out = b.op("Reshape", env[head.out], shape)
    types = _probe_types(b, head, row_type) if probes is not None else None
    if types is not None:  # (after the output: the names it is given do not depend on the probes)
        for name, et in types.items():
            probes[name] = (b.op("Reshape", env[name], shape), et)
    return out
