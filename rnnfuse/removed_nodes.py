"""Which nodes of a graph scope were removed since it was last finalized, as the scope's index asks it.

A set of removed ids is the plain answer; once most of a scope goes at once (a fused chain's 108k steps),
the ids of the nodes that stay are the smaller set to hold. :class:`Removed` answers either way.
"""

from __future__ import annotations

import itertools
import operator

from onnx import NodeProto


class Removed:
    """Which nodes of a scope were removed since it was last finalized, by id: the removed ones, or, once most
    of the scope went at once (a fused chain), the live ones (:meth:`keep_only`): a set of the 108k ids of a
    fused chain's steps would hold 7.5 MB (the int objects and the table) while the chain is committed.
    ``k in removed`` asks about a node's id. A node the graph holds must stay referenced (its id is not
    reused): the graph's graveyard keeps the removed ones."""

    __slots__ = ("ids", "live")

    def __init__(self):
        self.ids: set[int] = set()  # removed (while ``live`` is None)
        self.live: set[int] | None = None  # else: the ids of the nodes not removed

    def __contains__(self, k: int) -> bool:
        return k in self.ids if self.live is None else k not in self.live

    def __bool__(self) -> bool:
        return bool(self.ids) or self.live is not None

    def add(self, k: int) -> None:
        if self.live is None:
            self.ids.add(k)
        else:
            self.live.discard(k)

    def added(self, k: int) -> None:
        """A node added to the scope: live."""
        if self.live is not None:
            self.live.add(k)

    def keep_only(self, nodes) -> None:
        """Every node of the scope not in ``nodes`` is removed (and stays so; ``nodes`` stay live)."""
        self.ids, self.live = set(), set(map(id, nodes))

    def keep(self, nodes) -> list[NodeProto]:
        """The nodes not removed, in order (the loops run in C)."""
        if self.live is not None:
            return list(itertools.compress(nodes, map(self.live.__contains__, map(id, nodes))))
        return without(nodes, self.ids) if self.ids else list(nodes)


def without(nodes, ids: set[int]) -> list[NodeProto]:
    """The nodes whose id is not in ``ids``, in order (the loops run in C: a few ms for 100k nodes)."""
    return list(itertools.compress(nodes, map(operator.not_, map(ids.__contains__, map(id, nodes)))))
