"""`pipeline_loss`: a pipelined model's mean loss whose gradient the schedule
computes while it runs.

A `custom_vjp`: undifferentiated, the loss runs the forward ticks alone;
under `jax.grad` its forward rule runs the whole schedule (forward and
backward ticks, executor.py) and keeps the gradients, which the backward
rule scales by the loss's cotangent. So the gradient holds inside a larger
loss (an embedding before, a regulariser beside). The gradients are not
differentiable again: a second derivative raises at trace time
(`_first_order_only`; differentiating the executor would hang on its
switches' sends). The rules close over no value pipeline_loss traces:
grad of a jitted program traces them again after that trace
(test_gradient_of_a_jitted_program).
Pinned by tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.patterns.pipeline import checks as _checks
from jax_overlap._src.patterns.pipeline import placing as _placing
from jax_overlap._src.patterns.pipeline.executor import (DISPATCHES, execute,
                                                         reduce_like)
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.pipeline.pieces import model_of
from jax_overlap._src.patterns.pipeline.residuals import check_recompute as _check_recompute
from jax_overlap._src.patterns.pipeline.residuals import choose_recompute
from jax_overlap._src.patterns.pipeline.tick_names import sum_label
from jax_overlap._src.patterns.pipeline.work import (float0_like, is_float,
                                                    with_floats)


def pipeline_loss(stage_fn: Callable, loss_fn: Callable, stage_params: Any,
                  xs, targets, *, axis, schedule: str = "1f1b",
                  virtual_stages: int = 1, send_ticks: int | None = None,
                  before: Callable | None = None, has_aux: bool = False,
                  dispatch: str | None = None, recompute=None,
                  mean_axes=()):
  """The mean over m microbatches of `loss_fn(stages(before(x)), target)`,
  the stages pipelined over the devices of `axis`; call inside
  `jax.shard_map`.

  Args:
    stage_fn: `stage_fn(params, x) -> x`, one stage; the activation's
      structure, shapes and dtypes are kept (a pytree: a hidden state with
      its positions or segment ids). Declaring a keyword `microbatch` (e.g.
      `def stage(params, x, *, microbatch)`) gets the microbatch's index, a
      traced int (fold it into a dropout key). No collective over `axis`
      inside; any other mesh axis is fine (FSDP, tensor, context or expert
      parallelism: see `dispatch`).
    loss_fn: `loss_fn(y, target) -> scalar`, one microbatch's loss on the
      last stage's output (`(scalar, aux)` with `has_aux`). It may close
      over traced values, such as an LM head's weights: their gradients
      flow.
    stage_params: a pytree whose leaves have a leading axis of size
      `virtual_stages` here; entry j on device d is global stage j*p + d,
      for "zb-v" and "dualpipev" entries 0 and 1 are stages d and 2p-1-d
      (`pipeline_stage_layout(..., schedule=schedule)` lays a stack of the
      p*v stages out so).
      Integer and key leaves get float0 gradients.
    xs: a pytree of `[m, ...]` leaves, the microbatches' inputs, the same on
      every device of `axis` (replicated over it; sharded over other axes
      as the batch is).
    targets: a pytree of `[m, ...]` leaves, likewise. Float targets get
      gradients (they may depend on what is differentiated).
    axis: the pipeline's mesh axis, p devices.
    schedule: "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v" or
      "dualpipev" (DualPipeV: a forward and a backward of a device's two
      chunks in one tick in its steady state; m >= 2p) (`pipeline_schedule`
      prints each).
    virtual_stages: v, chunks a device (for "interleaved"; 2 for "zb-v" and
      "dualpipev", whose V puts stages d and 2p-1-d on device d).
    send_ticks: None (default): 1F1B and interleaved run one kind of action
      a tick, forward and backward ticks alternating, so each send is in
      flight over a tick of the other kind and the table has the
      literature's tick count; GPipe, ZB-H1, ZB-V and DualPipeV give each
      send a tick (1).
      An int: each send in flight over that many ticks of its own (0: waited
      for before the next tick). `pipeline_schedule` prints each table.
    before: `before(x) -> activation`, run on the first stage for each
      microbatch's `xs` entry (the embedding: xs may then be token ids).
      It may close over traced values (the embedding table): their
      gradients flow.
    has_aux: `loss_fn` returns `(loss, aux)`; pipeline_loss then returns
      `(mean loss, aux)` with aux's leaves stacked over the m microbatches.
    dispatch: "switch": each device runs only its own action at a tick;
      "lockstep": every device runs the same program at each tick, masked
      (needed when any device of a collective group would otherwise run a
      collective another does not); None (default): "lockstep" where
      `stage_fn`, `loss_fn` or `before` holds a collective, else "switch".
    recompute: what a stage's backward action does for the stage's
      forward, as `jax.checkpoint` would choose. False: the forward action
      keeps the residuals `jax.vjp` of the stage needs (one set a
      microbatch in flight, in the rows the kept stage inputs use, so the
      memory stays flat in m) and the backward applies them: the stage's
      forward runs once a microbatch. True: keep only the stage's input and
      run its forward again in the backward (zero bubble's input and weight
      halves each run it): less memory a microbatch in flight, about a third
      more compute. A `jax.checkpoint` policy (e.g.
      `jax.checkpoint_policies.dots_saveable`): keep what the policy saves,
      recompute the rest (`jax_overlap.all_to_alls_saveable`: keep what the
      stage's all-to-alls received). None (default): True when the program
      is for TPU (the platform of the shard_map's mesh devices, else
      `jax.default_backend()`), or `all_to_alls_saveable` there where the
      stage holds an all-to-all (an MoE layer: a recompute that exchanged
      again would have twice the all-to-alls to hide), False elsewhere: on
      the v5e compiler the pipeline's residual buffers cost more than the
      recompute (the bench's 1F1B modelled 51.1 ms kept against 33.2 ms
      recomputed), on the H100 keeping them is faster (0.89x).
      docs/pipeline.md, "Memory", has what each costs;
      tests/patterns/pipeline/pipeline_residuals_test.py pins the values
      and the forward count, tests/aot/pipeline_compiled_test.py and
      dualpipev_moe_compiled_test.py the default on each compiler.
    mean_axes: a mesh axis name or a tuple of them, not `axis`: the
      data-parallel axes whose devices hold other microbatches (or the same
      ones, as under tensor parallelism). The loss is then also averaged
      over them, as `jax.lax.pmean(pipeline_loss(...), mean_axes)` would
      average it, and is returned invariant over them. Why: the loss's
      cotangent is then the same on each of their devices, so the sum over
      them of each stage weight's gradient (a weight replicated over them)
      no longer waits for the cotangent's scaling: it is started as a
      future once the schedule's ticks end, one a leaf (on TPU, where one
      all-to-all may be in flight, the leaves joined in one), free to run
      beside what is left to compute, and finished at the end (a leaf's
      gradient is final only after the stage's last backward, so what runs
      beside it is that tick's end, not its matmuls). Default ():
      the loss varies over them and the caller `pmean`s it; the sums then
      follow the backward rule's scaling, after everything else.
      Values and gradients equal the pmean's (tests/patterns/pipeline/
      pipeline_mean_axes_test.py; tests/aot/llama_4d_compiled_test.py
      counts the sums' windows).

  Returns:
    The mean loss, the same on every device of `axis`. It is typed as
    varying over every other mesh axis an input varies over, but those of
    `mean_axes`: `pmean` it over a data-parallel, FSDP or tensor axis
    (docs/pipeline.md, "Composing the axes"), or name the axis in
    `mean_axes`. `jax.grad` of it gives the gradients of that mean with
    respect to `stage_params`, `xs`, `targets` and what `loss_fn`,
    `stage_fn` and `before` close over.

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

    Averaged over a data-parallel axis too (the weights replicated over
    'dp', each device of it with its half of each microbatch):

    >>> mesh = jax.make_mesh((2, 2), ('pp', 'dp'),
    ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> @jax.shard_map(mesh=mesh, in_specs=(P('pp'), P(None, 'dp'),
    ...                P(None, 'dp')), out_specs=P())   # no pmean needed
    ... def dp_loss(w, xs, ys):
    ...   return jax_overlap.pipeline_loss(
    ...       lambda w, x: x @ w, lambda y, t: jnp.mean((y - t) ** 2),
    ...       w, xs, ys, axis='pp', mean_axes='dp')
    >>> jax.jit(dp_loss)(w, xs, ys)
    Array(36., dtype=float32)
    >>> jax.jit(jax.grad(dp_loss))(w, xs, ys)[0, 0, 0]
    Array(12., dtype=float32)
  """
  _check_recompute(recompute)
  p = _checks.axis_size(axis)
  m = _checks.check_shapes(stage_params, xs, targets, virtual_stages, axis)
  mean_axes = _mean_axes(mean_axes, axis, xs)
  if dispatch is not None and dispatch not in DISPATCHES:
    raise ValueError(f"pipeline_loss(dispatch={dispatch!r}): expected one of "
                     f"{DISPATCHES} or None (chosen from the model).")
  plan = _placing.pipeline_schedule(schedule, p, m, virtual_stages,
                                 send_ticks=send_ticks)
  forward = _placing.place("forward", p, m, virtual_stages, plan.send_ticks,
                        plan.placement)
  built = model_of(stage_fn, loss_fn, before, has_aux, stage_params, xs,
                   targets, axis)
  dispatch = _checks.choose_dispatch(dispatch, built.model.collective,
                                     built.collective_axes)
  recompute = choose_recompute(recompute, built.exchanges)
  # An axis no input varies over leaves the loss and its gradients alike on
  # its devices: the mean over it is the identity, nothing to sum.
  mean_axes = tuple(a for a in mean_axes if a in built.axes)
  devices = math.prod(_checks.axis_size(a) for a in mean_axes)
  # Everything traced that run's rules use is an input or made inside them:
  # grad of a jitted program traces run_fwd again, after this trace, where a
  # value closed over from here is a leaked tracer (issue 43).
  run_plan = lambda plan_, params, consts, xs_, targets_, grads: execute(
      plan_, built.model, params, consts, xs_, targets_, axis,
      axes=built.axes, with_grads=grads, dispatch=dispatch,
      zero_act=_zeros(built.act_shape), zero_aux=_zeros(built.aux_shape),
      recompute=recompute, mean_axes=mean_axes)

  @jax.custom_vjp
  def run(params, consts, xs, targets):
    return run_plan(forward, params, consts, xs, targets, False)

  def run_fwd(params, consts, xs, targets):
    params, consts, xs, targets = _first_order_only((params, consts, xs, targets))
    loss, aux, *grads = run_plan(plan, params, consts, xs, targets, True)
    return (loss, aux), (grads, (params, consts, xs, targets))

  def run_bwd(res, ct):
    grads, primals = res
    # the aux values get no gradient; the mean over `mean_axes` divides each
    # device's part (the stage weights' parts are summed over them already)
    ct = ct[0] / devices if devices > 1 else ct[0]
    # each device's part scaled by its own cotangent, then summed
    scale = lambda g, like: reduce_like((ct * g).astype(g.dtype), like)
    out = []
    for parts, like, name in zip(grads, primals, _SUMMED):
      floats = [a for a in jax.tree.leaves(like) if is_float(a)]
      # What is replicated over the pipeline axis is summed over it: the
      # report's leaf says so (tick_names.py).
      with (contextlib.nullcontext() if name is None
            else moving(sum_label(f"the gradient of {name}"))):
        summed = [scale(g, f) for g, f in zip(parts, floats)]
      out.append(with_floats(like, summed, float0_like))
    return tuple(out)

  run.defvjp(run_fwd, run_bwd)
  loss, aux = run(stage_params, built.consts, xs, targets)
  return (loss, aux) if has_aux else loss


def _zeros(shapes):
  """Zeros of each `jax.ShapeDtypeStruct` in a pytree, made in the trace
  that calls this."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _mean_axes(mean_axes, axis, xs) -> tuple:
  """`mean_axes` as a tuple of bound mesh axis names, none of them the
  pipeline axis, in a trace that tracks what varies over them; raises
  naming the argument otherwise."""
  names = (mean_axes,) if isinstance(mean_axes, str) else tuple(mean_axes)
  pipeline = {axis} if isinstance(axis, str) else set(axis)
  for name in names:
    if not isinstance(name, str):
      raise TypeError(f"pipeline_loss(mean_axes={mean_axes!r}): expected a mesh "
                      "axis name or a tuple of them.")
    if name in pipeline:
      raise ValueError(
          f"pipeline_loss(mean_axes={mean_axes!r}) names the pipeline axis "
          f"{name!r}: the loss is already the mean over the microbatches the "
          "stages run; name the data-parallel axes only.")
    if _compat.axis_size(name) is None:
      raise ValueError(
          f"pipeline_loss(mean_axes={mean_axes!r}): no mesh axis {name!r} is "
          "bound here; name axes of the enclosing jax.shard_map's mesh.")
  if len(set(names)) != len(names):
    raise ValueError(f"pipeline_loss(mean_axes={mean_axes!r}) names an axis twice.")
  if names and _compat.varying_axes(jax.tree.leaves(xs)[0]) is None:
    raise ValueError(
        f"pipeline_loss(mean_axes={mean_axes!r}) needs the axes each input "
        "varies over, which jax.shard_map(..., check_vma=False) does not "
        "track: it could not tell which weights are replicated over them. "
        "Use check_vma=True (the default), or pmean the loss outside.")
  return names


#: The report's name for the sum of each input's gradient parts, in the
#: order of run's inputs. None for stage_params, sharded over the pipeline
#: axis (a sum over another axis is autodiff's usual one), and for the
#: closed-over values, cast to vary before the custom_vjp (pieces.py names
#: autodiff's sum of their gradients).
_SUMMED = (None, None, "xs", "targets")


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
