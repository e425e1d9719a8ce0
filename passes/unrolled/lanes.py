"""Cells side by side: a chain whose steps read several carried states split into one chain per cell.

Two cells reading the same step input and nothing of each other (``h1 = cell1(x[t], h1); h2 = cell2(x[t],
h2)``: two encoders of one input, an ensemble, a GRU beside an LSTM) unroll into one chain over x whose
every step reads both hidden states. Each is its own native op. The states are grouped into *lanes*, the
connected parts of "the state step k+1 reads is computed from the state step k reads"; a lane is a chain of
its own whose steps own no node computed from another lane's states alone. States whose cells mix (one cell
reading two states) fall into one lane, which is read as before: a step reading two hidden states declines.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rnnfuse.disjoint_sets import DisjointSets
from rnnfuse.graph import Graph

if TYPE_CHECKING:  # (the chains module splits its chains with this one)
    from .chains import Chain, Step

SHARED = -1  # a node computed from the states of several lanes (a head over both cells' h): no lane's own
_NO_LANES: frozenset = frozenset()


def split_lanes(g: Graph, chain: Chain, iv) -> list[Chain]:
    """``chain`` as one chain per lane, or ``[chain]`` when its states do not come apart into lanes that
    each run through every step."""
    steps = chain.steps
    if len(steps) < 2 or all(st.pulled_of is None for st in steps[1:]):
        return [chain]
    side = 1 if chain.direction == "forward" else 0
    owners = [_owners(g, st, iv, side) for st in steps]
    lanes = _lanes(g, steps, owners)
    if lanes is None or len(lanes) < 2:
        return [chain]
    # (one map a step, shared by the lanes; step 0's by what each lane's first state is computed from)
    lane_of = [_first_step_lane_of(g, steps[0], lanes, iv, side)] + [
        _lane_of(owner, lanes, k) for k, owner in enumerate(owners) if k]
    lane_nodes = [_lane_nodes(g, iv.step_nodes(side, st.t), lane_of[k], owners[k], len(lanes))
                  for k, st in enumerate(steps)]
    out = []
    for lane, roots in enumerate(lanes):
        lane_steps = []
        for k, st in enumerate(steps):
            own = roots[k]
            pulled = set().union(*(st.pulled_of.get(r, ()) for r in own)) if st.pulled_of else st.pulled
            lane_steps.append(replace(st, roots=set(own), pulled=pulled, masks=dict(st.masks), weighted=st.weighted & own,
                                      pulled_of=None, lane_owner=lane_of[k][0], lane=lane, lane_nodes=lane_nodes[k][lane]))
        out.append(replace(chain, steps=lane_steps, lane=sorted(roots[1])[0]))
    return out


def _owners(g: Graph, st: Step, iv, side: int) -> dict[int, frozenset]:
    """Node id -> the step's states it is computed from, over the step's own nodes (those whose span ends at
    the step, and the state-side nodes walked to reach each state: h @ R)."""
    reach: dict[int, frozenset | set] = {}
    several: dict[int, set] = {}  # the nodes of several states
    pulled_of = st.pulled_of or {r: st.pulled for r in st.roots}
    # (the readers taken from the index directly and the outputs pushed as read, empty names too, which no
    # node reads: one walk a state over every step of 1,000 cells side by side. Most nodes are one state's:
    # they share that state's one frozenset; a set of its own, made a frozenset at the end, only for a node of
    # several states, which grows in place: 1,041 cells, 0.35 -> 0.30 s)
    consumers, spans, t = g.consumers, iv.nodes, st.t
    for r in st.roots:
        mine = pulled_of.get(r, ())
        just_r = frozenset((r,))
        stack, seen = [r], set()
        while stack:
            readers = consumers.get(stack.pop())
            if readers is None:
                continue
            for c in readers if type(readers) is list else (readers,):
                k = id(c)
                if k in seen:
                    continue
                span = spans.get(k)
                if k not in mine and (span is None or span[side] != t):
                    continue
                seen.add(k)
                got = reach.get(k)
                if got is None:
                    reach[k] = just_r
                elif type(got) is frozenset:
                    reach[k] = several[k] = {*got, r}
                else:
                    got.add(r)
                stack += c.output
    for k, v in several.items():
        reach[k] = frozenset(v)
    return reach


def _lanes(g: Graph, steps: list[Step], owners: list[dict]) -> list[list[frozenset]] | None:
    """Per lane, per step, the states it reads; None when some state's producer is not computed from the
    states of the step before (a state that threads no lane) or a lane misses a step."""
    threads = DisjointSets((k, r) for k in range(1, len(steps)) for r in steps[k].roots)
    first_of: dict = {}  # a state of step 1 -> the states of step 0 it is computed from
    for k in range(1, len(steps)):
        for r in steps[k].roots:
            p = g.producer.get(r)
            came_from = owners[k - 1].get(id(p)) if p is not None else None
            if k == 1:
                first_of[r] = came_from or frozenset()  # (step 0 may read no state: a zero initial one)
                continue
            if not came_from:
                return None
            for older in came_from:
                threads.join((k - 1, older), (k, r))
    groups: dict = {}
    for k, r in threads:
        groups.setdefault(threads.root((k, r)), [set() for _ in steps])[k].add(r)
    lanes = []
    for per_step in groups.values():
        if not all(per_step[1:]):
            return None
        per_step[0] = set().union(*(first_of[r] for r in per_step[1]))
        lanes.append([frozenset(s) for s in per_step])
    # (in an order of the graph's names, not of string hashes: the same input gives the same output, byte for byte)
    return sorted(lanes, key=lambda per_step: min(per_step[1]))


def _lane_of(owner: dict[int, frozenset], lanes: list[list[frozenset]], k: int) -> tuple[dict[int, int], dict]:
    """(node id -> the lane whose states at step k it is computed from, SHARED: several lanes'; node id ->
    the set of those lanes, for the shared ones)."""
    lane_of_root: dict = {}
    for i, lane in enumerate(lanes):
        for r in lane[k]:
            lane_of_root.setdefault(r, set()).add(i)  # (step 0's given state may be everyone's)
    single, several = {}, {}
    for n, roots in owner.items():
        if len(roots) == 1:  # (most nodes: one state's)
            (r,) = roots
            found = lane_of_root.get(r, _NO_LANES)
        else:
            found = set().union(*(lane_of_root.get(r, ()) for r in roots))
        if len(found) == 1:
            single[n] = next(iter(found))
        else:
            single[n] = SHARED
            several[n] = set(found)  # (its own: a single state's is the shared map's set)
    return single, several


def _first_step_lane_of(g: Graph, st: Step, lanes: list[list[frozenset]], iv, side: int) -> tuple[dict, dict]:
    """:func:`_lane_of` for the first step, whose given state may be every lane's (one h0 read by all the
    cells: what is computed from it says nothing of the lane): its nodes by the lanes whose second state they
    compute, walked back from it."""
    found: dict[int, set] = {}
    for i, lane in enumerate(lanes):
        stack = [g.producer.get(r) for r in lane[1]]
        seen: set[int] = set()
        while stack:
            p = stack.pop()
            if p is None or id(p) in seen:
                continue
            span = iv.nodes.get(id(p))
            if id(p) not in st.pulled and (span is None or span[side] != st.t):
                continue
            seen.add(id(p))
            found.setdefault(id(p), set()).add(i)
            stack.extend(g.producer.get(x) for x in p.input if x)
    single = {k: next(iter(v)) if len(v) == 1 else SHARED for k, v in found.items()}
    return single, {k: v for k, v in found.items() if len(v) > 1}


def _lane_nodes(g: Graph, step_nodes: list, lane_of: tuple[dict, dict], owners: dict, n_lanes: int) -> list[list]:
    """Per lane, the step's nodes it computes from its states or reads (x_t, x_t @ W of its own cell), in walk
    order: what listing its step's values goes through, not every lane's (a lane's query stays its size)."""
    single, several = lane_of
    lanes_of: dict[int, set] = {}
    out: list[list] = [[] for _ in range(n_lanes)]
    for n in reversed(step_nodes):  # (readers first: an input-only node goes to the lanes that read it)
        k = id(n)
        own = single.get(k)
        if own is None:
            mine = set()
            for o in n.output[:]:
                for c in g.uses(o) if o else ():
                    mine |= lanes_of.get(id(c), set())
        else:
            mine = {own} if own != SHARED else several.get(k, set())
        lanes_of[k] = mine
        for lane in mine:
            out[lane].append(n)
    for nodes in out:
        nodes.reverse()
    return out
