"""Tensor parallelism inside a stage: a Megatron MLP on a ('pp', 'tp') mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

D, F, BATCH = 4, 8, 2


def mlp(w, x):
  """One stage; with w's hidden dimension split over 'tp' it needs a psum."""
  return x + jnp.tanh(x @ w["up"]) @ w["down"]


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _model(stages, m):
  k = jax.random.split(jax.random.key(0), 4)
  w = {"up": jax.random.normal(k[0], (stages, D, F)) / 2,
       "down": jax.random.normal(k[1], (stages, F, D)) / 2}
  return w, jax.random.normal(k[2], (m, BATCH, D)), jax.random.normal(k[3], (m, BATCH, D))


def _reference(w, xs, ts):
  def one(x, t):
    for g in range(w["up"].shape[0]):
      x = mlp(jax.tree.map(lambda a: a[g], w), x)
    return mse(x, t)
  return jnp.mean(jax.vmap(one)(xs, ts))


def _pipelined(p, tp, schedule):
  mesh = jax.make_mesh((p, tp), ("pp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:p * tp])

  def stage(w, x):   # w["up"]: [D, F/tp], w["down"]: [F/tp, D], this device's part
    return x + jax.lax.psum(jnp.tanh(x @ w["up"]) @ w["down"], "tp")

  def body(w, xs, ts):
    # the loss is typed varying over every axis an input varies over; its
    # value is equal over 'tp', and the mean makes it replicated
    loss = pipeline_loss(stage, mse, w, xs, ts, axis="pp", schedule=schedule)
    return jax.lax.pmean(loss, "tp")

  def loss(w, xs, ts):
    specs = {"up": P("pp", None, "tp"), "down": P("pp", "tp", None)}
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()),
                         out_specs=P())(pipeline_stage_layout(w, p), xs, ts)
  return loss


# On older jax: the two-stage zero-bubble case (the four-stage one is the
# same program at twice the stages).
@pytest.mark.newest_jax(older_jax=["test_pp_by_tp[2-2-4-zb-h1]"])
@pytest.mark.parametrize("p,tp,m,schedule", [
    pytest.param(2, 2, 4, "1f1b", marks=pytest.mark.slow), (2, 2, 4, "zb-h1"),
    (4, 2, 4, "1f1b")])
def test_pp_by_tp(p, tp, m, schedule):
  w, xs, ts = _model(p, m)
  got = jax.jit(jax.value_and_grad(_pipelined(p, tp, schedule), argnums=(0, 1)))(w, xs, ts)
  want = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(w, xs, ts)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
