"""A step that runs several cells: its carried states split into layers, each one native op.

Keras ``RNN([cell1, cell2])`` / ``StackedRNNCells`` and hand-written loops that call two cells per step put
a whole stack into one step: cell 2 reads cell 1's *new* output. A native op reads a per-step input it does
not compute, so the step is read layer by layer:

* layer 0 is every state whose update is cell maths of the step input and its own states;
* every tensor of the step that equals a layer's new state value (its unmasked update) becomes a fresh
  step input for the next round, so the cell above reads "the output of the cell below" as its input;
* the states left over are evaluated again with those inputs; a group whose maths read exactly one such
  input is the next layer, fed by the layer that produced it.

A cell that reads several of those inputs at once, each through one weight (a residual stack: GNMT's
``c2(h1 + x_t)``, ``c2(h1 + proj(x_t))``, ``c3(h2 + h1)``) is evaluated again with them as the columns of one
input, ``cat(y2_t, y1_t, x_t)``, which its native op reads as the layers' Ys (and x) side by side.

Groups are the connected parts of "reads": a layer's states read each other, and a carried copy of the
output reads the states it copies. Whether a cut input is the cell below's *output* (h, not c) is checked
once the layer below is recognised (see :func:`check_feeds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from onnx import NodeProto

from .disjoint_sets import DisjointSets
from .errors import Decline
from .graph import Graph
from .recurrence import NONE, ZERO, Init, InputPrep, Recurrence, SeqOutput
from .step import NoStateFedBack, StepState, analyse, unmasked_value
from .symbolic import STATE, STEP_INPUT, Poly, StepEvaluator, StepInput, StepInputPart, SymTensor, Value
from .symbolic import sources as symbolic_sources


@dataclass
class Layer:
    syms: list[str]  # the carried states of this layer, in the step's order
    ev: StepEvaluator  # evaluates the step with the outputs of the layers below as step inputs
    x: StepInput  # this layer's step input
    below: int | None = None  # the layer whose new output is x (None: the step's own input)
    feeds: dict = field(default_factory=dict)  # StepInput sym -> the states of this layer whose new value it is
    fed_by: str | None = None  # the step input of the round that is the output of ``below``
    # a residual layer's: x is the output of the layer below (``fed_by``) with the outputs of other layers below
    # (``beside``: (layer, step input sym), nearest first) and the step's own input (``beside_input``) after it,
    # each read through one weight: ``(y2_t + y1_t) @ W`` is ``cat(y2_t, y1_t) @ [W; W]``
    beside: list = field(default_factory=list)
    beside_input: bool = False


def sources(p: Poly) -> set:
    """Every state and step input a polynomial reads, through activations, matmuls and gated rows."""
    return symbolic_sources(p, follow_gated_rows=True)


def _groups(polys: dict[str, Poly]) -> list[list[str]]:
    """Connected parts of the 'reads' relation among ``polys``' states, in the step's order."""
    reading = DisjointSets(polys)
    for s, p in polys.items():
        for kind, sym in sources(p):
            if kind == STATE and sym in reading:
                reading.join(sym, s)
    out: dict[str, list[str]] = {}
    for s in polys:
        out.setdefault(reading.root(s), []).append(s)
    return list(out.values())


def split_layers(body: Graph, leaves: dict[str, Value], state_out: dict[str, str], x: StepInput,
                 batch: int | None = None) -> list[Layer]:
    """The layers of a step whose carried states ``state_out`` (sym -> the body tensor of its new value) are
    updated from the step input ``x``; one layer for an ordinary single-cell step (``batch``: the batch size
    the model fixes, if it does). Declines with the reason a
    state has no polynomial when no further layer can be read."""
    layers: list[Layer] = []
    producer_of: dict[str, int | None] = {x.sym: None}  # step input sym -> the layer whose output it is
    atoms: dict[str, StepInput] = {x.sym: x}
    remaining = list(state_out)
    level_leaves = dict(leaves)
    while remaining:
        ev = StepEvaluator(body, level_leaves)
        ev.batch = batch
        polys: dict[str, Poly] = {}
        first_error: Decline | None = None
        for s in remaining:
            try:
                polys[s] = ev.poly(state_out[s])
            except Decline as d:
                first_error = first_error or d
        if not polys:
            raise first_error
        new_layers: list[Layer] = []
        inputless: list[str] = []  # carried values that read no step input: judged with the layer they sit in
        for group in _groups(polys):
            read = set().union(*(sources(polys[s]) for s in group))
            inputs = {sym for kind, sym in read if kind == STEP_INPUT}
            foreign = {sym for kind, sym in read if kind == STATE and sym not in group}
            if foreign:
                raise Decline(f"a cell reads the states {sorted(foreign)} of another cell directly")
            if len(inputs) > 1:
                new_layers.append(_residual_layer(body, level_leaves, state_out, group, inputs, x, atoms,
                                                  producer_of, batch, polys))
                continue
            if not inputs:
                inputless += group
                continue
            sym = next(iter(inputs))
            new_layers.append(Layer(group, ev, atoms[sym], producer_of[sym], fed_by=sym))
        if inputless:
            if not new_layers and first_error is not None:
                raise first_error  # the state that reads the input has no polynomial: that is the reason
            if not new_layers and layers:
                raise Decline("a carried value of the step reads neither the step input nor a cell output")
            if not new_layers:  # one cell that does not read x: recognising it says what it is instead
                new_layers.append(Layer([], ev, x, None))
            first = new_layers[0]
            first.syms = [s for s in remaining if s in set(first.syms) | set(inputless)]
        layers.extend(new_layers)
        remaining = [s for s in remaining if s not in polys]
        if not remaining:
            break
        # the new value of each state of these layers becomes a step input of the round above
        for li, layer in enumerate(new_layers, start=len(layers) - len(new_layers)):
            by_key: dict = {}  # a new value -> its step input (a carried copy of h shares h's)
            for s in layer.syms:
                new_key = unmasked_value(polys[s]).key
                if new_key in by_key:
                    layer.feeds[by_key[new_key]].add(s)
                    continue
                sym = by_key[new_key] = f"y{li}_{s}"
                layer.feeds[sym] = {s}
                for name, v in list(layer.ev.memo.items()):
                    if name in leaves or not isinstance(v, SymTensor) or v.poly.key != new_key:
                        continue
                    if sym not in atoms:
                        atoms[sym] = StepInput(sym, v.poly.ncols)
                        producer_of[sym] = li
                    level_leaves[name] = SymTensor(Poly.atom(atoms[sym]), v.lead)
    return layers


def _residual_layer(body: Graph, level_leaves: dict, state_out: dict, group: list[str], inputs: set, x: StepInput,
                    atoms: dict, producer_of: dict, batch: int | None, polys: dict) -> Layer:
    """The layer of ``group``, whose cell reads several step inputs of the round: the outputs of layers below and
    perhaps the step input ``x`` (a residual stack's upper cell: ``(y1_t + x_t) @ W``, ``(y2_t + y1_t) @ W``).
    Evaluated again with them as the columns of one input, in the order its native op reads them concatenated
    on features: the nearest layer's output first (the op's x is that layer's Y), the other layers' outputs
    downwards, x last. ``polys`` get the group's states' new maths."""
    if any(atoms[s].ncols is None for s in inputs):
        raise Decline(f"a cell reads {len(inputs)} step inputs at once, one of unknown width")
    below = sorted((s for s in inputs if s != x.sym), key=lambda s: -producer_of[s])
    order = below + ([x.sym] if x.sym in inputs else [])
    total = sum(atoms[s].ncols for s in order)
    sym = "+".join(order)
    parts, start = {}, 0
    for s in order:
        parts[atoms[s].key] = Poly.atom(StepInputPart(sym, start, start + atoms[s].ncols, total))
        start += atoms[s].ncols
    leaves = {}
    for name, v in level_leaves.items():
        p = v.poly if isinstance(v, SymTensor) else None
        single = p.single_atom() if p is not None else None
        if single is not None and single[1] == 1.0 and single[0].key in parts:
            v = SymTensor(parts[single[0].key], v.lead)
        elif p is not None and any(k in parts for k in p.atoms):  # (x read any other way: masked, in columns)
            raise Decline("a cell reads the outputs of cells below (or the step input) other than as they are")
        leaves[name] = v
    ev = StepEvaluator(body, leaves)
    ev.batch = batch
    for s in group:
        polys[s] = ev.poly(state_out[s])
    return Layer(group, ev, StepInput(sym, total), producer_of[below[0]], fed_by=below[0],
                 beside=[(producer_of[s], s) for s in below[1:]], beside_input=x.sym in inputs)


def check_feeds(layers: list[Layer], cell_states: list[tuple[str, str | None]]) -> None:
    """Each layer above the first reads the new *output* (h) of the layer below, not another of its states
    (``cell_states``: per layer, the symbols of its cell's h and c)."""
    for layer in layers:
        if layer.below is None:
            continue
        for li, sym in [(layer.below, layer.fed_by), *layer.beside]:
            if cell_states[li][0] not in layers[li].feeds.get(sym, ()):
                raise Decline("a cell reads a state of the cell below other than its output")


def owner(layers: list[Layer], name: str) -> int:
    """The layer a per-step tensor of the step belongs to: the first whose maths express it from its own
    states and input alone."""
    if len(layers) == 1:
        layers[0].ev.poly(name)  # declines with the reason it has no polynomial
        return 0
    for i, layer in enumerate(layers):
        try:
            p = layer.ev.poly(name)
        except Decline:
            continue
        own = {(STATE, s) for s in layer.syms} | {layer.x.key}
        if sources(p) <= own:
            return i
    raise Decline(f"a per-step output '{name}' mixes the cells of the step")


def _check_width(sym: str, leaf, new: Poly) -> None:
    """Decline a state whose next value is computed at another width than the state's own (a carried tensor
    cut into pieces of other widths than the step's values: :mod:`passes.loop_pieces`): every atom of the next
    value that has a width (but 1, which broadcasts) has the state's."""
    width = leaf.poly.ncols if isinstance(leaf, SymTensor) else None
    others = {a.ncols for a in new.atoms.values() if a.ncols not in (None, 1, width)}
    if width is not None and others:
        raise Decline(f"the next value of {sym} is computed {max(others)} wide, the state is {width} wide")


def _init_of(g: Graph, name: str, lead: int) -> Init:
    """A state's initial value: none given (zeros), a constant fill, or the tensor itself; ``lead`` 1 for a
    state carried as [1, B, H] (its final value is too)."""
    if not name:
        return Init(None, 0.0, lead)
    fv = g.fill_value(name)
    if fv is not None:
        return Init(None, fv, lead)
    return Init(name, None, lead)


def layer_states(g: Graph, node: NodeProto, body: Graph, layer: Layer, *, body_out: int,
                 node_in: int) -> list[StepState]:
    """The carried states of ``layer`` (``s<k>``: the k-th carried value of the ``Loop`` / ``Scan`` node) as
    StepStates: the maths of the body output that is its new value, its initial value (the node's input) and
    the node's output that holds its final value when anything reads it. Carried values start at body output
    ``body_out`` and node input ``node_in``: a Loop's after the condition (1) and after the trip count and
    condition (2), a Scan's at 0 and 0; the node's outputs start with them in both."""
    states = []
    for sym in layer.syms:
        k = int(sym[1:])
        final = node.output[k] if k < len(node.output) else ""
        new = layer.ev.poly(body.output_names[body_out + k])
        leaf = layer.ev.value(body.input_names[node_in + k])  # (the body's inputs line up with the node's)
        _check_width(sym, leaf, new)
        states.append(StepState(sym, new, _init_of(g, node.input[node_in + k], getattr(leaf, "lead", 0)),
                                final if final and g.n_uses(final) else None))
    return states


def cells_first(g: Graph, node: NodeProto, body: Graph, layers: list[Layer], states: dict, *, body_out: int,
                node_in: int) -> list[list[StepState]]:
    """Each layer's :func:`layer_states`, its cell recognised from them alone first (``analyse`` with no
    per-step output): a step that is no native cell is declined before its per-step outputs are evaluated
    (a Scan with an 18-op head per step spent a quarter of its analysis there, to be declined on its cell). A
    cell recognised here is analysed again with its outputs; the verdict is the same, the reason may not be
    (an output that declines too is not the one named)."""
    per_layer = []
    for layer in layers:
        step_states = layer_states(g, node, body, layer, body_out=body_out, node_in=node_in)
        try:
            analyse(layer.x, step_states, [], states)
        except NoStateFedBack:
            if layer.below is None:
                raise
            # (values computed from the new state of a cell, none from itself: an output carried through the
            # loop, as Keras carries a custom cell's output apart from its state, holding it at masked steps)
            raise Decline(f"carried value {', '.join(layer.syms)} is computed from the new state of a cell, not "
                          "from itself: a per-step output carried through the loop (a cell's output other than "
                          "its state, held at masked steps) is not supported") from None
        per_layer.append(step_states)
    return per_layer


def layer_recurrence(front: str, where: str, an, layers: list, li: int, recs: list[Recurrence], *, x: str,
                     mask: str | None, x_time_axis: int, x_reversed: bool, x_prep: InputPrep, remove: list,
                     anchor, **extra) -> Recurrence:
    """Cell ``li`` of a step (``an``: its analysis) as a Recurrence: the bottom cell reads the step input, a
    cell above reads the Y of the one below (an internal sequence output of that layer, in x's order); the
    layers of a stacked step share ``stack`` and only the bottom one removes the loop."""
    layer = layers[li]
    below = recs[layer.below] if layer.below is not None else None
    if below is not None and below.masked and not an.masked:
        raise Decline("a cell ignores the mask the cell below it keeps to")
    rec = Recurrence(front=front, where=where, cell=an.rec.spec, x=x, h0=an.h0, c0=an.c0,
                     mask=mask if an.masked else None, mask_negated=an.masked and an.mask_negated,
                     seq_outputs=an.seq_outputs, finals=an.finals,
                     remove=remove if li == 0 else [], anchor=anchor, x_time_axis=x_time_axis,
                     x_reversed=x_reversed, x_prep=x_prep if below is None else InputPrep(), **extra)
    if below is not None:  # the cell below's Y, in time order like x, read in the same order as x
        rec.x, rec.x_internal, rec.x_time_axis = _internal_y(where, recs, layer.below, x_reversed), True, 0
        beside = tuple(_internal_y(where, recs, li_y, x_reversed) for li_y, _ in layer.beside)
        if any(recs[li_y].masked and not an.masked for li_y, _ in layer.beside):
            raise Decline("a cell ignores the mask a cell below it keeps to")
        if layer.beside_input:  # (x beside it as the bottom cell reads it: Y is laid out in x's order, read
            # backwards alike when x is; a flip, a slice of the steps or a map of x's would apply to x alone. Under
            # a mask the cell keeps its state at padded steps, so what it reads there is never seen)
            if (mask is not None and not an.masked) or replace(x_prep, input_map=None) != InputPrep():
                raise Decline("a cell reads the cell below's output plus the step input, and the step input is "
                              "masked, flipped or cut")
            rec.x_prep = InputPrep(ys_beside=beside, side_by_side=(x,), side_batch_first=x_time_axis == 1,
                                   side_map=x_prep.input_map)
        else:
            rec.x_prep = InputPrep(ys_beside=beside)
    if len(layers) > 1:
        rec.stack = where
    return rec


def _internal_y(where: str, recs: list[Recurrence], li: int, x_reversed: bool) -> str:
    """The Y of layer ``li`` of a stacked step, in time order like x: an internal sequence output of its
    recurrence, added when the first cell above reads it (several may)."""
    y = f"{where}/rnnfuse_cell{li + 1}_Y"
    rec = recs[li]
    if not any(so.internal and so.tensor == y for so in rec.seq_outputs):
        rec.seq_outputs.append(SeqOutput(y, ZERO if rec.masked else NONE, reversed=x_reversed, internal=True))
    return y
