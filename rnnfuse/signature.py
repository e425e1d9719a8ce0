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
        self.nodes: dict[int, tuple] = {}  # id -> (inputs, outputs, op_type, domain, attributes): each node read once
        self.const_ids: dict[str, int | None] = {}  # tensor -> id of its constant value (None: not constant)

    def _intern(self, key) -> int:
        v = self.table.get(key)
        if v is None:
            v = self.table[key] = len(self.table)
        return v

    def sign(self, name: str, leaves: dict[str, str], allowed, foreign: Callable[[str], str], visited: set,
             fills: dict | None = None, memo: dict | None = None) -> int:
        """``memo``: the signatures of a region signed before with the same ``leaves``, ``allowed`` and
        ``foreign`` (a step's h and then its c: the second walk stops where the first one went)."""
        g = self.g
        if memo is None:
            memo = {}
        expanded: dict[str, NodeProto] = {}  # tensors whose inputs are being signed: their producer
        infos = self.nodes
        runtime = runtime_values(g)
        stack = [name]
        while stack:
            cur = stack[-1]
            if cur in memo:
                stack.pop()
                continue
            p = expanded.get(cur)
            if p is None:
                if cur in leaves:
                    memo[cur] = self._intern(("leaf", leaves[cur]))
                    stack.pop()
                    continue
                cid = self.const_ids.get(cur, -1)
                if cid == -1 and cur in runtime:
                    cid = None  # computed from an input's values: not a constant (no fold attempt)
                elif cid == -1:
                    c = g.const(cur)
                    cid = self.const_ids[cur] = None if c is None else self._intern(("const", content_key(g, cur, c)))
                if cid is not None:
                    memo[cur] = cid
                    stack.pop()
                    continue
                p = g.producer.get(cur)
                info = None
                if p is not None:
                    info = infos.get(id(p))
                    if info is None:
                        info = infos[id(p)] = _node_info(p)
                if info is not None and info[2] in ("ConstantOfShape", "Expand"):
                    fv = g.fill_value(cur)
                    if fv is not None:
                        if fills is not None:
                            fills[cur] = fv
                        memo[cur] = self._intern(("fill", fv))
                        stack.pop()
                        continue
                if info is not None and info[2] in ("Shape", "Size") and info[0][0] not in leaves:
                    q = g.producer.get(info[0][0])
                    if q is None or not allowed(q):  # the shape of an outside tensor: the same for every step
                        memo[cur] = self._intern(("ext-shape", info[0][0], p.SerializeToString()))
                        visited.add(id(p))
                        stack.pop()
                        continue
                if p is None or not allowed(p):
                    fv = g.fill_value(cur)
                    if fv is not None and fills is not None:
                        fills[cur] = fv
                    memo[cur] = self._intern(("fill", fv) if fv is not None else ("leaf", foreign(cur)))
                    stack.pop()
                    continue
                pending = [i for i in info[0] if i and i not in memo]
                if pending:
                    expanded[cur] = p
                    stack.extend(pending)
                    continue
            else:
                info = infos[id(p)]
            stack.pop()
            visited.add(id(p))
            key = (info[2], info[3], info[4], info[1].index(cur), tuple([memo[i] if i else -1 for i in info[0]]))
            memo[cur] = self._intern(key)
        return memo[name]


def _node_info(p: NodeProto) -> tuple:
    """What a signature reads of a node, read from the proto once: (inputs, outputs, op_type, domain,
    attributes as bytes in name order)."""
    atts = p.attribute
    if not atts:
        ak: tuple = ()
    elif len(atts) == 1:
        ak = (atts[0].SerializeToString(),)
    else:
        ak = tuple(a.SerializeToString() for a in sorted(atts, key=_attr_name))
    return (tuple(p.input), tuple(p.output), p.op_type, p.domain, ak)


def _attr_name(a) -> str:
    return a.name
