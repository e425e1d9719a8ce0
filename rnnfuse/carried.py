"""Values a Loop or Scan body carries from one iteration to the next unchanged (jax2onnx threads every weight
and the scanned sequence through the Loop so, tf2onnx the lengths and ``range/delta``): loop invariants, read
as the outer value that initialises them."""

from __future__ import annotations

from .graph import Graph


def loop_invariant_init(body: Graph, name: str) -> str | None:
    """If ``name`` is a Loop body input carried through unchanged, the Loop input that initialises it."""
    loop = body.owner
    ins = body.input_names
    if name not in ins:
        return None
    k = ins.index(name)
    if k < 2:
        return None
    outs = body.output_names
    if k - 1 >= len(outs):
        return None
    if not carried_unchanged(body, outs[k - 1], name):
        return None
    return loop.input[k] if k < len(loop.input) else None


def carried_unchanged(body: Graph, out: str, inp: str) -> bool:
    """Whether the body output ``out`` is the body input ``inp`` itself, through Identity nodes only: a value
    a Loop or Scan passes on unchanged from one step to the next."""
    while out != inp:
        p = body.producer.get(out)
        if p is None or p.op_type != "Identity":
            return False
        out = p.input[0]
    return True
