"""A mask built for every step at once, proven equal to what each step computed, before the steps read it.

A recurrence whose steps compute their own masks (``t < L`` per step, ``(x[t] != 0).any(-1)``, ``mask[t] > 0``;
an unrolled chain's steps, or a Loop's or Scan's body) is fused with one mask ``M`` built for all steps, and
each step then reads its slice of ``M`` in place of what it computed, so that what validation overrides with
its patterns (``M``) is what the original steps read too (passes/unrolled/families.StepMask,
passes/loop_masks, passes/scan). Validation compares the fused op with the steps *given* ``M``: it never sees
the masks the steps computed, and a wrong ``M`` passed it. This module is that missing comparison: the nodes
each step computed its mask with and the nodes building ``M`` run side by side in onnxruntime on values of the
one tensor both are computed from (the lengths, or the sliced input), made to flip the masks (lengths across
the whole time range, rows of zeros and rows holding one zero among random ones), and each step's mask must
come out equal, element for element (every step, or 256 spread over a longer chain). A mask that differs
declines the recurrence. One that cannot be checked this way (its steps read other runtime values, a dim the
values must have is unknown, onnxruntime cannot run the check) is left to the analysis that built it, as
before.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from .graph import Graph
from .protos import has_subgraph, tensor_nbytes
from .progress import logger
from .row_wise import FLOATS

# batch sizes of the value sets (a batch of one, and one big enough to hold every kind of row)
BATCHES = (1, 6)
# a check of more nodes than this is not built (a step mask is a handful of nodes a step)
MAX_PROOF_NODES = 20_000
# steps checked at most: a longer chain's first and last ones and others spread between (a mask is built the
# same way for every step: an offset, an axis or a negation gone wrong shows at most of them)
MAX_PROOF_STEPS = 256
# value sets of lengths at most (a batch the type fixes: the lengths wanted run over several), the bytes of the
# sliced tensor's sets at most, and the constants the rows are made to hold at most
MAX_PROOF_SETS = 64
MAX_PROOF_BYTES = 64 << 20
MAX_MARKS = 8
# lengths a value set holds at most where the type fixes no batch
MAX_LENGTHS_BATCH = 128


def step_masks_differ(g: Graph, mask: str, axis: int, steps: dict[int, str], source: str, length: int,
                      source_axis: int | None = None) -> str | None:
    """Why ``Gather(mask, t, axis)`` is not what the graph computes as ``steps[t]`` (step -> its mask tensor)
    for some step ``t``, on value sets of ``source``, the tensor both are computed from: lengths (``[B]`` or
    ``[B, 1]``, ``source_axis`` None) or a tensor sliced per step (``[T, B(, F)]`` / ``[B, T(, F)]``, time along
    ``source_axis``, ``length`` steps). None when every step agrees, or when the check cannot be made (see the
    module)."""
    steps = {t: steps[t] for t in _spread(sorted(steps))}
    nodes = g.cone([*steps.values(), mask], stop={source})
    if len(nodes) > MAX_PROOF_NODES:
        return None
    values = _value_sets(g, source, length, source_axis, sorted(steps), _marks(g, nodes, {}))
    if values is None:
        return None
    gathers, indices, outputs = [], [], []
    for t, name in sorted(steps.items()):
        idx, new = f"__rnnfuse_proof_t{t}", f"__rnnfuse_proof_m{t}"
        indices.append(numpy_helper.from_array(np.array(t, np.int64), idx))
        gathers.append(helper.make_node("Gather", [mask, idx], [new], axis=axis))
        outputs += [name, new]
    return _run_differs(g, nodes + gathers, source, values, indices, outputs, sorted(steps))


def body_mask_differs(g: Graph, mask: str, mask_axis: int, source: str, source_axis: int, reads: list[str],
                      nodes: list[NodeProto], out: str, consts: dict[str, np.ndarray]) -> str | None:
    """:func:`step_masks_differ` for a mask a Loop or Scan body computes: ``nodes`` (the body's, in evaluation
    order) compute ``out`` from ``reads``, the step's slice of ``source`` along ``source_axis`` (a Loop's
    ``Gather(S, i)``, a Scan's scanned input), reading ``consts`` (name -> value) besides; the body is to read
    ``Gather(mask, t, mask_axis)`` instead. Each step of the value sets is computed both ways."""
    t = g.model.known_type(source)
    steps = t[1][source_axis] if t is not None and t[1] is not None and source_axis < len(t[1]) else None
    length = steps if isinstance(steps, int) and steps > 0 else 5  # (a static extent may be built into M's nodes)
    checked = _spread(list(range(length)))
    outer = g.cone([mask], stop={source})
    if len(outer) + len(checked) * (len(nodes) + len(reads) + 1) > MAX_PROOF_NODES:
        return None
    values = _value_sets(g, source, length, source_axis, checked, _marks(g, nodes, consts))
    if values is None:
        return None
    indices = [numpy_helper.from_array(np.array(k, np.int64), f"__rnnfuse_proof_t{k}") for k in checked]
    indices += [numpy_helper.from_array(np.asarray(v), f"__rnnfuse_proof_c/{name}") for name, v in consts.items()]
    made = {o for n in nodes for o in n.output if o}
    copies, outputs = [], []
    for k in checked:
        own = {name: f"{name}/rnnfuse_proof_step{k}" for name in [*reads, *made]}
        own.update((name, f"__rnnfuse_proof_c/{name}") for name in consts)
        copies += [helper.make_node("Gather", [source, f"__rnnfuse_proof_t{k}"], [own[r]], axis=source_axis) for r in reads]
        for n in nodes:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.input[:] = [own.get(i, i) for i in n.input]
            c.output[:] = [own.get(o, o) for o in n.output]
            c.name = ""  # (one copy a step: onnxruntime refuses two nodes of one name)
            copies.append(c)
        copies.append(helper.make_node("Gather", [mask, f"__rnnfuse_proof_t{k}"], [f"__rnnfuse_proof_m{k}"], axis=mask_axis))
        outputs += [own[out], f"__rnnfuse_proof_m{k}"]
    return _run_differs(g, outer + copies, source, values, indices, outputs, checked)


def _spread(steps: list[int]) -> list[int]:
    """``steps`` (sorted), or past :data:`MAX_PROOF_STEPS` the first and last quarter of that many and the
    rest spread evenly between."""
    if len(steps) <= MAX_PROOF_STEPS:
        return steps
    edge = MAX_PROOF_STEPS // 4
    picked = {*steps[:edge], *steps[-edge:]}
    picked.update(steps[int(k)] for k in np.linspace(edge, len(steps) - edge - 1, MAX_PROOF_STEPS - 2 * edge))
    return sorted(picked)


def _run_differs(g: Graph, nodes: list[NodeProto], source: str, values: list[np.ndarray], initializers: list,
                 outputs: list[str], steps: list[int]) -> str | None:
    """Run ``nodes`` on each value set of ``source`` and compare ``outputs`` in pairs (step ``steps[k]``'s own
    mask, then the built one's slice); why they differ, or None (also when the check cannot run)."""
    if not _reads_only(g, nodes, source, {t.name for t in initializers}):
        return None
    key = _proof_key(g, nodes, source, values, initializers, outputs, steps)
    verdicts = g.model.facts.mask_proofs
    if key is not None and key in verdicts:
        return verdicts[key]
    why = _ran_differs(g, nodes, source, values, initializers, outputs, steps)
    if key is not None and why != _NOT_RUN:
        verdicts[key] = why
    return None if why == _NOT_RUN else why


# (what _ran_differs says when onnxruntime could not run the check: not kept, an analysis' word for it)
_NOT_RUN = "not run"
# weights a proof reads up to this size in all are digested by value; a proof reading more is not kept
MAX_DIGESTED_BYTES = 1 << 20


def _proof_key(g: Graph, nodes: list[NodeProto], source: str, values: list[np.ndarray], initializers: list,
               outputs: list[str], steps: list[int]) -> bytes | None:
    """A digest of everything a proof's verdict depends on, its tensors named by their first use: the nodes
    (op, domain, attributes, wiring), the values of the weights and constants they read, the value sets and
    which outputs are compared at which steps. Masks built alike from sources alike (stacked masked Loops,
    each masking by its input's rows; one mask read by many steps' copies) are proven once, where each proof
    was an onnxruntime session of its own (~5 ms: 500 masked Loops, 2.5 s of a 14 s run). None when it
    cannot be digested cheaply (a subgraph, big weights): the proof runs."""
    h = hashlib.sha256()
    names: dict[str, str] = {source: "0"}
    consts = {t.name: t for t in initializers}
    weights: list[str] = []

    def canon(name: str) -> str:
        if name not in names:
            names[name] = str(len(names))
            if name in consts or name in g.initializers:
                weights.append(name)
        return names[name]

    for n in nodes:
        if has_subgraph(n):
            return None
        attrs = b"".join(a.SerializeToString() for a in n.attribute)
        h.update(repr((n.op_type, n.domain, [canon(i) if i else "" for i in n.input],
                       [canon(o) if o else "" for o in n.output])).encode() + hashlib.sha256(attrs).digest())
    h.update(repr(([canon(o) for o in outputs], steps)).encode())
    held = 0
    for name in weights:
        t = consts[name] if name in consts else g.initializers[name]
        held += tensor_nbytes(t)
        if held > MAX_DIGESTED_BYTES:
            return None
        a = numpy_helper.to_array(t) if name in consts else g.model.tensor_array(t)
        if a.dtype == object:
            return None
        h.update(repr((names[name], a.dtype.str, a.shape)).encode() + np.ascontiguousarray(a).tobytes())
    for v in values:
        h.update(repr((v.dtype.str, v.shape)).encode() + np.ascontiguousarray(v).tobytes())
    return h.digest()


def _ran_differs(g: Graph, nodes: list[NodeProto], source: str, values: list[np.ndarray], initializers: list,
                 outputs: list[str], steps: list[int]) -> str | None:
    """:func:`_run_differs` run in onnxruntime: why the masks differ, None, or ``_NOT_RUN``."""
    import onnxruntime as ort

    from .check_session import model_of, open_session, options

    m, big = model_of(g, nodes, [onnx.ValueInfoProto(name=o) for o in outputs], {source: values},
                      "rnnfuse_mask_proof", initializers)
    try:
        sess = open_session(ort, m, big, so=options(ort), light=True)
        runs = [sess.run(outputs, {source: v}) for v in values]
    except Exception as e:  # (onnxruntime cannot run the check: the analysis' word stands)
        logger.debug("the step masks of '%s' are not proven: %s", source, str(e).strip().splitlines()[:1])
        return _NOT_RUN
    for k, got in enumerate(runs):
        for t, old, new in zip(steps, got[0::2], got[1::2]):
            if old.shape != new.shape or not np.array_equal(old, new, equal_nan=old.dtype.kind == "f"):
                return f"the mask built for every step is not the one step {t} computes (value set {k + 1} of {len(runs)})"
    return None


def _reads_only(g: Graph, nodes: list[NodeProto], source: str, given: set[str]) -> bool:
    """Whether ``nodes`` read nothing at run time but ``source`` and what they compute (weights and the
    ``given`` initializers aside)."""
    made = {o for n in nodes for o in n.output if o}
    return all(i in made or i == source or i in g.initializers or i in given for n in nodes for i in g.reads(n) if i)


def _marks(g: Graph, nodes: list[NodeProto], consts: dict[str, np.ndarray]) -> list[float]:
    """The values of the small constants ``nodes`` read (what a mask compares with: 0, a pad value, a token id,
    a threshold), at most :data:`MAX_MARKS` of them."""
    found: list[float] = []
    for n in nodes:
        for i in n.input:
            c = consts.get(i) if i in consts else (g.const(i) if i in g.initializers or i in g.producer else None)
            if c is None or np.asarray(c).size > 16 or np.asarray(c).dtype.kind not in "biuf":
                continue
            found += [float(v) for v in np.asarray(c).ravel() if np.isfinite(v) and float(v) not in found]
    return found[:MAX_MARKS]


def _value_sets(g: Graph, source: str, length: int, source_axis: int | None, checked: list[int],
                marks: list[float]) -> list[np.ndarray] | None:
    """Values of ``source`` that flip the step masks computed from it: lengths at and beside each checked step
    and past both ends; a sliced tensor's rows filled with 0 or with a value the mask nodes compare with
    (``marks``), rows holding one such value, random rows (one value a row, a float mask: those values and
    their neighbours). The batch the source's type fixes, else 1 and 6. None when its type, or a dim beyond
    time and batch, is unknown."""
    t = g.model.known_type(source)
    if t is None or t[1] is None or not t[0]:
        return None
    elem, dims = t
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    if source_axis is None:  # lengths: [B] or [B, 1]
        return None if len(dims) not in (1, 2) else _lengths(dims, length, checked, np_type)
    if len(dims) < 2 or source_axis not in (0, 1) or any(not isinstance(d, int) for d in dims[2:]):
        return None
    fixed = dims[1 - source_axis]
    out = []
    for k, batch in enumerate([fixed] if isinstance(fixed, int) and fixed > 0 else BATCHES):
        shape = [0, 0] + list(dims[2:])
        shape[source_axis], shape[1 - source_axis] = length, batch
        out.append(_rows(np.random.default_rng([len(dims), length, k]), shape, np_type, elem, marks))
    return out if sum(v.nbytes for v in out) <= MAX_PROOF_BYTES else None


def _lengths(dims: list, length: int, checked: list[int], np_type) -> list[np.ndarray] | None:
    """Lengths that put a boundary at and beside every checked step (an offset gone wrong shows only at the
    step a row's length ends at), and below zero and past the end; in sets of the batch the type fixes (at
    most :data:`MAX_PROOF_SETS`), else one set of all and one of a single row."""
    want = sorted({v for s in checked for v in (s - 1, s, s + 1, s + 2)} | {-2, -1, 0, length, length + 1, length + 2})
    fixed = dims[0] if isinstance(dims[0], int) and dims[0] > 0 else None
    batch = fixed or MAX_LENGTHS_BATCH  # (a set's whole mask is [T, batch]: 20 MB a run at 20,000 steps of 1,000 rows)
    sets = [want[k:k + batch] for k in range(0, len(want), batch)] + ([] if fixed else [want[-1:]])
    if len(sets) > MAX_PROOF_SETS:
        return None
    tail = [1] * (len(dims) - 1)
    return [np.array((s * batch)[:batch] if fixed else s).astype(np_type).reshape([-1] + tail) for s in sets]


def _rows(rng, shape: list[int], np_type, elem: int, marks: list[float]) -> np.ndarray:
    """Random values in ``shape`` whose rows (the axes beyond the first two) are filled with 0 or a mark, hold
    one such value, or are random; one value a row (rank 2): 0, the marks and their neighbours, 1, -1, 0.5, 2."""
    if elem == TensorProto.BOOL:
        return rng.random(shape) < 0.5
    step = 0.5 if elem in FLOATS else 1
    special = np.array(sorted({0.0, *marks}))
    if len(shape) == 2:
        near = sorted({0.0, 1.0, -1.0, 0.5, 2.0} | {m + d for m in marks for d in (-step, 0.0, step)})
        return rng.choice(np.array(near), size=shape).astype(np_type)
    v = rng.standard_normal(shape) if elem in FLOATS else rng.integers(-3, 4, size=shape).astype(np.float64)
    kind = rng.integers(0, 3, size=shape[:2])
    for a, b in np.argwhere(kind == 0):
        v[a, b] = rng.choice(special)
    for a, b in np.argwhere(kind == 1):
        v[a, b].flat[rng.integers(0, max(1, v[a, b].size))] = rng.choice(special)
    return v.astype(np_type)
