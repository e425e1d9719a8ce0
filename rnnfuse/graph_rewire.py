"""Edits that rename what nodes read (and keep graph outputs' names), for :class:`rnnfuse.graph_edit.Graph`.

A merge, a fusion or a clean-up makes the readers of one value read another: only the reader lists of the old
and the new name change (not those of the reader's other inputs: a weight every step of a long chain reads has
a reader list as long as the chain), and a node reading very many values (a Concat or Sum of every step) keeps
its positions of each name, so that renaming one input costs that input, not the node's whole input list. A
reader capturing the old name in a subgraph is re-indexed whole.
"""

from __future__ import annotations

from onnx import NodeProto

from .graph_index import n_readers
from .protos import rename_free, subgraphs

WIDE_READS = 64  # inputs from which a node's positions of each name are kept (see Rewiring._wide_positions)


class Rewiring:
    """Mixed into :class:`~rnnfuse.graph_edit.Graph` (a :class:`~rnnfuse.graph_index.GraphIndex`)."""

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of ``old`` (nodes, captures in subgraphs, graph outputs) read ``new``."""
        if old == new:
            return
        self.replace_reads(list(self.uses(old)), old, new)
        if self.is_graph_output(old):
            self._detach(old)
            if self.producer.get(new) is not None and self._renamable(new):
                self._rename_output(new, old)
            else:
                self.add_node("Identity", [new], outputs=[old], name=f"rnnfuse/out/{old}")

    def replace_reads(self, readers: list[NodeProto], old: str, new: str) -> None:
        """Make ``readers`` (some of the nodes reading ``old``) read ``new`` instead; the graph's outputs and
        the other readers keep ``old``."""
        if old == new:
            return
        left_old: set[int] = set()  # readers renamed wholly: dropped from old's reader list in one filter at the end
        for n in readers:
            if not self.alive(n):
                continue  # (a removed node a long reader list still holds: see Graph.remove_node's ``defer``)
            if old not in self.implicit_inputs(n):
                # only the reader lists of old and new change: re-indexing all of n's inputs filtered the list of
                # each weight it reads, which every step of an unrolled chain reads (quadratic: a stacked
                # chain's 7,000 per-step reads of the lower cell took 10 s)
                at = self._wide_positions(n)
                if at is None:
                    at = {old: [i for i, x in enumerate(n.input) if x == old]}
                if not at.get(old):
                    continue  # (n does not read old: nothing to rename, no reader list to change)
                self._rewire_wide(n, at, old, new)
                left_old.add(id(n))
                continue
            self._rewire_captured(n, old, new)
            left_old.add(id(n))
        if left_old:  # (one filter of old's list: searched per reader, renaming every step's read was quadratic)
            self._drop_readers([old], left_old)

    # -- nodes reading many values (a Concat or Sum of every step) ---------------------------------------
    def _wide_positions(self, n: NodeProto) -> dict[str, list[int]] | None:
        """name -> its positions among ``n``'s inputs, for a node reading ``WIDE_READS`` or more (else None),
        read once and kept until ``n`` is indexed again: renaming one input of a Concat of 50,000 (a duplicate
        merged) touches that input, not the whole list, which made merging its duplicates quadratic."""
        if len(n.input) < WIDE_READS:
            return None
        cache = self.__dict__.setdefault("_wide_inputs", {})
        kept = cache.get(id(n))  # (n itself is kept with its positions: its id stays its own)
        if kept is None or kept[0] is not n or kept[2] != len(n.input):
            at: dict[str, list[int]] = {}
            for i, x in enumerate(n.input[:]):
                at.setdefault(x, []).append(i)
            kept = cache[id(n)] = (n, at, len(n.input))
        return kept[1]

    def _rewire_wide(self, n: NodeProto, at: dict[str, list[int]], old: str, new: str) -> None:
        """:meth:`replace_reads` of one node (``at``: its positions of each name, or of ``old`` at least): those
        positions renamed, n added to new's readers (the caller takes it off old's, see ``Graph._drop_readers``)."""
        moved = at.pop(old, [])
        # n is on new's reader list already exactly when it read new before (the index lists every reader of
        # each name it reads): asking that of n's own inputs, not searching a list every step may be on
        read_new = (new in at if len(n.input) >= WIDE_READS else any(x == new for x in n.input)) or (
            new in self.implicit_inputs(n))
        for i in moved:
            n.input[i] = new
        at.setdefault(new, []).extend(moved)
        self._now_reads(n, new, read_new)

    def _rewire_captured(self, n: NodeProto, old: str, new: str) -> None:
        """:meth:`replace_reads` of a node whose subgraphs read ``old`` from outside: renamed there too, and
        again only old's and new's reader lists change (the caller takes n off old's). Re-indexing the node
        filtered the list of everything it reads: 1,600 stacked Loops read one trip count, a quadratic commit."""
        captured = self.implicit_inputs(n)
        read_new = new in captured or any(x == new for x in n.input)
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new
        for sg in subgraphs(n):
            rename_free(sg, old, new)
        self._implicit[id(n)] = (captured - {old}) | {new}
        self.__dict__.get("_wide_inputs", {}).pop(id(n), None)
        self._now_reads(n, new, read_new)

    def _now_reads(self, n: NodeProto, new: str, read_new: bool) -> None:
        """``n`` was rewired to read ``new`` (``read_new``: it read it before): on new's reader list, once."""
        self._edits += 1
        self.owners_complete = False
        if not read_new or not n_readers(self.consumers.get(new)):
            self._add_reader(new, n)
        self.edited.append(n)

    def _unindex(self, n: NodeProto, defer: set | None = None) -> None:
        self.__dict__.get("_wide_inputs", {}).pop(id(n), None)  # (its inputs may change: read again when asked)
        if self._lost is not None:  # (what n reads may lose its last reader: see Graph.prune)
            self._lost.update(self.reads(n))
        super()._unindex(n, defer)

    def _renamable(self, name: str) -> bool:
        return (
            not self.is_graph_output(name)
            and name not in self._inputs
            and not self.uses(name)
            and self.producer.get(name) is not None
        )

    def _detach(self, old: str) -> None:
        """The old producer of a graph output gives the name up (it is about to be replaced)."""
        old_prod = self.producer.get(old)
        if old_prod is None:
            return
        self._rename_produced(old_prod, old, self.fresh(old + "/detached"), id(old_prod) not in self._removed)

    def _rename_output(self, new: str, old: str) -> None:
        """Rename the produced tensor ``new`` to ``old`` (used to keep graph output names)."""
        self._rename_produced(self.producer[new], new, old)

    def _rename_produced(self, node: NodeProto, old: str, new: str, live: bool = True) -> None:
        """``node``'s output ``old`` renamed ``new``: only the producer map changes, not what it reads (re-indexing
        it filtered the reader list of each of its inputs, a trip count 11,000 stacked Loops read, at every Loop
        whose final state is a graph output). ``live``: the node is not removed (indexed as the producer)."""
        for i, o in enumerate(node.output):
            if o == old:
                node.output[i] = new
        del self.producer[old]
        self._edits += 1
        self.owners_complete = False
        if live:
            self.producer[new] = node
            self.edited.append(node)
