"""Dynamic-shape transformers exported by torch's tracer, for the cost benchmark (benchmarks/scaling.py): the
modules of ``tests/exporters/transformer_cases.py`` sized to a node count. Every block assembles its Reshapes'
targets from the scalars of a ``Shape`` (``view(B, T, H, d)``), thousands of small nodes a pass must walk past.

* ``transformer``: an embedding, ``nn.LSTM`` (a native LSTM already), then blocks (~103 nodes each): nothing
  to fuse, the file comes out as it went in.
* ``celltransformer``: a loop over ``nn.LSTMCell`` (~20 nodes a step) holding about 40% of the nodes, its steps
  stacked into blocks: one LSTM, the blocks as they were.

Each is ``f(path, nodes) -> nodes written``. The export takes ~50 s at 100,000 nodes (more on a loaded machine).
"""

from __future__ import annotations

import os
import sys

EXPORTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "exporters")
NODES_PER_BLOCK = 103
NODES_PER_STEP = 20


def _cases():
    sys.path.insert(0, EXPORTERS)
    try:
        import transformer_cases
    finally:
        sys.path.remove(EXPORTERS)
    return transformer_cases


def _written(path: str) -> int:
    import onnx

    return len(onnx.load(path, load_external_data=False).graph.node)


def transformer_after_lstm(path: str, nodes: int) -> int:
    import torch

    tc = _cases()
    tc.BLOCKS = max(1, nodes // NODES_PER_BLOCK)
    torch.manual_seed(0)
    module = tc.modules()[0]().eval()
    tc.export(module, (torch.randint(0, tc.VOCAB, (2, 7)),), ["tokens"], ["logits"],
               {"tokens": {0: "B", 1: "T"}, "logits": {0: "B", 1: "T"}}, path)
    return _written(path)


def transformer_after_cell_loop(path: str, nodes: int) -> int:
    import torch

    tc = _cases()
    tc.STEPS = max(2, int(0.4 * nodes) // NODES_PER_STEP)
    tc.BLOCKS = max(1, (nodes - tc.STEPS * NODES_PER_STEP) // NODES_PER_BLOCK)
    torch.manual_seed(0)
    module = tc.modules()[1]().eval()
    tc.export(module, (torch.randn(2, tc.STEPS, tc.FEATURES),), ["x"], ["y", "h"],
               {"x": {0: "B"}, "y": {0: "B"}, "h": {0: "B"}}, path)
    return _written(path)
