"""`fsdp_scan`'s one executor: runs a plan's runs under one custom VJP, and
reads nothing else of the schedule.

A pass (the forward pass with a gradient, "forward"; without one,
"primal"; "backward") is the plan's runs of that pass in order
(plan_steps.Run), and each kind of run is one function below (`_FORWARD`,
`_BACKWARD`) that does what the run's fields say. A split run (layer 0's
transfers in groups by first use, use_order.py) that finds the traced layer
gives one group hands the rest of its pass to the runs the plan lists as
its `otherwise`. What the functions share is mechanism, not schedule: a
step's compute with its transfers in flight (`_Executor.step`), a run of
layer steps as a loop or one by one (`_Executor.loop`), and where the
forward pass left each layer's residuals (`_Saved`). Values and gradients
equal `lax.scan`'s for every plan (tests/patterns/fsdp/fsdp_plan_test.py,
fsdp_memory_knobs_test.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap._src import _compat

from jax_overlap._src.ordering import barrier_op
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.fsdp import use_order
from jax_overlap._src.patterns.fsdp.layer_inputs import (differentiable,
                                                         float0_zeros,
                                                         without_float0)
from jax_overlap._src.patterns.fsdp.one_layer import (Splits, layer_at,
                                                      layer_backward,
                                                      layer_forward)
from jax_overlap._src.patterns.fsdp.stack_ends import NO_ENDS, saved_of
from jax_overlap._src.patterns.fsdp.transfer_protocol import Transfer
from jax_overlap._src.patterns.leaf_scope import in_step
from jax_overlap._src.patterns.varying import vary_over

#: What a split run returns where the traced layer gives one group.
_ONE_GROUP = object()


def run(plan, layer, x, params, transfer: Transfer, remat_policy,
        ends=NO_ENDS):
  """`fsdp_scan`'s result under `plan` (with its custom gradient). `x` is
  what `ends` reads (with `StackEnds`: x, the hoisted values and the ends'
  consts; else the stack's carry)."""
  ex = _Executor(plan, layer, transfer, remat_policy, ends)

  @jax.custom_vjp
  def run_(x, params_):
    return ex.forward(x, params_, save=False)[0]

  def run_fwd(x, params_):
    y, saved = ex.forward(x, params_, save=True)
    return y, (saved, params_)

  def run_bwd(residuals, out_bar):
    return ex.backward(residuals, out_bar)

  run_.defvjp(run_fwd, run_bwd)
  return run_(x, params)


class _Forward:
  """A forward pass's state as its runs go."""

  def __init__(self, x_run, params, save: bool):
    self.x_run, self.params, self.save = x_run, params, save
    self.carry = None        # (x, buffer of gathered layers)
    self.pieces = []         # (first layer, last + 1, (saved, kept), stacked)
    self.entered = self.left = self.kept_last = self.out = None


class _Backward:
  """The backward pass's state as its runs go: `carry` is (x's cotangent,
  buffer of regathered layers, pending transfers, gradients)."""

  def __init__(self, params, saved, ends_saved, kept_last, out_bar):
    self.params, self.saved, self.ends_saved = params, saved, ends_saved
    self.kept_last, self.out_bar = kept_last, out_bar
    self.carry = self.after_bar = self.x_bar = self.grads = None


class _Executor:
  """What the runs share: the plan, the layer (split by weights, traced
  once a type), the transfer and the stack's ends."""

  def __init__(self, plan, layer, transfer: Transfer, remat_policy, ends):
    self.plan, self.n = plan, plan.n_layers
    self.transfer, self.remat_policy, self.ends = transfer, remat_policy, ends
    self.splits = Splits(layer)
    self.layer = layer
    self.x_avals = []   # x's types as one layer sees them (for the backward)

  # --- the passes ----------------------------------------------------------

  def forward(self, x_run, params, save: bool):
    f = _Forward(x_run, params, save)
    self.walk(self.plan.runs["forward" if save else "primal"], _FORWARD, f)
    return f.out, (f.pieces, saved_of(self.ends, f.entered, f.left, x_run),
                   f.kept_last)

  def backward(self, residuals, out_bar):
    (pieces, ends_saved, kept_last), params = residuals
    if self.plan.fence_inputs:
      # The backward pass reads the stack through a barrier: else a regather
      # can be the very op of a forward gather (same layer, same operand) and
      # XLA merges the two starts, which have two dones (the H100 compiler's
      # verifier refused 6 layers with prefetch=3 so). `barrier_op.barrier`
      # keeps each leaf's type: jax < 0.12's own barrier made a replicated
      # leaf vary over the axis, and its gradient then broke the custom
      # vjp's type (fsdp_replicated_leaf_test).
      leaves, tree = jax.tree.flatten(params)
      params = jax.tree.unflatten(tree, barrier_op.barrier(leaves))
    b = _Backward(params, _Saved(pieces), ends_saved, kept_last, out_bar)
    # Integer, boolean and key parts of xs have float0 cotangents: a scalar
    # stands in their stack during the loop, float0 zeros come back.
    b.grads = jax.tree.map(
        lambda p: jnp.zeros_like(p) if differentiable(p) else jnp.zeros(()),
        params)
    self.walk(self.plan.runs["backward"], _BACKWARD, b)
    return b.x_bar, jax.tree.map(
        lambda G, p: G if differentiable(p) else float0_zeros(p), b.grads,
        params)

  def walk(self, runs, kinds, state):
    """Each run by its kind's function; a split run that finds one group
    hands the rest of the pass to its `otherwise`."""
    for r in runs:
      if kinds[r.kind](self, r, state) is _ONE_GROUP:
        return self.walk(r.otherwise, kinds, state)
    return None

  # --- what the runs share -------------------------------------------------

  def layer_fn(self, save: bool):
    """The layer as a forward step runs it: `(y, saved)` (saved None
    without a gradient)."""
    def run_layer(x, w):
      if not save:
        return self.layer(x, w), None
      self.x_avals[:] = [jax.tree.map(jax.typeof, x)]
      return layer_forward(self.splits, self.remat_policy, x, w)
    return run_layer

  def layer_back(self, pullback, w, y_bar):
    return layer_backward(self.splits, pullback, w, self.x_avals[0], y_bar)

  def step(self, compute, stack, gathers, scatter=None, reduce=None):
    """`compute()` with the gathers of the layers `gathers` of `stack` (and the
    reduce-scatter / all-reduce) in flight. Returns (out, gathered list,
    scattered, reduced). Several gathers: nested ordered steps.

    With `plan.fence_inputs` the step's inputs are fenced together before its
    first operation, so its gathers start at this step, not before (plan_steps.py
    says where and why)."""
    shards = [layer_at(stack, g) for g in gathers]
    steps = lambda: self._nested_steps(compute, shards, scatter, reduce)
    if not self.plan.fence_inputs:
      return steps()
    return program_order(enforce=True, strict_in_out=(True, False))(steps)()

  def _nested_steps(self, compute, shards, scatter=None, reduce=None):
    if len(shards) > 1:
      def inner():
        out, more, _, _ = self._nested_steps(compute, shards[1:])
        return out, more
    else:
      inner = lambda: (compute(), [])
    first = shards[0] if shards else None
    if self.plan.stages == 2 and (scatter is not None or reduce is not None):
      (out, more), got, scattered, reduced = self.transfer.step2(
          inner, gather=first, scatter=scatter, reduce=reduce)
    else:
      (out, more), got, scattered = self.transfer.step(inner, gather=first,
                                                       scatter=scatter)
      reduced = None
    return out, ([got] if shards else []) + more, scattered, reduced

  def loop(self, body, carry, run, pass_: str, descending: bool = False):
    """`body` over the run's steps (consecutive layers): one `lax.scan`
    where the run loops, else one call each, each inside its step's
    `in_step` scope (the report names them). Returns the carry and the
    pieces of what the bodies saved: `(first layer, last + 1, saved,
    stacked)`."""
    if not run.loop:
      pieces = []
      for s in run.steps:
        with in_step(step_label(pass_, [s])):
          carry, saved = body(carry, s.layer)
        pieces.append((s.layer, s.layer + 1, saved, False))
      return carry, pieces
    layers = [s.layer for s in run.steps]
    index = jnp.arange(layers[0], layers[-1] + (-1 if descending else 1),
                       -1 if descending else 1)
    with in_step(step_label(pass_, run.steps)):
      carry, saved = _scan_remainder_first(body, carry, index,
                                           self.plan.unroll)
    return carry, [(min(layers), max(layers) + 1, saved, True)]


class _Saved:
  """Where the forward pass left each layer's residuals: its pieces, each
  `(first layer, last + 1, (saved, kept weights), stacked)`."""

  def __init__(self, pieces):
    self.pieces = pieces

  def piece_of(self, i: int) -> int:
    return next(k for k, (lo, hi, _, _) in enumerate(self.pieces)
                if lo <= i < hi)

  def at(self, i, part: int, piece: int | None = None):
    """Layer i's pullback (`part` 0) or kept weights (1); `piece`: where
    layer i is saved (given for a traced i)."""
    lo, _, ys, stacked = self.pieces[self.piece_of(i) if piece is None
                                     else piece]
    return layer_at(ys[part], i - lo) if stacked else ys[part]


# --- the forward pass's runs -------------------------------------------------------


def _enter(ex, run, f: _Forward):
  with in_step(step_label("forward", run.steps)):
    x, w0, f.entered = ex.ends.enter(ex.transfer, f.x_run,
                                     layer_at(f.params, 0), f.save)
  f.carry = (x, (w0,))


def _enter_split(ex, run, f: _Forward):
  with in_step(step_label("forward", run.steps)):
    first = use_order.forward_first(
        ex.transfer, ex.layer_fn(f.save),
        lambda: ex.ends.enter_compute(f.x_run, f.save),
        layer_at(f.params, 0), layer_at(f.params, 1))
  if first is None:
    return _ONE_GROUP
  x, saved0, f.entered, w1 = first
  f.carry = (x, (w1,))
  f.pieces.append((0, 1, (saved0, None), False))
  return None


def _layers(ex, run, f: _Forward):
  run_layer = ex.layer_fn(f.save)
  index = (lambda i: jnp.minimum(i, ex.n - 1)) if run.clamp else (lambda i: i)
  if run.stacks:
    f.carry, more = _saving_loop(ex, run, run_layer, f.params, f.carry, index)
  else:
    def body(carry, j):
      x, buf = carry
      (x, saved), got, _, _ = ex.step(lambda: run_layer(x, buf[0]), f.params,
                                      [index(j + o) for o in run.gathers])
      return (x, tuple(buf[1:]) + tuple(got)), (saved, buf[0] if run.keep
                                                else None)
    f.carry, more = ex.loop(body, f.carry, run, "forward")
  f.pieces += more


def _leave(ex, run, f: _Forward):
  # `again`: the last step's gather (of its own layer) is the kept copy.
  f.kept_last = f.carry[1][0] if run.again else None
  f.out, f.left = ex.ends.leave(f.carry[0], f.x_run, f.save)


_FORWARD = {"enter": _enter, "enter_split": _enter_split, "layers": _layers,
            "leave": _leave}


def _saving_loop(ex, run, run_layer, params, carry, index):
  """`ex.loop` over the forward steps of `run`, which save: each layer's
  residuals are written into stacks carried through the loop, inside the
  step's compute (its free block), not returned as the loop's ys. Returns
  what `ex.loop` returns, the pieces holding the stacks as ys would.

  Why: a step's outputs leave its ordered block through barriers, and a
  residual written into the loop's ys after them is a pass of its own; a
  plain scan fuses each write into the op that computes the residual
  (docs/fsdp.md, "On a TPU v5e"). Written inside the free block, XLA fuses
  them there too. Inside shard_map only (the stacks' types are then the
  residuals' with a layer axis; on an explicit mesh they would need the
  residuals' shardings too). Pinned (values and gradients) by
  tests/patterns/fsdp/fsdp_test.py; the write's place by
  tests/patterns/fsdp/fsdp_one_device_test.py."""
  layers = [s.layer for s in run.steps]
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
    (x, stacks), got, _, _ = ex.step(compute, params,
                                     [index(j + o) for o in run.gathers])
    return ((x, tuple(buf[1:]) + tuple(got)), stacks), (
        buf[0] if run.keep else None)

  (carry, stacks), pieces = ex.loop(body, (carry, stacks), run, "forward")
  ((first, last, kept, stacked),) = pieces
  return carry, [(first, last, (jax.tree.unflatten(trees[-1], stacks), kept),
                  stacked)]


# --- the backward pass's runs ------------------------------------------------------


def _put(grads, g, i):
  return jax.tree.map(lambda G, g: lax.dynamic_update_index_in_dim(G, g, i, 0)
                      if G.ndim else G, grads, g)


def _leave_back(ex, run, b: _Backward):
  # after's backward with the last layer's regather in flight
  with _in_steps("backward", run.steps):
    y_bar, w, b.after_bar = ex.ends.leave_back(
        ex.transfer, b.ends_saved, b.out_bar,
        layer_at(b.params, ex.n - 1) if run.gathers else None)
  b.carry = (y_bar, (w,) if run.gathers else (), (), b.grads)


def _layers_back(ex, run, b: _Backward):
  if run.again:   # the kept copy in the buffer, a zero gradient pending
    y_bar, _, _, grads = b.carry
    g_types = jax.make_jaxpr(lambda: ex.layer_back(
        b.saved.at(ex.n - 1, 0), b.kept_last, y_bar)[1])().out_avals
    b.carry = (y_bar, (b.kept_last,), (without_float0(jax.tree.unflatten(
        jax.tree.structure(b.kept_last), [_zeros(t) for t in g_types])),),
               grads)
  piece = b.saved.piece_of(run.steps[0].layer)
  fenced = ex.plan.fence_inputs
  index = (lambda i: jnp.maximum(i, 0)) if run.clamp else (lambda i: i)

  def body(carry, i):
    x_bar, buf, pend, grads = carry
    # Layer i's residuals: read inside the step, or, with fenced inputs,
    # before it (the fence then holds one layer's, not the stack).
    saved = (lambda: b.saved.at(i, 0, piece)) if not fenced \
        else (lambda one=b.saved.at(i, 0, piece): one)
    if run.kept:
      w = b.saved.at(i, 1, piece)
    else:
      w, buf = buf[0], tuple(buf[1:])
    scatter = pend[0] if run.pending >= 1 else None
    reduce = pend[1] if run.pending >= 2 else None
    (x_bar, g), got, scattered, reduced = ex.step(
        lambda: ex.layer_back(saved(), w, x_bar), b.params,
        [index(i + o) for o in run.gathers], scatter=scatter, reduce=reduce)
    if ex.plan.stages == 2:
      # scattered: layer i+1's shard, all-reduced at the next step;
      # reduced: layer i+2's final gradient.
      if reduced is not None:
        grads = _put(grads, reduced, i + 2)
      pend = (without_float0(g),) + (
          (scattered,) if scattered is not None else ())
    else:
      if scattered is not None:   # (again: n - 1 is written again)
        grads = _put(grads, scattered, jnp.minimum(i + 1, ex.n - 1))
      pend = (without_float0(g),)
    return (x_bar, buf + tuple(got), pend, grads), None

  b.carry, _ = ex.loop(body, b.carry, run, "backward", descending=True)


def _back_split(ex, run, b: _Backward):
  # layer 0's gradients reduce-scattered by use
  (split,) = run.steps
  x_bar, buf, pend, grads = b.carry
  w0 = b.saved.at(0, 1) if split.weights == "kept" else buf[0]
  with in_step(step_label("backward", run.steps)):
    last = use_order.backward_first(
        ex.transfer, ex.layer_back, b.saved.at(0, 0), w0, x_bar, pend[0],
        lambda x0: ex.ends.back_compute(b.ends_saved, x0))
  if last is None:
    return _ONE_GROUP
  (bars, x0), g0, g1 = last
  b.x_bar = ex.ends.back_finish(b.ends_saved, b.after_bar, x0, bars)
  b.grads = _put(_put(grads, g1, 1), g0, 0)
  return None


def _reduce(ex, run, b: _Backward):
  x_bar, buf, pend, grads = b.carry
  b.carry = (x_bar, buf, pend, _put(grads, ex.transfer.reduce_now(pend[1]), 1))


def _enter_back(ex, run, b: _Backward):
  # layer 0's reduce-scatter behind before's backward (or at once)
  x_bar, _, pend, grads = b.carry
  with in_step(step_label("backward", run.steps)):
    b.x_bar, g0 = ex.ends.enter_back(ex.transfer, b.ends_saved, b.after_bar,
                                     x_bar, pend[0])
  b.grads = _put(grads, g0, 0)


_BACKWARD = {"leave_back": _leave_back, "layers_back": _layers_back,
             "back_split": _back_split, "reduce": _reduce,
             "enter_back": _enter_back}


# --- helpers -----------------------------------------------------------------------


def step_label(pass_: str, steps) -> str:
  """How the report names the plan steps `steps` of `pass_` (one traced body
  may run several: a loop's), in `fsdp_plan`'s own words, e.g. "forward:
  layer 1 to layer 3 (one loop)" (tests/inspection/plan_step_test.py)."""
  if len(steps) == 1:
    return f"{pass_}: {steps[0].says()}"
  return f"{pass_}: {steps[0].says()} to {steps[-1].says()} (one loop)"


def _in_steps(pass_: str, steps):
  """`in_step` of the steps' label; none for no steps."""
  return in_step(step_label(pass_, steps)) if steps else contextlib.nullcontext()


def _zeros(aval, stacked: int | None = None):
  """Zeros of type `aval` (`stacked` of them, along a new first axis),
  varying over its mesh axes (a float0 array for a float0 type)."""
  shape = aval.shape if stacked is None else (stacked, *aval.shape)
  if aval.dtype == jax.dtypes.float0:
    return np.zeros(shape, dtype=jax.dtypes.float0)
  axes = _compat.varying_axes(aval)
  zeros = jnp.zeros(shape, aval.dtype)
  return zeros if not axes else vary_over(zeros, sorted(axes))


def _scan_remainder_first(body, carry, xs, unroll: int) -> Any:
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
