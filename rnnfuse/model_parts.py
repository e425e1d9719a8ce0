"""A part of a model as a model of its own: what the do-no-harm guard hands onnxruntime and the checker
instead of a whole big model (the changed region, rnnfuse.changed_region; consecutive pieces,
rnnfuse.load_in_pieces). A part holds some of the model's nodes in its frame (IR version, opsets,
functions); what it reads from outside becomes its inputs, copied initializers or copied Constant nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx
from onnx import ModelProto, NodeProto

from .protos import call_key, has_subgraph, subgraphs

if TYPE_CHECKING:
    from .changed_region import NodeScan


def part_model(whole: ModelProto, name: str, nodes: list[NodeProto], functions: "LocalFunctions | None" = None) -> ModelProto:
    """A model of ``nodes`` with ``whole``'s IR version, opsets and functions: those ``nodes`` need when
    ``functions`` (``whole``'s) is given, else all (its graph's interface is the caller's to fill in)."""
    m = ModelProto(ir_version=whole.ir_version)
    m.opset_import.extend(whole.opset_import)
    m.functions.extend(whole.functions if functions is None else functions.needed_by(nodes))
    m.graph.name = name
    m.graph.node.extend(nodes)
    return m


class LocalFunctions:
    """A model's local functions, and which of them some of its nodes need: those the nodes call (in their
    subgraphs too) and those these call in turn. A part of the model copies only those: 100 pieces of a model
    of 5,000 functions each copying all made the pieces' load quadratic."""

    def __init__(self, functions):
        self.functions = list(functions)
        self.place = {(f.domain, f.name, f.overload): i for i, f in enumerate(self.functions)}

    def needed_by(self, nodes) -> list:
        """The functions ``nodes`` need, in the model's order."""
        if not self.place:
            return []
        found: set[int] = set()
        stack = [nodes]
        while stack:
            for n in stack.pop():
                k = self.place.get(call_key(n))
                if k is not None and k not in found:
                    found.add(k)
                    stack.append(self.functions[k].node)
                if has_subgraph(n):
                    stack.extend(sg.node for sg in subgraphs(n))
        return [self.functions[k] for k in sorted(found)]


def split_constants(scan: NodeScan, read: list[str]) -> tuple[list[NodeProto], list[str]]:
    """The Constant nodes producing names of ``read``, and the other names. onnxruntime makes a Constant an
    initializer, which a kernel may check when it is built (a Resize's scales): a part of the model reading
    one is given the node, not a typed input that hides its value."""
    constants, rest = [], []
    for name in read:
        n = scan.nodes[scan.producer[name]] if name in scan.producer else None
        if n is not None and n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            constants.append(n)
        else:
            rest.append(name)
    return constants, rest


class Frame:
    """What a part of a model copies from the whole graph, by name: initializers, graph inputs and outputs,
    declared value types."""

    def __init__(self, g: onnx.GraphProto):
        self.initializers = {t.name: t for t in g.initializer}
        self.inputs = {v.name: v for v in g.input}
        self.outputs = {v.name: v for v in g.output}
        self.declared = {v.name: v for v in g.value_info}

    def declare_reads(self, sub: onnx.GraphProto, read: list[str], types) -> None:
        """Make ``read``, what a part of the model reads from outside it, the inputs of its graph ``sub``: a
        graph input as declared (one with a default stays an input beside its initializer: its value is not a
        constant), an initializer copied, any other value a typed input (``types``, name -> serialised type,
        holds them all)."""
        for name in read:
            if name in self.inputs:
                sub.input.add().CopyFrom(self.inputs[name])
            if name in self.initializers:
                sub.initializer.add().CopyFrom(self.initializers[name])
            elif name not in self.inputs:
                vi = sub.input.add()
                vi.name = name
                vi.type.ParseFromString(types[name])
