"""New weights of a graph scope, for :class:`rnnfuse.graph_edit.Graph`: held in the proto (the graph's own
message is the one indexed), or written block by block to a spill file and kept external, so that a fused
layer of big weights is never held in memory whole."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from .protos import set_external


class Weights:
    """Mixed into :class:`~rnnfuse.graph_edit.Graph`."""

    def add_initializer(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        a = np.asarray(array)
        t = numpy_helper.from_array(a if a.flags.c_contiguous else a.copy(order="C"), name)
        self.proto.initializer.append(t)  # (a copy: the graph's own message is the one indexed, the first is freed)
        self.initializers[name] = self.proto.initializer[-1]
        self._arrays[name] = array
        return name

    def add_spilled_initializer(self, parts: list, shape: tuple, dtype, hint: str) -> str:
        """An initializer of ``shape`` whose data is the concatenation of ``parts`` (in C order), written
        block by block to a spill file and kept external."""
        import atexit
        import os
        import shutil
        import tempfile

        spill = self.model.facts.spill_dir
        if spill is None:
            spill = tempfile.mkdtemp(prefix="rnnfuse-spill-")
            atexit.register(shutil.rmtree, spill, True)
            self.model.facts.spill_dir = spill
        name = self.fresh(hint)
        path = os.path.join(spill, f"{len(os.listdir(spill))}.bin")
        # written one block of rows at a time, so no copy of the whole tensor is ever held in memory
        with open(path, "wb") as f:
            for p in parts:
                q = p if p.ndim <= 2 else p.reshape(-1, p.shape[-1])
                block = max(1, (32 << 20) // max(1, int(np.prod(q.shape[1:])) * np.dtype(dtype).itemsize))
                for r in range(0, int(q.shape[0]), block):
                    f.write(np.ascontiguousarray(q[r : r + block], dtype=dtype).tobytes())
                    self.model.release_pages()
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        t.dims.extend(shape)
        set_external(t, path, 0, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.proto.initializer.append(t)
        self.initializers[name] = t
        return name
