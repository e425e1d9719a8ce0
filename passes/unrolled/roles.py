"""Role assignment: which tensors of each step are the hidden state h, the cell state c and an extra carried
output y, proven the same cell at every step; the result is a :class:`~rnnfuse.recurrence.Recurrence`.

Roles: ``h`` is read through the recurrent weights; ``c`` is the other value a step computes and the next reads
(LSTM); ``y`` an extra carried value (Keras' previous output). A step may read one mask slice: states then select.

A middle step is the reference, evaluated symbolically and recognised; every other step must have its structural
signature, or else the same polynomials (a first step whose zero initial state was folded: the cell at that zero).
"""

from __future__ import annotations

from rnnfuse.dataflow import lead_of, shape_derived
from rnnfuse.dims import extent_key, static_dim, untransposed
from rnnfuse.errors import Decline
from rnnfuse.graph import Graph
from rnnfuse.inputs import input_projection, projected_leaf, reading_projections
from rnnfuse.recurrence import CARRY, NONE, CellCheck, FinalOutput, Init, InputPrep, Recurrence, StepRead
from rnnfuse.signature import Signer
from rnnfuse.step import StepAnalysis, StepOut, StepState, analyse
from rnnfuse.symbolic import Poly, StepInput, SymTensor, zero_states
from rnnfuse.zeroed_outputs import zeroed_by_mask, zeroed_products

from .chains import Chain
from .families import StepMask
from .family_filter import layout_decline
from .outputs import (Escapes, FirstValueIsState, LastStepUnused, chain_outputs, extra_values, find_symbolic, inputs_of, mask_values, series_leads,
                      order_of, reads_state, split_first_value, step_output, value_lead)
from .step_eval import C_STATE, H_STATE, Y_STATE, Foreign, StepEval, allowed_fn, fed_through, same_at_zero_state


class FirstStepDiffers(Decline):
    """The chain's first step is not its cell (with the chain's initial state): the rest may still be one."""


def chain_recurrence(g: Graph, src: str, axis: int, chain: Chain, iv, signer: Signer, mask_srcs: dict | None = None,
                     made: list | None = None) -> Recurrence:
    """The recurrence an unrolled chain computes (Decline with the reason when it is not one native cell).
    ``made`` (a list) holds the last recognition tried, what it found (see :mod:`.recomputed`)."""
    made = [] if made is None else made
    def recognise() -> Recurrence:
        made[:] = [_ChainRoles(g, src, axis, chain, iv, signer, mask_srcs)]  # (one held: their memos are big)
        return made[-1].recurrence()
    return reading_projections(recognise)


class _ChainRoles:
    """The steps of :func:`chain_recurrence`, in order, sharing what each finds.

    Per step k: ``h_in[k]`` the hidden state it reads, ``h_new[k]`` / ``c_new[k]`` / ``ys[k]`` the values it
    computes, ``leaves[k]`` its inputs by role, ``allowed[k]`` which nodes are its own, ``foreign[k]`` the
    other older value it reads (c). ``km`` is the reference step, ``last`` the last one."""

    def __init__(self, g: Graph, src: str, axis: int, chain: Chain, iv, signer: Signer, mask_srcs: dict | None):
        self.g, self.src, self.axis, self.chain, self.iv, self.signer = g, src, axis, chain, iv, signer
        self.mask_srcs, self.zeroed = mask_srcs or {}, {}  # (zeroed: outputs read as a product, see analyse)
        self.steps, self.n, self.ts = chain.steps, len(chain.steps), [s.t for s in chain.steps]
        self.chain_nodes: set[int] = set()
        self.memos: dict[int, tuple] = {}  # step -> (its leaves, the signatures of its tensors so far)
        self.undo = None  # reverts the one edit recognition may make (split_first_value)

    def recurrence(self) -> Recurrence:
        try:
            return self.roles()
        except Decline:
            if self.undo is not None:
                self.undo()  # (a declined chain leaves the graph as it found it)
            raise

    def roles(self) -> Recurrence:
        self.check_layout()
        self.step_input()
        self.thread_hidden_state()
        self.find_cell_state()
        self.reference_step()
        self.complete_cell_state()
        self.carried_output()
        self.zero_initial_states()
        self.memos.clear()
        an = self.analyse()
        self.check_every_step()
        rec = self.build(an)
        self.add_cell_checks(rec, an)  # (a carried output's select is proven as a masked h's: the cell is checked)
        return rec

    def sign(self, name: str, k: int) -> int:
        # one memo per step while its leaves stay the same: signing c after h (and y after both) walks only
        # what h's walk did not reach, not the step again
        memo = self.memos.get(k)
        if memo is None or memo[0] is not self.leaves[k]:
            memo = self.memos[k] = (self.leaves[k], {})
        return self.signer.sign(name, self.leaves[k], self.allowed[k], self.foreign[k], self.chain_nodes, memo=memo[1],
                                given=self.chain.given)

    def add_leaves(self, k: int, extra: dict) -> None:
        """Step k reads ``extra`` as leaves too. Its memo stays when it holds none of them: a walk memoises
        every tensor it meets, so no signature in it read them (a Keras step's y walk then stops where h's went)."""
        memo = self.memos.pop(k, None)
        self.leaves[k] = {**self.leaves[k], **extra}
        if memo is not None and not any(v in memo[1] for v in extra):
            self.memos[k] = (self.leaves[k], memo[1])

    def keep_memo(self, k: int, names) -> None:
        """Keep only these names' signatures in step k's memo."""
        if (memo := self.memos.get(k)) is not None:
            self.memos[k] = (memo[0], {x: memo[1][x] for x in names if x is not None and x in memo[1]})

    def step_output(self, k: int, op_type: str, ref: int, ref_name: str) -> str | None:
        reads_h = reads_state(self.g, ref_name, self.leaves[self.km], self.allowed[self.km])  # (ref_name: step km's)
        return step_output(self.g, self.chain, k, self.iv, self.signer, self.leaves[k], self.allowed[k], op_type, ref, reads_h)

    def older_reads(self, k: int) -> set[str]:
        """Values of step k-1 that step k's own nodes read, other than its hidden state."""
        end = 1 if self.chain.direction == "forward" else 0  # the interval end that names a value's step
        t, t_prev, iv = self.ts[k], self.ts[k - 1], self.iv
        out = set()
        for name, _ in iv.in_order(end, t, self.steps[k].lane_nodes):
            p = self.g.producer.get(name)
            if p is None or not self.allowed[k](p):
                continue
            out.update(i for i in p.input if i and i != self.h_in[k] and iv.get(i) is not None and iv[i][end] == t_prev)
        # (h @ R and other values of h alone belong to step k although they end at step k-1)
        return {i for i in out if i not in self.g.producer or not self.allowed[k](self.g.producer[i])}

    # ---- the steps
    def check_layout(self) -> None:
        if (reason := layout_decline(self.g, self.src, self.axis)) is not None:
            raise Decline(reason)
        if sorted(self.ts) != list(range(min(self.ts), max(self.ts) + 1)):
            raise Decline("the chain skips time steps")

    def step_input(self) -> None:
        """The step input's leaf: x itself, or x @ K + b when the chain reads a projection computed outside it."""
        self.proj = input_projection(self.g, self.src, self.axis)
        if self.proj is not None and self.proj.time_axis != self.axis:
            self.proj = None  # (a projection transposed after the matmul: the chain reads it as computed)
        self.x_value = None
        if self.proj is not None:
            self.x_atom, self.x_value = projected_leaf(self.proj)
        else:
            self.x_atom = StepInput("x", static_dim(self.g, self.src, 2))

    def thread_hidden_state(self) -> None:
        """h: the one value each step reads through the recurrent weights; the next step's h is this one's output."""
        g, steps, n = self.g, self.steps, self.n
        h_in: list[str | None] = [None] * n
        for k in range(1, n):
            h_in[k] = steps[k].hidden_state()
        if steps[0].weighted:  # (the first step may also combine its input with a given c0 or carried output)
            h_in[0] = steps[0].hidden_state(steps[0].weighted)
        # zeros (the exporter may have folded them into the first step) or a given initial state, even a
        # constant one (a learned h0 expanded to the batch; a fill in chain.given is one, as StepEval reads it)
        self.h0_fill = 0.0 if h_in[0] is not None and h_in[0] not in self.chain.given and g.fill_value(h_in[0]) == 0.0 else None
        self.h_in = h_in
        self.h_new: list[str | None] = [h_in[k + 1] for k in range(n - 1)] + [None]
        self.allowed = [allowed_fn(g, self.chain, k, self.iv) for k in range(n)]
        self.foreign = [Foreign(s.t, fed_through(g, h_in[k])) for k, s in enumerate(steps)]
        self.leaves = []
        for k, st in enumerate(steps):
            lv = {st.x: "x"}
            if h_in[k] is not None and not (k == 0 and self.h0_fill is not None):
                lv[h_in[k]] = "h"
            lv.update(st.masks)
            self.leaves.append(lv)
        self.sig_h: list[int | None] = [None] * n
        # A step's memo names every tensor its h walk met (24 names a step in a torch LSTMCell loop: 16 MB over
        # 6,000 steps); what is signed later from an unmasked step is its c (its h walk met it: it is what step
        # k+1 reads besides h) and values computed from h or c. Once step k+1 is signed, step k's memo keeps
        # just those two: the rest would only be walked again (the memo is a cache: signatures are the same).
        # A masked step's c is a select of what its h walk met: its memo is kept whole.
        trim = not any(st.masks for st in steps)
        for k in range(n - 1):
            self.sig_h[k] = self.sign(self.h_new[k], k)
            if trim and k > 0:
                self.keep_memo(k - 1, (self.h_new[k - 1], self.foreign[k].name))

    def find_cell_state(self) -> None:
        """c (LSTM): what step k reads besides h is what step k-1 computed."""
        n, foreign = self.n, self.foreign
        self.lstm = any(f.name is not None for f in foreign[1 : n - 1]) or (n == 2 and foreign[0].name is not None)
        self.c_new: list[str | None] = [None] * n
        if self.lstm:
            for k in range(1, n - 1):
                if foreign[k].name is None:
                    raise Decline(f"step {self.ts[k]} does not read the cell state")
                self.c_new[k - 1] = foreign[k].name
        if n == 2 and self.h_in[0] is None:
            raise Decline("a two-step chain with a folded initial state")
        self.km = 1 if n > 2 else 0
        self.last = n - 1

    def reference_step(self) -> None:
        """Evaluate the reference step km; find the last step's h (nothing after it reads it)."""
        g, km, last = self.g, self.km, self.last
        # the last step's h: the tensor with the reference step's structure; in a three-step LSTM chain it is
        # also what tells which value the reference step passes on as c
        self.h_new[last] = self.step_output(last, g.producer[self.h_new[last - 1]].op_type, self.sig_h[km], self.h_new[km])
        if self.h_new[last] is not None:
            self.sig_h[last] = self.sign(self.h_new[last], last)
            if self.lstm and km == last - 1:
                self.c_new[km] = self.foreign[last].name
        if self.lstm and km == last - 1 and self.c_new[km] is None:
            # the last step's h is dead (only Y_c read, or a masked Y whose carried h nothing reads): what it
            # reads of the step before, besides h, is the cell state
            older = self.older_reads(last)
            if len(older) == 1:
                self.c_new[km] = older.pop()
        self.mid = StepEval(g, self.chain, km, self.iv, self.h_in[km], self.x_atom, self.x_value)
        self.ref = {"h": self.mid.poly(self.h_new[km])}
        self.ref_sig = {"h": self.sig_h[km]}
        if self.lstm:
            if self.c_new[km] is None:
                raise Decline("the cell state's next value cannot be found")
            self.ref["c"] = self.mid.poly(self.c_new[km])
            self.ref_sig["c"] = self.sign(self.c_new[km], km)
        # the last step's outputs: same structure as the reference step's (they may be dead: Keras on torch
        # returns only the carried output, and the exporter drops the last state updates)
        if self.h_new[last] is None:
            e = StepEval(g, self.chain, last, self.iv, self.h_in[last], self.x_atom, self.x_value)
            self.h_new[last] = find_symbolic(g, e, self.chain, last, self.iv, g.producer[self.h_new[last - 1]].op_type, self.ref["h"],
                                             self.leaves[last], self.allowed[last],
                                             reads_state(g, self.h_new[km], self.leaves[km], self.allowed[km]))
            if self.h_new[last] is not None:
                self.sig_h[last] = self.sign(self.h_new[last], last)
        self.series: dict[str, list] = {"h": self.h_new}
        self.sigs: dict[str, list] = {"h": self.sig_h}

    def complete_cell_state(self) -> None:
        """The cell state the last step reads and computes (found by the reference step's signature)."""
        if not self.lstm:
            return
        g, n, last, c_new = self.g, self.n, self.last, self.c_new
        sig_c: list[int | None] = [None] * n
        if c_new[self.km] not in g.producer:  # (a model input read by every step beside h is no cell state)
            raise Decline(f"'{c_new[self.km]}', read as the cell state, is not computed by the steps")
        c_new[last - 1] = self.foreign[last].name or self.step_output(last - 1, g.producer[c_new[self.km]].op_type, self.ref_sig["c"], c_new[self.km])
        if c_new[last - 1] not in g.producer:  # (None included)
            raise Decline(f"step {self.ts[last]} does not read the cell state")
        c_new[last] = self.step_output(last, g.producer[c_new[last - 1]].op_type, self.ref_sig["c"], c_new[self.km])
        for k in range(n):
            if c_new[k] is not None:
                sig_c[k] = self.sign(c_new[k], k)
        self.series["c"], self.sigs["c"] = c_new, sig_c

    def carried_output(self) -> None:
        """y: the extra value computed from the cells' values outside h and c (Keras' previous output, carried
        from step to step, or a per-step value read only by a stack); y2: a second one beside a carried y
        (the output filled otherwise at masked steps)."""
        g, n, km, last, leaves = self.g, self.n, self.km, self.last, self.leaves
        self.mask_values = mask_values(g, self.chain)
        self.cell_found = True  # (each step's h and c known: what a recomputed read may copy, see .recomputed)
        self.escapes = Escapes(g, self.chain_nodes)
        states = {t for t in self.h_new + self.c_new if t}
        self.initial = {t for t in (self.h_in[0], self.foreign[0].name) if t}  # (what the first step is given)
        try:
            per_step = extra_values(g, self.chain, self.iv, self.escapes, states, self.mask_values, self.initial)
        except FirstValueIsState:
            self.undo = split_first_value(g, self.iv, [self.h_new[0], self.c_new[0]], self.chain_nodes)
            if self.undo is None:
                raise
            self.escapes = Escapes(g, self.chain_nodes)
            per_step = extra_values(g, self.chain, self.iv, self.escapes, states, self.mask_values, self.initial)
        self.ys, self.y_carried, self.y0 = None, False, None
        if per_step is None:
            return
        ys, other = self.extra_series(per_step)
        self.ys = ys
        self.y_carried = any(ys[k - 1] in inputs_of(g, ys[k], self.allowed[k], leaves[k]) for k in range(1, n) if ys[k] and ys[k - 1])
        if self.y_carried and km == 0:
            raise Decline("a two-step chain carrying an extra value")
        sig_y: list[int | None] = [None] * n
        if self.y_carried and ys[0] is not None:
            self.y0 = self.given_initial_output(ys[0])
            if self.y0 is not None:
                self.add_leaves(0, {self.y0: "y"})
        for k in range(n):
            if self.y_carried and k > 0:
                self.add_leaves(k, {ys[k - 1]: "y"})
            if ys[k] is None:  # the last step's value, not reached from its (dead) states
                ys[k] = self.step_output(k, g.producer[ys[k - 1]].op_type, sig_y[km], ys[km]) if k == last else None
                if ys[k] is None:
                    raise Decline(f"step {self.ts[k]}'s carried output cannot be found")
            sig_y[k] = self.sign(ys[k], k)
        if self.y_carried:
            self.mid.ev.memo[ys[km - 1]] = SymTensor(Poly.atom(Y_STATE), lead_of(g, ys[km - 1]) or 0)
        self.ref["y"] = self.mid.poly(ys[km])
        self.ref_sig["y"] = sig_y[km]
        self.series["y"], self.sigs["y"] = ys, sig_y
        if other is not None:
            self.uncarried_series("y2", other)

    def extra_series(self, per_step: list[list[str]]) -> tuple[list, list | None]:
        """The per-step extra values as series over the steps: (y, y2). One value a step is y; of two, y is
        the one that reads the other step's y (the carried output) and y2 the one that reads neither (a
        value of the last step nothing reads is None, found later by its signature)."""
        g, n = self.g, self.n
        if len(per_step[0]) == 1:
            return [vals[0] if vals else None for vals in per_step], None
        if len(per_step[0]) > 2:
            raise Decline(f"step {self.ts[0]} computes {len(per_step[0])} values beyond its states (expected at most two)")
        ys: list[str | None] = [None] * n
        other: list[str | None] = [None] * n
        for k in range(1, n):
            before = per_step[k - 1]
            fresh = []  # values of step k reading none of step k-1's
            for v in per_step[k]:
                read = [b for b in before if b in inputs_of(g, v, self.allowed[k], self.leaves[k])]
                if not read:
                    fresh.append(v)
                elif len(read) == 1 and ys[k] is None and ys[k - 1] in (None, read[0]):
                    ys[k], ys[k - 1] = v, read[0]
                else:
                    raise Decline(f"step {self.ts[k]} carries two values beside its states")
            if ys[k - 1] is None or len(fresh) > 1:
                raise Decline(f"the two values step {self.ts[k - 1]} computes beyond its states are not a carried"
                              " output and another")
            other[k] = fresh[0] if fresh else None
            other[k - 1] = next(b for b in before if b != ys[k - 1])
        return ys, other

    def uncarried_series(self, role: str, names: list) -> None:
        """A per-step value no step reads back (stacked as a sequence): its tensor at every step, signed."""
        n, km, last = self.n, self.km, self.last
        sigs: list[int | None] = [None] * n
        for k in range(n):
            if names[k] is None:  # the last step's value, not reached from its (dead) states
                names[k] = self.step_output(k, self.g.producer[names[k - 1]].op_type, sigs[km], names[km]) if k == last else None
                if names[k] is None:
                    raise Decline(f"step {self.ts[k]}'s extra output cannot be found")
            sigs[k] = self.sign(names[k], k)
        self.ref[role] = self.mid.poly(names[km])
        self.ref_sig[role] = sigs[km]
        self.series[role], self.sigs[role] = names, sigs

    def given_initial_output(self, y_first: str) -> str | None:
        """A given initial value of the carried output: the one outside tensor the first step reads."""
        g, iv, allowed = self.g, self.iv, self.allowed[0]
        given = [t for t in inputs_of(g, y_first, allowed, self.leaves[0])
                 if iv.get(t) is None and t not in self.leaves[0] and t != self.foreign[0].name and g.const(t) is None
                 and not shape_derived(g, t) and g.fill_value(t) is None
                 and (g.producer.get(t) is None or not allowed(g.producer[t]))]
        return given[0] if len(given) == 1 else None

    def zero_initial_states(self) -> None:
        """Which states start from zero folded into the first step."""
        last, c_new = self.last, self.c_new
        if self.h_new[last] is None and self.ys is None and c_new[last] is None:
            raise LastStepUnused("the last step's hidden output cannot be found")
        if self.lstm and self.foreign[last].name is not None and self.foreign[last].name != c_new[last - 1]:
            raise Decline(f"step {self.ts[last]} reads another cell state than step {self.ts[last - 1]} computes")
        self.c0 = self.foreign[0].name if self.lstm else None
        zero = set()
        if self.h_in[0] is None or self.h0_fill is not None:
            zero.add("h")
        if self.lstm and self.c0 is None:
            zero.add("c")
        if self.y_carried and self.y0 is None:
            zero.add("y")
        self.zero = zero

    def analyse(self) -> StepAnalysis:
        """The chain's outputs and the reference step's maths -> the cell and the recurrence's states."""
        g, series, ref = self.g, self.series, self.ref
        stacks, finals, self.step_reads = chain_outputs(g, self.chain, series, self.escapes.update(self.chain_nodes),
                                                        self.mask_values, self.initial)
        h0 = self.h_in[0]
        inits = {
            "h": Init(h0, None, lead_of(g, h0) or 0) if h0 is not None and self.h0_fill is None else Init(),
            "c": Init(self.c0, None, lead_of(g, self.c0) or 0) if self.c0 is not None else Init(),
            "y": Init(self.y0, None, lead_of(g, self.y0) or 0) if self.y0 is not None else Init(),
        }
        states = {"h": H_STATE, "c": C_STATE, "y": Y_STATE}
        carried = [r for r in series if r in ("h", "c") or (r == "y" and self.y_carried)]
        step_states = [StepState(r, ref[r], inits[r], finals.get(r)) for r in carried]
        outs = [StepOut(ref[r], cat, axis, rev, zeroed=z) for r, cat, axis, rev, z in stacks]
        self.zeroed = zeroed_products(g, outs)  # (checked in build, by the mask)
        for r, t in finals.items():
            if r not in carried:
                raise Decline("an extra per-step value of the last step is read outside the chain")
        return analyse(self.x_atom, step_states, outs, {r: states[r] for r in series if r in states})

    def check_every_step(self) -> None:
        """Every step computes the reference step: by structure, or else by its maths."""
        g, zero, ref = self.g, self.zero, self.ref
        for r, names in self.series.items():
            for k in range(self.n):
                name = names[k]
                if name is None:
                    continue
                if self.sigs[r][k] == self.ref_sig[r] and not (k == 0 and zero):
                    continue
                e = StepEval(g, self.chain, k, self.iv, self.h_in[k], self.x_atom, self.x_value)
                prev = (self.ys[k - 1] if k > 0 else self.y0) if self.y_carried else None
                if prev is not None:
                    e.ev.memo[prev] = SymTensor(Poly.atom(Y_STATE), lead_of(g, prev) or 0)
                try:
                    p = e.poly(name)
                except Decline as d:
                    if k == 0:  # (e.g. a constant initial state folded in: the rest may still be the cell)
                        raise FirstStepDiffers(f"the first step is not the cell: {d.reason}") from None
                    raise
                self.chain_nodes |= e.ev.visited_nodes
                if k == 0 and zero:
                    z = zero_states(ref[r], zero)
                    if not same_at_zero_state(p, z):
                        raise FirstStepDiffers(f"the first step is not the cell with a zero initial state ({r})")
                elif p.key != ref[r].key:
                    why = f"step {self.ts[k]} computes a different cell than step {self.ts[self.km]} ({r})"
                    raise FirstStepDiffers(why) if k == 0 else Decline(why)

    def build(self, an: StepAnalysis) -> Recurrence:
        g, src, axis, ts = self.g, self.src, self.axis, self.ts
        msrc, maxis = self.mask_srcs.get(an.mask_sym, (None, None)) if an.masked else (None, None)
        if maxis not in (None, axis) and self.proj is None and not isinstance(msrc, StepMask):
            src, axis = untransposed(g, src, axis) or (src, axis)  # (x read from a time-major copy of a batch-first
            # tensor, the mask from its own [B, T]: jax2onnx's unrolled loops; both read batch-first)
        x, T, leads = src if self.proj is None else self.proj.x0, static_dim(g, src, axis), series_leads(g, self.h_new, self.sig_h)
        first = min(ts) if self.chain.direction == "forward" else max(ts)  # (the step processed first)
        anchor = g.producer.get(self.h_new[-1] or self.c_new[-1] or (self.ys or [None])[-1])
        mask = None
        if an.masked:
            if isinstance(msrc, StepMask):  # lengths > t or f(x_t) written per step: its [T, B] source, like x
                msrc, maxis = msrc.source(g, axis, T if T is not None else max(ts) + 1, maxis, anchor), axis
            elif msrc is None or (static_dim(g, msrc, maxis) != T and extent_key(g, msrc, maxis) != extent_key(g, src, axis)):
                raise Decline("the mask is not laid out like the per-step inputs")
            mask = msrc
        zeroed_by_mask(g, an.seq_outputs, self.zeroed, mask, maxis, an.mask_negated)
        steps = None if min(ts) == 0 and T is not None and max(ts) == T - 1 else (min(ts), max(ts) + 1, axis)
        if mask is not None and maxis != axis and (steps is not None or maxis not in (0, 1)):  # (else swapped: emit)
            raise Decline("the mask is laid out otherwise than the per-step inputs")
        return Recurrence(
            front="chain",
            where=self.chain.describe(f"'{src}' (axis {axis})") + f", steps {ts[0]}..{ts[-1]}: {self.n} cells",
            cell=an.rec.spec,
            x=x,
            h0=an.h0,
            c0=an.c0,
            mask=mask,
            mask_batch_first=None if mask is None or maxis == axis else maxis == 1,
            mask_negated=an.masked and an.mask_negated,
            seq_outputs=an.seq_outputs,
            finals=[FinalOutput(f.tensor, f.which, f.init, value_lead(g, f.tensor, self.series, self.sigs)) for f in an.finals],
            step_reads=[StepRead(t, abs(ts[k] - first),  # (its index in processing order)
                                 CARRY if an.masked else NONE, an.h0 if an.masked else Init(),
                                 leads[k] if t == self.h_new[k] else lead_of(g, t) or 0) for k, t in self.step_reads],
            anchor=anchor,
            x_time_axis=axis,
            x_reversed=self.chain.direction == "reverse",
            x_prep=InputPrep(self.proj.flips if self.proj is not None else (), steps),
        )

    def add_cell_checks(self, rec: Recurrence, an: StepAnalysis) -> None:
        """What cell-level validation compares (the whole chain may be too big to run in onnxruntime). A masked
        step is fed its mask (valid rows: the cell's; padded rows: the state read); one whose masks cannot be
        fed so (several, of unknown type) gets no checks: the whole model is validated."""
        g, ts = self.g, self.ts
        checks = []
        # the first step too, unless it is signed as the reference (the same nodes, constants and roles: the
        # same numbers; a folded zero state, say, makes it differ)
        same = not self.zero and all(self.sigs[r][0] == self.ref_sig[r] for r in ("h", "c") if r in self.sigs)
        for k in sorted({self.km} if same else {self.km, 0}):
            visited: set = set()
            fills: dict = {}
            f = Foreign(ts[k])
            outs_k = {self.h_new[k]: "h"}
            self.signer.sign(self.h_new[k], self.leaves[k], self.allowed[k], f, visited, fills, given=self.chain.given)
            if self.lstm and self.c_new[k] is not None:
                self.signer.sign(self.c_new[k], self.leaves[k], self.allowed[k], f, visited, fills, given=self.chain.given)
                outs_k[self.c_new[k]] = "c"
            ins = {v: r for v, r in self.leaves[k].items() if r in ("x", "h")}
            if f.name is not None:
                ins[f.name] = "c"
            nodes = order_of(g, visited)
            masks = self._fed_masks(k, nodes, an) if an.masked else {}
            zero = self.zero if k == 0 else set()
            if masks is None or (masks and not all(r in ins.values() or r in zero or len(set(fills.values())) == 1
                                                   for r in outs_k.values())):
                return  # (a padded row's state must be known: read, zero, or the one fill the step reads)
            chk = CellCheck(nodes, ins, outs_k, zero, static_dim(g, self.src, 1 - self.axis), fills, masks=masks,
                            mask_valid=not an.mask_negated)
            if self.proj is not None:
                chk.x_projection = (self.proj.K, self.proj.bias)
            checks.append(chk)
        rec.cell_checks.extend(checks)

    def _fed_masks(self, k: int, nodes: list, an: StepAnalysis) -> dict | None:
        """Step ``k``'s mask values its nodes read -> (elem type, dims after the batch), when they are the
        analysis' one mask with static trailing dims; else None."""
        read = {i for n in nodes for i in n.input}
        masks = {v: r for v, r in self.leaves[k].items() if r not in ("x", "h") and v in read}
        if set(masks.values()) - {an.mask_sym}:
            return None
        out = {}
        for v in masks:
            t = self.g.model.known_type(v)
            if t is None or t[1] is None or not t[1] or not all(isinstance(d, int) for d in t[1][1:]):
                return None
            out[v] = (t[0], tuple(t[1][1:]))
        return out

