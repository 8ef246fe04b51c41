"""pipeline_loss's arguments, checked where the user made the mistake."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.patterns.leading_axis import wrong_leading_axis


def axis_size(axis) -> int:
  size = _compat.axis_size(axis)
  if size is None:
    raise ValueError(
        f"pipeline_loss(axis={axis!r}): no mesh axis of that name is bound "
        "here; call pipeline_loss inside jax.shard_map over that axis.")
  return size


def check_shapes(stage_params, xs, targets, v: int) -> int:
  """Returns m; raises naming the argument whose leading axis is wrong."""
  bad = wrong_leading_axis(stage_params, v)
  if bad:
    raise ValueError(
        f"stage_params{bad[0]} has shape {bad[1]} inside "
        f"shard_map: its leading axis must be virtual_stages={v} (entry j "
        "is global stage j*p + d on device d). Lay the stack of the p*v "
        "stages out with jax_overlap.pipeline_stage_layout and shard it "
        "over the pipeline axis.")
  if jnp.ndim(xs) < 1:
    raise ValueError(f"xs has shape {jnp.shape(xs)}: expected m microbatches "
                     "stacked on axis 0.")
  m = jnp.shape(xs)[0]
  bad = wrong_leading_axis(targets, m)
  if bad:
    raise ValueError(
        f"targets{bad[0]} has shape {bad[1]}: "
        f"expected the {m} microbatches of xs stacked on axis 0.")
  return m


def check_stage_fn(stage_fn: Callable, loss_fn: Callable, stage_params: Any,
                   xs, targets, axis) -> None:
  """stage_fn keeps the activation's shape and holds no collective over the
  pipeline axis (each device runs another stage: it would wait forever or
  mix stages); loss_fn returns a scalar."""
  one = jax.tree.map(lambda a: a[0], stage_params)
  x = xs[0]
  closed = jax.make_jaxpr(stage_fn)(one, x)
  y = closed.out_avals
  if len(y) != 1 or y[0].shape != x.shape or y[0].dtype != x.dtype:
    got = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in y)
    raise ValueError(
        f"stage_fn must return an array of its input activation's shape and "
        f"dtype, {x.dtype.name}{list(x.shape)}; it returned {got}. Every "
        "stage of a pipeline passes the same activation shape on.")
  names = {axis} if isinstance(axis, str) else set(axis)
  found = _collective_over(closed.jaxpr, names)
  if found:
    raise ValueError(
        f"stage_fn holds a collective over the pipeline axis {axis!r} "
        f"({found}): each device runs another stage at each tick, so no "
        "collective over that axis can run inside a stage. Use another mesh "
        "axis (tensor or FSDP parallelism) inside stage_fn.")
  out = jax.eval_shape(loss_fn, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                           a.shape[1:], a.dtype), targets))
  if not hasattr(out, "shape") or out.shape != ():
    raise ValueError(f"loss_fn must return a scalar (the loss of one "
                     f"microbatch); it returned {out}.")


#: Primitives naming an axis that move no data (type casts, the index).
_NOT_COLLECTIVES = frozenset({"pvary", "pcast", "pbroadcast", "axis_index",
                              "core_call"})


def _collective_over(jaxpr, names) -> str | None:
  for eqn in jaxpr.eqns:
    keys = () if eqn.primitive.name in _NOT_COLLECTIVES else (
        "axis_name", "axes", "axis_names")
    for key in keys:
      val = eqn.params.get(key)
      vals = val if isinstance(val, (tuple, list, frozenset, set)) else (val,)
      if any(isinstance(n, str) and n in names for n in vals):
        return eqn.primitive.name
    for val in eqn.params.values():
      for sub in _subjaxprs(val):
        found = _collective_over(sub, names)
        if found:
          return found
  return None


def _subjaxprs(val):
  if isinstance(val, (tuple, list)):
    for v in val:
      yield from _subjaxprs(v)
    return
  inner = getattr(val, "jaxpr", None)
  if hasattr(val, "eqns"):
    yield val
  elif inner is not None:
    yield from _subjaxprs(inner)
