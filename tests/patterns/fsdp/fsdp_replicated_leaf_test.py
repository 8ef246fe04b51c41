"""A leaf kept replicated (`P()`, a norm scale) beside sharded ones, under
the schedules whose backward reads the stack through a barrier
(`prefetch=2`, `reshard_after_forward=False`): values and every gradient
equal a plain `lax.scan`'s, on every jax version.

Before 0.12, jax's own `optimization_barrier` made every operand vary over
the same mesh axes, so the replicated leaf's gradient came back typed as
varying over the fsdp axis and the custom vjp refused it ("Custom VJP bwd
rule must produce an output with the same type"); the engine now uses
`ordering.barrier_op.barrier`, which keeps each leaf's type. `prefetch=1` (no barrier)
is the case that always worked. Tiny shapes, one compile a case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
import meshes

L, D, B = 4, 16, 8   # layers, width, batch
SPECS = {"w": P(None, "fsdp"), "scale": P()}


def layer(p, x):
  return jnp.tanh(x @ p["w"]) * p["scale"]


def plain(params, x):
  y = jax.lax.scan(lambda x, p: (layer(p, x), None), x, params)[0]
  return jnp.sum(y ** 2)


@pytest.mark.parametrize("knobs", [dict(prefetch=2),
                                   dict(reshard_after_forward=False),
                                   dict(prefetch=1)], ids=str)
def test_replicated_leaf_gradient_under_fenced_schedules(knobs):
  mesh = meshes.make((8,), ("fsdp",))
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(k[0], (L, D, D)) * 0.3,
            "scale": 1.0 + 0.1 * jax.random.normal(k[1], (L, D))}
  x = jax.random.normal(k[2], (B, D))

  def body(params, x):
    y = jo.fsdp_scan(layer, x, params, axis="fsdp", params_first=True, **knobs)
    return jax.lax.psum(jnp.sum(y ** 2), "fsdp")

  loss = jax.shard_map(body, mesh=mesh, in_specs=(SPECS, P("fsdp")),
                       out_specs=P())
  value, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)
  want, want_grads = jax.value_and_grad(plain, (0, 1))(params, x)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
