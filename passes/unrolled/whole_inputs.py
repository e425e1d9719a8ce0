"""A step input computed from the step's slice alone is the slice of the whole sequence computed at once.

Three forms, each the same at every step of a family:

- **embedding lookups**: ``Gather(E, tokens[:, t])`` (a constant table, rows gathered on axis 0) of an integer
  row family (:func:`.families.is_row_family`) is ``Gather(E, tokens)[:, t]``;
- **row-wise maps**: an input MLP or a LayerNorm applied to x_t inside the loop (``relu(x_t W1 + b1)``, ops that
  provably act row by row: :func:`rnnfuse.row_wise.check_row_wise`) before the cell's input matmul is that map
  applied to every row of X at once, then sliced;
- **the time axis last**: ``x[:, :, t]`` of a ``[B, F, T]`` x (a Conv1d's output read step by step) is the
  step of the time-major ``Transpose(x, [2, 0, 1])``, the layout the native ops read;
- **one feature a step**: ``x[:, t:t+1]`` or ``x.split(1, 1)[t]`` of a ``[B, T]`` x (a univariate series, as in
  pytorch/examples' time_sequence_prediction) is the step of ``Unsqueeze(x, 2)``, ``[B, T, 1]``; taken only
  where a step's column is multiplied by weights (a cell's input matmul, or concatenated for one), so a
  ``[B, T]`` mask, which is multiplied with states, stays a row family.

The whole tensor is built beside the graph and the per-step values become a data family over it, so the chain
front end threads, masks, reverses and fuses them as it does the slices of x; the per-step values themselves
stay until a fusion replaces the steps that read them. A whole tensor no fusion reads is removed again
(:meth:`WholeInputs.drop_unused`).
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.builder import Builder
from rnnfuse.dataflow import reaches
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.input_maps import mapped_input, tile_context
from rnnfuse.row_wise import FLOATS, on_every_step
from rnnfuse.signature import Signer

from .families import weighed

_INTS = (6, 7)  # int32, int64: token ids


class WholeInputs:
    """The whole-sequence inputs built so far, reused from round to round (keyed by what they compute)."""

    def __init__(self, g: Graph):
        self.g = g
        self.built: dict[tuple, NodeProto] = {}
        # a whole tensor -> how a report names the sequence it is (its own name is rnnfuse's)
        self.labels: dict[str, str] = {}

    def families(self, fams: dict, signer: Signer, may_chain=None) -> dict[tuple[str, int], dict[int, str]]:
        """New data families among ``fams``' steps: (the whole tensor, its time axis) -> step -> the value it
        holds at that step. ``may_chain(key)``: whether a data family may hold a chain (its maps are built only
        then: 1,500 unbind/stack blocks, none a chain, built 1,500 whole inputs to remove them again)."""
        out = {}
        slices: set | None = None  # every family's step values (what a context row is computed from none of)
        for (src, axis), fam in fams.items():
            et, rank = self.g.model.elem_type(src), self.g.model.rank(src)
            if et in _INTS and rank == 2:
                got = self._lookups(src, axis, fam)
            elif et in FLOATS and rank == 2 and axis == 1:
                got = self._columns(src, fam)
            elif et in FLOATS and rank == 3 and axis == 2 and may_chain is not None and may_chain.combines((src, axis)):
                got = self._time_major(src, fam)
            elif et in FLOATS and rank == 3 and (may_chain is None or may_chain((src, axis))):
                if slices is None:
                    slices = {x for f in fams.values() for x in f.values()}
                got = self._row_maps(src, axis, fam, signer, slices)
            else:
                continue
            if got is not None:
                out[got[0]] = got[1]
        return out

    # -- embedding lookups -------------------------------------------------------------------------------
    def _lookups(self, tokens: str, axis: int, fam: dict):
        g = self.g
        table, steps = None, {}
        for t, ids in fam.items():
            found = _lookup_of(g, ids)
            if found is None or (table is not None and found.input[0] != table):
                return None
            table, steps[t] = found.input[0], found.output[0]
        key = ("lookup", tokens, table)
        node = self.built.get(key)
        if node is None or not g.alive(node):
            out, = g.add_node("Gather", [table, tokens], name="rnnfuse/lookup", anchor=g.producer.get(tokens), axis=0)
            node = self.built[key] = g.producer[out]
            dims = list(g.model.shape(tokens) or [None, None]) + [g.const(table).shape[1]]
            g.model.declare(out, (g.model.elem_type(table), dims))
        self.labels[node.output[0]] = f"'{tokens}' (axis {axis}) looked up in '{table}'"
        return (node.output[0], axis), steps

    # -- the time axis last ----------------------------------------------------------------------------
    def _time_major(self, src: str, fam: dict):
        g = self.g
        if any(g.model.rank(x) != 2 for x in fam.values()):
            return None  # (a [B, F, 1] slice kept unsqueezed is no step of the copy, whose slices are [1, B, F])
        key = ("time-major", src)
        node = self.built.get(key)
        if node is None or not g.alive(node):
            out, = g.add_node("Transpose", [src], name=f"rnnfuse/{src}/time_major", anchor=g.producer.get(src),
                              perm=[2, 0, 1])
            node = self.built[key] = g.producer[out]
            b, f, t = g.model.shape(src) or [None, None, None]
            g.model.declare(out, (g.model.elem_type(src), [t, b, f]))
        self.labels[node.output[0]] = f"'{src}' (axis 2), time-major"
        return (node.output[0], 0), dict(fam)

    # -- one feature a step ------------------------------------------------------------------------------
    def _columns(self, src: str, fam: dict):
        g = self.g
        if not all(weighed(g, x) and g.model.rank(x) == 2 for x in fam.values()):
            return None
        key = ("columns", src)
        node = self.built.get(key)
        if node is None or not g.alive(node):
            b = Builder(g, g.producer.get(src), f"rnnfuse/{src}/columns")
            out = b.unsqueeze(src, [2])
            node = self.built[key] = g.producer[out]
            g.model.declare(out, (g.model.elem_type(src), list(g.model.shape(src) or [None, None]) + [1]))
        self.labels[node.output[0]] = f"'{src}' (axis 1), one column a step"
        return (node.output[0], 1), dict(fam)

    def time_major_sources(self) -> set[str]:
        """The sources given a time-major copy (their chains are searched over it)."""
        return {key[1] for key in self.built if key[0] == "time-major"}

    # -- row-wise maps -----------------------------------------------------------------------------------
    def _row_maps(self, src: str, axis: int, fam: dict, signer: Signer, slices: set):
        g = self.g
        template, steps, sig0 = None, {}, None
        for t, x in fam.items():
            found = mapped_input(g, [x], g.const, lambda name, x=x: _context_row(g, name, x, slices))
            if found is None:
                return None
            value, nodes, context = found.value, found.nodes, found.context
            ids = {id(n) for n in nodes}
            try:
                sig = signer.sign(value, {x: "x", **{c: f"context {c}" for c in context}},
                                  lambda p, ids=ids: id(p) in ids, _no_other_input, set())
            except Decline:
                return None
            if sig0 is not None and sig != sig0:
                return None  # (every step maps its slice the same way, or the steps are no one sequence)
            sig0, steps[t] = sig, value
            template = template or (x, value, nodes, context)
        key = ("map", src, sig0)
        node = self.built.get(key)
        if node is None or not g.alive(node):

            x, value, nodes, context = template
            b = Builder(g, g.producer.get(x), "rnnfuse/step_input")
            # a context row (one per batch row, the same at every step) repeated for every step's rows
            tiled = {c: tile_context(b, c, src, axis) for c in context}
            whole = on_every_step(b, nodes, [x], src, value, tiled=tiled)
            node = self.built[key] = g.producer[whole]
            lead = (g.model.shape(src) or [None, None])[:2]
            g.model.declare(whole, (g.model.elem_type(src), list(lead) + [(g.model.shape(value) or [None, None])[-1]]))
        self.labels[node.output[0]] = f"'{src}' (axis {axis}) through the steps' input map"
        return (node.output[0], axis), steps

    def drop_unused(self) -> None:
        """Remove the whole tensors no fusion reads (with what computes them alone)."""
        g = self.g
        dead, stack = {}, [n for n in self.built.values() if g.alive(n) and not g.uses(n.output[0])]
        while stack:
            n = stack.pop()
            if id(n) in dead or not g.alive(n) or any(g.uses(o) and not all(id(u) in dead for u in g.uses(o))
                                                      for o in n.output):
                continue
            dead[id(n)] = n
            stack.extend(p for i in n.input if i and (p := g.producer.get(i)) is not None and p.name.startswith("rnnfuse/"))
        if dead:
            g.remove_nodes(list(dead.values()))
        self.built = {k: n for k, n in self.built.items() if g.alive(n)}


def _lookup_of(g: Graph, ids: str) -> NodeProto | None:
    """The one row lookup of a constant 2-D table by ``ids`` (one id a row: ``[B]``), if that is how it is read."""
    p = g.producer.get(ids)
    if g.model.rank(ids) not in (1, None) or p is None or p.op_type == "Slice":
        return None  # (a [B, 1] slice looks up [B, 1, F], no step of the whole lookup)
    found = [u for u in g.uses(ids) if u.op_type == "Gather" and len(u.input) == 2 and u.input[1] == ids
             and attr(u, "axis", 0) == 0]
    if len(found) != 1:
        return None
    table = g.const(found[0].input[0])
    return found[0] if table is not None and table.ndim == 2 else None


def _context_row(g: Graph, name: str, x: str, slices: set, limit: int = 64) -> bool:
    """Whether ``name`` is one row per batch row (``[B, C]`` like x_t ``[B, F]``) computed from no step's slice
    (a latent, a speaker embedding concatenated to every step's input; never a state, which every step after
    the first computes from the slices)."""
    shape, xs = g.model.shape(name), g.model.shape(x)
    if shape is None or xs is None or len(shape) != 2 or shape[0] is None or shape[0] != xs[0]:
        return False
    return reaches(g, name, slices, limit + 1) is False  # (an ancestry longer than ``limit``: not known to be one)


def _no_other_input(name: str) -> str:
    raise Decline(f"a step input reads '{name}'")
