"""Shapes the ops fix: each tensor's dims read from how it is made, with no shape inference.

A fold of ``Shape(h)`` asks whether h's shape is static; in a big model that meant inferring h's cone, and a
long chain asks it of every step (torch's ``where(m, h, zeros_like(h))`` writes ``ConstantOfShape(Shape(h))``
each step: 1,640 cone inferences to learn, each time, that the batch is symbolic). Here the dims of every
tensor are worked out once from the types known without a new inference (what the file or an edit declares,
what an inference already run established) and the ops' shape rules, one bottom-up walk over what the tensor
is computed from, memoised for the run (tensor names are never reused,
and a rewrite replaces a tensor by one of the same values: the dims stay true).

A dim is an int, a str (a symbolic extent: it varies at run time), or None (not known here); the dims are
None when the rank is not known. Exact where it answers: every rule gives what ONNX defines the op's output
to be, a symbolic extent only where it is carried unchanged (a cut or an arithmetic of one is not known).
"""

from __future__ import annotations

from onnx import NodeProto

from . import op_args
from .cells.kinds import output_dims
from .dataflow import literal_value, post_order
from .shape_arith import ARITH, arith, cast
from .graph import Graph
from .protos import attr, carried_layout, node_field, scan_output_layout

Dims = "tuple | None"

# ops whose output has their first input's shape
_SAME_SHAPE = frozenset(("Relu", "Tanh", "Sigmoid", "Identity", "Cast", "CastLike", "Neg", "Abs", "Exp", "Log",
                         "Sqrt", "Reciprocal", "Softmax", "LogSoftmax", "LeakyRelu", "Elu", "Selu", "Erf", "Not",
                         "Floor", "Ceil", "Round", "Sign", "HardSigmoid", "Softplus", "Softsign", "Clip", "Gelu"))
# ops broadcasting all their inputs to one another (multidirectional broadcasting)
_BROADCAST = frozenset(("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "And", "Or", "Xor", "Equal", "Less",
                        "Greater", "LessOrEqual", "GreaterOrEqual", "Max", "Min", "Sum", "Mean"))
_FIRST_INPUT = frozenset(("Transpose", "Squeeze", "Unsqueeze", "Slice", "Reshape", "Shape")) | _SAME_SHAPE


def op_dims(g: Graph, name: str):
    """The dims of main-graph tensor ``name`` as its ops fix them (see the module's docstring), or None."""
    return _fixed(g, (_DIMS, name))


def shape_value(g: Graph, name: str):
    """The values of a small integer tensor that holds a shape or part of one, as its ops fix them: a tuple of
    ints, symbols (str) and None (not known) for a 1-D tensor, one such element for a scalar, None when not
    known at all. A symbol is an extent read by ``Shape`` that is symbolic (see :func:`op_dims`)."""
    return _fixed(g, (_VALUE, name))


def op_rank(g: Graph, name: str) -> int | None:
    """The rank of main-graph tensor ``name`` as its ops fix it: :func:`op_dims`' rules read for the rank alone,
    which often stop sooner (a Transpose's ``perm`` says it without its input: 9,000 attention families asked
    each walked back through every block before it for their dims)."""
    dims = g.model.facts.op_shapes.get((_DIMS, name)) if g.parent is None else None
    return len(dims) if dims is not None else _fixed(g, (_RANK, name))


def known_dims(g: Graph, name: str):
    """``name``'s dims: known already or fixed by its ops (:func:`op_dims`), else what a type query gives (one
    that only filters: no cone too big for one inference is inferred; a stack of 6,660 steps asked each step's
    rank, and the budget ran out)."""
    dims = op_dims(g, name)
    if dims is None:
        t = g.model.known_type(name)
        dims = tuple(t[1]) if t is not None and t[1] is not None else None
    return dims


def known_rank(g: Graph, name: str) -> int | None:
    dims = known_dims(g, name)
    return None if dims is None else len(dims)


def varies_at_run_time(g: Graph, name: str) -> bool:
    """Whether an extent of ``name`` is provably symbolic: its Shape folds to no constant."""
    dims = op_dims(g, name)
    return dims is not None and any(isinstance(d, str) for d in dims)


# what a walk works out: a tensor's dims, or a shape tensor's values (one walk for both: a step's zeros_like(h)
# reads the dims of h, which are the previous step's zeros' dims, read from that step's Shape(h)...)
_DIMS, _VALUE, _RANK = "d", "v", "r"


def _fixed(g: Graph, key: tuple):
    if not key[1]:
        return None
    # (a body's answers are kept for one query only: its index may be rebuilt while the run's memo lives; what
    # it reads from outside is not followed, only what a settled type says)
    memo = g.model.facts.op_shapes if g.parent is None else {}
    return post_order(key, memo, lambda cur: _open(g, cur, memo), lambda cur: _close(g, cur, memo))


def _open(g: Graph, key: tuple, memo: dict):
    kind = key[0]
    return _open_dims(g, key, memo) if kind == _DIMS else _open_rank(g, key, memo) if kind == _RANK else \
        _open_value(g, key, memo)


def _close(g: Graph, key: tuple, memo: dict):
    kind = key[0]
    return _close_dims(g, key[1], memo) if kind == _DIMS else _close_rank(g, key[1], memo) if kind == _RANK else \
        _close_value(g, key[1], memo)


def _open_dims(g: Graph, key: tuple, memo: dict):
    cur = key[1]
    # (declared, or established by an inference already run: a walk stops there, not 100,000 prologue nodes on)
    t = g.model.settled_type(cur)
    if t is not None and t[1] is not None:
        memo[key] = tuple(t[1])
        return None
    p = g.producer.get(cur)
    if p is None or p.domain not in ("", "ai.onnx"):
        memo[key] = None
        return None
    op = p.op_type
    if op == "Reshape":  # (the data's dims, the shape's values, and its length: the rank where they are not known)
        return [(_DIMS, p.input[0]), (_VALUE, p.input[1]), (_DIMS, p.input[1])]
    if op == "Expand":  # (the data's dims and the shape's values)
        return [(_DIMS, p.input[0]), (_VALUE, p.input[1])]
    if op == "ConstantOfShape":
        return [(_VALUE, p.input[0])]
    if op in _FIRST_INPUT:
        return [(_DIMS, p.input[0])]
    if op in _BROADCAST or op in ("Concat", "MatMul", "Gemm"):
        return [(_DIMS, i) for i in p.input if i]
    if op == "Gather":
        return [(_DIMS, p.input[0]), (_DIMS, p.input[1])]
    native = output_dims(p, cur)
    if native is not None:
        return [(_DIMS, i) for i in sorted({p.input[d[0]] for d in native if isinstance(d, tuple)
                                            and len(p.input) > d[0]} - {""})]
    declared = loop_output_type(g, p, cur) if op in ("Loop", "Scan") else None
    memo[key] = declared[1] if declared is not None else None
    return None


def loop_output_type(g: Graph, node: NodeProto, name: str) -> tuple[int, tuple | None] | None:
    """(element type, dims) of output ``name`` of Loop or Scan ``node`` of ``g`` as its body declares the value:
    a carried value has the body output's rank (its dims are the initial value's when the loop runs no
    iteration), a scan output the body output's dims and one axis more where the steps are stacked (its extent
    not known here). Numbers only (a body's symbols are its own: None in their place). A stack of
    1,600 Loops, each reading the one below: the rank of each one's input took a cone inference through every
    Loop below it, and above ~770 of them the cone was too big to infer (the Loops were declined)."""
    if node.op_type == "Scan" and g.model.opset < 9:  # (Scan-8 has a batch axis of its own)
        return None
    body = g.subgraph(node)
    outs, k = body.output_names, list(node.output).index(name)
    lead, n_states = carried_layout(node)
    t = body.local_type(outs[lead + k]) if lead + k < len(outs) else None
    if t is None or not t[0]:
        return None
    dims = None if t[1] is None else tuple(d if isinstance(d, int) else None for d in t[1])
    if dims is None or k < n_states:
        return t[0], None if dims is None else (None,) * len(dims)
    j = k - n_states
    axes, _ = scan_output_layout(node, len(node.output) - n_states)
    axis = axes[j] if j < len(axes) else 0
    axis = axis + len(dims) + 1 if axis < 0 else axis
    return (t[0], dims[:axis] + (None,) + dims[axis:]) if 0 <= axis <= len(dims) else (t[0], None)


def _close_dims(g: Graph, cur: str, memo: dict):
    p = g.producer[cur]
    op = p.op_type
    ins = [memo.get((_DIMS, i)) if i else None for i in p.input]
    first = ins[0] if ins else None
    if op in _SAME_SHAPE:
        return first
    if op in _BROADCAST:
        return _broadcast([d for i, d in zip(p.input, ins) if i])
    if op == "Transpose":
        perm = _attr(p, "perm", None)
        if first is None:  # (the perm says the rank)
            return (None,) * len(perm) if perm else None
        perm = perm or list(range(len(first)))[::-1]
        return tuple(first[k] for k in perm) if sorted(perm) == list(range(len(first))) else None
    if op in ("Squeeze", "Unsqueeze"):
        return _unit_axes(g, p, first)
    if op == "Slice":
        return _sliced(g, p, first)
    if op == "Concat":
        return concatenated_dims(p, ins)
    if op == "Gemm":
        return _gemm(p, ins)
    if op == "MatMul":
        return _matmul(ins)
    if op == "Gather":
        return _gathered(p, ins)
    if op == "Reshape":
        return _reshaped(p, first, memo.get((_VALUE, p.input[1])), memo.get((_DIMS, p.input[1])))
    if op == "ConstantOfShape":
        value = memo.get((_VALUE, p.input[0]))
        return value if isinstance(value, tuple) else None
    if op == "Expand":
        value = memo.get((_VALUE, p.input[1]))
        return _broadcast([first, value]) if isinstance(value, tuple) else None
    if op == "Shape":
        if first is None:
            return None
        start, end = _attr(p, "start", 0), _attr(p, "end", None)
        return (len(range(len(first))[start:end]),)
    native = output_dims(p, cur)
    if native is None:
        return None
    out = []
    for d in native:
        if isinstance(d, int):
            out.append(d)
            continue
        src = memo.get((_DIMS, p.input[d[0]])) if len(p.input) > d[0] and p.input[d[0]] else None
        out.append(src[d[1]] if src is not None and -len(src) <= d[1] < len(src) else None)
    return tuple(out)


def _broadcast(dims: list):
    """Multidirectional broadcasting: aligned from the end; a number other than 1 is the extent (the others
    must match it), else a symbol when every operand's extent there is known, else 1 when all are 1."""
    if any(d is None for d in dims):
        return None
    rank = max((len(d) for d in dims), default=0)
    out = []
    for k in range(-rank, 0):
        here = [d[k] if len(d) >= -k else 1 for d in dims]
        wide = [x for x in here if isinstance(x, int) and x != 1]
        if wide:
            out.append(wide[0])
        elif None in here:
            out.append(None)
        else:
            symbols = [x for x in here if isinstance(x, str)]
            out.append(symbols[0] if symbols else 1)
    return tuple(out)


def _attr(p, name: str, default=None):
    """``attr`` without reading an empty attribute list (see protos.node_field: most step nodes have none)."""
    return attr(p, name, default) if node_field(p, "attribute") else default


def _unit_axes(g: Graph, p, first):
    axes = op_args.axes(p, g.model.opset, lambda i: literal_value(g, p.input[i]))
    if first is None or axes is None:
        return None
    # (an axis out of range or named twice: an invalid model, left to the runtime to say)
    out = op_args.squeezed(list(first), axes) if p.op_type == "Squeeze" else op_args.unsqueezed(list(first), axes)
    return None if out is None else tuple(out)


def _sliced(g: Graph, p, first):
    if first is None:
        return None
    literal = lambda i: literal_value(g, p.input[i])  # noqa: E731
    starts, ends, axes, steps = op_args.slice_args(p, g.model.opset, literal)
    rank = len(first)
    if not rank:
        return None
    if axes is None:
        return (None,) * rank  # (which axes it cuts is not known: only the rank, which a Slice keeps)
    out = list(first)
    for k, a in enumerate(axes):
        a %= rank
        d = first[a]
        known = None not in (starts, ends, steps) and isinstance(d, int)
        out[a] = len(range(*slice(starts[k], ends[k], steps[k]).indices(d))) if known else None
    return tuple(out)


def concatenated_dims(p, ins: list):
    """The dims of Concat ``p``'s output from its inputs' (``ins``, None where not known): the extents along
    its axis summed, the others as any input fixes them."""
    known = [d for d in ins if d is not None]
    if not known:
        return None
    rank = len(known[0])
    axis = _attr(p, "axis", 0) % rank if rank else 0
    out = []
    for k in range(rank):
        here = [d[k] if d is not None else None for d in ins]
        if k == axis:
            out.append(sum(here) if all(isinstance(x, int) for x in here) else None)
            continue
        ints = [x for x in here if isinstance(x, int)]
        symbols = [x for x in here if isinstance(x, str)]
        out.append(ints[0] if ints else symbols[0] if symbols else None)
    return tuple(out)


def _gemm(p, ins: list):
    a, b = (ins + [None, None])[:2]
    m = (a[1] if _attr(p, "transA", 0) else a[0]) if a is not None and len(a) == 2 else None
    n = (b[0] if _attr(p, "transB", 0) else b[1]) if b is not None and len(b) == 2 else None
    return (m, n)


def _matmul(ins: list):
    a, b = (ins + [None, None])[:2]
    if a is None or b is None or not a or not b:
        return None
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = _broadcast([a2[:-2], b2[:-2]])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _gathered(p, ins: list):
    data, idx = (ins + [None, None])[:2]
    if data is None or idx is None or not data:
        return None
    axis = _attr(p, "axis", 0) % len(data)
    return data[:axis] + idx + data[axis + 1:]


def _entry_count(shape_dims) -> int | None:
    """How many entries a 1-D shape tensor of these dims holds (None: not known, or not 1-D)."""
    n = shape_dims[0] if shape_dims is not None and len(shape_dims) == 1 else None
    return n if isinstance(n, int) else None


def _reshaped(p, first, shape, shape_dims):
    if not isinstance(shape, tuple):  # (as many axes as the shape has entries)
        n = _entry_count(shape_dims)
        return (None,) * n if n is not None else None
    out = []
    for k, v in enumerate(shape):
        if v is None:
            out.append(None)  # (an entry not known: a number, a copy of the data's, or what its size leaves)
        elif isinstance(v, str) or v > 0:
            out.append(v)
        elif v == 0 and not _attr(p, "allowzero", 0):
            out.append(first[k] if first is not None and k < len(first) else None)
        else:
            out.append(None)  # (-1, or an empty axis asked for: what the data's size leaves)
    return tuple(out)


def _open_rank(g: Graph, key: tuple, memo: dict):
    cur = key[1]
    dims = memo.get((_DIMS, cur))
    t = g.model.settled_type(cur) if dims is None else None
    if dims is not None or (t is not None and t[1] is not None):
        memo[key] = len(dims if dims is not None else t[1])
        return None
    p = g.producer.get(cur)
    op = p.op_type if p is not None and p.domain in ("", "ai.onnx") else None
    fixed = None
    if op == "Transpose" and _attr(p, "perm", None):
        fixed = len(_attr(p, "perm"))
    elif op in ("Gemm", "Shape"):
        fixed = 2 if op == "Gemm" else 1
    elif op in _SAME_SHAPE or op in ("Transpose", "Slice", "Squeeze", "Unsqueeze", "Split"):
        return [(_RANK, p.input[0])]
    elif op in ("Reshape", "ConstantOfShape"):  # (as many axes as the shape has entries)
        return [(_DIMS, p.input[-1])]
    elif op == "Expand":
        return [(_RANK, p.input[0]), (_DIMS, p.input[1])]
    elif op in _BROADCAST or op in ("MatMul", "Gather"):
        return [(_RANK, i) for i in p.input if i]
    elif op == "Concat" and p.input and p.input[0]:  # (every input has the output's rank)
        return [(_RANK, p.input[0])]
    elif op in ("Loop", "Scan"):
        declared = loop_output_type(g, p, cur)
        fixed = None if declared is None or declared[1] is None else len(declared[1])
    elif op is not None:
        native = output_dims(p, cur)
        fixed = None if native is None else len(native)
    memo[key] = fixed
    return None


def _close_rank(g: Graph, cur: str, memo: dict):
    p = g.producer[cur]
    op = p.op_type
    ranks = [memo.get((_RANK, i)) if i else None for i in p.input]
    if op in ("Reshape", "ConstantOfShape", "Expand"):
        n = _entry_count(memo.get((_DIMS, p.input[-1])))
        return n if op != "Expand" or n is None or ranks[0] is None else max(n, ranks[0])
    if op in _BROADCAST:
        known = [r for i, r in zip(p.input, ranks) if i]
        return None if None in known else max(known, default=None)
    if None in ranks[:2 if op in ("MatMul", "Gather") else 1]:
        return None
    if op == "MatMul":  # (a 1-D operand loses its axis)
        a, b = ranks[:2]
        return max(a, b) - (a == 1) - (b == 1) if max(a, b) > 1 else 0
    if op == "Gather":
        return ranks[0] - 1 + ranks[1]
    if op in ("Squeeze", "Unsqueeze"):
        axes = op_args.axes(p, g.model.opset, lambda i: literal_value(g, p.input[i]))
        if axes is None:
            return None  # (a Squeeze of no axes drops every unit axis: what the data says)
        return ranks[0] - len(axes) if op == "Squeeze" else ranks[0] + len(axes)
    return ranks[0]  # (same-shape ops, Slice, Split, Concat, a Transpose reversing its input's axes)


# ops computing a shape tensor's values from others (torch's ``zeros(x.size(0), H)``: Concat(Unsqueeze(Gather(
# Shape(x), 0)), [H]); its ``x.size(0) * 2``: Mul)
_SHAPE_VALUE_SIZE = 64  # (the most entries a literal read as a shape value has)
_SHAPE_ARITH = frozenset(("Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Identity", "Slice",
                          "Reshape")) | frozenset(ARITH)


def _open_value(g: Graph, key: tuple, memo: dict):
    cur = key[1]
    init = g.initializers.get(cur)
    if init is not None and (len(init.dims) > 1 or (init.dims and init.dims[0] > _SHAPE_VALUE_SIZE)):
        memo[key] = None  # (a weight, met by a walk through arithmetic: not read to learn it is no shape)
        return None
    c = literal_value(g, cur)
    if c is not None:
        memo[key] = _as_value(c)
        return None
    p = g.producer.get(cur)
    if p is None or p.domain not in ("", "ai.onnx") or p.op_type not in _SHAPE_ARITH:
        memo[key] = None
        return None
    if p.op_type == "Shape":
        return [(_DIMS, p.input[0])]
    return [(_VALUE, p.input[0])] if p.op_type not in ARITH and p.op_type != "Concat" else \
        [(_VALUE, i) for i in p.input if i]


def _close_value(g: Graph, cur: str, memo: dict):
    p = g.producer[cur]
    op = p.op_type
    first = memo.get((_VALUE, p.input[0])) if p.input else None
    if op == "Shape":
        dims = memo.get((_DIMS, p.input[0]))
        return None if dims is None else dims[_attr(p, "start", 0):_attr(p, "end", None)]
    if op == "Identity":
        return first
    if op == "Cast":
        return cast(_attr(p, "to"), first)
    if op in ARITH:
        return arith(op, first, memo.get((_VALUE, p.input[1])) if len(p.input) == 2 else None)
    if op == "Concat":
        parts = [memo.get((_VALUE, i)) for i in p.input if i]
        return None if any(not isinstance(v, tuple) for v in parts) else sum(parts, ())
    literal = lambda i: literal_value(g, p.input[i])  # noqa: E731
    if op == "Gather":
        idx = literal_value(g, p.input[1])
        if not isinstance(first, tuple) or idx is None or idx.ndim > 1 or _attr(p, "axis", 0) not in (0, -1):
            return None
        picks = [int(i) for i in idx.ravel()]
        if not all(-len(first) <= i < len(first) for i in picks):
            return None
        return first[picks[0]] if idx.ndim == 0 else tuple(first[i] for i in picks)
    if op == "Unsqueeze":
        axes = op_args.axes(p, g.model.opset, literal)
        return (first,) if axes is not None and len(axes) == 1 and not isinstance(first, tuple) else None
    if op == "Squeeze":
        axes = op_args.axes(p, g.model.opset, literal)
        return first[0] if isinstance(first, tuple) and len(first) == 1 and axes in (None, [0], [-1]) else None
    if op == "Reshape":  # (dynamo's ``Reshape(d2 * d3, [-1])``: a one-entry value to one dim, and back)
        return _reshaped_value(first, literal(1))
    if op == "Slice":
        starts, ends, axes, steps = op_args.slice_args(p, g.model.opset, literal)
        if not isinstance(first, tuple) or None in (starts, ends, axes, steps) or len(starts) != 1 or \
                axes[0] not in (0, -1):
            return None
        return first[slice(starts[0], ends[0], steps[0])]
    return None


def _reshaped_value(value, shape):
    """A shape value (a tuple: one dim; else a scalar) reshaped to the literal ``shape``: the same entries as a
    one-dim value of ``[-1]`` or its own length, a scalar's as ``[1]`` / ``[-1]``, a one-entry value's as a
    scalar (``[]``); None otherwise."""
    if value is None or shape is None or shape.ndim != 1 or len(shape) > 1:
        return None
    size = len(value) if isinstance(value, tuple) else 1
    if len(shape) == 0:
        return value[0] if isinstance(value, tuple) and size == 1 else None
    if int(shape[0]) not in (-1, size):
        return None
    return value if isinstance(value, tuple) else (value,)


def _as_value(c):
    """A literal's values in shape_value's form (only small int32 / int64 tensors of rank 0 or 1: arithmetic in
    a narrower or unsigned type wraps where Python's does not)."""
    import numpy as np

    a = np.asarray(c)
    if a.ndim > 1 or a.size > _SHAPE_VALUE_SIZE or a.dtype not in (np.int32, np.int64):
        return None
    return int(a) if a.ndim == 0 else tuple(int(x) for x in a)
