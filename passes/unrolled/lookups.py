"""Embeddings looked up per step: a loop that reads ``E(tokens[:, t])`` at step t reads the slices of one tensor.

``Gather(E, tokens[:, t])`` (a constant table, rows gathered on axis 0) is ``Gather(E, tokens)[:, t]``: the
lookups of an integer row family (see :func:`.families.is_row_family`) are the slices of the whole sequence
looked up at once. That tensor is built beside the graph and the lookups become a data family over it, so the
chain front end threads, masks (from the same tokens: ``tokens[:, t] != pad``), reverses and fuses them as it
does the slices of x. The lookups themselves stay as they are until a fusion replaces the steps that read
them; the whole-sequence lookup of a family nothing fused is removed again (:meth:`Lookups.drop_unused`).
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.graph import Graph, attr

_INTS = (6, 7)  # int32, int64: token ids


class Lookups:
    """The whole-sequence lookups built so far (one per tokens tensor and table), reused from round to round."""

    def __init__(self, g: Graph):
        self.g = g
        self.built: dict[tuple[str, str], NodeProto] = {}

    def families(self, fams: dict) -> dict[tuple[str, int], dict[int, str]]:
        """The data families of per-step lookups among ``fams``' integer row families: (the whole-sequence
        lookup, the tokens' time axis) -> step -> that step's lookup."""
        g = self.g
        out = {}
        for (src, axis), fam in fams.items():
            if g.model.elem_type(src) not in _INTS or g.model.rank(src) != 2:
                continue
            table, steps = None, {}
            for t, ids in fam.items():
                found = _lookup_of(g, ids)
                if found is None or (table is not None and found.input[0] != table):
                    break
                table, steps[t] = found.input[0], found.output[0]
            else:
                if table is not None:
                    out[(self._whole(src, table, axis), axis)] = steps
        return out

    def _whole(self, tokens: str, table: str, axis: int) -> str:
        g = self.g
        node = self.built.get((tokens, table))
        if node is None or not g.alive(node):
            out, = g.add_node("Gather", [table, tokens], name="rnnfuse/lookup", anchor=g.producer.get(tokens), axis=0)
            node = self.built[(tokens, table)] = g.producer[out]
            dims = list(g.model.shape(tokens) or [None, None]) + [g.const(table).shape[1]]
            g.model.declare(out, (g.model.elem_type(table), dims))
        return node.output[0]

    def drop_unused(self) -> None:
        """Remove the whole-sequence lookups no fusion reads."""
        g = self.g
        unused = [n for n in self.built.values() if g.alive(n) and not g.uses(n.output[0])]
        if unused:
            g.remove_nodes(unused)
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
