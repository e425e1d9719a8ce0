"""Which tensors a Loop body reads per step provably share x's time length or batch: sizes by their keys (a
number, a declared name, one axis of a tensor both were made from), seen through time flips, and the declines
for a tensor whose length or batch the file gives apart from x's."""

from __future__ import annotations

from rnnfuse.dims import declared_name, extent_key, root_dim, time_keys
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.time_flips import time_flip_source


def size_keys(g: Graph, key) -> set:
    """A size's keys: its own, and for a dimension the model declares with a symbolic name, that name (the
    dims a model names alike are one size: the T of ``Gather(mask, T - 1 - i)`` may be read from x's shape)."""
    out = {key}
    if key is not None and key[0] == "dim":
        t = g.model.known_type(key[1])
        dims = t[1] if t is not None else None
        if dims is not None and 0 <= key[2] < len(dims) and isinstance(dims[key[2]], str):
            out.add(("param", dims[key[2]]))
    return out


def timesize_keys(g: Graph, name: str, axis: int) -> set:
    """Every key of ``name``'s time extent (:func:`rnnfuse.dims.time_keys`) with the names it is declared by."""
    return set().union(*(size_keys(g, key) for key in time_keys(g, name, axis)))


def _same_time_length(g: Graph, data: str, axis: int, x: str, x_axis: int) -> bool:
    """Whether ``data``'s extent along ``axis`` is provably x's time length (both seen through their time
    flips): one number, one declared name, or one axis of a tensor both were made from. (A loop reads a longer
    mask's first T rows, or its rows from its own end at ``-1 - i``: a native op would read all of them.)"""
    mine = size_keys(g, extent_key(g, data, axis)) - {None}
    return bool(mine & timesize_keys(g, x, x_axis))


def same_time_length(g: Graph, data: str, x: str, axis: int) -> bool:
    """Whether ``data`` and ``x`` provably have one time length along ``axis`` (both seen through their time
    flips)."""
    return _same_time_length(g, unflipped(g, data, axis), axis, unflipped(g, x, axis), axis)


def same_extent(g: Graph, a: str, b: str, axis: int) -> bool:
    """Whether ``a`` and ``b`` provably have one extent along ``axis`` (a batch axis, say)."""
    return _same_time_length(g, a, axis, b, axis)


def same_extent_along(g: Graph, a: str, a_axis: int, b: str, b_axis: int) -> bool:
    """Whether ``a`` along ``a_axis`` and ``b`` along ``b_axis`` provably have one extent."""
    return _same_time_length(g, a, a_axis, b, b_axis)


def check_step_lengths(g: Graph, others: dict[str, int], x: str, x_axis: int, read_forms: set,
                       mask: str | None = None) -> bool:
    """Decline a tensor of ``others`` (-> its time axis) the body reads per step whose time length may differ from x's:
    one read from its own end (``-1 - i``) unless its length is provably x's; one read from its start when the
    file gives the two lengths apart (two numbers, or two names of graph inputs). (A length the file leaves
    unknown, a mask computed from x, say, is left to validation, as before.) ``read_forms``: how the body's
    step reads index time (see :func:`.loop_reads.step_read`). The bool ``mask`` read forward from its start that the file
    gives apart is not declined: True (the native op then reads its first T steps, as the loop does; a mask
    input of tf2onnx's has a time axis named apart from x's, ``unk__N``, whatever its length). Read backwards
    (``T - 1 - i`` of its own length) a longer mask gives its last rows: declined."""
    from_end = "reverse_end" in read_forms
    x = unflipped(g, x, x_axis)
    cut = False
    for other, axis in sorted(others.items()):
        data = unflipped(g, other, axis)
        if _same_time_length(g, data, axis, x, x_axis) or not (from_end or _declared_apart(g, data, axis, x, x_axis)):
            continue
        if other != mask or read_forms != {"forward"}:  # (read backwards, T - 1 - i of its own T: its last rows)
            raise Decline(f"'{other}' is read per step but its time length is not provably the input's")
        cut = True
    return cut


def check_same_batch(g: Graph, others: dict[str, int], x: str, x_axis: int) -> None:
    """Decline a tensor of ``others`` (-> its time axis, 0 or 1) read per step beside ``x`` whose batch the file
    gives apart from x's (two numbers, or two names of graph inputs): the loop broadcasts a mask of one row
    over x's rows, which the native op's per-row mask does not."""
    for other, axis in sorted(others.items()):
        if axis in (0, 1) and x_axis in (0, 1) and _declared_apart(g, other, 1 - axis, x, 1 - x_axis, made_up_names=False):
            raise Decline(f"'{other}' is read per step but its batch is not provably the input's")


def _declared_apart(g: Graph, a: str, a_axis: int, b: str, b_axis: int, made_up_names: bool = True) -> bool:
    """Whether the file gives ``a``'s and ``b``'s extents (both seen through their time flips) as two different
    numbers, or as two different names of graph inputs (a name an exporter makes up for an intermediate's
    unknown dim says nothing; ``made_up_names=False``: nor does tf2onnx's ``unk__N``, which every unknown input
    dim gets, see :func:`rnnfuse.dims.declared_name`)."""
    dims = []
    for name, axis in ((a, a_axis), (b, b_axis)):
        root, ax = root_dim(g, name, axis)  # (through transposes and the like: a graph input's own axis)
        shape = g.model.shape(root) or []
        d = shape[ax] if ax < len(shape) else None
        if isinstance(d, str):
            d = (d if root in g.input_names else None) if made_up_names else declared_name(g, name, axis)
        dims.append(d)
    return None not in dims and dims[0] != dims[1]


def unflipped(g: Graph, name: str, axis: int) -> str:
    """``name`` seen through its time flips (a flip keeps the extent: a backward layer's x and mask)."""
    for _ in range(8):
        src = time_flip_source(g, name, axis)
        if src is None:
            break
        name = src
    return name
