"""Declines of Loop and Scan nodes kept from one round of passes to the next.

A round after one that fused something analyses every Loop and Scan again (a fusion can expose another:
a stacked Loop whose trip count is proven once the Loop below it is a native op). A node declined last round
whose surroundings no edit since has reached is declined again for the same reason without its analysis
(4,545 Scans declined twice, once per round, because a fusion elsewhere started a second one: 1.7 s of a
100k-node graph).

What an analysis reads, and so what an edit must not have reached for its decline to stand:

- the node itself (its inputs, attributes and subgraphs: an edit inside a body re-indexes its owner, which
  counts as an edit of the owner);
- what it reads and everything that is computed from (types, constants, producers): no value it reads may be
  one an edit made or one computed from such a value;
- who reads what it reads and what it computes, two readers deep (how many read an output, a Gather of the
  last step read through a Squeeze): no edited or removed node may read them.

A kept decline can only ever leave a node unfused that a fresh analysis would fuse, never rewrite anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from onnx import NodeProto

from .protos import reads_of


@dataclass
class RoundEdits:
    """The values the nodes edited, added or removed in a round define and read (``Graph.finalize`` keeps the
    last round's on the model's facts)."""

    defined: set = field(default_factory=set)
    read: set = field(default_factory=set)

    def add(self, nodes) -> "RoundEdits":
        for n in nodes:
            self.defined.update(o for o in n.output if o)
            self.read.update(i for i in reads_of(n) if i)
        return self


def edits_of(nodes) -> RoundEdits:
    return RoundEdits().add(nodes)


def unaffected(g, last_round: RoundEdits | None) -> Callable[[NodeProto], bool]:
    """Whether no edit of the last round (``last_round``) nor of this one so far has reached a node of ``g``'s
    main graph (see the module). Built once per pass: one walk forward from the values the edits defined."""
    edits = RoundEdits(set(last_round.defined), set(last_round.read)) if last_round is not None else RoundEdits()
    edits.add(g.edited_this_round())
    dirty = set(edits.defined)
    for n in g.downstream(list(edits.defined)) or []:
        dirty.update(o for o in n.output if o)
    touched = dirty | edits.read

    def fresh(node: NodeProto) -> bool:
        if any(i in touched for i in g.reads(node)):
            return False
        for o in node.output:
            if o in touched or any(x in touched for r in g.uses(o) for x in r.output):
                return False
        return True

    return fresh


class KeptDeclines:
    """Decline reasons by pass and node (its op and outputs: a value's name is never reused), given or confirmed
    last round; a round's own are kept for the next one only when its type queries were all answered whole
    (a decline for want of a type may not stand when the next round infers with a fresh budget or the whole
    model at once)."""

    def __init__(self):
        self.reasons: dict[tuple, str] = {}  # last round's
        self.this_round: dict[tuple, str] = {}
        self.whole_inference: bool | None = None  # whether last round inferred the whole model at once

    def kept(self, pass_name: str, node: NodeProto, model,
             fresh: Callable[[], Callable[[NodeProto], bool]]) -> str | None:
        """The reason ``node`` was declined for last round, if nothing reached it since (``fresh()``: the
        predicate, built on first need) and types are inferred as they were."""
        key = _key(pass_name, node)
        reason = self.reasons.get(key) if key is not None else None
        if reason is None or model.inferred_at_once != self.whole_inference or not fresh()(node):
            return None
        self.this_round[key] = reason
        return reason

    def keep(self, pass_name: str, node: NodeProto, reason: str) -> None:
        key = _key(pass_name, node)
        if key is not None:
            self.this_round[key] = reason

    def close_round(self, model) -> None:
        """The round is over (``Graph.finalize``): what it declined or confirmed is what the next one may keep."""
        complete = model.types_complete()
        self.reasons = self.this_round if complete else {}
        self.this_round = {}
        self.whole_inference = model.inferred_at_once


def _key(pass_name: str, node: NodeProto) -> tuple | None:
    """The node by its op and outputs (None when it has no named output: two such nodes could not be told apart)."""
    outputs = tuple(node.output)
    return (pass_name, node.op_type, outputs) if any(outputs) else None
