"""A Loop carrying a list of states (TorchScript ``hs[k] = cell_k(u, hs[k])`` over a ``List[Tensor]``) as one
carried tensor per list position.

TorchScript keeps a Python list that the loop updates in place as a carried sequence: the body reads an item
with ``SequenceAt(S, k)`` and sets one with ``SequenceErase(S, k)`` then ``SequenceInsert(S', v, k)``. A
stacked cell written with its states in a list (``for k, cell in enumerate(self.cells)``) is then one carried
value the Loop front end cannot read as states. When the list is built before the loop with a known length
(``SequenceConstruct``) and the body only reads items and sets them at constant positions, every version of
the list is a tuple of tensors known position by position, so the same Loop carries each position as a
tensor of its own: item reads become the tensor at that position, a set replaces it, ``SequenceLength`` is
the constant length, and the final list is built again after the Loop from the final items
(``SequenceConstruct``), for whatever reads it. The rewritten Loop computes the same values by construction;
it replaces the Loop only where the Loop front end then finds its recurrences (see
:func:`passes.loop_split.fuse_parts`), and stays once they are tried, fused or not (a Loop over its final list
may read its items by then). A list a nested graph of the body reads by name is left as it is.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, TensorProto, TypeProto, ValueInfoProto, helper

from rnnfuse.graph import Graph
from rnnfuse.protos import has_subgraph


def unpack_lists(g: Graph, loop: NodeProto) -> tuple[NodeProto, list[NodeProto]] | None:
    """``(the Loop with each carried list of constant length carried item by item, the nodes rebuilding its
    final lists after it)``, both new (not in the graph), or None when no carried value is such a list."""
    lists: dict[int, list[str]] = {}  # carried position -> the outer tensors its list is built from
    for k, init in enumerate(loop.input[2:]):  # (first: most Loops carry no list, and cost no more than this)
        p = g.producer.get(init) if init else None
        if p is not None and p.op_type == "SequenceConstruct" and len(p.input) >= 1 and all(p.input):
            lists[k] = list(p.input)
    if not lists:
        return None
    body_proto = next((a.g for a in loop.attribute if a.name == "body" and a.type == AttributeProto.GRAPH), None)
    if body_proto is None or len(body_proto.input) != len(loop.input) or len(body_proto.output) < len(loop.input) - 1:
        return None
    body = g.subgraph(loop)
    plan = _Plan(body, body_proto, {body_proto.input[2 + k].name: (k, len(items)) for k, items in lists.items()},
                 g.fresh)
    if not plan.read():
        return None
    return _rebuilt(g, loop, body_proto, lists, plan)


class _Plan:
    """How the body's nodes read the carried lists: each version of a list (the carried input, then the
    outputs of its sets) as the body tensors at its positions, and the nodes to rewrite or drop."""

    def __init__(self, body: Graph, proto: GraphProto, carried: dict[str, tuple[int, int]], fresh):
        self.body, self.proto, self.carried = body, proto, carried  # carried: body input -> (position k, length)
        # every version of a list -> the body tensors at its positions (the carried input's: new body inputs)
        self.items = {name: [fresh(f"{name}/rnnfuse_item{p}") for p in range(n)] for name, (k, n) in carried.items()}
        self.fresh = fresh
        self.replaced: dict[int, NodeProto | None] = {}  # id(body node) -> its replacement (None: dropped)
        # the names the body's nested graphs read from it (an If's branch may read a list by its name)
        self.captured = set().union(*(body.implicit_inputs(n) for n in proto.node if has_subgraph(n)))

    def read(self) -> bool:
        """Walk the body once (its nodes are in order); False when a list is used otherwise than read or set
        at a constant position, measured, or handed on whole as the carried value of a list as long."""
        items = self.items
        erased: dict[str, tuple[str, int]] = {}  # SequenceErase output -> (the version it erased from, position)
        set_back: set[str] = set()  # the erased lists an insert read (once each: the item set back)
        outputs = {o.name for o in self.proto.output}
        for n in self.proto.node:
            seqs = [i for i in n.input if i in items or i in erased]
            if not seqs:
                continue
            if len(seqs) != 1 or n.input[0] != seqs[0]:
                return False
            if n.op_type == "SequenceAt" and n.input[0] in items:
                p = self._position(items[n.input[0]], n.input[1], erase=True)
                if p is None:
                    return False
                self.replaced[id(n)] = helper.make_node("Identity", [items[n.input[0]][p]], [n.output[0]], name=n.name)
            elif n.op_type == "SequenceLength" and n.input[0] in items:
                value = helper.make_tensor("value", TensorProto.INT64, [], [len(items[n.input[0]])])
                self.replaced[id(n)] = helper.make_node("Constant", [], [n.output[0]], name=n.name, value=value)
            elif n.op_type == "SequenceErase" and n.input[0] in items:
                p = self._position(items[n.input[0]], n.input[1] if len(n.input) > 1 else "", erase=True)
                if p is None or n.output[0] in outputs:
                    return False
                erased[n.output[0]] = (n.input[0], p)
                self.replaced[id(n)] = None
            elif n.op_type == "SequenceInsert" and n.input[0] in erased and n.input[0] not in set_back:
                set_back.add(n.input[0])
                version, p = erased[n.input[0]]
                q = self._position(items[version], n.input[2] if len(n.input) > 2 else "", erase=False)
                if q != p:  # (inserted elsewhere than erased: the items move)
                    return False
                items[n.output[0]] = items[version][:p] + [n.input[1]] + items[version][p + 1:]
                self.replaced[id(n)] = None
            else:
                return False
        if set(erased) - set_back or self.captured & (set(items) | set(erased)):
            return False  # (an erased list not set back, or a list a nested graph reads)
        handed = {self.proto.output[1 + k].name for k, _ in self.carried.values()}
        if (outputs - handed) & set(items):  # (a list as a per-step output: it is no more a list once unpacked)
            return False
        return all(self.handed_on(name) is not None for name in self.carried)

    def handed_on(self, name: str) -> list[str] | None:
        """The items the body hands on as the next value of the carried list ``name``: a version of a list as
        long (any other value: None)."""
        k, n = self.carried[name]
        out = self.proto.output[1 + k].name
        found = self.items.get(out)
        return found if found is not None and len(found) == n else None

    def _position(self, version: list[str], name: str, erase: bool) -> int | None:
        """The position ``name`` (a constant integer; "" the last) names in a list of ``len(version)`` items
        (``erase``: a read or an erase), or in that list with one item erased (an insert: up to its end)."""
        n = len(version) if erase else len(version) - 1
        if not name:
            return n - 1 if erase else n
        c = self.body.const(name)
        if c is None or np.size(c) != 1 or np.asarray(c).dtype.kind not in "iu":
            return None
        p = int(np.ravel(c)[0])
        p = p + n if p < 0 else p  # (negative: from the back, as onnxruntime counts)
        return p if 0 <= p < n or (not erase and p == n) else None


def _rebuilt(g: Graph, loop: NodeProto, proto: GraphProto, lists: dict[int, list[str]], plan: _Plan):
    """The new Loop (its body the old one with the lists carried item by item) and the SequenceConstruct
    nodes that give its final lists their old names."""
    body = GraphProto()
    body.CopyFrom(proto)
    del body.node[:]
    for n in proto.node:
        if id(n) not in plan.replaced:
            body.node.append(n)
        elif plan.replaced[id(n)] is not None:
            body.node.append(plan.replaced[id(n)])
    del body.input[2:]
    del body.output[1:]
    inputs, finals, rebuilds = list(loop.input[:2]), [], []
    for k, v in enumerate(proto.input[2:]):
        out = proto.output[1 + k]
        if k not in lists:
            body.input.append(v)
            body.output.append(out)
            inputs.append(loop.input[2 + k])
            finals.append(loop.output[k])
            continue
        item_type = _item_type(g, v, lists[k][0])
        for p, name in enumerate(plan.items[v.name]):
            body.input.append(helper.make_value_info(name, item_type))
            body.output.append(helper.make_value_info(plan.fresh(f"{name}/next"), item_type))
            inputs.append(lists[k][p])
        for p, name in enumerate(plan.handed_on(v.name)):
            body.node.append(helper.make_node("Identity", [name], [body.output[-len(lists[k]) + p].name]))
        items = [g.fresh(f"{loop.output[k] or loop.name + '/list' + str(k)}/rnnfuse_item{p}") for p in range(len(lists[k]))]
        finals.extend(items)
        if loop.output[k]:
            rebuilds.append(helper.make_node("SequenceConstruct", items, [loop.output[k]],
                                             name=f"{loop.name or 'loop'}/rnnfuse_list{k}"))
    body.output.extend(proto.output[1 + len(proto.input) - 2:])
    new = helper.make_node("Loop", inputs, finals + list(loop.output[len(proto.input) - 2:]), name=loop.name,
                           body=body)
    if loop.domain:
        new.domain = loop.domain
    return new, rebuilds


def _item_type(g: Graph, carried: ValueInfoProto, first_item: str) -> TypeProto:
    """A list item's type: the one the body declares for the list's elements, else the first item's outside."""
    t = carried.type
    if t.HasField("sequence_type") and t.sequence_type.elem_type.HasField("tensor_type"):
        return t.sequence_type.elem_type
    known = g.model.known_type(first_item)
    elem = known[0] if known is not None else TensorProto.FLOAT
    return helper.make_tensor_type_proto(elem, None)
