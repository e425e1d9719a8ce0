"""Facts about one model that passes compute once and later passes read, in typed fields.

One :class:`ModelFacts` lives on each :class:`~rnnfuse.graph.Model` (``model.facts``) and carries over to the
next round of passes (tensor names are never reused, so what is known about a name stays true).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelFacts:
    # dataflow queries (rnnfuse.dataflow), memoised per tensor name
    shape_derived: dict = field(default_factory=dict)  # tensor -> computed from shapes and constants only
    runtime: set | None = None  # main-graph tensors computed from input values (rnnfuse.dataflow.runtime_values)
    given: set | None = None  # non-zero broadcast constants and what they compute (rnnfuse.dataflow.given_constants)
    lead: dict = field(default_factory=dict)  # tensor -> leading unit axes of a [*, B, N] value (or None)
    # ("d", tensor) -> its dims as its ops fix them, ("v", shape tensor) -> its values (rnnfuse.op_shapes)
    op_shapes: dict = field(default_factory=dict)
    # tensor -> its element type as its ops fix it (rnnfuse.elem_types)
    elem_types: dict = field(default_factory=dict)
    # constants named by their bytes (rnnfuse.symbolic.content_key): per-step copies of one weight share a key
    content_keys: dict = field(default_factory=dict)
    # what the emitter built, for the passes after it
    seq_lens_mask: dict = field(default_factory=dict)  # sequence_lens tensor -> the mask it was computed from
    compactions: dict = field(default_factory=dict)  # compacted input -> (input, [T, B] mask, original mask)
    uncompactions: dict = field(default_factory=dict)  # scattered-back output -> (compacted Y, [T, B] mask)
    spill_dir: str | None = None  # where large new initializers are written as external data
    # content digest -> the initializer an emitted weight was written to (rnnfuse.builder.Builder._weight)
    emitted_weights: dict = field(default_factory=dict)
    # passes/dedupe.Dedupe: (the graph's edit list, how much of it was already deduplicated)
    dedupe_mark: tuple | None = None
    # rnnfuse.mask_proof: digest of a proof's model and value sets -> its verdict (None: the masks agree)
    mask_proofs: dict = field(default_factory=dict)
    # validation's kept values of shared upstreams (rnnfuse.upstream.KeptValues), keyed by what computes them
    upstream_values: object | None = None
    # Loop / Scan declines kept for the next round, and what the last round's edits defined and read
    # (rnnfuse.kept_declines)
    kept_declines: object | None = None
    round_edits: object | None = None
