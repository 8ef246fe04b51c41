"""Casting an array inside `shard_map` to vary over more mesh axes.

A pattern's buffers, the values a user function closes over and the
cotangents of a `custom_vjp` must often have a varying type (`vma`) they
were not made with; which axes to add is each caller's choice (every axis
the arrays it holds vary over, or the axes every output varies over), the
cast is this module's. Reading an array's axes differs across jax versions
and lives in `_compat.varying_axes`.
"""

from __future__ import annotations

from typing import Iterable

import jax
from jax._src import core

from jax_overlap._src import _compat


def varying(a) -> frozenset:
  """The mesh axes `a` varies over; empty where they are not tracked."""
  return _compat.varying_axes(a) or frozenset()


def vary_over(a, axes: Iterable):
  """`a`, cast to vary over those of `axes` it does not vary over already,
  in the order given; `a` itself where it lacks none, or where this trace
  does not track varying axes (`check_vma=False`, where the cast is the
  identity anyway). jax refuses a cast to an axis `a` varies over already,
  so only the missing ones are cast to.

  Example (inside `shard_map` over a mesh axis "x", `w` replicated):

    w = vary_over(w, ("x",))   # now typed as varying over "x"
  """
  have = _compat.varying_axes(a)
  if have is None:
    return a
  missing = tuple(ax for ax in axes if ax not in have)
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def eval_with_varying_consts(jaxpr, consts, args) -> list:
  """`jax_core.eval_jaxpr`, where a const may come typed varying over more
  mesh axes than it was traced with (`_varying_like_outputs`): a `pvary` of
  it to axes it varies over already is left out (pvary is the identity on
  values; jax refuses it on a value already varying), and a `jax.jit` call
  given such a value is inlined, so that the pvary inside it is left out
  too (`jnp.take`, flax's `Embed`, is one; bound as it is, its transpose
  sums the cotangent over the axes: test_before_with_jnp_take_under_grad in
  tests/integration/real_clients_fsdp_test.py). Used by fsdp_scan's
  before/after and pipeline_loss's before/loss_fn."""
  env = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for v, a in zip(jaxpr.constvars, consts):
    env[v] = a
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive.name == "pvary" and len(invals) == 1:
      outs = [vary_over(invals[0], eqn.params["axes"])]
    elif _inline(eqn, invals):
      inner = eqn.params["jaxpr"]
      outs = eval_with_varying_consts(_compat.open_jaxpr(inner),
                                       _compat.jaxpr_consts(inner), invals)
    else:
      outs = _compat.bind_eqn(eqn, invals)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _inline(eqn, invals) -> bool:
  """Whether `eqn` is a `jax.jit` call given a value typed varying over
  more mesh axes than it was traced with."""
  if eqn.primitive.name not in ("jit", "pjit") or "jaxpr" not in eqn.params:
    return False
  for v, a in zip(eqn.invars, invals):
    have, traced = _compat.varying_axes(a), _compat.varying_axes(v.aval)
    if have is not None and traced is not None and have - traced:
      return True
  return False
