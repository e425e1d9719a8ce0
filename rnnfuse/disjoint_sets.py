"""Items joined into sets, each set known by its smallest item (union-find with path halving).

For groupings built from pairwise ties in one pass over a graph: chains sharing a state carrier
(passes/step_chains), a check model's parts (rnnfuse.check_groups). Nearly constant time a query.
"""

from __future__ import annotations


class DisjointSets:
    """The items ``0 .. n-1``, each in a set of its own until joined."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def root(self, i: int) -> int:
        """The smallest item of ``i``'s set."""
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(self, i: int, j: int) -> None:
        a, b = self.root(i), self.root(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
