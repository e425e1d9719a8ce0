"""Numeric check of rewrites before they are kept.

A candidate rewrite adds new tensors next to the old ones without touching the old ones. One validation model
computes both from the same inputs: the model's own inputs (random, respecting int index ranges), with every
recurrence mask replaced by patterns we choose (post-padded, pre-padded, gappy, empty rows, full rows), at
batch 1 and >1, several sequence lengths, and small and large magnitudes. Each old/new pair must agree
elementwise to a tight tolerance, on the full outputs (padded steps included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .check_groups import Group, in_groups, independent_groups
from .check_results import PairResult, ValidationResult, compare, failed_run, first_line
from .check_session import Source, model_of, open_session, takes_file_route
from .feeds import TRIP_COUNTS, index_ranges, input_sizes, random_values, trip_count_inputs, valid_steps
from .graph import Graph
from .protos import data_bytes, nodes_within, rename_reads
from .piecewise_runs import run_in_pieces, weight
from .sessions_ahead import Opening, SessionsAhead
from .upstream import CUT_BYTES, Cut, cut


def ort_module():
    import onnxruntime as ort

    return ort


def _inputs_for(g: Graph, dims: dict, b: int, t: int, scale: float, rng, index_ranges,
                counts: set[str] = frozenset()) -> dict[str, np.ndarray]:
    """One generated input set (``counts``: inputs read as a Loop's trip count, see feeds.TRIP_COUNTS)."""
    feeds = {}
    for name in g.input_names:
        if name in g.initializers:
            continue
        et = g.model.elem_type(name)
        shape = g.model.shape(name)
        if shape is None:
            raise _Skip(f"input '{name}' has no declared shape")
        concrete, _ = input_sizes(name, shape, dims, b, t)
        np_t = helper.tensor_dtype_to_np_dtype(et) if et else np.float32
        if name in counts:
            feeds[name] = random_values(concrete, np_t, rng, index_range=TRIP_COUNTS, lowest_index=1)
            continue
        feeds[name] = random_values(concrete, np_t, rng, scale=scale, p_true=0.7, index_range=index_ranges.get(name, 3))
    return feeds


class _Skip(Exception):
    pass


def build_check_model(
    g: Graph, pairs: list[tuple[str, str]], masks: list[str], start: Cut | None = None
) -> tuple[onnx.ModelProto, dict[str, str], dict[str, Source]]:
    """A model that outputs every old and new tensor, with masks overridden by pattern inputs; its big
    initializers are not copied into it but returned apart (name -> where their values are), for
    :func:`rnnfuse.check_session.open_session`. ``start``: the nodes it holds and the tensors it is fed
    instead of computing them (see rnnfuse.upstream); by default the whole cone of the compared tensors."""
    wanted = {n for p in pairs for n in p}
    if start is None:
        start = Cut(g.cone(wanted))
    keep = []
    for n in start.nodes:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        keep.append(m)
    pattern_inputs, overrides, inits = _mask_overrides(keep, masks)
    nodes = _with_overrides(keep, overrides)
    partner = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    outputs = []
    for name in sorted(wanted):
        et = g.model.elem_type(name) or g.model.elem_type(partner[name]) or TensorProto.FLOAT
        outputs.append(helper.make_tensor_value_info(name, et, None))
    for k in range(len(masks)):
        outputs.append(helper.make_tensor_value_info(f"__rnnfuse_mask_{k}/shape2", TensorProto.INT64, [2]))
    m, big = model_of(g, nodes, outputs, start.given, "rnnfuse_check", inits)
    for mname, pname in pattern_inputs.items():
        m.graph.input.append(helper.make_tensor_value_info(pname, TensorProto.BOOL, [None, None]))
    return m, pattern_inputs, big


def _mask_overrides(keep: list[onnx.NodeProto], masks: list[str]):
    """Every read of mask k in ``keep`` (subgraphs included) reads ``__rnnfuse_mask_k`` instead: the bool
    pattern input ``__rnnfuse_pattern_k`` cut to the mask's [T, B] and reshaped to its shape. Returns (mask ->
    pattern input, mask -> the nodes computing its override, their constants)."""
    pattern_inputs: dict[str, str] = {}
    overrides: dict[str, list[onnx.NodeProto]] = {}
    rename_reads((), {mname: f"__rnnfuse_mask_{k}" for k, mname in enumerate(masks)}, keep)  # (one walk)
    for k, mname in enumerate(masks):
        pname = f"__rnnfuse_pattern_{k}"
        over = f"__rnnfuse_mask_{k}"
        pattern_inputs[mname] = pname
        sh, sh2, sl = f"{over}/shape", f"{over}/shape2", f"{over}/slice"
        overrides[mname] = [
            helper.make_node("Shape", [mname], [sh]),
            helper.make_node("Slice", [sh, f"{over}/c0", f"{over}/c2"], [sh2]),
            helper.make_node("Slice", [pname, f"{over}/c00", sh2, f"{over}/c01"], [sl]),
            helper.make_node("Reshape", [sl, sh], [over]),
        ]
    inits = []
    for k, mname in enumerate(masks):
        over = f"__rnnfuse_mask_{k}"
        inits += [
            numpy_helper.from_array(np.array([0], np.int64), f"{over}/c0"),
            numpy_helper.from_array(np.array([2], np.int64), f"{over}/c2"),
            numpy_helper.from_array(np.array([0, 0], np.int64), f"{over}/c00"),
            numpy_helper.from_array(np.array([0, 1], np.int64), f"{over}/c01"),
        ]
    return pattern_inputs, overrides, inits


def _with_overrides(keep: list[onnx.NodeProto], overrides: dict[str, list[onnx.NodeProto]]) -> list:
    """``keep`` (in topological order) with each mask's override nodes right after the node computing the mask
    (first, for a mask no kept node computes: a graph input): every reader of a mask reads its override, and
    comes after that node. (Sorting the whole check model again instead cost a walk and a copy of every node:
    100,000 of them for a recurrence behind a long prologue, three times a run.)"""
    computed = {o for n in keep for o in n.output if o in overrides}
    ordered = [n for mname, nodes in overrides.items() if mname not in computed for n in nodes]
    for n in keep:
        ordered.append(n)
        for o in n.output:
            if o in overrides:
                ordered.extend(overrides[o])
    return ordered


# models whose weights exceed this are not copied into a validation model (it would double their memory)
MAX_VALIDATION_BYTES = 1 << 30
# check models of more nodes than this (their bodies' included) are run without graph optimizations first (see
# _check_session)
LIGHT_CHECK_NODES = 10_000
# a check model without masks of more nodes than this (bodies counted) runs in pieces of CHECK_PIECE_NODES, one
# session after the other (see _compare_in_pieces): onnxruntime's set-up grows faster than the nodes, and holds
# several KB a node while a session is open
PIECEWISE_CHECK_NODES = 20_000
CHECK_PIECE_NODES = 2_500
# the old tensors a check in pieces holds until their new partners are computed, at most (the whole check model
# holds every compared tensor of one input set at once; the pieces hold the four sets)
CHECK_HELD_BYTES = 256 << 20


def validate(
    g: Graph,
    pairs: list[tuple[str, str]],
    masks: dict[str, str],
    seed: int = 0,
    min_time: int = 1,
) -> ValidationResult:
    """Compare old/new tensor pairs on generated inputs.

    ``masks``: mask tensor -> (kind, time axis) with kind "any" (all patterns) or "post" (post-padded only).
    ``min_time``: the least time length generated (each input set's, raised to it).
    """
    if not pairs:
        return ValidationResult(True)
    ort = ort_module()
    proto = g.model.proto
    size = data_bytes(proto)
    if size > MAX_VALIDATION_BYTES:
        return ValidationResult(
            False,
            f"the model holds {size / 2**30:.1f} GB of weights; running it again in onnxruntime would exceed "
            "rnnfuse's memory bound (the rewrite is proven from the cell's maths)",
        )
    return checked_as_deployed(lambda as_deployed: _validate_once(ort, g, pairs, masks, seed, prepack=as_deployed,
                                                                  min_time=min_time))


def checked_as_deployed(run: Callable[[bool], ValidationResult]) -> ValidationResult:
    """``run(as_deployed=False)``, and when onnxruntime ran it lighter than deployed (without pre-packing, as
    the file route does for memory, or without graph optimizations, as small step checks do for speed: see
    rnnfuse.check_session) and a pair failed, ``run(as_deployed=True)``: pre-packed or fused kernels add in
    another order, and a failure stands only if the computation onnxruntime runs by default agrees."""
    res = run(False)
    if res.ran and res.light and not all(r.ok for r in res.pairs.values()):
        res = run(True)
    return res


# (batch, time steps, input scale) of each generated input set
CONFIGS = [(1, 6, 1.0), (4, 9, 1.0), (3, 5, 8.0), (2, 1, 1.0)]


class InputSets:
    """The generated input sets of a validation, one per config, each made again whenever it is asked for, so
    a model with big inputs holds one set at a time although the sets are read more than once (rnnfuse.upstream
    digests them and runs the shared upstream on them before the check model runs them). Each set comes from
    a generator of its own, seeded by the seed and the set's number: the same sets for every validation of a
    run, whatever masks each overrides, so values computed from them can be kept."""

    def __init__(self, g: Graph, seed: int, min_time: int = 1):
        self.g, self.seed, self.ranges, self.min_time = g, seed, index_ranges(g), min_time
        self.counts = trip_count_inputs(g)

    def __len__(self) -> int:
        return len(CONFIGS)

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        b, t, scale = CONFIGS[k]
        return _inputs_for(self.g, {}, b, max(t, self.min_time), scale, np.random.default_rng([self.seed, k]),
                           self.ranges, self.counts)

    def __iter__(self):
        return (self[k] for k in range(len(self)))


class _InGroup(NamedTuple):
    """What the check of a group of a big check's parts (rnnfuse.check_groups) takes from the big one: where
    the group starts, the longest static extent of all its masks (_mask_shapes) and its input sets. A group
    runs light, without graph optimizations, as the big check would have."""

    start: Cut
    longest: int
    inputs: InputSets
    opening: Opening | None = None  # its check session, being opened while the group before it runs


def _validate_once(ort, g: Graph, pairs, masks: dict[str, str], seed: int, prepack: bool,
                   min_time: int = 1, group: _InGroup | None = None) -> ValidationResult:
    """One check of ``pairs`` (see :func:`validate`); ``group``: as a group of a bigger one's parts."""
    start, longest = (group.start, group.longest) if group else (None, None)
    inputs = group.inputs if group else InputSets(g, seed, min_time)
    try:
        inputs[0]  # (an input without a declared shape cannot be generated: said before anything is built)
    except _Skip as s:
        return ValidationResult(False, str(s))
    # a big check without masks runs each input set once: it can run in pieces, light (a failure is checked
    # again as deployed in one session, as onnxruntime would run it: its optimizers fuse across what would be a
    # cut); one with masks, as groups of the parts it holds
    if start is None and not prepack:
        start = _start(ort, g, pairs, sorted(masks), prepack, inputs)
        if start is not None and _weight_over(start.nodes, PIECEWISE_CHECK_NODES):
            res = (_check_in_groups(ort, g, pairs, masks, seed, min_time, start, inputs) if masks
                   else _compare_in_pieces(ort, g, pairs, start, inputs))
            if res is not None:
                return res
    loaded = _check_session(ort, g, pairs, sorted(masks), prepack, inputs, start, light=group is not None,
                            opening=group.opening if group else None)
    if isinstance(loaded, ValidationResult):
        return loaded
    sess, pattern_inputs, given = loaded
    out_names = [o.name for o in sess.get_outputs()]
    # the check model keeps only the inputs the compared tensors depend on: feed just those
    fed = {i.name for i in sess.get_inputs()}
    res = ValidationResult(True, light=sess.rnnfuse_light)
    for p in pairs:
        res.pairs[p] = PairResult(*p)
    pattern_rng = np.random.default_rng([seed, 1])

    def failed(e: Exception, feeds: dict, k: int) -> ValidationResult:
        # (the original alone reads graph inputs where the check model may be fed values: give it those too)
        every = {**inputs[k], **feeds}
        return failed_run(e, pairs, lambda: _original_runs(ort, g, pairs, masks, prepack, every))

    kinds_any = ["post", "pre", "gappy", "full"]
    kinds_post = ["post", "full"]
    # an input set the original itself cannot run (an unrolled trace of a symbolic time axis reads 6 steps: T = 5
    # is no input of it) is no input the rewrite must agree on: the check goes on with the others, and is
    # skipped only when the original runs none
    not_inputs: ValidationResult | None = None
    for k, (b, t, scale) in enumerate(CONFIGS):
        feeds = {name: v for name, v in inputs[k].items() if name in fed}  # (made again: see InputSets)
        feeds.update((name, values[k]) for name, values in given.items() if name in fed)
        # learn each mask's [T, B] with an all-true pattern, then feed exact patterns of each kind
        shapes = _mask_shapes(g, sess, out_names, feeds, pattern_inputs, longest, max(b, t, 4),
                              lambda e, f, k=k: failed(e, f, k)) if pattern_inputs else {}
        if isinstance(shapes, ValidationResult):
            if shapes.ran:
                return shapes
            not_inputs = not_inputs or shapes
            continue
        n_kinds = len(kinds_any) if any(v[0] == "any" for v in masks.values()) else len(kinds_post)
        for ki in range(n_kinds if masks else 1):
            for mname, pname in pattern_inputs.items():
                kind, time_axis = masks[mname]
                kinds = kinds_any if kind == "any" else kinds_post
                d0, d1 = shapes[mname]
                if time_axis == 0:
                    feeds[pname] = valid_steps(kinds[ki % len(kinds)], d0, d1, pattern_rng)
                else:
                    feeds[pname] = np.ascontiguousarray(valid_steps(kinds[ki % len(kinds)], d1, d0, pattern_rng).T)
            try:
                outs = sess.run(None, feeds)
            except Exception as e:
                verdict = failed(e, feeds, k)
                if verdict.ran:
                    return verdict
                not_inputs = not_inputs or verdict
                break
            res.runs += 1
            vals = dict(zip(out_names, outs))
            for p in pairs:
                compare(res.pairs[p], vals[p[0]], vals[p[1]], f"batch {b}, T={max(t, inputs.min_time)}")
    return not_inputs if res.runs == 0 and not_inputs is not None else res


def _cut(ort, g: Graph, pairs, mask_names, prepack: bool, inputs: InputSets) -> Cut:
    """Where the check model starts (rnnfuse.upstream.cut: the shared upstream run apart in sessions like the
    check model's)."""
    return cut(ort, g, pairs, mask_names, inputs,
               lambda ort_, m, big: open_session(ort_, m, big, prepack=prepack, file_route=takes_file_route(big)))


def _start(ort, g: Graph, pairs, mask_names, prepack: bool, inputs: InputSets) -> Cut | None:
    """:func:`_cut`, or None when finding it raised (the check session's path finds it again, and says what
    fails)."""
    try:
        return _cut(ort, g, pairs, mask_names, prepack, inputs)
    except Exception:
        return None


def _weight_over(nodes: list, limit: int) -> bool:
    """Whether ``nodes`` are more than ``limit`` nodes for a session, their subgraphs' counted."""
    total = 0
    for n in nodes:
        total += weight(n)
        if total > limit:
            return True
    return False


def _compare_in_pieces(ort, g: Graph, pairs, start: Cut, inputs: InputSets) -> ValidationResult | None:
    """The check of ``pairs`` (no mask overridden) with the check model's nodes run in pieces of
    ``CHECK_PIECE_NODES`` (rnnfuse.piecewise_runs), each pair compared as soon as both its tensors are computed
    and its values then let go. Each input set runs once, as in the whole check model, and the values are the
    same: the pieces run the same nodes on the same inputs, handing on exact tensors. None when the pieces
    cannot run it (a value that is not a tensor, too many bytes held, a piece that fails to load or run): the
    whole check model then decides, and says what fails. Light sessions, as a big check model's are (a failure
    is checked again as deployed, in one session)."""
    of_name: dict[str, list[tuple[str, str]]] = {}  # tensor -> the pairs it is in
    res = ValidationResult(True, light=True, runs=len(CONFIGS))
    for p in pairs:
        res.pairs[p] = PairResult(*p)
        for name in set(p):
            of_name.setdefault(name, []).append(p)
    left = {name: len(ps) for name, ps in of_name.items()}  # tensor -> its pairs not compared yet
    got: dict[str, list[np.ndarray]] = {}
    held = [0]  # the bytes of ``got``: values waiting for their pair's other tensor

    def take(name: str, values: list[np.ndarray]) -> None:
        got[name] = values
        held[0] += sum(v.nbytes for v in values)
        for p in of_name[name]:
            if p[0] in got and p[1] in got:
                for k, (b, t, _) in enumerate(CONFIGS):
                    compare(res.pairs[p], got[p[0]][k], got[p[1]][k], f"batch {b}, T={max(t, inputs.min_time)}")
                for x in set(p):
                    left[x] -= 1
                    if not left[x]:
                        held[0] -= sum(v.nbytes for v in got.pop(x))
        if held[0] > CHECK_HELD_BYTES:
            raise MemoryError("the values waiting for their pairs")  # (the whole check model runs instead)

    try:
        for name in [x for x in left if x in start.given]:  # (an old tensor an earlier validation computed: fed)
            take(name, start.given[name])
        done = run_in_pieces(ort, g, start.nodes, [x for x in left if x not in start.given], start.given, inputs,
                             lambda ort_, m, big: open_session(ort_, m, big, file_route=takes_file_route(big), light=True),
                             CHECK_PIECE_NODES, CUT_BYTES, take=take)
    except Exception:
        return None
    return res if done is not None and not got else None


def _check_in_groups(ort, g: Graph, pairs, masks, seed: int, min_time: int, start: Cut, inputs: InputSets
                     ) -> ValidationResult | None:
    """The masked check of ``pairs`` as groups of its parts (rnnfuse.check_groups), each group fed the old tensors
    it reads from the others, computed first by the original nodes (in pieces, each input set once); None when
    the groups cannot settle it (the whole check model then does)."""
    groups = independent_groups(start.nodes, pairs, masks, g.reads, CHECK_PIECE_NODES)
    if groups is None:
        return None
    fed = sorted(set().union(*(grp.fed for grp in groups)))
    try:
        links = run_in_pieces(ort, g, g.cone(fed, start.given), fed, start.given, inputs,
                              lambda ort_, m, big: open_session(ort_, m, big, file_route=takes_file_route(big), light=True),
                              CHECK_PIECE_NODES, CUT_BYTES) if fed else {}
    except Exception:
        return None
    if links is None:
        return None
    longest = _longest_extent(g, masks)

    def start_of(grp: Group) -> Cut:
        return Cut(grp.nodes, {**start.given, **{x: links[x] for x in grp.fed}})

    def check(grp: Group, opening: Opening) -> ValidationResult:
        return _validate_once(ort, g, grp.pairs, grp.masks, seed, False, min_time,
                              _InGroup(start_of(grp), longest, inputs, opening))

    def built(grp: Group) -> tuple:
        check_model, pattern_inputs, big = build_check_model(g, grp.pairs, sorted(grp.masks), start_of(grp))
        return check_model, big, pattern_inputs

    with SessionsAhead() as ahead:  # (each group's session opens while the group before it runs)
        return in_groups(groups, pairs, check, lambda grp: ahead.open(
            lambda: built(grp),
            lambda check_model, big: open_session(ort, check_model, big, file_route=takes_file_route(big), light=True)))


def _check_session(ort, g: Graph, pairs, mask_names, prepack: bool, inputs: InputSets, start: Cut | None = None,
                   light: bool = False, opening: Opening | None = None):
    """An onnxruntime session of the check model, its pattern inputs and the values it is fed instead of
    computing them (per input set, see rnnfuse.upstream), or the ValidationResult that says which side
    onnxruntime cannot load (the original model, or the rewrite). ``start``: where it starts, when found;
    ``light``: without graph optimizations whatever its size (a group of a big check's parts); ``opening``:
    that session, light, already being opened from ``start`` (what building or opening it raised is raised
    here, and answered alike)."""
    try:
        if opening is not None:
            sess, pattern_inputs = opening.result()
            return sess, pattern_inputs, start.given
        if start is None:
            start = _cut(ort, g, pairs, mask_names, prepack, inputs)
        check, pattern_inputs, big = build_check_model(g, pairs, mask_names, start)
        # a big check model runs first without graph optimizations, as small step checks do (a failure is
        # checked again as deployed): onnxruntime's optimizers cost more than linear time in the nodes (a
        # 100k-node model of 5,400 one-step LSTMs, torch's nn.LSTM called per step: minutes to load), and
        # they optimize every Loop body too (1,600 stacked Loops and their RNNs: 2.0 s to load, 0.9 s without)
        light = not prepack and (light or len(check.graph.node) > LIGHT_CHECK_NODES or nodes_within(check.graph) > LIGHT_CHECK_NODES)
        sess = open_session(ort, check, big, prepack=prepack, file_route=takes_file_route(big), light=light)
        return sess, pattern_inputs, start.given
    except _Skip as s:
        return ValidationResult(False, str(s))
    except OSError as e:  # (the file route's temporary directory)
        return ValidationResult(False, f"cannot write the check model's weights to a temporary directory ({first_line(e)})")
    except Exception as e:  # is it the original that onnxruntime cannot load, or the rewrite?
        return failed_run(e, pairs, lambda: _original_runs(ort, g, pairs, mask_names, prepack),
                          "onnxruntime cannot run the original model", "the rewritten graph does not load in onnxruntime")


def _original_runs(ort, g: Graph, pairs, masks, prepack: bool, feeds: dict | None = None) -> bool:
    """Whether the check model of the original tensors alone loads (and runs on ``feeds``, their inputs' part).
    Taken as True when it holds a node this round rewrote in place (a step's mask made to read its slice of
    the whole mask, Graph.rewrite_many_in_place): the original tensors then read what a rewrite built, and
    their failing says nothing of the input model (a rewrite onnxruntime could not run was applied, its
    validation skipped)."""
    try:
        check, _, big = build_check_model(g, [(a, a) for a, _ in pairs], sorted(masks))
        in_place = g.__dict__.get("in_place")
        if in_place:
            rebuilt = {o for n in g.nodes if id(n) in in_place for o in n.output if o}
            if any(o in rebuilt for n in check.graph.node for o in n.output):
                return True
        sess = open_session(ort, check, big, prepack=prepack, file_route=takes_file_route(big))
        if feeds is not None:
            sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    except Exception:
        return False
    return True


def _longest_extent(g: Graph, masks) -> int:
    """The longest static extent of ``masks`` along their first two axes (0: none)."""
    return max([0] + [d for m in masks for d in ((g.model.shape(m) or []) + [None, None])[:2] if isinstance(d, int)])


def _mask_shapes(g: Graph, sess, out_names, feeds: dict, pattern_inputs: dict, longest: int | None, size: int,
                 failed):
    """Each overridden mask's [T, B], learned by one run with all-true patterns larger than any mask (or
    the ValidationResult of a failed run): each axis as long as the mask's static extent along it, or the
    generated sizes' bound along a named (symbolic) one; an unknown one as long as the longest static extent
    of any mask (a static T of 200,000 made every pattern square: 37 GiB): ``longest``, when the check is a group
    of a bigger one's parts (rnnfuse.check_groups), else found here."""
    least = 4 * size + 64
    leads = {mname: ((g.model.shape(mname) or [None, None]) + [None, None])[:2] for mname in pattern_inputs}
    longest = max(least, _longest_extent(g, pattern_inputs) if longest is None else longest)
    for mname, pname in pattern_inputs.items():
        sizes = [max(least, d) if isinstance(d, int) else least if isinstance(d, str) else longest for d in leads[mname]]
        feeds[pname] = np.ones(sizes, dtype=bool)
    try:
        outs = sess.run(None, feeds)
    except Exception as e:
        return failed(e, feeds)
    vals = dict(zip(out_names, outs))
    return {mname: tuple(int(v) for v in vals[f"__rnnfuse_mask_{k}/shape2"]) for k, mname in enumerate(pattern_inputs)}
