"""pipeline_loss's arguments, checked where the user made the mistake."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.patterns import varying as _varying
from jax_overlap._src.patterns.leading_axis import wrong_leading_axis


def axis_size(axis) -> int:
  size = _compat.axis_size(axis)
  if size is None:
    raise ValueError(
        f"pipeline_loss(axis={axis!r}): no mesh axis of that name is bound "
        "here; call pipeline_loss inside jax.shard_map over that axis.")
  return size


def check_shapes(stage_params, xs, targets, v: int, axis) -> int:
  """Returns m; raises naming the argument whose leading axis is wrong, or
  that is sharded over the pipeline axis."""
  bad = wrong_leading_axis(stage_params, v)
  if bad:
    raise ValueError(
        f"stage_params{bad[0]} has shape {bad[1]} inside "
        f"shard_map: its leading axis must be virtual_stages={v} (entry j "
        "is global stage j*p + d on device d; for schedule='zb-v' or "
        "'dualpipev' stages d and 2p-1-d). Lay the stack of the p*v stages "
        "out with jax_overlap.pipeline_stage_layout (passing the schedule "
        "for ZB-V and DualPipeV) and shard it over the pipeline axis.")
  leaves = jax.tree.leaves(xs)
  if not leaves or any(jnp.ndim(a) < 1 for a in leaves):
    got = [jnp.shape(a) for a in leaves]
    raise ValueError(f"xs has leaves of shapes {got}: expected the m "
                     "microbatches stacked on axis 0 of every leaf.")
  m = jnp.shape(leaves[0])[0]
  names = {axis} if isinstance(axis, str) else set(axis)
  for name, tree in (("xs", xs), ("targets", targets)):
    bad = wrong_leading_axis(tree, m)
    if bad:
      raise ValueError(
          f"{name}{bad[0]} has shape {bad[1]}: expected the {m} microbatches "
          "of xs stacked on axis 0.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      over = names & _varying.varying(leaf)
      if over:
        raise ValueError(
            f"{name}{jax.tree_util.keystr(path)} is sharded over the pipeline "
            f"axis {sorted(over)[0]!r} (its in_specs entry names it): every "
            f"stage reads all {m} microbatches, so {name} must be the same on "
            "every device of the pipeline axis. Give it an in_specs entry "
            "without that axis (e.g. P(), or P(None, 'data') to shard the "
            "batch over another axis).")
  return m


def check_stage_output(x, out) -> None:
  """stage_fn keeps the activation's structure, shapes and dtypes."""
  same = (jax.tree.structure(x) == jax.tree.structure(out) and all(
      jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
      for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(out))))
  if not same:
    show = lambda t: jax.tree.map(
        lambda a: f"{jnp.result_type(a).name}{list(jnp.shape(a))}", t)
    raise ValueError(
        f"stage_fn must return an activation of its input's structure, shapes "
        f"and dtypes, {show(x)}; it returned {show(out)}. Every stage of a "
        "pipeline passes the same activation on (an embedding goes in "
        "`before=`, a head in `loss_fn`).")


def check_loss_output(loss, has_aux: bool) -> None:
  if not hasattr(loss, "shape") or loss.shape != ():
    what = "(scalar, aux)" if has_aux else "a scalar"
    raise ValueError(f"loss_fn must return {what} (the loss of one "
                     f"microbatch); it returned a loss of {loss}.")


_FN = {"stage": "stage_fn", "loss": "loss_fn", "embed": "before"}


def refuse_pipeline_collective(piece: str, names: frozenset, axis) -> None:
  """No collective over the pipeline axis in a piece: each device runs
  another stage at each tick, so it would wait forever or mix stages."""
  if names & ({axis} if isinstance(axis, str) else set(axis)):
    raise ValueError(
        f"{_FN[piece]} holds a collective over the pipeline axis {axis!r}: "
        "each device runs another stage at each tick, so no collective over "
        "that axis can run inside a stage. Use another mesh axis (tensor or "
        "FSDP parallelism) inside it.")


def choose_dispatch(dispatch, collective: frozenset, found: dict) -> str:
  """'lockstep' where a piece holds a collective, else 'switch'; an asked-for
  'switch' with collectives is refused (devices of one group would run
  different collectives at one tick)."""
  if dispatch == "switch" and collective:
    piece = sorted(collective)[0]
    raise ValueError(
        f"pipeline_loss(dispatch='switch'): {_FN[piece]} holds a collective "
        f"over {sorted(found[piece])}; with 'switch' devices at different "
        "actions would run different collectives at one tick, which XLA does "
        "not define (on CPU it hangs). Use dispatch='lockstep' or None.")
  if dispatch is None:
    return "lockstep" if collective else "switch"
  return dispatch


def collective_axes(jaxpr) -> frozenset:
  """The mesh axes the collectives in `jaxpr` (and its sub-jaxprs) name."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _NOT_COLLECTIVES:
      for key in ("axis_name", "axes", "axis_names"):
        val = eqn.params.get(key)
        vals = val if isinstance(val, (tuple, list, frozenset, set)) else (val,)
        found |= {n for n in vals if isinstance(n, str)}
    for val in eqn.params.values():
      for sub in _subjaxprs(val):
        found |= collective_axes(sub)
  return frozenset(found)


def saves_any(jaxpr, policy) -> bool:
  """Whether `policy` (a `jax.checkpoint` policy) saves the result of an
  equation of `jaxpr` or its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    if policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params):
      return True
    for val in eqn.params.values():
      if any(saves_any(sub, policy) for sub in _subjaxprs(val)):
        return True
  return False


#: Primitives naming an axis that move no data (type casts, the index).
_NOT_COLLECTIVES = frozenset({"pvary", "pcast", "pbroadcast", "axis_index",
                              "core_call"})



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
