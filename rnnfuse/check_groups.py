"""A big check model with masks, run as groups of the parts it is made of.

A validation that overrides masks (rnnfuse.validate) runs one check model, each input set once per padding
pattern, so it cannot run in pieces the way a check without masks does (there each input set runs once, and
the pieces hand on what they computed). One onnxruntime session of a big one grows faster than its nodes:
masked Loops stacked and fused in one pass (onnxruntime 1.32, 2,000 of them, a 90,000-node check model: 14 s to
set up, 10 s to run, 1.2 GB; 7,700 of them ran past 4 minutes and 4 GB).

Such a check model is many parts: each rewrite's old nodes and new nodes, joined to the next rewrite's only by
the old tensor the next one reads (a stacked Loop reads the Loop below's output). So the parts are found (what
a node computes and another reads joins them, and so does a mask both read, its override being one), but not
joined through an old tensor of a compared pair (a "link"). They are packed in order into groups of at most
``limit`` nodes, each checked as a check model of its own, one session after the other (the next one opened
while one runs, :mod:`rnnfuse.sessions_ahead`). A group reading a link
another group computes is fed it: its value computed once per input set by the original nodes with their own
masks, not the patterns (in pieces, by rnnfuse.validate._check_in_groups). Each rewrite is still checked on its whole output,
with its own mask overridden by every pattern kind, against the old nodes given the same inputs: what changes
is only that a part reading another group's output sees it computed with real masks. Only a pass is taken from
the groups: a failure anywhere, or anything the groups cannot run, leaves the verdict to the whole check model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from onnx import NodeProto

from .check_results import ValidationResult
from .disjoint_sets import DisjointSets
from .piecewise_runs import weight

Pair = tuple[str, str]


class Group:
    """Parts of a check model: its ``nodes`` (in the check model's order), the ``pairs`` they compare, the
    ``masks`` (name -> kind and time axis, as rnnfuse.validate takes them) and the links other groups compute
    that they read (``fed``)."""

    def __init__(self):
        self.nodes: list[NodeProto] = []
        self.pairs: list[Pair] = []
        self.masks: dict[str, tuple] = {}
        self.fed: set[str] = set()


def independent_groups(nodes: list[NodeProto], pairs: list[Pair], masks: dict[str, tuple],
                       reads: Callable[[NodeProto], Iterable[str]], limit: int) -> list[Group] | None:
    """``nodes`` (a check model's, in topological order) as groups of parts (see the module), each group of at
    most ``limit`` nodes unless one part is bigger (subgraphs counted, see piecewise_runs.weight); None when
    they are one group, or a pair or a mask belongs to no part."""
    links = {a for a, _ in pairs}
    parts = DisjointSets(range(len(nodes)))  # (a part known by its first node)
    join = parts.join
    producer: dict[str, int] = {}
    mask_node: dict[str, int] = {}  # mask -> a node computing or reading it (all of them joined)
    read_links: list[tuple[int, str]] = []
    compared = {x for p in pairs for x in p}
    free: list[bool] = []  # a node reading only inputs, weights, fed values and what free nodes compute
    for i, n in enumerate(nodes):
        ins = reads(n)
        free.append(not any(r in links or r in masks or (r in producer and not free[producer[r]]) for r in ins)
                    and not any(o in compared or o in masks for o in n.output))
        for r in ins:
            if r in links:
                read_links.append((i, r))
            elif r in producer and not free[producer[r]]:
                join(i, producer[r])
            if r in masks:
                join(i, mask_node.setdefault(r, i))
        for o in n.output:
            if o:
                producer[o] = i
                if o in masks:
                    join(i, mask_node.setdefault(o, i))
    if any(m not in mask_node for m in masks) or any(not any(x in producer for x in p) for p in pairs):
        return None
    if sum(weight(n) for n, f in zip(nodes, free) if f) > limit:
        return None  # (each group copies the free nodes it reads: a big shared upstream is rnnfuse.upstream's)
    for p in pairs:  # (a pair's two tensors: one part)
        at = [producer[x] for x in p if x in producer]
        for i in at[1:]:
            join(at[0], i)
    groups = _packed(nodes, free, parts.root, limit)
    if len(groups) < 2:
        return None
    group_of = {id(n): g for g in groups for n in g.nodes}
    for p in pairs:
        group_of[id(nodes[producer[next(x for x in p if x in producer)]])].pairs.append(p)
    for m, i in mask_node.items():
        group_of[id(nodes[i])].masks[m] = masks[m]
    for i, r in read_links:  # (a link no node computes is fed to the whole check already: start.given)
        if r in producer and group_of[id(nodes[producer[r]])] is not group_of[id(nodes[i])]:
            group_of[id(nodes[i])].fed.add(r)
    at = {id(n): i for i, n in enumerate(nodes)}
    for g in groups:
        _with_free_nodes(g, nodes, at, free, producer, reads)
    return groups


def _with_free_nodes(g: Group, nodes: list[NodeProto], at: dict[int, int], free: list[bool], producer: dict[str, int],
                     reads) -> None:
    """``g``'s nodes with the free nodes they read (and those read), in the check model's order (``at``: a node's
    position, by its id)."""
    keep = {at[id(n)] for n in g.nodes}
    stack = [producer[r] for n in g.nodes for r in reads(n) if r in producer and free[producer[r]]]
    while stack:
        i = stack.pop()
        if i not in keep:
            keep.add(i)
            stack += [producer[r] for r in reads(nodes[i]) if r in producer and free[producer[r]]]
    g.nodes = [nodes[i] for i in sorted(keep)]


def _packed(nodes: list[NodeProto], free: list[bool], root: Callable[[int], int], limit: int) -> list[Group]:
    """Groups of whole parts (free nodes aside), in the order of their first nodes, each filled while it has
    room; each node appended to its part's group (so a group's nodes keep the check model's order)."""
    part_size: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if not free[i]:
            r = root(i)
            part_size[r] = part_size.get(r, 0) + weight(n)
    groups: list[Group] = []
    home: dict[int, Group] = {}  # a part's root (its first node) -> its group
    size = 0
    for i, n in enumerate(nodes):
        if free[i]:
            continue
        r = root(i)
        if r == i:  # (a part starts)
            if not groups or (size and size + part_size[r] > limit):
                groups.append(Group())
                size = 0
            size += part_size[r]
            home[r] = groups[-1]
        home[r].nodes.append(n)
    return groups


def in_groups(groups: list[Group], pairs: list[Pair], check: Callable[[Group, object], ValidationResult],
              ahead: Callable[[Group], object]) -> ValidationResult | None:
    """The check of ``pairs`` made group by group: ``ahead(group)`` starts opening a group's session (see
    rnnfuse.sessions_ahead), asked for the next group before ``check(group, what ahead gave)`` checks one, so
    at most two groups' sessions are open at once. Only a pass is taken from the groups: None (the whole check
    model decides, and says what fails) when a group's check did not run or a pair failed in it."""
    res, runs = ValidationResult(True), []
    coming = ahead(groups[0]) if groups else None
    for k, group in enumerate(groups):
        opening, coming = coming, (ahead(groups[k + 1]) if k + 1 < len(groups) else None)
        part = check(group, opening)
        if not part.ran or not all(r.ok for r in part.pairs.values()):
            return None
        res.pairs.update(part.pairs)
        runs.append(part.runs)
        res.light = res.light or part.light
    if set(res.pairs) != set(pairs):
        return None
    res.runs = min(runs)  # (the runs each pair was compared in, at least)
    return res
