"""A scope-aware, linear-time view of an ONNX graph that rewrites can edit (the names passes import).

rnnfuse works on the ``ModelProto`` directly (no import/export round trip): every pass sees the same
``Model`` object, whose graphs keep producer and consumer maps that are built once and updated on each edit.
Subgraph bodies (Loop, Scan, If) are graphs of their own with a ``parent``; names they capture from outer
scopes count as uses of the capturing node, so dead-code removal and use-replacement stay correct.

Edits never re-sort the node list; :meth:`Graph.finalize` does one stable topological sort, removes dead
nodes and unused initializers, and writes the result back into the proto.

This module only gathers the public names; each idea lives in its own module:

- :mod:`rnnfuse.graph_index`: one scope's producer/consumer maps and the queries on them (``GraphIndex``:
  uses, scopes, constant values);
- :mod:`rnnfuse.graph_edit`: ``Graph``, the index plus edits (add, remove, replace uses), prune, finalize
  and the stable topological sort;
- :mod:`rnnfuse.model`: ``Model``, the proto with its opsets, fresh names, tensor types and weight data;
- :mod:`rnnfuse.tensor_types`: declared and inferred element types and shapes;
- :mod:`rnnfuse.naming`: fresh names;
- :mod:`rnnfuse.tensor_values`: a tensor's values read from its bytes, a Constant's without the fold;
- :mod:`rnnfuse.protos`: proto utilities (attributes, subgraphs, captured names, external data).
"""

from __future__ import annotations

from .graph_edit import Graph
from .graph_index import GraphIndex
from .model import Model
from .naming import NameAllocator
from .protos import attr, has_subgraph, rename_free, set_external, subgraphs
from .tensor_types import CHEAP_INFERENCE_NODES, declared_types, infer_types

__all__ = [
    "CHEAP_INFERENCE_NODES",
    "Graph",
    "GraphIndex",
    "Model",
    "NameAllocator",
    "attr",
    "declared_types",
    "has_subgraph",
    "infer_types",
    "rename_free",
    "set_external",
    "subgraphs",
]
