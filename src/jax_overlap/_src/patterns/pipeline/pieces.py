"""The user's stage, loss and embedding as the executor calls them.

Each is traced once here, on values typed exactly as the executor passes
them (every float varying over every mesh axis an input varies over), which
tells what they hold: a collective over the pipeline axis (refused), over
another axis (the model then runs in lockstep), and what `loss_fn`,
`before` and `stage_fn` close over. Closed-over traced values (an LM head,
an embedding table, a stage's shared scale) become explicit inputs, the
floats with gradients (stage_fn's only where it closes over a traced
value; test_stage_closing_over_traced_values): the
traced program is evaluated again with them cast to vary like the
activations, so that each device's backward keeps its own part of their
gradient (summed once, as for the stage parameters) instead of jax summing
it inside every microbatch's backward. Pinned by
tests/patterns/pipeline/pipeline_compose_test.py and pipeline_loss_test.py.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.remat_policy import all_to_alls_saveable
from jax_overlap._src.patterns import varying as _varying
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.pipeline import checks as _checks
from jax_overlap._src.patterns.pipeline.executor import all_axes
from jax_overlap._src.patterns.pipeline.tick_names import sum_label
from jax_overlap._src.patterns.pipeline.work import Model, is_float


@dataclasses.dataclass(frozen=True)
class Built:
  model: Model
  consts: Any            # (embedding's, loss's, stage's) closed-over tracers
  act_shape: Any         # the activation pytree, jax.ShapeDtypeStructs
  aux_shape: Any         # loss_fn's aux pytree, jax.ShapeDtypeStructs
  axes: tuple            # every mesh axis an input varies over
  collective_axes: dict  # piece -> the axes its collectives name
  exchanges: bool = False  # the stage holds an all-to-all (residuals.py)


def model_of(stage_fn: Callable, loss_fn: Callable, before: Callable | None,
             has_aux: bool, stage_params, xs, targets, axis) -> Built:
  axes = all_axes((stage_params, xs, targets), axis)
  while True:
    built = _trace(stage_fn, loss_fn, before, has_aux, stage_params, xs,
                   targets, axis, axes)
    wider = all_axes((stage_params, xs, targets, built.consts), axis)
    if wider == axes:
      return built
    axes = wider


def _varies(a) -> bool:
  return not jnp.issubdtype(a.dtype, jax.dtypes.extended)


def _trace(stage_fn, loss_fn, before, has_aux, stage_params, xs, targets, axis,
           axes) -> Built:
  vary = lambda t: jax.tree.map(
      lambda a: _varying.vary_over(a, axes) if _varies(a) else a, t)
  first = lambda t: jax.tree.map(lambda a: a[0], t)
  raw, target = vary(first(xs)), vary(first(targets))
  i0 = vary(jnp.zeros((), jnp.int32))
  found = {}
  if before is None:
    embed, embed_consts, act = None, [], raw
  else:
    embed, embed_consts, act, found["embed"] = _convert(
        lambda r: before(r), (raw,), "before", vary)
    act = vary(act)   # as the executor's buffers hold it
  stage = _stage_call(stage_fn)
  chunk = vary(first(stage_params))
  closed, out = jax.make_jaxpr(stage, return_shape=True)(chunk, act, i0)
  _checks.check_stage_output(act, out)
  found["stage"] = _checks.collective_axes(_compat.open_jaxpr(closed))
  exchanges = _checks.saves_any(_compat.open_jaxpr(closed), all_to_alls_saveable)
  if any(isinstance(c, core.Tracer) for c in _compat.jaxpr_consts(closed)):
    # stage_fn closes over traced values (a shared weight, a traced scale,
    # a step count): given as inputs like loss_fn's, they do not leak into
    # the custom_vjp's rules, and the floats get gradients (the executor
    # differentiates the stage with respect to `consts`; ints get float0).
    run_stage, stage_consts, _, _ = _convert(stage, (chunk, act, i0),
                                             "stage_fn", vary)
  else:   # the common case: the user's function as written
    run_stage, stage_consts = lambda consts, w, x, i: stage(w, x, i), []
  pair = (lambda y, t: loss_fn(y, t)) if has_aux else (
      lambda y, t: (loss_fn(y, t), ()))
  loss, loss_consts, (l, aux), found["loss"] = _convert(
      pair, (vary(jax.tree.map(jnp.zeros_like, act)), target), "loss_fn", vary)
  _checks.check_loss_output(l, has_aux)
  for piece, names in found.items():
    _checks.refuse_pipeline_collective(piece, names, axis)
  # Shapes, not zeros: a value made here belongs to this trace, and the
  # custom_vjp's forward rule, traced again when grad linearizes a jitted
  # program, would hold it as a leaked tracer (loss.py makes the zeros there).
  shapes = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
  # The closed-over floats vary like the activations; the others keep the
  # type they were traced with (an int the program mixes with a constant).
  floats = lambda cs: [vary(c) if is_float(c) else c for c in cs]
  model = Model(
      stage=lambda w, consts, x, i: run_stage(floats(consts[2]), w, x, i),
      embed=None if embed is None else (
          lambda consts, r: embed(floats(consts[0]), vary(r))),
      loss=lambda consts, y, t: loss(floats(consts[1]), vary(y), vary(t)),
      collective=frozenset(k for k, v in found.items() if v))
  return Built(model, (embed_consts, loss_consts, stage_consts), shapes(act),
               shapes(aux), axes, found, exchanges)


def _stage_call(stage_fn):
  """`(params, x, i) -> y`, passing `microbatch=i` where stage_fn takes it."""
  try:
    sig = inspect.signature(stage_fn)
  except (TypeError, ValueError):
    sig = None
  takes = sig is not None and any(
      p.name == "microbatch" or p.kind == p.VAR_KEYWORD
      for p in sig.parameters.values())
  if takes:
    return lambda w, x, i: stage_fn(w, x, microbatch=i)
  return lambda w, x, i: stage_fn(w, x)


def _convert(fn, args, name, vary):
  """(call, consts, example output, collective axes): `call(consts, *args)`
  evaluates `fn`'s traced program with its closed-over floats given."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  jaxpr = _compat.open_jaxpr(closed)
  values = _compat.jaxpr_consts(closed)
  # Every traced const is given: one closed over here would leak into the
  # custom_vjp's forward rule, which grad of a jitted program traces after
  # this trace (issue 43). Non-float ones (an int, a key) get float0
  # gradients and stay as they are.
  free = [isinstance(c, core.Tracer) for c in values]
  # Cast to vary here, outside pipeline_loss's custom_vjp, so autodiff sums
  # their gradients' parts: the report's leaf names that sum (tick_names.py).
  with moving(sum_label(f"the gradient of what {name} closes over")):
    consts = [vary(c) if is_float(c) else c for c, f in zip(values, free) if f]
  fixed = [c for c, f in zip(values, free) if not f]
  out_tree = jax.tree.structure(out_shape)

  def call(given, *call_args):
    given, fixed_it = iter(given), iter(fixed)
    env_consts = [next(given) if f else next(fixed_it) for f in free]
    flat = jax.tree.leaves(call_args)
    return jax.tree.unflatten(out_tree, _varying.eval_with_varying_consts(jaxpr, env_consts, flat))

  example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
  return call, consts, example, _checks.collective_axes(jaxpr)
