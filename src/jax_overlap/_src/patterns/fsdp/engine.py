"""`fsdp_scan`'s one executor: runs any plan (plan.py) under one custom VJP.

The forward pass runs the plan's forward steps: the entry (layer 0's gather
behind `before`, or at once; with the layer-0 split, `before` and layer 0 in
one block, use_order.py), one step a layer, then `after`. The backward pass
runs its backward steps: `after`'s backward (hiding the last layer's
regather), one step a layer, then layer 0's reduce-scatter behind `before`'s
backward (or, split, inside layer 0's step). Each step is
`transfer.step(compute, gather=..., scatter=...)` (HSDP: `step2` with the
all-reduce); a step gathering several layers nests them.

Consecutive layer steps that do the same thing relative to their layer (the
same gathers, buffer length, weights' source, pending reduce-scatters) run as
one `lax.scan` (remainder first, `_scan_remainder_first`); the others run one
by one. Where the plan says `again`, the last layer's steps join the loops:
forward, its gather index is clamped to the last layer (that regathered copy
is what the backward pass keeps); backward, the loop starts with a zero
gradient pending (its reduce-scatter lands on the last layer's slot, which
the next step overwrites). Values and gradients equal `lax.scan`'s for every plan
(tests/patterns/fsdp/fsdp_plan_test.py, fsdp_memory_knobs_test.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap._src import _compat

from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.fsdp import use_order
from jax_overlap._src.patterns.fsdp.layer_inputs import (differentiable,
                                                         float0_zeros,
                                                         without_float0)
from jax_overlap._src.patterns.fsdp.one_layer import (Splits, layer_at,
                                                      layer_backward,
                                                      layer_forward)
from jax_overlap._src.patterns.fsdp.plan import backward_signature, runs
from jax_overlap._src.patterns.fsdp.stack_ends import NO_ENDS, saved_of
from jax_overlap._src.patterns.leaf_scope import in_step
from jax_overlap._src.patterns.varying import vary_over


def _offsets(step) -> tuple:
  return tuple(g - step.layer for g in step.gathers)


def run(plan, layer, x, params, transfer, unroll, remat_policy, ends=NO_ENDS):
  """`fsdp_scan`'s result under `plan` (with its custom gradient). `x` is
  what `ends` reads (with `StackEnds`: x, the hoisted values and the ends'
  consts; else the stack's carry)."""
  n = plan.n_layers
  splits = Splits(layer)   # the layer split by weights, traced once a type
  x_avals = []   # x's types as one layer sees them (for the backward's trace)

  def step(compute, stack, gathers, scatter=None, reduce=None):
    """`compute()` with the gathers of the layers `gathers` of `stack` (and the
    reduce-scatter / all-reduce) in flight. Returns (out, gathered list,
    scattered, reduced). Several gathers: nested ordered steps.

    With `plan.fence_inputs` the step's inputs are fenced together before its
    first operation, so its gathers start at this step, not before (plan.py
    says where and why)."""
    shards = [layer_at(stack, g) for g in gathers]
    steps = lambda: _nested_steps(compute, shards, scatter, reduce)
    if not plan.fence_inputs:
      return steps()
    return program_order(enforce=True, strict_in_out=(True, False))(steps)()

  def _nested_steps(compute, shards, scatter=None, reduce=None):
    if len(shards) > 1:
      def inner():
        out, more, _, _ = _nested_steps(compute, shards[1:])
        return out, more
    else:
      inner = lambda: (compute(), [])
    first = shards[0] if shards else None
    if plan.stages == 2 and (scatter is not None or reduce is not None):
      (out, more), got, scattered, reduced = transfer.step2(
          inner, gather=first, scatter=scatter, reduce=reduce)
    else:
      (out, more), got, scattered = transfer.step(inner, gather=first,
                                                  scatter=scatter)
      reduced = None
    return out, ([got] if shards else []) + more, scattered, reduced

  def loop(body, carry, steps, descending=False, named=None):
    """`body` over `steps` (consecutive layers): one `lax.scan` where the plan
    loops over them, else one call each, each inside its steps' `in_step`
    scope (the report names them; `named`: the plan's steps, where `steps`
    were changed from them). Returns the carry and the pieces of what the
    bodies saved: `(first layer, last + 1, saved, stacked)`."""
    pass_ = "backward" if descending else "forward"
    if not steps[0].loop:
      pieces = []
      for s, as_planned in zip(steps, named or steps):
        with in_step(step_label(pass_, [as_planned])):
          carry, saved = body(carry, s.layer)
        pieces.append((s.layer, s.layer + 1, saved, False))
      return carry, pieces
    layers = [s.layer for s in steps]
    index = jnp.arange(layers[0], layers[-1] + (-1 if descending else 1),
                       -1 if descending else 1)
    with in_step(step_label(pass_, steps)):
      carry, saved = _scan_remainder_first(body, carry, index, unroll)
    return carry, [(min(layers), max(layers) + 1, saved, True)]

  # --- forward ---------------------------------------------------------------------

  def forward(x_run, params_, save: bool):
    def run_layer(x, w):
      if not save:
        return layer(x, w), None
      x_avals[:] = [jax.tree.map(jax.typeof, x)]
      return layer_forward(splits, remat_policy, x, w)

    entry, *steps = [s for s in plan.forward if s.compute != "after"]
    fold_fwd = save and any(s.again for s in steps)
    gather_index = (lambda i: jnp.minimum(i, n - 1)) if fold_fwd else \
        (lambda i: i)
    pieces = []   # (first layer, last layer + 1, (saved, kept), stacked)
    first = None
    if entry.split:   # before and layer 0 in one block (use_order.py)
      with in_step(step_label("forward", [entry])):
        first = use_order.forward_first(
            transfer, run_layer, lambda: ends.enter_compute(x_run, save),
            layer_at(params_, 0), layer_at(params_, 1))
    if first is not None:
      x, saved0, entered, w1 = first
      carry = (x, (w1,))
      pieces.append((0, 1, (saved0, None), False))
    else:
      with in_step(step_label("forward", [entry])):
        x, w0, entered = ends.enter(transfer, x_run, layer_at(params_, 0),
                                    save)
      carry = (x, (w0,))
      if entry.split:   # one group only: layer 0 loops with the others
        steps = [entry._replace(gathers=entry.gathers[1:], split=False,
                                buffered=1, loop=True)] + steps

    def signature(s):
      # Without a gradient nothing is kept: a fenced schedule's runs then
      # join across the kept layers' first step, and loop where longer than
      # one step (the plan's loops are those of the pass that saves).
      looped = s.loop if save or not plan.fence_inputs else None
      if s.again:   # as the loop's steps with a gradient, else on its own
        return ((1,), s.buffered, False, True) if save else \
            ((), s.buffered, False, False)
      return _offsets(s), s.buffered, save and s.keeps, looped

    def body_of(offsets, keep):
      def body(carry, j):
        x, buf = carry
        (x, saved), got, _, _ = step(lambda: run_layer(x, buf[0]), params_,
                                     [gather_index(j + o) for o in offsets])
        return (x, tuple(buf[1:]) + tuple(got)), (saved, buf[0] if keep
                                                  else None)
      return body

    for run_ in runs(steps, signature):
      offsets, _, keep, looped = signature(run_[0])
      looped = len(run_) > 1 if looped is None else looped
      run_ = [s._replace(loop=looped) for s in run_]
      # (inside shard_map; unrolled iterations keep the scan's ys: carried
      # stacks there grew the saved bytes past the activations', fsdp_test::
      # test_memory_grows_by_activations_only)
      if save and looped and plan.futures and unroll == 1:
        carry, more = _saving_loop(loop, step, run_layer, params_, carry,
                                   run_, offsets, keep, gather_index)
      else:
        carry, more = loop(body_of(offsets, keep), carry, run_)
      pieces += more
    # Folded: the last step's gather (of its own layer) is the kept copy.
    kept_last = carry[1][0] if fold_fwd else None
    x, left = ends.leave(carry[0], x_run, save)
    return x, (pieces, saved_of(ends, entered, left, x_run), kept_last)

  @jax.custom_vjp
  def run_(x, params_):
    return forward(x, params_, save=False)[0]

  def run_fwd(x, params_):
    y, saved = forward(x, params_, save=True)
    return y, (saved, params_)

  # --- backward --------------------------------------------------------------------

  def run_bwd(residuals, out_bar):
    (pieces, ends_saved, kept_last), params_ = residuals
    if plan.fence_inputs:
      # The backward pass reads the stack through a barrier: else a regather
      # can be the very op of a forward gather (same layer, same operand) and
      # XLA merges the two starts, which have two dones (the H100 compiler's
      # verifier refused 6 layers with prefetch=3 so).
      params_ = lax.optimization_barrier(params_)
    backward = lambda pullback, w, y_bar: layer_backward(
        splits, pullback, w, x_avals[0], y_bar)
    # Integer, boolean and key parts of xs have float0 cotangents: a scalar
    # stands in their stack during the loop, float0 zeros come back.
    grads = jax.tree.map(
        lambda p_: jnp.zeros_like(p_) if differentiable(p_) else jnp.zeros(()),
        params_)
    put = lambda grads, g, i: jax.tree.map(
        lambda G, g: lax.dynamic_update_index_in_dim(G, g, i, 0)
        if G.ndim else G, grads, g)
    piece_of = lambda i: next(k for k, (lo, hi, _, _) in enumerate(pieces)
                              if lo <= i < hi)

    def saved_at(i, part, piece=None):   # part 0: the pullback, 1: the kept
      # weights; `piece`: where layer i is saved (given for a traced i)
      lo, _, ys, stacked = pieces[piece_of(i) if piece is None else piece]
      return layer_at(ys[part], i - lo) if stacked else ys[part]

    steps = [s for s in plan.backward if "layer_back" in s.compute]
    entry = plan.backward[0] if plan.backward[0] is not steps[0] else None
    regather_last = entry is not None and bool(entry.gathers)
    # after's backward with the last layer's regather in flight
    with in_step(step_label("backward", [plan.backward[0]])):
      y_bar, w, after_bar = ends.leave_back(
          transfer, ends_saved, out_bar,
          layer_at(params_, n - 1) if regather_last else None)
    split = steps[-1] if steps[-1].split else None
    if split is not None:
      steps = steps[:-1]
    def signature(s):
      if s.again:   # as the loop's steps: weights from the buffer, a
        # (zero) gradient pending
        return (_offsets(s), 1, "gathered", 1, piece_of(s.layer), s.loop)
      return (*backward_signature(s, piece_of), s.loop)

    def body_of(offsets, from_saved, pending, piece):
      def body(carry, i):
        x_bar, buf, pend, grads = carry
        # Layer i's residuals: read inside the step, or, with fenced inputs,
        # before it (the fence then holds one layer's, not the stack).
        saved = (lambda: saved_at(i, 0, piece)) if not plan.fence_inputs \
            else (lambda one=saved_at(i, 0, piece): one)
        if from_saved:
          w = saved_at(i, 1, piece)
        else:
          w, buf = buf[0], tuple(buf[1:])
        scatter = pend[0] if pending >= 1 else None
        reduce = pend[1] if pending >= 2 else None
        (x_bar, g), got, scattered, reduced = step(
            lambda: backward(saved(), w, x_bar), params_,
            [i + o for o in offsets], scatter=scatter, reduce=reduce)
        if plan.stages == 2:
          # scattered: layer i+1's shard, all-reduced at the next step;
          # reduced: layer i+2's final gradient.
          if reduced is not None:
            grads = put(grads, reduced, i + 2)
          pend = (without_float0(g),) + (
              (scattered,) if scattered is not None else ())
        else:
          if scattered is not None:   # (folded: n - 1 is written again)
            grads = put(grads, scattered, jnp.minimum(i + 1, n - 1))
          pend = (without_float0(g),)
        return (x_bar, buf + tuple(got), pend, grads), None
      return body

    carry = (y_bar, (w,) if regather_last else (), (), grads)
    if steps[0].again:   # the kept copy in the buffer, a zero gradient pending
      g_types = jax.make_jaxpr(lambda: backward(
          saved_at(n - 1, 0), kept_last, y_bar)[1])().out_avals
      carry = (y_bar, (kept_last,), (without_float0(jax.tree.unflatten(
          jax.tree.structure(kept_last), [_zeros(t) for t in g_types])),),
               grads)
    for run_ in runs(steps, signature):
      offsets, _, weights, pending, piece, _ = signature(run_[0])
      carry, _ = loop(body_of(offsets, weights == "kept", pending, piece),
                      carry, run_, descending=True)
    x_bar, buf, pend, grads = carry
    last = None
    if split is not None:   # layer 0's gradients reduce-scattered by use
      w0 = saved_at(0, 1) if split.weights == "kept" else buf[0]
      with in_step(step_label("backward", [split])):
        last = use_order.backward_first(
            transfer, backward, saved_at(0, 0), w0, x_bar, pend[0],
            lambda x0: ends.back_compute(ends_saved, x0))
      if last is None:   # one group only: layer 0 runs as its own step
        carry, _ = loop(body_of((), split.weights == "kept", 1, piece_of(0)),
                        carry, [split._replace(split=False)], descending=True,
                        named=[split])
        x_bar, _, pend, grads = carry
    if last is not None:
      (bars, x0), g0, g1 = last
      x_bar = ends.back_finish(ends_saved, after_bar, x0, bars)
      grads = put(put(grads, g1, 1), g0, 0)
    else:
      if plan.stages == 2 and len(pend) == 2:
        grads = put(grads, transfer.reduce_now(pend[1]), 1)
      # layer 0's reduce-scatter behind before's backward (or at once)
      with in_step(step_label("backward", [plan.backward[-1]])):
        x_bar, g0 = ends.enter_back(transfer, ends_saved, after_bar, x_bar,
                                    pend[0])
      grads = put(grads, g0, 0)
    return x_bar, jax.tree.map(
        lambda G, p_: G if differentiable(p_) else float0_zeros(p_), grads,
        params_)

  run_.defvjp(run_fwd, run_bwd)
  return run_(x, params)


def _saving_loop(loop, step, run_layer, params_, carry, run_, offsets, keep,
                 gather_index):
  """`loop` over the forward steps `run_` that save: each layer's residuals
  are written into stacks carried through the loop, inside the step's
  compute (its free block), not returned as the loop's ys. Returns what
  `loop` returns, the pieces holding the stacks as ys would.

  Why: a step's outputs leave its ordered block through barriers, and a
  residual written into the loop's ys after them is a pass of its own; on
  a TPU v5e those writes were 5.5 ms of the f32 train step against 0.2 ms in
  a plain scan, which fuses each into the op that computes the residual
  (benchmarks/results/chip-2026-12-05/fsdp_profiles). Written inside the
  free block, XLA fuses them there too. Inside shard_map only (the stacks'
  types are then the residuals' with a layer axis; on an explicit mesh
  they would need the residuals' shardings too). Pinned (values and gradients) by
  tests/patterns/fsdp/fsdp_test.py; the write's place by
  tests/patterns/fsdp/fsdp_one_device_test.py."""
  layers = [s.layer for s in run_]
  lo, length = min(layers), max(layers) + 1 - min(layers)
  x0, buf0 = carry
  types = jax.make_jaxpr(
      lambda: jax.tree.leaves(run_layer(x0, buf0[0])[1]))().out_avals
  stacks = [_zeros(t, length) for t in types]
  trees = []

  def body(carry, j):
    (x, buf), stacks = carry

    def compute():
      y, saved = run_layer(x, buf[0])
      leaves, tree = jax.tree.flatten(saved)
      trees.append(tree)
      return y, [lax.dynamic_update_index_in_dim(S, v.astype(S.dtype), j - lo, 0)
                 for S, v in zip(stacks, leaves, strict=True)]
    (x, stacks), got, _, _ = step(compute, params_,
                                  [gather_index(j + o) for o in offsets])
    return ((x, tuple(buf[1:]) + tuple(got)), stacks), (
        buf[0] if keep else None)

  (carry, stacks), pieces = loop(body, (carry, stacks), run_)
  ((first, last, kept, stacked),) = pieces
  return carry, [(first, last, (jax.tree.unflatten(trees[-1], stacks), kept),
                  stacked)]


def step_label(pass_: str, steps) -> str:
  """How the report names the plan steps `steps` of `pass_` (one traced body
  may run several: a loop's), in `fsdp_plan`'s own words, e.g. "forward:
  layer 1 to layer 3 (one loop)" (tests/inspection/plan_step_test.py)."""
  if len(steps) == 1:
    return f"{pass_}: {steps[0].says()}"
  return f"{pass_}: {steps[0].says()} to {steps[-1].says()} (one loop)"


def _zeros(aval, stacked: int | None = None):
  """Zeros of type `aval` (`stacked` of them, along a new first axis),
  varying over its mesh axes (a float0 array for a float0 type)."""
  shape = aval.shape if stacked is None else (stacked, *aval.shape)
  if aval.dtype == jax.dtypes.float0:
    return np.zeros(shape, dtype=jax.dtypes.float0)
  axes = _compat.varying_axes(aval)
  zeros = jnp.zeros(shape, aval.dtype)
  return zeros if not axes else vary_over(zeros, sorted(axes))


def _scan_remainder_first(body, carry, xs, unroll: int):
  """`lax.scan(body, carry, xs, unroll=unroll)`, with the `len(xs) % unroll`
  iterations that do not fill a loop trip run first, unrolled, not after the
  loop as lax.scan runs them.

  Why: XLA's CPU runtime starts a collective that follows a while loop as
  soon as the loop has started, when the collective's operands do not come
  from the loop (our barriers order it in the HLO schedule, but the runtime
  drops barriers), and jax gives every collective the same channel id, which
  keys the rendezvous. The remainder's gathers read only the params, so they
  met the loop's gathers in one rendezvous: the process aborted ("Check
  failed: id < num_threads"), hung, or crashed. Collectives before a loop
  have finished when it starts. See benchmarks/repro_cpu_loop_collectives.py.
  """
  length = jax.tree.leaves(xs)[0].shape[0]
  head = length % unroll
  if not head:
    return lax.scan(body, carry, xs, unroll=unroll)
  split = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], xs)
  carry, ys_head = lax.scan(body, carry, split(0, head), unroll=True)
  if head == length:
    return carry, ys_head
  carry, ys = lax.scan(body, carry, split(head, length), unroll=unroll)
  return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys_head, ys)
