"""The zoo, for collective matmul and `program_order`: a user's model, not ours.

A sequence-parallel transformer MLP stack (Megatron style) on a 2-axis mesh
(`("data", "tensor") = (2, 4)`): the batch over `data`, the sequence and the
weights over `tensor`, layers stacked as a *tuple* of params and run by the
user's own `lax.scan`. Each layer gathers the sequence into its first matmul
(`all_gather_matmul`) and reduce-scatters its second (`matmul_reduce_scatter`),
and the same stack is run again with each layer an ordered `program_order`
block holding a free block. Values and gradients (of x and every weight) are
compared with the dense computation on whole arrays, with no jax_overlap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo

L, B, S, D, H = 3, 4, 8, 8, 16          # layers, batch, sequence, width, hidden
MESH = jax.make_mesh((2, 4), ("data", "tensor"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 2)
SPECS = (P("data", "tensor"), (P(None, None, "tensor"), P(None, "tensor")))


def _inputs():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k[0], (B, S, D))
  params = (jax.random.normal(k[1], (L, D, H)) * 0.3,   # a tuple, stacked
            jax.random.normal(k[2], (L, H, D)) * 0.3)
  return x, params


def dense_loss(x, params):
  def layer(x, w):
    w1, w2 = w
    return x + jax.nn.gelu(x @ w1) @ w2, None
  return jnp.sum(lax.scan(layer, x, params)[0] ** 2)


def _layer(x, w):
  """One layer on this device's blocks: x (b, s/4, D), w1 (D, H/4), w2 (H/4, D)."""
  w1, w2 = w
  h = jax.nn.gelu(jo.all_gather_matmul(x, w1, "tensor", gather_dimension=1))
  return x + jo.matmul_reduce_scatter(h, w2, "tensor", scatter_dimension=1)


def _ordered_layer(x, w):
  @jo.program_order(enforce=True)
  def ordered(x, w):
    y = _layer(x, w)

    @jo.program_order(enforce=False)
    def free(y):
      return jnp.tanh(y) * 0.5 + y * 0.5
    return free(y)
  return ordered(x, w)


def _ordered_dense_loss(x, params):
  def layer(x, w):
    w1, w2 = w
    y = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.tanh(y) * 0.5 + y * 0.5, None
  return jnp.sum(lax.scan(layer, x, params)[0] ** 2)


def _sharded_loss(layer):
  def loss(x, params):
    y = lax.scan(lambda x, w: (layer(x, w), None), x, params)[0]
    return lax.psum(jnp.sum(y ** 2), ("data", "tensor"))
  return jax.shard_map(loss, mesh=MESH, in_specs=SPECS, out_specs=P())


def _close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4 * float(np.abs(b).max()))


@pytest.mark.parametrize("layer, reference", [
    (_layer, dense_loss), (_ordered_layer, _ordered_dense_loss)],
    ids=["collective_matmul", "ordered_collective_matmul"])
def test_sequence_parallel_stack_matches_dense(layer, reference):
  x, params = _inputs()
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  _close(grad(_sharded_loss(layer))(x, params), grad(reference)(x, params))
