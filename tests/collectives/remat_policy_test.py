"""`all_to_alls_saveable` (collectives/remat_policy.py): under
`jax.checkpoint` the backward runs each all-to-all once, its transpose, not
again to recompute; values and gradients are the function's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap

N = 4


def _exchange(kind, x):
  if kind == "future":
    return jax_overlap.all_to_all_start(x, "ep", 0, 0, tiled=True).done()
  return jax.lax.all_to_all(x, "ep", 0, 0, tiled=True)


def _f(kind, x, w):
  """Two exchanges with compute around each, as an MoE layer's dispatch and
  combine."""
  h = _exchange(kind, jnp.tanh(x @ w))
  return jnp.sum(_exchange(kind, jnp.tanh(h @ w)) ** 2)


def _grad(fn):
  mesh = jax.make_mesh((N,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:N])
  return jax.shard_map(jax.grad(fn, argnums=(0, 1)), mesh=mesh,
                       in_specs=(P("ep"), P()), out_specs=(P("ep"), P("ep")))


def _all_to_alls(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    comm = eqn.params.get("comm")
    n += (eqn.primitive.name == "all_to_all" or (
        eqn.primitive.name == "collective_start" and comm.name == "all_to_all"))
    for key, val in eqn.params.items():
      if key == "comm":   # the future's own description holds its collective
        continue
      for sub in (val if isinstance(val, (tuple, list)) else (val,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          n += _all_to_alls(inner)
  return n


def _data():
  k = jax.random.split(jax.random.key(0), 2)
  return (jax.random.normal(k[0], (N * N, 8)),
          jax.random.normal(k[1], (8, 8)) / 3)


@pytest.mark.parametrize("kind", ["future", "jax"])
def test_the_backward_runs_each_all_to_all_once(kind):
  f = lambda x, w: _f(kind, x, w)
  saving = jax.checkpoint(f, policy=jax_overlap.all_to_alls_saveable)
  nothing = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
  count = lambda fn: _all_to_alls(jax.make_jaxpr(_grad(fn))(*_data()).jaxpr)
  # forward 2, their transposes 2; recomputing also runs the forward's 2
  assert count(saving) == 4, count(saving)
  assert count(nothing) == 6, count(nothing)


@pytest.mark.parametrize("kind", ["future", "jax"])
def test_values_and_gradients_are_the_functions(kind):
  f = lambda x, w: _f(kind, x, w)
  saving = jax.checkpoint(f, policy=jax_overlap.all_to_alls_saveable)
  got = jax.jit(_grad(saving))(*_data())
  want = jax.jit(_grad(f))(*_data())
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
