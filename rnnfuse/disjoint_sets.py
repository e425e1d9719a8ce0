"""Items joined into sets, each set known by its smallest item (union-find with path halving).

For groupings built from pairwise ties in one pass: a step's states that read one another
(rnnfuse.recurrence_layers), a chain's lanes (passes/unrolled/lanes), a Loop body's carried values
(passes/loop_split), chains sharing a state carrier (passes/step_chains), a check model's parts
(rnnfuse.check_groups). Nearly constant time a query.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class DisjointSets:
    """``items`` (comparable among themselves), each in a set of its own until joined."""

    def __init__(self, items: Iterable[Hashable]):
        self.parent = {x: x for x in items}

    def __contains__(self, x) -> bool:
        return x in self.parent

    def __iter__(self):
        return iter(self.parent)

    def root(self, x):
        """The smallest item of ``x``'s set."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(self, x, y) -> None:
        a, b = self.root(x), self.root(y)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
