"""Structural signatures: a number per tensor that is equal for two tensors computed the same way.

Names aside, two regions of a graph that apply the same ops with the same attributes to the same constants
(compared by content) and the same roles of inputs get the same signature. Far cheaper than symbolic
evaluation; used to prove the steps of an unrolled chain identical.
"""

from __future__ import annotations

from typing import Callable

from onnx import NodeProto

from .dataflow import runtime_values
from .graph import Graph
from .protos import takes_attributes
from .symbolic import content_key


class Signer:
    """Structural signatures of step outputs: equal signatures mean the same computation (names aside).

    Far cheaper than symbolic evaluation, so every step of a long chain is compared to a reference step this
    way; steps that differ structurally (a folded first step) are checked symbolically instead.

    ``sign(name, leaves, allowed, foreign, visited)``: ``leaves`` names the region's inputs by role,
    ``allowed(node)`` says which producers belong to the region, ``foreign(name)`` gives the role of any other
    outside value (or raises Decline); ``visited`` collects the ids of the nodes walked."""

    def __init__(self, g: Graph):
        self.g = g
        self.table: dict = {}
        self.const_ids: dict[str, int | None] = {}  # tensor -> id of its constant value (None: not constant)
        # a Constant node's attribute bytes -> the id of its value: an unrolled chain repeats the same Constant
        # (a Split's sizes) in every step; equal bytes are an equal value, folded and hashed once
        self.constant_nodes: dict[bytes, int] = {}
        self.takes: dict[tuple[str, str], bool] = {}  # (op type, domain) -> whether it may have attributes

    def _intern(self, key) -> int:
        v = self.table.get(key)
        if v is None:
            v = self.table[key] = len(self.table)
        return v

    def sign(self, name: str, leaves: dict[str, str], allowed, foreign: Callable[[str], str], visited: set,
             fills: dict | None = None, memo: dict | None = None, given: frozenset = frozenset()) -> int:
        """``memo``: the signatures of a region signed before with the same ``leaves``, ``allowed`` and
        ``foreign`` (a step's h and then its c: the second walk stops where the first one went). ``given``:
        constant initial states the region carries (signed as values, not as the constants they fold to)."""
        if memo is None:
            memo = {}
        if name in memo:
            return memo[name]
        runtime = runtime_values(self.g)
        table, producer, takes, opset = self.table, self.g.producer, self.takes, self.g.model.opset
        const_ids = self.const_ids
        # each producer's fields, read once, kept for this walk only (a chain's steps are each walked once:
        # a cache across walks would hold every node's fields); the tensors whose inputs are being signed
        infos: dict[int, tuple] = {}
        walked: dict[str, tuple] = {}
        # dataflow.post_order's walk, written out here: this is the hot loop of an unrolled chain's proof
        # (every node of every step, 108k at T=6,000), and the calls through its open/close callbacks and the
        # interning method were a third of its time
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in memo:
                stack.pop()
                continue
            info = walked.get(cur)
            if info is None:
                # the two common values, inline: a constant met before (a weight: its value's id) and a value
                # computed at run time by a node of the region whose op is no fill or shape (what _open looks at
                # first); any other goes through _open
                p = None
                if cur not in leaves:
                    if cur in runtime:
                        p = producer.get(cur)
                    elif cur not in given and (cid := const_ids.get(cur)) is not None:
                        memo[cur] = cid
                        stack.pop()
                        continue
                if p is not None:
                    info = infos.get(id(p))
                    if info is None:
                        info = infos[id(p)] = _node_info(p, takes, opset)
                    if info[2] in _OPENED_OPS or not allowed(p):
                        info = None
                if info is None:
                    info = self._open(cur, leaves, allowed, foreign, visited, fills, memo, runtime, infos, given)
                if info is None:  # (its signature is in memo)
                    stack.pop()
                    continue
                walked[cur] = info
                pending = [i for i in info[0] if i and i not in memo]
                if pending:
                    stack.extend(pending)
                    continue
            stack.pop()
            visited.add(info[5])
            key = (info[2], info[3], info[4], info[1].index(cur), tuple([memo[i] if i else -1 for i in info[0]]))
            sig = table.get(key)
            if sig is None:
                sig = table[key] = len(table)
            memo[cur] = sig
        return memo[name]

    def _open(self, cur: str, leaves: dict, allowed, foreign, visited: set, fills: dict | None, memo: dict,
              runtime, infos: dict, given) -> tuple | None:
        """Either ``cur``'s signature goes into ``memo`` (a leaf, a constant, a fill, an outside value) and the
        answer is None, or its producer's fields (:func:`_node_info`) say which inputs to sign first."""
        role = leaves.get(cur)
        if role is not None:
            memo[cur] = self._intern(("leaf", role))
            return None
        if cur not in runtime and cur not in given:  # (computed from an input's values: not a constant, no fold attempt)
            cid = self.const_ids.get(cur, -1)
            if cid == -1:
                cid = self.const_ids[cur] = self._const_id(cur)
            if cid is not None:
                memo[cur] = cid
                return None
        p = self.g.producer.get(cur)
        if p is None:
            return self._outside(cur, fills, foreign, memo)
        info = infos.get(id(p))
        if info is None:
            info = infos[id(p)] = _node_info(p, self.takes, self.g.model.opset)
        op = info[2]
        if op in ("ConstantOfShape", "Expand") and cur not in given:
            fv = self.g.fill_value(cur)
            if fv is not None:
                if fills is not None:
                    fills[cur] = fv
                memo[cur] = self._intern(("fill", fv))
                return None
        elif op in ("Shape", "Size") and info[0][0] not in leaves:
            q = self.g.producer.get(info[0][0])
            if q is None or not allowed(q):  # the shape of an outside tensor: the same for every step
                memo[cur] = self._intern(("ext-shape", info[0][0], p.SerializeToString()))
                visited.add(id(p))
                return None
        if not allowed(p):
            return self._outside(cur, fills, foreign, memo, given)
        return info

    def _const_id(self, name: str) -> int | None:
        """The id of ``name``'s constant value (None: not a constant)."""
        g = self.g
        p = g.producer.get(name)
        key = None
        if p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx"):
            key = b"".join(a.SerializeToString() for a in p.attribute)
            cid = self.constant_nodes.get(key)
            if cid is not None:
                return cid
        c = g.const(name)
        cid = None if c is None else self._intern(("const", content_key(g, name, c)))
        if key is not None and cid is not None:
            self.constant_nodes[key] = cid
        return cid

    def _outside(self, cur: str, fills: dict | None, foreign, memo: dict, given=frozenset()) -> None:
        """A value from outside the region: a filled tensor (a zero state) by its value, else by its role."""
        fv = self.g.fill_value(cur) if cur not in given else None
        if fv is not None and fills is not None:
            fills[cur] = fv
        memo[cur] = self._intern(("fill", fv) if fv is not None else ("leaf", foreign(cur)))
        return None


def _node_info(p: NodeProto, takes: dict, opset: int | None) -> tuple:
    """What a signature reads of a node, read from the proto once: (inputs, outputs, op_type, domain,
    attributes as bytes in one canonical order, the node's id). ``takes``: (op type, domain) -> whether such a node
    may have attributes (protos.takes_attributes at ``opset``), filled as nodes are met.

    An op that takes no attribute (Add, Mul, Tanh: most of a cell) has its fields read directly; else they
    come from one ListFields call, which lists the fields present only: a first read of an empty repeated
    field (a Gather's default axis) leaves a map of stand-ins on the node's object (see protos.node_field).
    [:] is upb's fastest copy of a list of names."""
    op, domain = p.op_type, p.domain
    attrs = takes.get((op, domain))
    if attrs is None:
        attrs = takes[(op, domain)] = takes_attributes(op, domain, opset)
    if not attrs and op != "Constant":  # (a Constant reads no input: its empty field is not read either)
        return (p.input[:], p.output[:], op, domain, (), id(p))
    ins: list = []
    ak: tuple = ()
    for field, value in p.ListFields():
        if field is _INPUT:
            ins = value[:]
        elif field is _ATTRIBUTE:
            # (sorted as bytes: one order whatever the node's, without reading each attribute's name)
            ak = (value[0].SerializeToString(),) if len(value) == 1 else \
                tuple(sorted([a.SerializeToString() for a in value]))
    return (ins, p.output[:], op, domain, ak, id(p))


# the ops whose outputs _open looks at before their node's inputs: a fill (its value) and a shape (of an
# outside tensor, the same for every step)
_OPENED_OPS = frozenset(("ConstantOfShape", "Expand", "Shape", "Size"))

_INPUT, _ATTRIBUTE = NodeProto.DESCRIPTOR.fields_by_name["input"], NodeProto.DESCRIPTOR.fields_by_name["attribute"]

