"""The gradient's collective is named for itself at both ends.

The transpose of a future's `done` starts the transposed collective (the
reduce-scatter of a gather's gradient); the transpose of its `start`
finishes it. Both equations carry the transposed collective's one `Comm`
(collectives/autodiff.py), so the reports pair `psum_scatter_start` with
`psum_scatter_done`, not with the forward future's `all_gather_done`.
"""

import collections

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)

STARTS = {
    "all_gather": lambda v: jo.all_gather_start(v, "i", tiled=True),
    "psum_scatter": lambda v: jo.psum_scatter_start(v, "i", tiled=True),
    "all_to_all": lambda v: jo.all_to_all_start(v, "i", 0, 1, tiled=True),
    "ppermute": lambda v: jo.ppermute_start(v, "i", [(0, 1), (1, 0)]),
}
TRANSPOSED = {"all_gather": "psum_scatter", "psum_scatter": "all_gather",
              "all_to_all": "all_to_all", "ppermute": "ppermute"}


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _pairs(jaxpr):
  """[(start's Comm, done's Comm)] for each done whose in-flight value a
  start of the same jaxpr made."""
  pairs = []
  started = {}
  for eqn in _eqns(jaxpr):
    if eqn.primitive is collective_start_p:
      started[eqn.outvars[0]] = eqn.params["comm"]
    elif eqn.primitive is collective_done_p and eqn.invars[0] in started:
      pairs.append((started[eqn.invars[0]], eqn.params["comm"]))
  return pairs


@pytest.mark.parametrize("name", list(STARTS))
def test_transposed_start_and_done_share_one_comm(mesh2, name):
  start = STARTS[name]

  @jax.shard_map(mesh=mesh2, in_specs=P("i"), out_specs=P("i"))
  def f(x):
    return jnp.sin(start(x).done())

  closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(
      jnp.ones((8, 4)))
  pairs = _pairs(closed.jaxpr)
  names = sorted((s.name, d.name) for s, d in pairs)
  assert names == sorted([(name, name), (TRANSPOSED[name],) * 2]), names
  for s, d in pairs:   # one object: the lowering finds the start by it
    assert s is d, (s, d)


def test_done_names_match_start_names_in_fsdp_scan_gradient(mesh2):
  # fsdp_scan carries futures across loop iterations, where the start's
  # transpose runs before the done's: every done still has its start's name.
  def layer(x, w):
    return jnp.tanh(x @ w["a"])

  @jax.shard_map(mesh=mesh2, in_specs=(P(), P(None, "i")), out_specs=P())
  def loss(x, ws):
    y = jo.fsdp_scan(layer, x, ws, axis="i")
    return jax.lax.pmean(jnp.sum(y ** 2), "i")

  ws = {"a": jnp.ones((3, 4, 4)) * 0.1}
  closed = jax.make_jaxpr(jax.grad(loss, argnums=1))(jnp.ones((2, 4)), ws)
  count = collections.Counter()
  for eqn in _eqns(closed.jaxpr):
    if eqn.primitive is collective_start_p:
      count[eqn.params["comm"].name] += 1
    elif eqn.primitive is collective_done_p:
      count[eqn.params["comm"].name] -= 1
  dones = collections.Counter(
      eqn.params["comm"].name for eqn in _eqns(closed.jaxpr)
      if eqn.primitive is collective_done_p)
  assert dones["psum_scatter"], dones    # the gradient's reduce-scatters
  assert all(v == 0 for v in count.values()), count
