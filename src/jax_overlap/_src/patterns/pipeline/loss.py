"""`pipeline_loss`: a pipelined model's mean loss whose gradient the schedule
computes while it runs.

A `custom_vjp`: undifferentiated, the loss runs the forward ticks alone;
under `jax.grad` its forward rule runs the whole schedule (forward and
backward ticks, executor.py) and keeps the gradients, which the backward
rule scales by the loss's cotangent. So the gradient holds inside a larger
loss (an embedding before, a regulariser beside). The gradients are not
differentiable again: a second derivative raises at trace time
(`_first_order_only`; differentiating the executor would hang on its
switches' sends). Pinned by tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jax_overlap._src.patterns.pipeline import checks as _checks
from jax_overlap._src.patterns.pipeline import plan as _plan
from jax_overlap._src.patterns.pipeline.executor import execute, reduce_like


def pipeline_loss(stage_fn: Callable, loss_fn: Callable, stage_params: Any,
                  xs, targets, *, axis, schedule: str = "1f1b",
                  virtual_stages: int = 1, send_ticks: int = 1):
  """The mean over m microbatches of `loss_fn(stages(x), target)`, the
  stages pipelined over the devices of `axis`; call inside `jax.shard_map`.

  Args:
    stage_fn: `stage_fn(params, x) -> x`, one stage; the activation's shape
      and dtype are kept. No collective over `axis` inside (another mesh
      axis, for FSDP or tensor parallelism, is fine).
    loss_fn: `loss_fn(y, target) -> scalar`, one microbatch's loss.
    stage_params: a pytree whose leaves have a leading axis of size
      `virtual_stages` here; entry j on device d is global stage j*p + d
      (`pipeline_stage_layout` lays a stack of the p*v stages out so).
    xs: `[m, ...]`, the microbatches' inputs, the same on every device.
    targets: a pytree of `[m, ...]` leaves, the same on every device.
    axis: the pipeline's mesh axis, p devices.
    schedule: "gpipe", "1f1b", "interleaved" or "zb-h1"
      (`pipeline_schedule` prints each).
    virtual_stages: v, chunks a device (for "interleaved").
    send_ticks: 1 (default): each stage-to-stage send is in flight while the
      next tick computes, for a longer table (`pipeline_schedule(...,
      send_ticks=1)`); 0: each send is waited for before the next tick, the
      literature's table.

  Returns:
    The mean loss, the same on every device of `axis`. It is typed as
    varying over every other mesh axis an input varies over: `pmean` it
    over a data-parallel, FSDP or tensor axis (tests/patterns/pipeline/
    pipeline_tp_test.py). `jax.grad` of it with respect to `stage_params`
    and `xs` gives the gradients of that mean.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('pp',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> w = jnp.stack([jnp.eye(3) * 2.0, jnp.eye(3) * 3.0])  # 2 stages
    >>> xs, ys = jnp.ones((4, 2, 3)), jnp.zeros((4, 2, 3))   # m = 4
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P('pp'), P(), P()), out_specs=P())
    ... def loss(w, xs, ys):
    ...   return jax_overlap.pipeline_loss(
    ...       lambda w, x: x @ w,
    ...       lambda y, t: jnp.mean((y - t) ** 2), w, xs, ys, axis='pp')
    >>> loss(w, xs, ys)
    Array(36., dtype=float32)
  """
  p = _checks.axis_size(axis)
  m = _checks.check_shapes(stage_params, xs, targets, virtual_stages)
  plan = _plan.pipeline_schedule(schedule, p, m, virtual_stages,
                                 send_ticks=send_ticks)
  forward = _plan.place("forward", p, m, virtual_stages, send_ticks)
  _checks.check_stage_fn(stage_fn, loss_fn, stage_params, xs, targets, axis)

  @jax.custom_vjp
  def run(params, xs, targets):
    return execute(forward, stage_fn, loss_fn, params, xs, targets, axis,
                   with_grads=False)

  def run_fwd(params, xs, targets):
    params, xs = _first_order_only((params, xs))
    loss, grads, dxs = execute(plan, stage_fn, loss_fn, params, xs, targets,
                               axis, with_grads=True)
    return loss, (grads, dxs, params, xs)

  def run_bwd(res, ct):
    grads, dxs, params, xs = res
    # each device's part scaled by its own cotangent, then summed
    scale = lambda g, like: reduce_like((ct * g).astype(g.dtype), like)
    # targets get no gradient (None: a zero cotangent, integer labels too)
    return jax.tree.map(scale, grads, params), scale(dxs, xs), None

  run.defvjp(run_fwd, run_bwd)
  return run(stage_params, xs, targets)


@jax.custom_jvp
def _first_order_only(tree):
  """The identity; differentiated (the forward rule's inputs carry tangents
  only under a second derivative) it raises."""
  return tree


@_first_order_only.defjvp
def _refuse_second_order(primals, tangents):
  raise NotImplementedError(
      "pipeline_loss has first derivatives only (jax.grad, jax.value_and_grad, "
      "jax.vjp): its gradient is computed by the schedule's backward ticks, "
      "which are not differentiable again, so a second derivative (jax.hessian, "
      "grad of grad, jvp of grad) is refused. Differentiate a sequential "
      "model (no pipeline) for higher derivatives.")
