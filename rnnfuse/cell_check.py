"""Cell-level validation: each recorded step of the original graph against a one-step native op.

Used instead of whole-model validation when the model is too big to run cheaply (long unrolled chains): every
other step was proven identical to the checked ones structurally or symbolically. A check model holds the
step's nodes (constants copied in), the same inputs fed to a native op with the recognised cell's weights,
and both results as outputs. The native op is fed its own ``[1, B, n]`` views of the step's ``[B, n]`` x and
states and its ``[1, B, H]`` states are compared as ``[B, H]`` in numpy: a reshape node is onnxruntime set-up
time, paid per step and session (2,082 steps of cells side by side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .check_session import Source, is_big_array, materialize_nested, open_session
from .emit import native_attrs
from .feeds import random_values
from .graph import Graph
from .protos import has_subgraph
from .check_results import PairResult, ValidationResult, compare, failed_run
from .validate import MAX_VALIDATION_BYTES, checked_as_deployed, ort_module

MAX_SHAPE_SOURCE_BYTES = 1 << 26  # a tensor a step reads the shape of is fed as zeros up to this size (at batch 4)


@dataclass
class StepModel:
    """A step check's model and what running it takes."""

    model: onnx.ModelProto
    big: dict[str, Source]  # its big tensors, kept apart (see rnnfuse.check_session)
    role_name: dict[str, str]  # role ("x", "h", "c") -> the tensor fed for it
    pairs: list[tuple[str, str]]  # (the original's output, the native op's output)
    dims: dict[str, tuple]  # fed tensor -> its dims, "B" for the batch
    shaped: dict[str, np.dtype]  # tensors fed as zeros, only their shapes read
    views: dict[str, str] = field(default_factory=dict)  # native input -> the fed tensor it is a [1, B, n] view of


def validate_cells(g: Graph, rec, seed: int = 0) -> ValidationResult:
    """Compare each step in ``rec.cell_checks`` with a one-step native op on random inputs (light sessions
    first: a failure is checked again as deployed, see validate.checked_as_deployed)."""
    return checked_as_deployed(lambda as_deployed: _validate_cells_once(g, rec, seed, as_deployed))


def _validate_cells_once(g: Graph, rec, seed: int, as_deployed: bool) -> ValidationResult:
    ort = ort_module()
    cell = rec.cell
    res = ValidationResult(True)
    rng = np.random.default_rng(seed)
    too_big = _weights_too_big(cell)
    if too_big is not None:
        return too_big
    weights = cell.weights()
    for ci, chk in enumerate(rec.cell_checks):
        built = _check_model(g, cell, chk, weights)
        if isinstance(built, ValidationResult):
            return _unless_failed(res, built)
        pairs = built.pairs
        try:
            sess = open_session(ort, built.model, built.big, prepack=as_deployed, light=not as_deployed)
            res.light = res.light or sess.rnnfuse_light
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return _unless_failed(res, ValidationResult(False, f"onnxruntime cannot run the step ({msg[:200]})"))
        for p in pairs:
            res.pairs.setdefault(p, PairResult(*p))
        for run, (batch, scale) in enumerate(_runs(chk)):
            try:
                feeds, valid = _step_feeds(chk, built, batch, scale, run, rng)
            except (ValueError, MemoryError) as e:  # (dims no array takes: a type inference got wrong, rank 99)
                reason = f"the step's inputs cannot be made ({str(e).strip()[:200] or type(e).__name__})"
                return _unless_failed(res, ValidationResult(False, reason))
            try:
                vals = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
            except Exception as e:  # (the step's own nodes ran in the original model: the native cell fails)
                return failed_run(e, pairs, lambda: True)
            res.runs += 1
            _compare_step(res, chk, pairs, vals, feeds, valid, f"step check {ci}, batch {batch}")
    return res


def _weights_too_big(cell) -> ValidationResult | None:
    n_weights = 4 * cell.hidden * (cell.input_size + cell.hidden) * 4
    if 2 * n_weights > MAX_VALIDATION_BYTES:
        return ValidationResult(False, f"the cell's weights ({n_weights / 2**30:.1f} GB) are too big to check twice in memory")
    return None


def _step_feeds(chk, built: StepModel, batch: int, scale: float, run: int, rng):
    """One run's feeds of a step check (random x and states, fills, zeros read for their shape, masks, the
    native op's views) and which rows are valid (None: the step has no mask)."""
    feeds = {}
    dims = built.dims
    for name, role in chk.inputs.items():
        name = built.role_name[role] if role == "x" else name
        feeds[name] = random_values(_sized(dims[name], batch), np.float32, rng, scale=scale if role == "x" else 1.0)
    for name, v in chk.fills.items():
        feeds[name] = np.full(_sized(dims[name], batch), v, np.float32)
    for name, dtype in built.shaped.items():  # (only their shapes are read)
        feeds[name] = np.zeros(_sized(dims[name], batch), dtype)
    for view, name in built.views.items():
        feeds[view] = feeds[name].reshape(1, batch, -1)
    return feeds, _feed_masks(chk, feeds, batch, run)


def _compare_step(res: ValidationResult, chk, pairs: list, vals: dict, feeds: dict, valid, where: str) -> None:
    for p, role in zip(pairs, chk.outputs.values()):
        want = vals[p[1]][0]  # (the native op's [1, B, H] state)
        if valid is not None:  # (padded rows keep the state the step read)
            want = np.where(valid[:, None], want, _state_read(chk, role, feeds, want.shape))
        compare(res.pairs[p], _without_unit_lead(vals[p[0]], want.shape), want, where)


# step checks of several recurrences run in one onnxruntime session, up to this many steps and bytes of check
# models a session: a session costs ~0.9 ms to create for one small step and ~0.25 ms a step for 16 (1,041
# cells side by side, two step kinds each: 2,082 sessions were half the optimizer's time)
STEPS_PER_SESSION = 32
SHARED_SESSION_BYTES = 32 << 20


def validate_cells_together(g: Graph, recs: list, seed: int = 0) -> list[ValidationResult]:
    """:func:`validate_cells` of each recurrence in ``recs``, their steps' check models run side by side in
    shared sessions (each renamed apart). Sharing is only a way to run the same checks for less: every step
    gets the feeds and comparisons its own validation would, and a recurrence whose steps cannot share (a
    step holding a subgraph or big weights, one that cannot be built, a shared session that fails) or whose
    shared checks do not all pass is validated on its own, so every verdict but a pass is reached exactly as
    alone. Check models are built as their recurrence comes and dropped once run: a few sessions' worth is
    held at a time."""
    if len(recs) < 2:
        return [validate_cells(g, rec, seed=seed) for rec in recs]
    ort = ort_module()
    results: list[ValidationResult | None] = [None] * len(recs)
    alone: set[int] = set()
    pending: dict[tuple, list] = {}  # the runs of a step kind -> steps waiting for a session
    pending_bytes: dict[tuple, int] = {}

    def flush(key: tuple) -> None:
        part = [u for u in pending.pop(key) if u[0] not in alone]
        pending_bytes.pop(key)
        if part:
            alone.update(_run_shared(ort, part, results))

    for ri, rec in enumerate(recs):
        steps = _shareable_steps(g, rec, seed)
        if steps is None:
            alone.add(ri)
            continue
        results[ri] = ValidationResult(True)
        for ci, chk, built, runs in steps:
            key = tuple(_runs(chk))
            pending.setdefault(key, []).append((ri, ci, chk, built, runs))
            pending_bytes[key] = pending_bytes.get(key, 0) + built.model.ByteSize()
            if len(pending[key]) >= STEPS_PER_SESSION or pending_bytes[key] >= SHARED_SESSION_BYTES:
                flush(key)
    for key in list(pending):
        flush(key)
    for ri, rec in enumerate(recs):
        r = results[ri]
        if ri in alone or not all(p.ok for p in r.pairs.values()):
            results[ri] = validate_cells(g, rec, seed=seed)
    return results


def _shareable_steps(g: Graph, rec, seed: int) -> list | None:
    """Each step check of ``rec`` built, with its runs' feeds drawn as its own validation draws them, or None
    when one cannot share a session."""
    cell = rec.cell
    if _weights_too_big(cell) is not None:
        return None
    rng = np.random.default_rng(seed)
    weights = cell.weights()
    steps = []
    for ci, chk in enumerate(rec.cell_checks):
        built = _check_model(g, cell, chk, weights)
        if isinstance(built, ValidationResult):
            return None
        if built.big or any(has_subgraph(n) for n in built.model.graph.node):
            return None
        runs = []
        for run, (batch, scale) in enumerate(_runs(chk)):
            try:
                feeds, valid = _step_feeds(chk, built, batch, scale, run, rng)
            except (ValueError, MemoryError):  # (validated alone, which says why)
                return None
            runs.append((feeds, valid, batch))
        steps.append((ci, chk, built, runs))
    return steps


def _run_shared(ort, part: list, results: list) -> set[int]:
    """Run the step checks ``part`` in one light session, each renamed under a prefix of its own; record their
    comparisons in ``results``. Returns the recurrences to validate alone (all of them, if the shared session
    fails to load or run)."""
    first = part[0][3].model
    merged = onnx.ModelProto()
    merged.ir_version = first.ir_version
    merged.opset_import.extend(first.opset_import)
    merged.graph.name = "rnnfuse_cell_checks"
    for k, (_, _, _, built, _) in enumerate(part):
        _append_renamed(merged.graph, built.model.graph, f"__s{k}/")
    try:
        sess = open_session(ort, merged, {}, light=True)
        out_names = [o.name for o in sess.get_outputs()]
        for run in range(len(part[0][4])):
            feeds = {f"__s{k}/{name}": v for k, u in enumerate(part) for name, v in u[4][run][0].items()}
            vals = dict(zip(out_names, sess.run(None, feeds)))
            for k, (ri, ci, chk, built, runs) in enumerate(part):
                step_feeds, valid, batch = runs[run]
                pairs = built.pairs
                res = results[ri]
                for p in pairs:
                    res.pairs.setdefault(p, PairResult(*p))
                res.runs += 1
                mine = {name: vals[f"__s{k}/{name}"] for p in pairs for name in p}
                _compare_step(res, chk, pairs, mine, step_feeds, valid, f"step check {ci}, batch {batch}")
    except Exception:  # (each is checked alone, where a failure is attributed)
        return {u[0] for u in part}
    return set()


def _append_renamed(into: onnx.GraphProto, graph: onnx.GraphProto, prefix: str) -> None:
    """Append ``graph``'s nodes, inputs, outputs, declarations and initializers to ``into``, every name under
    ``prefix``: a step check's model beside others in one session (onnx.compose.add_prefix copies the whole
    model first and renames what a step check never holds; shared step checks hold no subgraph)."""
    def renamed(names) -> list[str]:
        return [prefix + x if x else "" for x in names]

    for n in graph.node:
        c = into.node.add()
        c.CopyFrom(n)
        del c.input[:], c.output[:]
        c.input.extend(renamed(n.input))
        c.output.extend(renamed(n.output))
        if n.name:
            c.name = prefix + n.name
    for listed in ("input", "output", "value_info", "initializer"):
        target = getattr(into, listed)
        for v in getattr(graph, listed):
            c = target.add()
            c.CopyFrom(v)
            c.name = prefix + v.name


def _sized(dims: tuple, batch: int) -> tuple:
    return tuple(batch if d == "B" else d for d in dims)


def _without_unit_lead(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` without the leading unit axes a step's [1, B, H] state has beside the native [B, H] (torch's
    per-layer slices of h0), when that is all that differs."""
    extra = a.ndim - len(shape)
    if extra > 0 and a.shape[extra:] == tuple(shape) and all(d == 1 for d in a.shape[:extra]):
        return a.reshape(shape)
    return a


def _fed_dims(g: Graph, cell, chk) -> dict[str, tuple]:
    """The dims each fed tensor has in the graph, "B" for the batch: a state read with leading unit axes
    (``[1, B, H]``) is fed so, and a fill with the dims it has (torch's ``h0`` of ``[layers, B, H]``, sliced by
    the step) where they are known as constants around one batch dim; else ``[B, width]``."""
    dims: dict[str, tuple] = {}
    batch_dim = None
    for name, role in chk.inputs.items():
        width = cell.input_size if role == "x" else cell.hidden
        shape = g.model.shape(name)
        # (the known rank only: a lead guessed through the graph may be wrong, and the check then cannot run)
        lead = 0 if (role == "x" and chk.x_projection is not None) or not shape else max(len(shape) - 2, 0)
        dims["__x0" if role == "x" and chk.x_projection is not None else name] = (1,) * lead + ("B", width)
        if role == "x" and shape and isinstance(shape[-2], str):
            batch_dim = shape[-2]
    for name in chk.fills:
        shape = g.model.shape(name)
        if shape and all(isinstance(d, int) for d in shape) and chk.batch:
            dims[name] = tuple(shape)  # (a static export: the batch is the fill's own)
        elif shape and batch_dim is not None and shape.count(batch_dim) == 1 and all(
                isinstance(d, int) or d == batch_dim for d in shape):
            dims[name] = tuple("B" if d == batch_dim else d for d in shape)
        else:
            dims[name] = ("B", cell.hidden)
    return dims


def _unless_failed(res: ValidationResult, cannot: ValidationResult) -> ValidationResult:
    """A later step that cannot be checked makes the checks "not run" (the whole model is then validated),
    unless an earlier step already failed: that failure stands."""
    return res if any(not p.ok for p in res.pairs.values()) else cannot


def _runs(chk) -> list[tuple[int, float]]:
    """(batch, input scale) of each run; a masked step with a static batch of 1 gets a padded run too."""
    b = chk.batch
    if not b:
        return [(1, 1.0), (3, 1.0), (4, 8.0)]
    return [(b, 1.0), (b, 8.0)] + ([(b, 1.0)] if chk.masks and b == 1 else [])


def _feed_masks(chk, feeds: dict, batch: int, run: int) -> np.ndarray | None:
    """Feed the step's masks: rows alternately valid and padded, the first row's turn changing with each run
    (a batch of one is valid in one run, padded in the next). Returns which rows are valid (None: no mask)."""
    if not chk.masks:
        return None
    valid = (np.arange(batch) + run) % 2 == 0
    on = valid if chk.mask_valid else ~valid
    for name, (elem, dims) in chk.masks.items():
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        feeds[name] = np.broadcast_to(on.reshape((batch,) + (1,) * len(dims)), (batch, *dims)).astype(dtype)
    return valid


def _state_read(chk, role: str, feeds: dict, shape: tuple) -> np.ndarray:
    """The state ``role`` the step read (its feed; zero where the step starts from folded zeros; else the one
    value the step's fills hold)."""
    for name, r in chk.inputs.items():
        if r == role:
            return feeds[name].reshape(shape)  # (a [1, B, H] state read: the rows are the same)
    if role in chk.zero:
        return np.zeros(shape, np.float32)
    (fill,) = set(chk.fills.values())  # (a state started from a fill: roles.add_cell_checks made sure of one)
    return np.full(shape, fill, np.float32)


def _check_model(g: Graph, cell, chk, weights) -> StepModel | ValidationResult:
    """One step's check model (:class:`StepModel`), or a ValidationResult saying why it cannot be built."""
    produced = {o for n in chk.nodes for o in n.output}
    nodes = list(chk.nodes)  # (copied once, into the model's graph)
    inits = {}
    dims = _fed_dims(g, cell, chk)
    shaped: dict[str, np.dtype] = {}
    for n in chk.nodes:
        for i in n.input:
            if i and i not in produced and i not in chk.inputs and i not in inits and i not in chk.fills and i not in chk.masks:
                c = g.const(i)
                if c is not None:
                    inits[i] = np.asarray(c)
                elif i not in shaped and not _shape_source(g, chk, i, dims, shaped):
                    return ValidationResult(False, f"the step reads '{i}', which is not constant")
    inputs, role_name = _step_inputs(cell, chk, nodes, inits, dims)
    inputs += [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dt), list(dims[name]))
               for name, dt in shaped.items()]
    W, R, B = weights
    inits.update({"__W": W, "__R": R, "__B": B})
    # the native op's X [1, B, F] and initial states [1, B, H]: views of x_t and the states fed as [B, n] or
    # [1, B, n], fed beside them
    dt = TensorProto.FLOAT
    views = {"__X": role_name["x"]}
    inputs.append(helper.make_tensor_value_info("__X", dt, [1, "B", cell.input_size]))
    ins = ["__X", "__W", "__R", "__B", ""]
    extra = []
    for st in cell.kind.states:
        if st in role_name:
            views[f"__init_{st}"] = role_name[st]
            inputs.append(helper.make_tensor_value_info(f"__init_{st}", dt, [1, "B", cell.hidden]))
            ins.append(f"__init_{st}")
        else:
            ins.append("")
    for name, arr in cell.kind.extra_arrays(cell).items():  # e.g. an LSTM's peepholes P
        while len(ins) < cell.kind.inputs.index(name):
            ins.append("")
        extra.append(numpy_helper.from_array(arr[None], f"__{name}"))
        ins.append(f"__{name}")
    while ins[-1] == "":
        ins.pop()
    outs = ["__Y"] + [f"__Y{st}" for st in cell.kind.states]
    nodes.append(helper.make_node(cell.op, ins, outs, **native_attrs(cell, "forward")))
    pairs = []
    outputs = []
    for name, role in chk.outputs.items():
        pairs.append((name, f"__Y{role}"))  # (compared as [B, H]: _compare_step)
        outputs += [helper.make_tensor_value_info(name, dt, None), helper.make_tensor_value_info(f"__Y{role}", dt, None)]
    big = {k: a for k, a in inits.items() if is_big_array(a)}
    m = onnx.ModelProto()
    m.ir_version = g.model.proto.ir_version
    m.opset_import.extend(g.model.proto.opset_import)
    graph = m.graph
    graph.name = "rnnfuse_cell_check"
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.initializer.extend([numpy_helper.from_array(a, k) for k, a in inits.items() if k not in big] + extra)
    materialize_nested(m, g.model.tensor_array)
    return StepModel(m, big, role_name, pairs, dims, shaped, views)


def _shape_source(g: Graph, chk, name: str, dims: dict, shaped: dict) -> bool:
    """Whether the step reads ``name`` (a graph input, say the whole sequence) only through its shape (``Shape``,
    ``Size``: torch's trace of ``gates.view(x.size(1), 4, H)`` reads the batch from x at every step) and its
    dims are known, the batch dim as the step's x has it: then the check is fed zeros of those dims (batch
    sized per run), recorded in ``dims`` and ``shaped``. Any other dim unknown: the step cannot be run alone."""
    if any(i == name and n.op_type not in ("Shape", "Size") for n in chk.nodes for i in n.input):
        return False
    t = g.model.known_type(name)
    batch = next(((g.model.shape(x) or [None, None])[-2] for x, role in chk.inputs.items() if role == "x"), None)
    if t is None or t[1] is None or not all(isinstance(d, int) or (d == batch and isinstance(d, str)) for d in t[1]):
        return False
    if not isinstance(batch, str) and chk.batch is None:
        return False  # (the runs' batches are not the static one its dims hold: the step would see another)
    fed = tuple("B" if d == batch and isinstance(d, str) else d for d in t[1])
    dtype = helper.tensor_dtype_to_np_dtype(t[0])
    if np.prod(_sized(fed, 4), dtype=np.float64) * dtype.itemsize > MAX_SHAPE_SOURCE_BYTES:
        return False
    dims[name], shaped[name] = fed, dtype
    return True


def _step_inputs(cell, chk, nodes: list, inits: dict, dims: dict[str, tuple]) -> tuple[list, dict]:
    """The check model's inputs (the step's x, h, c and runtime-shaped fills) and which tensor is fed per role.
    A step that reads the projected input ``x0 @ K + b`` is fed x0, the projection computed in the model."""
    dt = TensorProto.FLOAT
    inputs = []
    role_name = {}
    for name, role in chk.inputs.items():
        if role == "x" and chk.x_projection is not None:
            K, bias = chk.x_projection
            raw = "__x0"
            inputs.append(helper.make_tensor_value_info(raw, dt, list(dims[raw])))
            extra_nodes = [helper.make_node("MatMul", [raw, "__K"], [name if bias is None else "__xk"])]
            inits["__K"] = np.asarray(K)
            if bias is not None:
                inits["__kb"] = np.asarray(bias)
                extra_nodes.append(helper.make_node("Add", ["__xk", "__kb"], [name]))
            nodes[:0] = extra_nodes
            role_name[role] = raw
            continue
        inputs.append(helper.make_tensor_value_info(name, dt, list(dims[name])))
        role_name[role] = name
    for name in chk.fills:
        inputs.append(helper.make_tensor_value_info(name, dt, list(dims[name])))
    for name, (elem, dims) in chk.masks.items():
        inputs.append(helper.make_tensor_value_info(name, elem, ["B", *dims]))
    return inputs, role_name
