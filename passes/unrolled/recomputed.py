"""Inner values of a chain that the rest of the graph reads, recomputed outside it from what a native op keeps.

A step's cell may share a value with what else the step computes. PyTorch's char-RNN tutorial concatenates
``x_t`` with the state before it once, for the cell's matmul and for the output head's (``i2h(cat(x_t, h))``,
``i2o(cat(x_t, h))``); a chain with such a read was declined ("a per-step output is not the cell output"). Fused,
the chain's nodes are gone, but a value its step only rearranges from the step's own inputs and the hidden state
it read stays computable: the step input is there as it was, and that state is the op's Y at the step before (or
the initial state). So when a chain is declined, each such value read outside it is given a copy of the few nodes
of its step that move it, outside the chain, and the chain is recognised again. Whatever reads the copy reads
the hidden state of the step before, which the recurrence then hands out as a step of Y (a cell state c is never
one of those leaves: a native op outputs only the last). The retry is a new recognition, validated like any other;
if it declines too, the copies are removed and the first decline stands (``rule._recurrence``).
"""

from __future__ import annotations

from typing import Callable

from rnnfuse.dataflow import shape_derived
from rnnfuse.graph import Graph

from .outputs import Escapes

# nodes a recomputed value may take, each of them one that moves values and computes none: a copy then costs
# next to nothing, where a value that computes (a matmul, an activation: the unmasked cell output of a masked
# step) would run the cell's own work again at every step beside the native op
MAX_COPIED = 8
MOVES = {"Concat", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Cast", "Slice", "Split",
         "Gather", "Expand"}


def recompute_reads(g: Graph, roles) -> Callable[[], None] | None:
    """Give the readers outside the chain of each inner value that step k computes from its own leaves (the step
    input, its masks, the hidden state ``h_in[k]`` it read) and constants by moving values (:data:`MOVES`,
    within :data:`MAX_COPIED` of the step's own nodes), a copy of those nodes to read. Returns the undo, or None
    when there is no such value."""
    if not getattr(roles, "cell_found", False):
        return None  # (declined before each step's states were known)
    cell = _cell_nodes(g, roles)
    chain, iv = roles.chain, roles.iv
    side = 1 if chain.direction == "forward" else 0  # the interval end that names a value's step
    k_of = {st.t: k for k, st in enumerate(chain.steps)}
    states = {t for t in roles.h_in + roles.h_new + roles.c_new if t}
    plans = []
    for nd, o, outside in Escapes(g, cell).entries:
        v = iv.nodes.get(id(nd))
        k = k_of.get(v[side]) if v is not None else None
        if k is None or not outside or o in states or g.is_graph_output(o):
            continue
        cone = _cone(g, o, roles, k, cell)
        if cone:
            plans.append((o, outside, cone, chain.steps[k].t))
    if not plans:
        return None
    made, redirected = [], []
    for o, outside, cone, t in plans:
        env: dict[str, str] = {}
        before = len(g.nodes)
        g.add_copies(cone, env, f"rnnfuse/recomputed_{t}", anchor=cone[-1])
        made.extend(g.nodes[before:])
        g.replace_reads(outside, o, env[o])
        redirected.append((outside, o, env[o]))

    def undo() -> None:
        for outside, o, copy in redirected:
            g.replace_reads([u for u in outside if g.alive(u)], copy, o)
        g.remove_nodes(made)

    return undo


def _cell_nodes(g: Graph, roles) -> set[int]:
    """The ids of each step's own nodes that compute its states from its leaves (asked only of a declined chain:
    a fused one's recognition keeps no second set of its 100,000 nodes)."""
    out: set[int] = set()
    for k, leaves in enumerate(roles.leaves):
        allowed = roles.allowed[k]
        stack = [v for v in (roles.h_new[k], roles.c_new[k]) if v]
        while stack:
            v = stack.pop()
            p = g.producer.get(v) if v not in leaves else None
            if p is None or id(p) in out or not allowed(p):
                continue
            out.add(id(p))
            stack.extend(i for i in p.input if i)
    return out


def _cone(g: Graph, name: str, roles, k: int, cell: set) -> list | None:
    """Step k's nodes that compute ``name`` from its leaves and constants, in evaluation order; None when it
    reads anything else (another step's value, a cell state), computes (an op outside :data:`MOVES`) or takes
    more than :data:`MAX_COPIED` nodes."""
    # (the step input, its masks, the h it read: no extra carried output, whose steps no native op keeps)
    leaves = {v for v, role in roles.leaves[k].items() if role != "y"}
    h_in = roles.h_in[k]
    allowed = roles.allowed[k]
    nodes: dict[int, object] = {}
    stack, seen = [name], set()
    while stack:
        cur = stack.pop()
        if cur in seen or not cur or cur == h_in or cur in leaves:
            continue
        seen.add(cur)
        p = g.producer.get(cur)
        if p is None or id(p) not in cell:
            continue  # (a graph input, a weight, a value computed outside the chain: there after the fusion)
        if shape_derived(g, cur):
            if _shapes_cell_values(g, cur, cell):
                return None  # (the shape of a value the fusion removes: the copy would keep the chain's nodes)
            continue  # (a shape or a fill of the input's, the zero state of a first step: there after the fusion)
        if p.op_type not in MOVES or p.domain or not allowed(p) or g.implicit_inputs(p) or len(nodes) >= MAX_COPIED:
            return None
        nodes[id(p)] = p
        stack.extend(p.input)
    return g.nodes_with_ids(set(nodes)) if nodes else None


def _shapes_cell_values(g: Graph, name: str, cell: set, limit: int = 32) -> bool:
    """Whether the shape value ``name`` reads the shape of a value a node of the cell computes (or is not known
    not to, past ``limit`` nodes)."""
    stack, seen = [name], set()
    while stack:
        p = g.producer.get(stack.pop())
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if len(seen) > limit:
            return True
        if p.op_type in ("Shape", "Size"):
            q = g.producer.get(p.input[0])
            if q is not None and id(q) in cell:
                return True
            continue
        stack.extend(i for i in p.input if i)
    return False
