"""Runs any `PipelinePlan` inside `shard_map`: one executor for every schedule.

The ticks are unrolled. At each, every device runs its action, chosen by its
axis index (`lax.switch` over the tick's branches; no collective in any
branch), then the tick's sends start as `ppermute_start` futures: one
carrying activations to the next stage, one carrying cotangents back. A send
is finished after the next tick's compute where no device needs it sooner
(buffers.py), so it is in flight while that tick computes. A backward action
recomputes its stage's forward from the stage input it kept (each stage is
rematerialised, as `jax.checkpoint` of it would be), so a device holds one
activation a live microbatch. Values and gradients equal the plain model's:
tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_overlap._src.collectives.api import ppermute_start
from jax_overlap._src.patterns import varying as _varying
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.pipeline import buffers as _buffers
from jax_overlap._src.patterns.pipeline.tick_names import label
from jax_overlap._src.patterns.pipeline.plan import PipelinePlan


def execute(plan: PipelinePlan, stage_fn: Callable, loss_fn: Callable,
            params: Any, xs, targets, axis, *, with_grads: bool):
  """The mean loss and, with_grads, this device's parts of its gradients
  with respect to `params` (its chunks) and `xs`: each part varies over
  every axis an input does, and `reduce_like` sums it to its primal's type
  (after the loss's cotangent scales it: that may vary too)."""
  prog = _buffers.program(plan)
  m = plan.microbatches
  axes = _all_axes((params, xs, targets), axis)
  vary = lambda a: _varying.vary_over(a, axes)
  zero_act = vary(jnp.zeros(xs.shape[1:], xs.dtype))
  state = dict(
      inputs=vary(jnp.zeros((max(prog.slots, 1),) + xs.shape[1:], xs.dtype)),
      dys=vary(jnp.zeros((max(prog.slots, 1),) + xs.shape[1:], xs.dtype)),
      grads=jax.tree.map(lambda a: vary(jnp.zeros_like(a)), params),
      dxs=vary(jnp.zeros_like(xs)),
      loss=vary(jnp.zeros((), jnp.float32)),
  )
  branches = _branches(stage_fn, loss_fn, m, with_grads, zero_act, vary)
  me = jax.lax.axis_index(axis)
  pending = []
  for t, tick in enumerate(prog.ticks):
    with jax.named_scope(f"pipeline_tick_{t}"):   # profiles name the tick
      state, out_fwd, out_bwd = _run_tick(tick, branches, state, params, xs,
                                          targets, me)
      for fut, send, buffer in pending:
        state[buffer] = _write(state[buffer], fut.done(), send.slots, me)
      pending = []
      for send, out, buffer, what in (
          (tick.forward, out_fwd, "inputs", "activations"),
          (tick.backward, out_bwd, "dys", "cotangents")):
        if send is None:
          continue
        with moving(label(t, what, plan.table[t])):   # the report's leaf
          fut = ppermute_start(out, axis, send.perm)
        if send.deferred:
          pending.append((fut, send, buffer))
        else:
          state[buffer] = _write(state[buffer], fut.done(), send.slots, me)
  assert not pending, "a plan's last tick sends nothing"
  loss = jax.lax.psum(state["loss"], axis) / m   # only the last stage's is not 0
  if not with_grads:
    return loss
  return loss, state["grads"], state["dxs"]


def _all_axes(tree, axis) -> tuple:
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


def _pick(table, me):
  return jnp.asarray(table, jnp.int32)[me]


def _write(buffer, value, slots, me):
  slot = _pick(slots, me)
  row = jnp.maximum(slot, 0)
  old = jax.lax.dynamic_index_in_dim(buffer, row, 0, keepdims=False)
  new = jnp.where(slot >= 0, value.astype(buffer.dtype), old)
  return jax.lax.dynamic_update_index_in_dim(buffer, new, row, 0)


def _run_tick(tick, branches, state, params, xs, targets, me):
  present = sorted(set(tick.branch))
  operands = (state, params, xs, targets, _pick(tick.microbatch, me),
              _pick(tick.chunk, me), _pick(tick.slot, me))
  if len(present) == 1:
    return branches[present[0]](operands)
  local = [present.index(b) for b in tick.branch]
  return jax.lax.switch(_pick(local, me), [branches[b] for b in present],
                        operands)


def _branches(stage_fn, loss_fn, m, with_grads, zero_act, vary):
  """The nine actions, each `(state, params, xs, targets, microbatch, chunk,
  slot) -> (state, sent forward, sent back)`; built once, so that jax
  traces each once for every tick's switch."""
  at = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
  put = lambda a, v, i: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0)
  chunk_of = lambda params, j: jax.tree.map(lambda a: at(a, j), params)

  def out(state, fwd=None, bwd=None):
    state = jax.tree.map(vary, state)
    return (state, zero_act if fwd is None else vary(fwd.astype(zero_act.dtype)),
            zero_act if bwd is None else vary(bwd.astype(zero_act.dtype)))

  def idle(ops):
    return out(ops[0])

  def forward(first, last):
    def run(ops):
      state, params, xs, targets, i, j, s = ops
      state = dict(state)
      x = at(xs, i) if first else at(state["inputs"], s)
      if first:
        state["inputs"] = put(state["inputs"], x, s)
      y = stage_fn(chunk_of(params, j), x)
      if not last:
        return out(state, fwd=y)
      target = jax.tree.map(lambda a: at(a, i), targets)
      if with_grads:
        l, dy = jax.value_and_grad(loss_fn)(y, target)
        state["dys"] = put(state["dys"], dy / m, s)
      else:
        l = loss_fn(y, target)
      state["loss"] = state["loss"] + l.astype(jnp.float32)
      return out(state)
    return run

  def backward(first, inputs_grad, weights_grad):
    def run(ops):
      state, params, xs, targets, i, j, s = ops
      state = dict(state)
      x, dy = at(state["inputs"], s), at(state["dys"], s)
      w = jax.tree.map(vary, chunk_of(params, j))
      dx = None
      if inputs_grad and weights_grad:
        _, vjp = jax.vjp(stage_fn, w, x)
        dw, dx = vjp(dy.astype(x.dtype))
      elif inputs_grad:
        _, vjp = jax.vjp(lambda x_: stage_fn(w, x_), x)
        (dx,) = vjp(dy.astype(x.dtype))
      else:
        _, vjp = jax.vjp(lambda w_: stage_fn(w_, x), w)
        (dw,) = vjp(dy.astype(x.dtype))
      if weights_grad:
        state["grads"] = jax.tree.map(lambda g, d: put(g, at(g, j) + d, j),
                                      state["grads"], dw)
      if dx is None:
        return out(state)
      if first:
        state["dxs"] = put(state["dxs"], dx, i)
        return out(state)
      return out(state, bwd=dx)
    return run

  B = _buffers
  table = {B.IDLE: idle, B.F_FIRST: forward(True, False),
           B.F_MID: forward(False, False), B.F_LAST: forward(False, True),
           B.B_FIRST: backward(True, True, True), B.B_MID: backward(False, True, True),
           B.I_FIRST: backward(True, True, False), B.I_MID: backward(False, True, False),
           B.W_ANY: backward(False, False, True)}
  return [table[k] for k in range(9)]
