"""Small linear-time cleanups that make fused graphs lean.

* ``Dedupe`` -- common-subexpression elimination: nodes with the same op, attributes and inputs compute the
  same values (exporters recompute a layer's mask per layer; rnnfuse shares mask plumbing this way).
* ``CancelFlips`` -- a time reversal of a time reversal (through any Transposes in between) is the
  identity: Keras' backward layers reverse their output back, rnnfuse's reverse ops already produce time
  order. Consecutive Transposes are composed; identity Transposes vanish.

Dead nodes and unused initializers are removed when the pipeline finalizes the graph.
"""

from __future__ import annotations

from onnx import NodeProto

from rnnfuse.dims import time_flip_source
from rnnfuse.graph import Graph, Model, attr, has_subgraph
from rnnfuse.pipeline import Options, PassResult

_IMPURE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}


class Dedupe:
    name = "dedupe"

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        seen: dict[tuple, NodeProto] = {}
        n_merged = 0
        outputs = set(g.output_names)
        for n in list(g.nodes):  # graph order: topological for the input model, which is where it matters
            if not g.alive(n) or n.op_type in _IMPURE or not n.output or has_subgraph(n):
                continue
            if outputs.intersection(n.output):
                continue
            key = (n.domain, n.op_type, tuple(n.input), len(n.output), tuple(a.SerializeToString() for a in n.attribute))
            other = seen.get(key)
            if other is None:
                seen[key] = n
                continue
            for a, b in zip(n.output, other.output):
                if a and b:
                    g.replace_uses(a, b)
            g.remove_node(n)
            n_merged += 1
        if n_merged:
            res.modified = True
            res.notes.append(f"merged {n_merged} duplicate nodes")
        return res


def _flip_of(g: Graph, name: str) -> tuple[str, int] | None:
    """(source, axis) if ``name`` is ``source`` reversed along ``axis``."""
    n = g.producer.get(name)
    if n is None:
        return None
    if n.op_type == "ReverseSequence":
        ax = attr(n, "time_axis", 0)
        return (n.input[0], ax) if time_flip_source(g, name, ax) is not None else None
    if n.op_type == "Slice" and len(n.input) >= 5:
        rank = g.model.rank(n.input[0])
        axes = g.const(n.input[3])
        if axes is None or axes.size != 1:
            return None
        ax = int(axes.ravel()[0])
        if ax < 0:
            if rank is None:
                return None
            ax += rank
        return (n.input[0], ax) if time_flip_source(g, name, ax) is not None else None
    return None


def _compose(p1: list[int], p2: list[int]) -> list[int]:
    """Transpose by p1, then by p2 == transpose by the result."""
    return [p1[k] for k in p2]


class CancelFlips:
    name = "cancel-flips"

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        n_flips = n_transposes = 0
        for n in list(g.nodes):
            if not g.alive(n) or n.op_type not in ("Transpose", "ReverseSequence", "Slice"):
                continue
            if n.op_type == "Transpose":
                n_transposes += self._fold_transpose(g, n)
                continue
            f2 = _flip_of(g, n.output[0]) if n.output else None
            if f2 is None:
                continue
            src, ax2 = f2
            perm = None
            cur = src
            while True:
                p = g.producer.get(cur)
                if p is None or p.op_type != "Transpose" or attr(p, "perm") is None:
                    break
                pp = list(attr(p, "perm"))
                perm = pp if perm is None else _compose(pp, perm)
                cur = p.input[0]
            f1 = _flip_of(g, cur)
            if f1 is None:
                continue
            src1, ax1 = f1
            if perm is None:
                perm = list(range(max(ax1, ax2) + 1)) if g.model.rank(src1) is None else list(range(g.model.rank(src1)))
            if ax1 not in perm or perm.index(ax1) != ax2:
                continue
            if perm == sorted(perm):
                new = src1
            else:
                new = g.add_node("Transpose", [src1], 1, name="rnnfuse/Transpose", anchor=n, perm=perm)[0]
            g.replace_uses(n.output[0], new)
            g.remove_node(n)
            n_flips += 1
        if n_flips or n_transposes:
            res.modified = True
            res.notes.append(f"cancelled {n_flips} double time reversals, folded {n_transposes} transposes")
        return res

    @staticmethod
    def _fold_transpose(g: Graph, n: NodeProto) -> int:
        perm = attr(n, "perm")
        if perm is None:
            return 0
        p = g.producer.get(n.input[0])
        if p is not None and p.op_type == "Transpose" and attr(p, "perm") is not None:
            perm = _compose(list(attr(p, "perm")), list(perm))
            src = p.input[0]
        else:
            src = n.input[0]
        if list(perm) == list(range(len(perm))):
            if g.is_graph_output(n.output[0]) and (g.is_graph_input(src) or g.is_graph_output(src)):
                return 0
            g.replace_uses(n.output[0], src)
            g.remove_node(n)
            return 1
        if src != n.input[0]:
            new = g.add_node("Transpose", [src], 1, name="rnnfuse/Transpose", anchor=n, perm=list(perm))[0]
            g.replace_uses(n.output[0], new)
            g.remove_node(n)
            return 1
        return 0
