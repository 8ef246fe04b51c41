"""Runs any `PipelinePlan` inside `shard_map`: one executor for every schedule.

The ticks are unrolled. At each, every device runs its action (work.py),
then the tick's sends start as `ppermute_start` futures: one carrying
activations to the next stage, one carrying cotangents back (on ZB-V's V one
each way along the devices, and the turn from stage p-1 to p written on its
device without a collective; buffers.py). A send is
finished after the next tick's compute where no device needs it sooner
(buffers.py), so it is in flight while that tick computes. A forward action keeps its
stage's residuals for the backward ones in rows beside the kept stage input
(residuals.py), or, with `recompute=True`, a backward action recomputes its
stage's forward from the stage input it kept (as `jax.checkpoint` of the
stage would); either way a device holds one row a live microbatch.

Two dispatches. `switch`: each device runs only its own action, chosen by
its axis index with `lax.switch`; off TPU a branch gives back the rows it
writes, written after the switch (row_writes.py), and the row buffers start
unfilled (`_unset_rows`). Devices of one collective group (over
another mesh axis) would then run different collective instructions at one
tick, which XLA does not define (on CPU its rendezvous waits forever), so a
model whose stage, loss or embedding holds a collective runs in `lockstep`:
at each tick every device runs the same program, one slot for each kind of
action the tick holds, each device's flags masking what it keeps
(work.py). A DualPipeV F&B cell runs both its parts at its tick: switch's
branch runs the forward then the backward (they touch different rows);
lockstep's F slot and B slot each read their own part's microbatch, chunk
and row, the B slot from the buffers as the tick starts, each part on its
own side of an optimization barrier (pair_fences.py), so nothing of
one part's compute waits for the other's collectives, and the two parts
zipped at their futures, each part's all-to-alls (an MoE stage's) in flight
while the other part computes (ordering/interleave.py;
tests/aot/dualpipev_moe_compiled_test.py). Compiled for TPU (quirks row "tpu-pipeline-tick-gate"), a tick
reads the parameters through a barrier on the loss the tick before starts
from (`_gate`), so its weight gathers start a tick or two early at most.
Values and gradients equal the plain model's:
tests/patterns/pipeline/pipeline_loss_test.py, pipeline_compose_test.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.collectives.api import ppermute_start
from jax_overlap._src.patterns import varying as _varying
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.pipeline import buffers as _buffers
from jax_overlap._src.patterns.pipeline import mean_sums as _mean_sums
from jax_overlap._src.patterns.pipeline import pair_fences as _pair_fences
from jax_overlap._src.patterns.pipeline import residuals as _residuals
from jax_overlap._src.patterns.pipeline import row_writes as _row_writes
from jax_overlap._src.patterns.pipeline.actions import B, F, I, W
from jax_overlap._src.patterns.pipeline.plan import PipelinePlan
from jax_overlap._src.patterns.pipeline.tick_names import label, sum_label
from jax_overlap._src.patterns.pipeline.work import (Model, Work, float_leaves,
                                                    is_float)
from jax_overlap._src.xla.tick_gate import tick_gate

DISPATCHES = ("switch", "lockstep")

#: (kind, first stage, last stage) of each of buffers.py's branches.
_VARIANT = {_buffers.IDLE: None, _buffers.F_FIRST: (F, True, False),
            _buffers.F_MID: (F, False, False), _buffers.F_LAST: (F, False, True),
            _buffers.B_FIRST: (B, True, False), _buffers.B_MID: (B, False, False),
            _buffers.I_FIRST: (I, True, False), _buffers.I_MID: (I, False, False),
            _buffers.W_ANY: (W, False, False)}


def execute(plan: PipelinePlan, model: Model, params: Any, consts: Any, xs,
            targets, axis, *, axes: tuple, with_grads: bool, dispatch: str,
            zero_act, zero_aux, recompute=False, mean_axes=()):
  """The mean loss, the aux values stacked over the microbatches and, with
  `with_grads`, this device's parts of the gradients of the summed loss / m
  with respect to the float leaves of `params` (its chunks), `consts`, `xs`
  and `targets`, as lists: each part varies over every axis an input does,
  and `reduce_like` sums it to its primal's type (after the loss's
  cotangent scales it: that may vary too). `axes`: every mesh axis an input
  varies over (`all_axes`), which the buffers and sends vary over.
  `mean_axes` (some of `axes`): the loss is also averaged over them, and
  the parts of the leaves of `params` that do not vary over them come back
  summed over them (mean_sums.py)."""
  prog = _buffers.program(plan)
  m = plan.microbatches
  vary = lambda a: _varying.vary_over(a, axes)
  # consts keep their type but floats' (pieces.py casts those): an int the
  # stage mixes with a literal would not match a varying one (issue 43)
  vary_float = lambda a: vary(a) if is_float(a) else a
  rows = max(prog.slots, 1)
  stack = lambda a, n: vary(jnp.zeros((n,) + jnp.shape(a), a.dtype))
  rows_after = dispatch == "switch" and _row_writes.after_switch()
  unset = (lambda a, n: vary(_unset_rows(a, n))) if rows_after else stack
  state = dict(inputs=jax.tree.map(lambda a: unset(a, rows), zero_act),
               loss=vary(jnp.zeros((), jnp.float32)),
               aux=jax.tree.map(lambda a: stack(a, m), zero_aux))
  if with_grads:
    state.update(
        dys=[unset(a, rows) for a in float_leaves(zero_act)],
        grads=[vary(jnp.zeros_like(a)) for a in float_leaves(params)],
        dconsts=[vary(jnp.zeros_like(a)) for a in float_leaves(consts)],
        dxs=[vary(jnp.zeros_like(a)) for a in float_leaves(xs)],
        dtargets=[vary(jnp.zeros_like(a)) for a in float_leaves(targets)])
  zero_act = jax.tree.map(vary, zero_act)
  layout = None
  if with_grads and recompute is not True:
    chunk = jax.tree.map(lambda a: vary(a[0]) if is_float(a) else a[0], params)
    layout = _residuals.layout(model.stage, recompute, chunk,
                               jax.tree.map(vary_float, consts), zero_act,
                               vary(jnp.zeros((), jnp.int32)), axes)
    state["res"] = [unset(a, rows) for a in layout.kept]
  work = Work(model, m, with_grads, vary, zero_act, layout)
  me = jax.lax.axis_index(axis)
  pending = []
  gated = params
  for t, tick in enumerate(prog.ticks):
    with jax.named_scope(f"pipeline_tick_{t}"):   # profiles name the tick
      tick_params, gated = gated, _gate(params, state)
      operands = (state, tick_params, consts, xs, targets)
      if dispatch == "lockstep":
        state, out_fwd, out_bwd = _lockstep_tick(tick, work, operands, me)
      else:
        state, out_fwd, out_bwd = _switch_tick(tick, work, operands, me,
                                               rows_after)
      for futs, send, buffer in pending:
        state[buffer] = _write_all(state[buffer], [f.done() for f in futs],
                                   send.slots, me)
      pending = []
      for send in tick.sends:
        out = jax.tree.leaves(out_fwd if send.buffer == "inputs" else out_bwd)
        if send.local:   # ZB-V's turn: the device's own output, no collective
          state[send.buffer] = _write_all(state[send.buffer], out, send.slots, me)
          continue
        with moving(label(t, send.what, plan.table[t])):   # the report's leaf
          futs = [ppermute_start(a, axis, send.perm) for a in out]
        if send.deferred:
          pending.append((futs, send, send.buffer))
        else:
          state[send.buffer] = _write_all(state[send.buffer],
                                          [f.done() for f in futs], send.slots, me)
  assert not pending, "a plan's last tick sends nothing"
  finish = _mean_sums.start(state["grads"], params, mean_axes) if with_grads else None
  # only the last stage's are not 0; the mean over `mean_axes` too
  with moving(sum_label("the loss")):   # the report's leaf (tick_names.py)
    over = (axis,) + tuple(mean_axes) if isinstance(axis, str) else (
        tuple(axis) + tuple(mean_axes))
    loss = jax.lax.psum(state["loss"], over) / (
        m * _compat.axis_size(tuple(mean_axes)))
    aux = jax.tree.map(lambda a: jax.lax.psum(a, axis), state["aux"])
  if not with_grads:
    return loss, aux
  return (loss, aux, finish(), state["dconsts"], state["dxs"], state["dtargets"])


def all_axes(tree, axis) -> tuple:
  """`axis` and every mesh axis a leaf of `tree` varies over, sorted."""
  axes = {axis} if isinstance(axis, str) else set(axis)
  for leaf in jax.tree.leaves(tree):
    axes |= _varying.varying(leaf)
  return tuple(sorted(axes, key=str))


def reduce_like(value, like):
  """`value` summed over the axes it varies over and `like` does not (a
  gradient of a replicated input sums every device's part)."""
  have = _varying.varying(like)
  extra = tuple(sorted((a for a in _varying.varying(value) if a not in have),
                       key=str))
  return jax.lax.psum(value, extra) if extra else value


def _unset_rows(a, n):
  """`n` rows like `a`, not filled: a switch tick's row buffers (the kept
  inputs, cotangents and residuals; not the sums, which start from 0).

  Why: a row is read only by the device that wrote it, after it did
  (buffers.py), and XLA merges the zero broadcasts the buffers would start
  from into one value, of which each buffer is then a copy (docs/pipeline.md
  "Memory"). In lockstep the zeros fuse into each buffer's first row write
  and an unfilled buffer would live from the program's start, so there the
  rows start from 0, and so they do where a switch tick's rows are written
  in its branches (on TPU, row_writes.py). Pinned by
  tests/aot/pipeline_compiled_test.py
  (`test_switch_ticks_write_their_rows_after_the_conditional`) and
  tests/patterns/pipeline/pipeline_row_writes_test.py (no row is read
  before it is written)."""
  return jax.lax.empty((n,) + jnp.shape(a), a.dtype)


def _gate(params, state):
  """`params` as the next tick reads them: their float leaves tied by an
  optimization barrier to the loss this tick starts from (a scalar every
  forward tick renews), so what the next tick computes from its parameters
  alone (an FSDP stage's weight gathers) can start no more than a tick or
  two early. Without it the lockstep ticks' gathers, which need nothing but
  the parameters, were started near the program's start (XLA:TPU held 63
  gathered layers at its peak: the v5e bench's 1F1B temp 3,609 MiB;
  docs/pipeline.md). The tie is a TPU compiler workaround, quirks row
  "tpu-pipeline-tick-gate" (xla/tick_gate.py: a barrier where the row
  applies, nothing elsewhere): on the H100 it made the step 5% longer and
  the temp bytes 8% larger. Pinned by tests/aot/pipeline_compiled_test.py
  (`test_lockstep_ticks_gather_their_weights_one_tick_ahead_at_most`)."""
  leaves, tree = jax.tree.flatten(params)
  at = [k for k, a in enumerate(leaves) if is_float(a)]
  out = tick_gate([leaves[k] for k in at] + [state["loss"]])
  for k, a in zip(at, out):
    leaves[k] = a
  return jax.tree.unflatten(tree, leaves)


def _pick(table, me):
  return jnp.asarray(table, jnp.int32)[me]


def _write_all(buffer, values, slots, me):
  """Each received leaf into its row of `buffer` (a tree or list of
  [rows, ...] arrays with the leaves in the same order)."""
  leaves, tree = jax.tree.flatten(buffer)
  return jax.tree.unflatten(tree, [_write(b, v, slots, me)
                                   for b, v in zip(leaves, values)])


def _write(buffer, value, slots, me):
  slot = _pick(slots, me)
  row = jnp.maximum(slot, 0)
  old = jax.lax.dynamic_index_in_dim(buffer, row, 0, keepdims=False)
  new = jnp.where(slot >= 0, value.astype(buffer.dtype), old)
  return jax.lax.dynamic_update_index_in_dim(buffer, new, row, 0)


def _branches(tick):
  """Per device, its (branch, second branch): the second a Pair's backward
  (buffers.Tick.second), IDLE where the device runs one action or none."""
  second = tick.second[0] if tick.second else (_buffers.IDLE,) * len(tick.branch)
  return list(zip(tick.branch, second))


def _parts(tick):
  """Per device, its variants at `tick`: one, or a Pair's forward and
  backward."""
  return [tuple(_VARIANT[b] for b in pair if _VARIANT[b] is not None)
          for pair in _branches(tick)]


def _picks(tick, me):
  """Per part (0; 1, a Pair's backward, where the tick holds a Pair), the
  (microbatch, chunk, slot) that part reads on this device."""
  cols = [(tick.microbatch, tick.chunk, tick.slot)]
  if tick.second:
    cols.append(tick.second[1:])
  return [tuple(_pick(c, me) for c in part) for part in cols]


def _switch_tick(tick, work, operands, me, rows_after):
  """Each device runs its own action's variant; a device with a Pair runs
  both parts, the forward first (they touch different rows), in one
  branch. With `rows_after`, a branch's row writes are made after the
  switch (row_writes.py)."""
  combos = _branches(tick)
  present = sorted(set(combos))
  picks = _picks(tick, me)

  def branch(b1, b2):
    def run(ops):
      state, rest = ops[0], ops[1:]
      fwd = bwd = None
      for k, b in enumerate((b1, b2)):
        if _VARIANT[b] is None:
          continue
        kind, first, last = _VARIANT[b]
        given = state if k == 0 else _row_writes.beside(state)
        out, f, g = work.action(kind, first, last, True)(
            (given,) + rest[:4] + picks[k])
        state = out if k == 0 else _row_writes.merged(state, given, out)
        if kind == F:
          fwd = f
        else:
          bwd = g
      return work.out(state, fwd, bwd)
    return run

  fns = [branch(*c) for c in present]
  if len(fns) == 1:
    return fns[0](operands)
  local = [present.index(c) for c in combos]
  if not rows_after:
    return jax.lax.switch(_pick(local, me), fns, operands)
  return _row_writes.switch(_pick(local, me), fns, operands, work.vary)


def _lockstep_tick(tick, work, operands, me):
  """Every device runs one slot for each kind of action the tick holds; a
  device with a Pair is active in two (its forward's and its backward's),
  each slot reading the microbatch, chunk and row of that kind's part. A
  Pair tick's two parts are zipped at their futures (pair_fences.zipped)."""
  run = lambda ops: _lockstep_slots(tick, work, ops, me)
  return _pair_fences.zipped(run)(operands) if tick.second else run(operands)


def _lockstep_slots(tick, work, operands, me):
  per_device = _parts(tick)
  kinds = [k for k in (F, B, I, W) if any(v[0] == k for vs in per_device for v in vs)]
  flag = lambda bits: _pick([int(b) for b in bits], me).astype(bool)
  state, out_fwd, out_bwd = work.idle(operands)
  before = state
  if tick.second:
    state = _pair_fences.fenced(state)
  picks = _picks(tick, me)
  sent_back = None
  for kind in kinds:
    # which part of each device's cell is of this kind (None: none)
    part = [next((k for k, v in enumerate(vs) if v[0] == kind), None)
            for vs in per_device]
    of = [vs[k] if k is not None else None for vs, k in zip(per_device, part)]
    active = flag([v is not None for v in of])
    first = flag([bool(v and v[1]) for v in of])
    last = flag([bool(v and v[2]) for v in of])
    if len(picks) == 1 or all(k in (0, None) for k in part):
      pick = picks[0]
    else:
      use2 = flag([k == 1 for k in part])
      pick = tuple(jnp.where(use2, b, a) for a, b in zip(*picks))
    if tick.second and kind != F:
      # A Pair's backward reads the rows the tick starts with: nothing of
      # the forward slot (other rows), so the two parts can overlap.
      state, fwd, bwd = _pair_fences.beside(work.action(kind, first, last, active), before,
                                state, operands[1:5] + pick, kind)
    else:
      ops = (state,) + operands[1:5] + pick
      with _pair_fences.scope(tick, "pair_forward"):
        state, fwd, bwd = work.action(kind, first, last, active)(ops)
    if kind == F:
      out_fwd = fwd
    elif kind in (B, I):   # a W sends nothing
      # B and I slots at one tick (DualPipeV): each device sends its own
      out_bwd = bwd if sent_back is None else jax.tree.map(
          lambda new, old: jnp.where(active, new, old), bwd, out_bwd)
      sent_back = kind
  return state, out_fwd, out_bwd
