"""The proof that a Loop runs exactly once per time step (its trip count and its condition, read against x's
time length), and why a carried integer that is not the step counter stops a fusion."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto

from rnnfuse.dims import condition_bounds, dim_key, time_dim_key, time_keys
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph, attr
from rnnfuse.index_terms import terms
from .loop_extents import size_keys, unflipped
from .loop_reads import counter_step


def integer_carry_reason(name: str, type_name: str, step: tuple[str, int] | None, start: float | None) -> str:
    """Why the carried integer ``name`` is neither the loop's counter nor a value it carries unchanged (``step``:
    what :func:`counter_step` read of its update; ``start``: its initial value when a constant)."""
    what = f"carried value '{name}' of type {type_name}"
    if step is not None and step[0] == name and step[1] != 1:
        return f"{what} adds {step[1]} a step: only a counter that adds 1 is read as the step's index"
    if step is not None and step[0] == name and (start is None or not float(start).is_integer()):
        return f"{what} counts from a start that is not a constant integer"
    return f"{what} is no counter (adding 1 a step) and not carried unchanged: the cell would read it"


def _torchscript_range(g: Graph, M: str) -> tuple[str, str, float] | None:
    """(stop, start, step) when ``M`` is the element count TorchScript computes for ``range(start, stop,
    step)``, ``Cast(Ceil(Cast(stop - start) / step))``, with a constant scalar step; else None."""
    name, chain = M, []
    for op in ("Cast", "Ceil", "Div", "Cast", "Sub"):
        n = g.producer.get(name)
        if n is None or n.op_type != op or not n.input:
            return None
        chain.append(n)
        name = n.input[0]
    div, sub = chain[2], chain[4]
    step = g.const(div.input[1]) if len(div.input) > 1 else None
    if step is None or np.size(step) != 1 or len(sub.input) != 2:
        return None
    return sub.input[0], sub.input[1], float(np.ravel(step)[0])


def _range_count(g: Graph, M: str, T_keys: set):
    """T's key when ``M`` is the element count TorchScript computes for ``range(T - 1, -1, -1)``,
    ``Cast(Ceil(Cast(-1 - (T - 1)) / -1))``; else None."""
    r = _torchscript_range(g, M)
    if r is None or r[2] != -1.0:
        return None
    stop, start = g.const(r[0]), g.producer.get(r[1])
    if stop is None or np.size(stop) != 1 or int(np.ravel(stop)[0]) != -1 or start is None or start.op_type != "Sub":
        return None
    one, T = g.const(start.input[1]), dim_key(g, start.input[0])
    if one is None or np.size(one) != 1 or int(np.ravel(one)[0]) != 1 or T not in T_keys:
        return None
    return T


def _range_length(g: Graph, M: str, is_T) -> int | None:
    """d when ``M`` is the element count TorchScript computes for ``range(start, stop)`` (step 1) and
    ``stop - start`` is T + d (T: x's time length, ``is_T``); else None. ``range(1, T)`` runs T - 1
    iterations, ``range(1, T + 1)`` T."""
    r = _torchscript_range(g, M)
    if r is None or r[2] != 1.0:
        return None
    stop, start = terms(g, r[0]), terms(g, r[1])
    if stop is None or start is None or len(stop) != 1 or len(start) != 1 or start[0][0] != "c":
        return None
    if stop[0][0] != "d" or not is_T(stop[0][1]):
        return None
    return stop[0][2] - start[0][1]


def _time_length_test(g: Graph, T_keys: set):
    """Whether a size key is x's time length: one of ``T_keys``, or an axis of another tensor that the model
    declares by the same name (a loop counting x.size(0) may step z, declared [time, B, F] too; not another
    axis of x itself, which a file declaring [N, N, F] would make "equal" to T)."""
    named = set().union(*(size_keys(g, key) for key in T_keys)) - T_keys - {None}
    roots = {key[1] for key in T_keys if key is not None and key[0] == "dim"}

    def is_T(key) -> bool:
        if key in T_keys:
            return True
        return key is not None and key[0] == "dim" and key[1] not in roots and bool(size_keys(g, key) & named)

    return is_T


def check_trip_count(g: Graph, body: Graph, loop: NodeProto, x: str, index_syms: dict[str, int], axis: int = 0,
                     invariants: dict[str, str] | None = None, offset: int = 0, counted_ok: bool = False) -> str | None:
    """Prove the loop runs exactly T - ``offset`` iterations (T: x's size on ``axis``; the body reads x from
    step ``offset`` on), or Decline.

    ``index_syms`` maps body names holding the iteration number to their offset (0 for the iteration input
    and counters starting at 0); ``invariants`` the values the loop carries through unchanged. Each bound
    found (the trip count, the condition) gives the iterations it allows as T + delta.

    ``counted_ok``: the body reads x only where a read past its last step fails (a Gather of one step), so a
    trip count that is some runtime integer M (TorchScript's ``range(n)``, ``range(x.size(0) - k)``) runs
    over steps ``offset .. offset + M - 1`` of x: the loop's maths wherever the original runs at all. Then M
    is returned (when the condition allows every step) and the recurrence runs over those steps only."""
    # (a time flip keeps the length: torch.flip(x, [1])[:, t] in a loop over x.size(1) counts the unflipped x)
    T_keys = time_keys(g, x, axis)
    source = unflipped(g, x, axis)
    if source != x:  # (asked once where x is its own source, as mostly: a walk to its root dimension each)
        T_keys |= time_keys(g, source, axis)
    T = next((k for k in T_keys if k[0] == "const"), None) or time_dim_key(g, x, axis)
    is_T = _time_length_test(g, T_keys)
    deltas: list[int] = []
    counted = None  # a runtime trip count the loop runs over (see counted_ok)
    M = loop.input[0] if loop.input else ""
    if M:
        k = dim_key(g, M) or _range_count(g, M, T_keys)
        written = _range_length(g, M, is_T) if k is None else None
        if k is None and written is None:  # T + d written out (T - 1: a loop over x[1:])
            ts = terms(g, M)
            if ts is not None and len(ts) == 1 and ts[0][0] == "d" and is_T(ts[0][1]):
                written = ts[0][2]
        if is_T(k) or (k is not None and k[0] == "min" and all(is_T(one) for one in k[1:])):
            deltas.append(0)  # (the least of several sizes, each T: zip(x.unbind(1), mask.unbind(1)))
        elif written is not None:
            deltas.append(written)  # (T + d iterations: range(start, stop), T - 1 written out)
        elif offset and k is not None and k[0] == "const" and T[0] == "const" and k[1] - T[1] == -offset:
            deltas.append(-offset)  # (a static length, the loop starting at step offset)
        elif k is not None and k[0] == "const" and (k[1] >= 2**31 - 1 or (T[0] == "const" and k[1] >= T[1])):
            pass  # a bound at least T: the condition decides
        elif k is not None and k[0] == "const":
            raise Decline(f"the loop runs at most {k[1]} iterations, not once per time step")
        elif counted_ok and g.model.elem_type(M) in (TensorProto.INT64, TensorProto.INT32):
            counted = M
        else:
            raise Decline("cannot prove the trip count equals the number of time steps")
    for bound in condition_bounds(body, body.output_names[0], true=body.input_names[1]):
        if bound is None:
            raise Decline("the loop condition is not a bound on the iteration number")
        a, b = bound
        cs = counter_step(body, a, invariants)
        if cs is None or cs[0] not in index_syms:
            raise Decline(_condition_reason(body, a))
        k = index_syms[cs[0]] + cs[1]  # the compared value is i + k
        if not is_T(dim_key(body, b)):
            raise Decline("the loop condition's bound is not the number of time steps")
        deltas.append(1 - k)
    if counted is not None:
        if deltas and min(deltas) < -offset:  # (the condition must leave the count alone: every step allowed)
            raise Decline("the loop's condition stops it before its trip count from a runtime value")
    elif not deltas:
        raise Decline("the loop has no bound")
    elif min(deltas) != -offset:
        raise Decline("the loop does not run exactly once per time step" if not offset else
                      f"the loop does not run exactly once per time step from step {offset}")
    # the first iteration must run whenever T >= offset + 1
    cond0 = loop.input[1] if len(loop.input) > 1 else ""
    for bound in condition_bounds(g, cond0) if cond0 else []:
        if bound is None or dim_key(g, bound[0]) != ("const", offset) or not is_T(dim_key(g, bound[1])):
            raise Decline("cannot prove the loop's first iteration runs")
    return counted


def _condition_reason(body: Graph, compared: str) -> str:
    """Why the loop condition's compared value is no iteration number: a cast of one to a type that does not hold
    every step count (a model converted to float16 compares the counter so), or something else."""
    n = body.producer.get(compared)
    if n is not None and n.op_type == "Cast" and attr(n, "to") not in (TensorProto.INT32, TensorProto.INT64,
                                                                       TensorProto.FLOAT, TensorProto.DOUBLE):
        return (f"the loop condition compares a cast to {TensorProto.DataType.Name(attr(n, 'to'))}, which does not hold "
                "every step count (a counter so cast is not the iteration number past its range)")
    return "the loop condition compares something other than the iteration number"
