"""Symbolic evaluation of one recurrence step: a subgraph becomes polynomials over cell atoms.

A step of a recurrent layer, whatever exporter wrote it, computes elementwise combinations of a few kinds of
things. Evaluating the step's nodes over these abstract values gives one canonical form per output, so the
same maths written with other node orders, Gemm vs MatMul+Add, Split vs Slice, Where vs Mul/Add of casts,
Concat([x, h])·W vs x·W + h·R, all land on the same polynomial. Anything outside the algebra (a vector
coefficient, a matmul of a non-leaf, an unsupported op on the recurrent path) raises
:class:`~rnnfuse.errors.Decline` with the reason, so a near-miss cell is never fused.

The semantics of each ONNX op live in :mod:`.ops_math` and :mod:`.ops_shape`; ops of higher layers (native
cells) are added with :func:`register_handler`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from ..errors import Decline
from ..fold import evaluate
from ..graph import Graph, attr
from ..row_wise import ELEMENTWISE
from . import ops_math, ops_shape, ops_transposed
from .algebra import INITIALIZER, ConstRef, Poly, content_digest
from .values import Const, Fill, Opaque, RowConst, ShapeValue, SymTensor, Transposed, Value, as_poly


def content_key(graph: Graph, name: str, arr: np.ndarray):
    """A key for a named constant that equal bytes share (per-step copies of one weight)."""
    cache = graph.model.facts.content_keys
    k = cache.get(name)
    if k is None:
        k = cache[name] = content_digest(arr)
    return k


_HANDLERS: dict[str, Callable] = {**ops_math.HANDLERS, **ops_shape.HANDLERS, **ops_transposed.HANDLERS}


# The ops whose semantics multiply a tensor by a weight matrix, the affine map every cell is built around
# (``matmul_lin`` is reached from these handlers only); any op given semantics later may do so too.
_WEIGHT_OPS = {"MatMul", "Gemm", "Einsum"}


def register_handler(op_type: str, handler: Callable) -> None:
    """Give the evaluator the semantics of an op defined in a higher layer (native cells: :mod:`rnnfuse.cells`)."""
    _HANDLERS[op_type] = handler
    _WEIGHT_OPS.add(op_type)


def weight_ops() -> frozenset[str]:
    """The op types that can multiply a step's state by a weight matrix. A graph holding none of them holds no
    cell the evaluator can recognise (a recurrent cell without a recurrent weight is no native op)."""
    return frozenset(_WEIGHT_OPS)


# --------------------------------------------------------------------------------------------------------
# the evaluator


class StepEvaluator:
    """Evaluates tensors of one step over symbolic values, on demand and memoised.

    ``leaves`` seeds tensor names with values (states, step inputs, masks). ``may_evaluate(node)`` limits
    which producers belong to the step (a chain step must not walk into the previous step). A name that is
    neither a leaf, nor constant, nor produced by an allowed node evaluates to :class:`Opaque`. ``not_constant``
    names values that are evaluated from their inputs even when they fold to a constant (what an unrolled
    chain computes from a constant initial state it carries as a state).
    """

    def __init__(
        self,
        graph: Graph,
        leaves: dict[str, Value],
        may_evaluate: Callable[[onnx.NodeProto], bool] | None = None,
        foreign: Callable[[str], Value] | None = None,
        content_keys: bool = False,
        not_constant: frozenset | set = frozenset(),
    ):
        self.graph = graph
        self.not_constant = not_constant
        # the batch size when the model fixes it (a static export): a slice over all of it along the batch axis
        # (jax's ``gx[:, :H]`` written with ends [B, H]) then changes nothing
        self.batch: int | None = None
        self.memo: dict[str, Value] = dict(leaves)
        self.may_evaluate = may_evaluate or (lambda n: True)
        self.opset = graph.model.opset
        self.visited_nodes: set[int] = set()
        self.foreign = foreign
        self.content_keys = content_keys

    def _const_key(self, name: str, arr: np.ndarray):
        if not self.content_keys:
            return (INITIALIZER, name)
        return content_key(self.graph, name, arr)

    def _declared_shape(self, node: onnx.NodeProto) -> Value | None:
        """``Shape(src)`` of a tensor the step does not compute (the graph input x, read for its batch), from its
        declared dims: a constant when every dim is a number, a ShapeValue whose None is the batch when exactly one
        dim is not (torch trace's ``view(x.size(1), 4, H)``); None (read it as usual) otherwise."""
        src = node.input[0]
        p = self.graph.producer.get(src)
        if p is not None and self.may_evaluate(p):
            return None
        return self._declared_dims(node)

    def _declared_dims(self, node: onnx.NodeProto) -> Value | None:
        """``Shape(src)`` from ``src``'s declared dims (see :meth:`_declared_shape`), or None."""
        dims = self.graph.model.shape(node.input[0])
        if dims is None or sum(not isinstance(d, int) for d in dims) > 1:
            return None
        return self._dims_value(node, [d if isinstance(d, int) else None for d in dims])

    @staticmethod
    def _dims_value(node: onnx.NodeProto, dims: list) -> Value:
        """What ``node`` (a Shape) gives of a tensor with these dims (None: not known), its start and end applied."""
        dims = dims[attr(node, "start", 0):attr(node, "end", None)]
        return Const(np.array(dims, dtype=np.int64)) if None not in dims else ShapeValue(dims)

    # ---- public
    def value(self, name: str) -> Value:
        if name in self.memo:
            return self.memo[name]
        # iterative post-order to avoid deep recursion on long bodies
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in self.memo:
                stack.pop()
                continue
            c = self.graph.const(cur) if cur and cur not in self.not_constant else None
            if c is not None:
                self.memo[cur] = Const(c, ConstRef(self._const_key(cur, c), c))
                stack.pop()
                continue
            g = self.graph.scope_of(cur)
            node = g.producer.get(cur) if g is self.graph else None
            if node is not None and node.op_type in ("ConstantOfShape", "Expand") and cur not in self.not_constant:
                fv = self.graph.fill_value(cur)
                if fv is not None:  # a constant of runtime shape (zero states): its value is all that matters
                    self.memo[cur] = Fill(np.array(fv, dtype=np.float32))
                    stack.pop()
                    continue
            if node is not None and node.op_type == "Shape" and node.input[0] not in self.memo and self.may_evaluate(node):
                declared = self._declared_shape(node)
                if declared is not None:  # the shape of a tensor from outside the step: not a value it reads
                    self.memo[cur] = declared
                    self.visited_nodes.add(id(node))
                    stack.pop()
                    continue
            if node is None or not self.may_evaluate(node):
                if self.foreign is not None:
                    self.memo[cur] = self.foreign(cur)
                else:
                    fv = self.graph.fill_value(cur)
                    self.memo[cur] = (
                        Fill(np.array(fv, dtype=np.float32))
                        if fv is not None
                        else Opaque(f"'{cur}', a runtime value from outside the step, is read by the cell maths (not as "
                                    "its step input, mask or lengths)")
                    )
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in self.memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self.visited_nodes.add(id(node))
            ins = [self.memo[i] if i else None for i in node.input]
            try:
                outs = self._eval_node(node, ins)
            except Decline as d:
                outs = [Opaque(f"{node.op_type} '{node.name or node.output[0]}': {d.reason}", type(d))] * len(node.output)
            for o, v in zip(node.output, outs):
                if o:
                    self.memo[o] = v
        return self.memo[name]

    def _taken_branch(self, node: onnx.NodeProto, cond: bool) -> list[Value]:
        """The outputs of the branch an If whose condition the step decides takes, its nodes evaluated over
        the step's values: TorchScript exports ``v.squeeze(0)`` of a dim it cannot see as
        ``If(Shape(v)[0] == 1, Squeeze(v), Identity(v))``, and a one-step slice ``x[t:t + 1]`` has that dim 1
        at every step."""
        branch = next((a.g for a in node.attribute if a.name == ("then_branch" if cond else "else_branch")), None)
        if branch is None:
            raise Decline("an If without its branch")
        local: dict[str, Value] = {}

        def read(name: str) -> Value | None:
            if not name:
                return None
            return local[name] if name in local else self.value(name)

        for n in branch.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
                raise Decline("an If branch holding a subgraph")
            for o, v in zip(n.output, self._eval_node(n, [read(i) for i in n.input])):
                if o:
                    local[o] = v
        return [read(o.name) for o in branch.output]

    def _broadcast_shape(self, name: str, limit: int = 64) -> "SymTensor | ShapeValue | None":
        """A value of the step known to have the shape of ``name``, a [B, N] value whose maths are not known:
        an elementwise result has the shape of any operand of its rank without unit dims (the others broadcast
        into it), so a [B, N] (N > 1) value found through elementwise ops of rank 2 has its shape (N not known,
        a state's width the model does not declare: read as :func:`ops_shape._shape` reads it). A product of a
        [B, K] value of the step by a constant [K, N] matrix (a head's ``dense(h)``, whose shape jax2onnx
        broadcasts the step mask to) is [B, N]: its :class:`ShapeValue`. None when none is found within
        ``limit`` values."""
        model = self.graph.model
        todo, seen = [name], set()
        while todo and len(seen) < limit:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            v = self.memo.get(cur)
            if isinstance(v, SymTensor):
                if v.lead == 0 and v.poly.ncols != 1:
                    return v
                continue
            p = self.graph.producer.get(cur)
            if p is None or not self.may_evaluate(p):
                continue
            if p.op_type in ("MatMul", "Gemm"):  # (rank 2 by its operands': the model may not declare it)
                width = self._product_width(p)
                if width is not None:
                    return ShapeValue([None, width])
            elif p.op_type in ELEMENTWISE and model.rank(cur) == 2:
                todo.extend(i for i in p.input if i and i not in seen)
        return None

    def _product_width(self, p: onnx.NodeProto) -> int | None:
        """N when ``p`` multiplies a [B, K] value of the step (rows: the batch) by a constant [K, N] matrix."""
        if p.op_type == "Gemm" and attr(p, "transA", 0):
            return None
        w = self.memo.get(p.input[1]) if len(p.input) > 1 else None  # (a weight the loop passes in: a Const)
        w = w.arr if isinstance(w, Const) else None
        left = self.memo.get(p.input[0])
        if w is None or np.ndim(w) != 2 or not (isinstance(left, SymTensor) and left.lead == 0):
            return None
        return int(w.shape[0] if p.op_type == "Gemm" and attr(p, "transB", 0) else w.shape[1])

    def poly(self, name: str) -> Poly:
        """The polynomial of an elementwise [B, N] tensor, or Decline with the reason it has none."""
        return as_poly(self.value(name), name)

    # ---- nodes
    def _eval_node(self, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise Decline(f"custom op {node.domain}::{op} in the step")
        if op == "Where":  # (before the condition's reason: a select between equal values needs none)
            same = ops_math.equal_branches(ins)
            if same is not None:
                return [same]
        if op == "Shape" and isinstance(ins[0], Opaque):
            # the shape of a value whose maths are not (yet) known: jax2onnx broadcasts the step mask to the
            # shape of any [B, H] value of the step, in a stack of cells perhaps one of a cell above the one being
            # evaluated (known only in a later round, see recurrence_layers.split_layers)
            known = self._broadcast_shape(node.input[0])
            if isinstance(known, ShapeValue):
                known = self._dims_value(node, known.dims)
            known = known or self._declared_dims(node)
            if known is not None:
                return ops_shape.HANDLERS["Shape"](self, node, [known]) if isinstance(known, SymTensor) else [known]
        for k, v in enumerate(ins):
            if isinstance(v, Opaque):
                if op in _WEIGHT_OPS and k == 1 and v.why.startswith("'"):
                    weights = v.why.split("'")[1]  # (the name the reason quotes first)
                    return [Opaque(f"the weights '{weights}' of {op} '{node.name or node.output[0]}' are computed at runtime, not constants")] * len(node.output)
                return [v] * len(node.output)  # keep the first reason, unprefixed
        if any(isinstance(v, ShapeValue) for v in ins) and op not in ("Reshape", "Expand"):
            return _shape_op(self, node, ins)  # (Reshape / Expand *to* a shape value have their own rules)
        if op == "If" and isinstance(ins[0], Const) and np.size(ins[0].arr) == 1:
            return self._taken_branch(node, bool(np.ravel(ins[0].arr)[0]))
        if all(isinstance(v, Const) or v is None for v in ins):
            if any(isinstance(v, (Fill, RowConst)) for v in ins):
                return _fill_op(self, node, ins)
            res = evaluate(node, [v.arr if v is not None else None for v in ins], self.opset)
            if res is None:
                raise Decline(f"cannot evaluate constant {op}")
            return [Const(r) for r in res]
        if any(isinstance(v, Transposed) for v in ins):
            return ops_transposed.on_transposed(self, node, ins, _HANDLERS)
        h = _HANDLERS.get(op)
        if h is None:
            raise Decline(f"unsupported op {op} on the recurrent path")
        return h(self, node, ins)


_FILL_KEEPS = {"Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Transpose", "Flatten", "Split", "Slice", "Gather", "Expand", "Tile", "Concat"}


def _fill_op(ev, node, ins):
    """Constant folding when a runtime-shaped fill is involved: only its value matters."""
    op = node.op_type
    if op == "Shape":
        v = ins[0]
        dims = [None] * max(np.asarray(v.arr).ndim, 2)
        if isinstance(v, RowConst):
            dims[-1] = int(v.arr.shape[-1])
        start, end = attr(node, "start", 0), attr(node, "end", None)
        dims = dims[start:end]
        return [Const(np.array(dims, dtype=np.int64))] if all(d is not None for d in dims) else [ShapeValue(dims)]
    if any(isinstance(v, RowConst) for v in ins) and op not in ("MatMul", "Gemm"):
        res = evaluate(node, [v.arr if v is not None else None for v in ins], ev.opset)
        if res is None:
            raise Decline(f"cannot evaluate constant {op}")
        return [RowConst(r) for r in res]
    fills = [v for v in ins if isinstance(v, Fill)]
    if op in _FILL_KEEPS:
        vals = {float(v.arr) for v in fills}
        if len(vals) == 1 and (op != "Concat" or all(isinstance(v, Fill) for v in ins if v is not None)):
            return [Fill(fills[0].arr)] * len(node.output)
        raise Decline(f"{op} of a runtime-shaped constant")
    if op == "Einsum":  # a matmul-shaped Einsum of a zero state: zeros
        k, _ = ops_math.einsum_as_matmul(node, ins)
        if not isinstance(ins[k], Fill) or float(ins[k].arr) != 0.0 or isinstance(ins[1 - k], Fill):
            raise Decline(f"{op} of a runtime-shaped constant")
        return [Fill(np.array(0.0, dtype=np.float32))]
    if op in ("MatMul", "Gemm"):
        a = ins[0]
        if not isinstance(a, Fill) or float(a.arr) != 0.0 or isinstance(ins[1], Fill):
            raise Decline(f"{op} of a runtime-shaped constant")
        if op == "Gemm" and len(ins) > 2 and ins[2] is not None:
            bias = np.asarray(ins[2].arr) * np.asarray(attr(node, "beta", 1.0), dtype=ins[2].arr.dtype)
            return [RowConst(bias.reshape(1, -1) if bias.ndim == 1 else bias)]
        return [Fill(np.array(0.0, dtype=np.float32))]
    res = evaluate(node, [v.arr if v is not None else None for v in ins], ev.opset)
    if res is None:
        raise Decline(f"cannot evaluate constant {op}")
    return [Fill(r) if np.asarray(r).ndim == 0 else RowConst(r) for r in res]


def _shape_op(ev, node, ins):
    """Ops on the shape of a cell value (torch's chunk computes split sizes from Shape)."""
    v = ins[0]
    if node.op_type in ("Gather", "Slice") and isinstance(v, ShapeValue):
        idx = np.arange(len(v.dims))
        res = evaluate(node, [idx] + [x.arr if isinstance(x, Const) else None for x in ins[1:]], ev.opset)
        if res is None:
            raise Decline("an unsupported use of a shape")
        sel = np.asarray(res[0])
        dims = [v.dims[int(i)] for i in sel.ravel()]
        if all(d is not None for d in dims):
            return [Const(np.array(dims, dtype=np.int64).reshape(sel.shape))]
        return [ShapeValue(dims)]
    if node.op_type in ("Cast", "Identity") and isinstance(v, ShapeValue):
        return [v]
    if node.op_type in ("Unsqueeze", "Squeeze") and isinstance(v, ShapeValue) and len(v.dims) == 1:
        return [v]  # one dim as a scalar or a 1-element vector (torch's size(1) before a Concat)
    if node.op_type == "Concat" and attr(node, "axis", 0) in (0, -1):
        # a shape built from a cell value's batch and constants (jax2onnx broadcasts the step mask with it)
        dims: list = []
        for x in ins:
            if isinstance(x, ShapeValue):
                dims += list(x.dims)
            elif isinstance(x, Const) and np.asarray(x.arr).ndim <= 1:
                dims += [int(d) for d in np.asarray(x.arr).ravel()]
            else:
                raise Decline("Concat of a runtime shape")
        return [ShapeValue(dims)]
    raise Decline(f"{node.op_type} of a runtime shape")
