"""Unrolled-chain front end: one cell per time step, written out (torch trace/dynamo, Keras unroll=True).

1. **Families.** Step inputs are slices of one tensor at constant indices: ``Gather(S, t)``,
   ``Squeeze(Slice(S, t, t+1))``, ``Squeeze(Split(S)[t])`` along a time axis.
2. **Intervals.** For every tensor, the lowest and highest step index whose input it depends on (one
   topological pass). A forward chain's step t computes values whose interval ends at t, a backward
   chain's values whose interval starts at t.
3. **Threading.** A step's *combining* nodes mix its input with something older; walking that something back
   through weight matmuls and slices finds the carried state h. A state of step t whose interval ends at
   t-1 links step t-1 -> t (forward); one starting at t+1 links t+1 -> t (backward).
4. **One cell, every step.** A middle step is evaluated symbolically (its h as a State leaf; any other value
   from an earlier step, like the LSTM cell state, becomes a State leaf of its own) and recognised; then
   *every* step must compute exactly the same polynomials (the first step may see a zero initial state that
   the exporter folded into constants: it must equal the cell with that state at zero).
5. **Masks.** Slices of a bool tensor taken at the same steps (Keras' mask, per step) are interval leaves
   too, so a step's masked selects belong to it; the states then go through the same analysis as a loop
   body's (``m * new + (1 - m) * old`` in any spelling; zero-filled or carried outputs).
6. **Carried outputs.** A value a step computes from its cell's values beyond h and c (Keras' previous
   output, carried next to the state for masking) becomes a third state, ``y``.
7. **Outputs.** Per-step values stacked with ``Unsqueeze`` + ``Concat`` become sequence outputs, the last
   step's values the final states. Anything else read outside the chain declines it.
8. **Other step inputs.** Steps reading other state-independent values than one tensor's slices in time
   order (``2 * x[t]``, ``x[t] - x[t-1]``, every other step, a permutation) are threaded through their cells;
   their inputs stacked are the sequence. A chain whose first step is another cell is fused from its second.

Modules, in the order they run: :mod:`.families` (1, 5), :mod:`.chains` (2, 3), :mod:`.step_eval` (one step
as a region), :mod:`.roles` (4, 6), :mod:`.outputs` (7), :mod:`.step_inputs` (8), :mod:`.rule` (the pass). Generic dataflow queries
live in :mod:`rnnfuse.dataflow`, structural signatures in :mod:`rnnfuse.signature`.
"""

from .rule import FuseChains

__all__ = ["FuseChains"]
