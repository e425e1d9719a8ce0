"""New nodes of a graph scope, for :class:`rnnfuse.graph_edit.Graph`: one made from parts (:meth:`Additions.add_node`),
copies of a list of nodes read under new names (:meth:`Additions.add_copies`: a head replayed on every step at
once), and the indexing of either. Each is held in the graph's nursery until finalize writes it into the proto."""

from __future__ import annotations

from array import array

from onnx import GraphProto, NodeProto, helper

from .graph_index import POS_TIE


class Additions:
    """Mixed into :class:`~rnnfuse.graph_edit.Graph`."""

    def fresh(self, hint: str) -> str:
        return self.model.names.fresh(hint)

    def _new_node(self) -> NodeProto:
        """An empty node message for an edit to fill, held in this graph's nursery: one GraphProto whose arena
        holds every node the edits of a round add (finalize copies the live ones into the proto, then starts a
        new nursery). A NodeProto made on its own has an arena of its own, ~1.5 KB, where one in a shared arena
        takes ~0.35 KB: replaying a 100,000-node head out of a Loop body grew the process by 232 MB, now 170."""
        nursery = self.__dict__.get("_nursery")
        if nursery is None:
            nursery = self._nursery = GraphProto()
        return nursery.node.add()

    def add_node(
        self,
        op_type: str,
        inputs: list[str],
        n_outputs: int = 1,
        *,
        name: str | None = None,
        outputs: list[str] | None = None,
        domain: str = "",
        anchor: NodeProto | None = None,
        **attrs,
    ) -> list[str]:
        """Append a node; returns its output names. ``anchor`` places it near that node in the final order."""
        base = name or f"rnnfuse/{op_type}"
        if outputs is None:
            outputs = [self.fresh(f"{base}:{i}" if n_outputs > 1 else base) for i in range(n_outputs)]
        node = self._new_node()  # (as onnx.helper.make_node fills one)
        node.op_type = op_type
        node.input.extend(inputs)
        node.output.extend(outputs)
        node.name = self.fresh(base)
        if domain:
            node.domain = domain
        if attrs:
            node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None)
        self.append_node(node, self.position(anchor) if anchor is not None else None)
        return outputs

    def add_copies(self, nodes: list[NodeProto], env: dict[str, str], base: str, anchor: NodeProto | None = None) -> None:
        """Append a copy of each of ``nodes`` (in evaluation order; named as add_node names ``base/op``), reading
        ``env[name]`` for each input ``env`` names; ``env`` gains the copies' outputs (a replayed head: 100,000).

        An ``Identity`` is read through, not copied: its output is named as what it reads (a head ending in
        ``Identity(e) -> y_t``, as exporters write a Loop's scan output, left a no-op that the next round of
        passes removed: on a 100,000-node head, a round of its own)."""
        anchor_pos = self.position(anchor) if anchor is not None else None
        fresh, new_node = self.model.names.fresh, self._new_node
        copies = []
        for n in nodes:
            hint, outs = f"{base}/{n.op_type}", n.output[:]
            if n.op_type == "Identity" and not n.domain and len(outs) == 1 and len(n.input) == 1 and n.input[0]:
                env[outs[0]] = env.get(n.input[0], n.input[0])
                continue
            new = [fresh(f"{hint}:{i}" if len(outs) > 1 else hint) for i in range(len(outs))]
            node = new_node()
            node.op_type = n.op_type
            node.name = fresh(hint)
            node.input.extend([env.get(i, i) if i else "" for i in n.input])
            node.output.extend(new)
            if n.domain:
                node.domain = n.domain
            if n.attribute:
                node.attribute.extend(n.attribute)
            copies.append(node)
            env.update(zip(outs, new))
        self.append_nodes(copies, anchor_pos)  # (a copy reads env, never the index: all are indexed at once)

    def append_node(self, node: NodeProto, anchor_pos: int | None) -> None:
        """Put a new node (with its subgraphs) in the graph and its index, near ``anchor_pos`` when given."""
        self.append_nodes([node], anchor_pos)

    def append_nodes(self, new: list[NodeProto], anchor_pos: int | None) -> None:
        """:meth:`append_node` for each of ``new``, in order."""
        nodes, added, place, seq = self.nodes, self._removed.added, self.place, self._seq
        for node in new:
            nodes.append(node)
            added(id(node))
            self._by_op_add(node)
            at = anchor_pos // POS_TIE if anchor_pos is not None else len(nodes)
            place(node, at * POS_TIE + next(seq))
            self._index(node)
        self.edited.extend(new)

    def _by_op_moved(self, moved: list[tuple[NodeProto, str]]) -> None:
        """File each ``(node, old op type)`` of nodes rewritten in place under its new op type in the by-op
        index (:meth:`nodes_of`), at its place in the node order: each op's list filtered or merged once for
        the lot (an unrolled chain's 12,000 list items rewritten as Slices). Left unfiled, a pass asking for the
        new op type later in the round did not see them (a step's read of x, rewritten, was no step)."""
        by_op = self._by_op
        if by_op is None or not moved:
            return
        going: dict[str, set[int]] = {}
        for n, old in moved:
            going.setdefault(old, set()).add(id(n))
        rank: dict[int, int] = {}
        for old, ids in going.items():
            kept_ranks, kept = array("q"), []
            for r, n in zip(*by_op.get(old, ((), ()))):
                if id(n) in ids:
                    rank[id(n)] = r
                else:
                    kept_ranks.append(r)
                    kept.append(n)
            by_op[old] = (kept_ranks, kept)
        if len(rank) != len({id(n) for n, _ in moved}):
            self._by_op = None  # (a node the index did not hold: built again from the node list when asked)
            return
        coming: dict[str, list] = {}
        for n, _ in moved:
            coming.setdefault(n.op_type, []).append((rank[id(n)], n))
        for op, items in coming.items():
            ranks, nodes = by_op.get(op, ((), ()))
            merged = sorted([*zip(ranks, nodes), *items], key=lambda item: item[0])
            by_op[op] = (array("q", [r for r, _ in merged]), [n for _, n in merged])
