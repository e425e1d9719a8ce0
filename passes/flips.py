"""``CancelFlips``: a time reversal of a time reversal (through any Transposes, Squeezes or Unsqueezes in
between) is the identity: Keras' backward layers reverse their output back, rnnfuse's reverse ops already
produce time order. Consecutive Transposes are composed; identity Transposes vanish.
"""

from __future__ import annotations

from onnx import NodeProto, helper

from rnnfuse import op_args
from rnnfuse.time_flips import time_flip_source
from rnnfuse.findings import Options, PassResult
from rnnfuse.graph import Graph, Model, attr


def _flip_of(g: Graph, name: str) -> tuple[str, int] | None:
    """(source, axis) if ``name`` is ``source`` reversed along ``axis``."""
    n = g.producer.get(name)
    if n is None:
        return None
    if n.op_type == "ReverseSequence":
        ax = attr(n, "time_axis", 0)
    elif n.op_type == "Gather":
        ax = _from_front(g, n.input[0], attr(n, "axis", 0))
    elif n.op_type == "Slice" and len(n.input) >= 5:
        axes = g.const(n.input[3])
        ax = _from_front(g, n.input[0], int(axes.ravel()[0])) if axes is not None and axes.size == 1 else None
    else:
        return None
    return (n.input[0], ax) if ax is not None and time_flip_source(g, name, ax) is not None else None


def _from_front(g: Graph, data: str, ax: int) -> int | None:
    """Axis ``ax`` of ``data`` counted from the front (None: counted from the back and the rank unknown)."""
    if ax >= 0:
        return ax
    rank = g.model.rank(data)
    return None if rank is None else ax + rank


def _flip_behind(g: Graph, name: str, axis: int) -> tuple[str, list] | None:
    """If ``name`` is a time flip along the axis that becomes ``axis`` of ``name``, seen through layout ops
    (Transpose, Squeeze, Unsqueeze): (the unflipped source, the layout nodes from ``name`` inwards)."""
    chain: list = []
    cur, ax = name, axis
    for _ in range(8):
        f = _flip_of(g, cur)
        if f is not None:
            return (f[0], chain) if f[1] == ax else None
        p = g.producer.get(cur)
        if p is None or len(p.output) != 1:
            return None
        if p.op_type == "Transpose":
            perm = attr(p, "perm")
            if perm is None or ax >= len(perm):
                return None
            ax = int(perm[ax])
        elif p.op_type in ("Squeeze", "Unsqueeze"):
            axes = op_args.axes(p, g.model.opset, op_args.const_reader(g, p))
            if axes is None:
                return None
            if p.op_type == "Squeeze":
                rank = g.model.rank(p.input[0])
                if any(v < 0 for v in axes) and rank is None:
                    return None
                axes = [v + rank if v < 0 else v for v in axes]
                kept = [i for i in range(max(axes + [ax + len(axes)]) + 1) if i not in axes]
                ax = kept[ax]
            else:
                if any(v < 0 for v in axes):
                    return None
                if ax in axes:
                    return None
                ax -= sum(v < ax for v in axes)
        else:
            return None
        chain.append(p)
        cur = p.input[0]
    return None


def _compose(p1: list[int], p2: list[int]) -> list[int]:
    """Transpose by p1, then by p2 == transpose by the result."""
    return [p1[k] for k in p2]


class CancelFlips:
    name = "cancel-flips"
    fuses_only_with = frozenset()  # a clean-up: it fuses nothing itself (see rnnfuse.findings.Pass)

    def run(self, model: Model, ctx: Options) -> PassResult:
        g = model.graph
        res = PassResult(self.name)
        n_flips = n_transposes = 0
        # (reader lists of 64+ nodes are filtered once, at the end: every flip reads the Slice bounds Dedupe
        # made one, and filtering their lists per flip removed was quadratic: 20,000 double reversals, 47 s)
        long_lists: set[str] = set()
        try:
            for n in g.nodes_of("Transpose", "ReverseSequence", "Slice"):
                if not g.alive(n):
                    continue
                if n.op_type == "Transpose":
                    n_transposes += self._fold_transpose(g, n, long_lists)
                    continue
                n_flips += self._cancel_flip(g, n, long_lists)
        finally:
            g.drop_removed_readers(long_lists)
        if n_flips or n_transposes:
            res.modified = True
            res.notes.append(f"cancelled {n_flips} double time reversals, folded {n_transposes} transposes")
        return res

    @staticmethod
    def _cancel_flip(g: Graph, n: NodeProto, long_lists: set[str]) -> int:
        """Read past ``n`` when it reverses time on a value that reversed it already (through layout ops)."""
        f2 = _flip_of(g, n.output[0]) if n.output else None
        if f2 is None:
            return 0
        found = _flip_behind(g, f2[0], f2[1])
        if found is None:
            return 0
        new, chain = found
        if all(p.op_type == "Transpose" for p in chain):
            perm = None
            for p in reversed(chain):
                perm = list(attr(p, "perm")) if perm is None else _compose(perm, list(attr(p, "perm")))
            if perm is not None and perm != sorted(perm):
                new = g.add_node("Transpose", [new], 1, name="rnnfuse/Transpose", anchor=n, perm=perm)[0]
            chain = []
        for p in reversed(chain):  # the layout ops between the two flips, replayed on the unflipped source
            attrs = {a.name: helper.get_attribute_value(a) for a in p.attribute}
            new = g.add_node(p.op_type, [new] + list(p.input[1:]), 1, name=f"rnnfuse/{p.op_type}", anchor=n, **attrs)[0]
        g.replace_uses(n.output[0], new)
        g.remove_node(n, long_lists)
        return 1

    @staticmethod
    def _fold_transpose(g: Graph, n: NodeProto, long_lists: set[str]) -> int:
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
            g.remove_node(n, long_lists)
            return 1
        if src != n.input[0]:
            new = g.add_node("Transpose", [src], 1, name="rnnfuse/Transpose", anchor=n, perm=list(perm))[0]
            g.replace_uses(n.output[0], new)
            g.remove_node(n, long_lists)
            return 1
        return 0
