"""`all_to_alls_saveable`: a `jax.checkpoint` policy that keeps what an
all-to-all received and recomputes the rest.

Invariant: under `jax.checkpoint(f, policy=all_to_alls_saveable)` the
backward runs each all-to-all of `f` once (its transpose), not twice: the
result of the forward's exchange (`jax.lax.all_to_all`, or a future's
`done()` of `all_to_all_start` / `ragged_all_to_all_start`) is a residual,
the compute around it is recomputed. Why: recomputing an exchange is
communication, not compute; a recomputing backward with MoE exchanges runs
twice the all-to-alls of a keeping one, more than the other chunk of a
DualPipeV F&B tick has matmuls to hide (docs/pipeline.md, "DualPipeV").
Pinned by tests/collectives/remat_policy_test.py.
"""

from __future__ import annotations

from jax_overlap._src.collectives.primitives import collective_done_p

#: The exchanges the policy keeps: jax's primitives and our futures' names.
_ALL_TO_ALLS = frozenset({"all_to_all", "ragged_all_to_all"})


def all_to_alls_saveable(prim, *avals, **params) -> bool:
  """A `jax.checkpoint` policy: save the results of all-to-alls (jax's and
  this library's futures), recompute everything else.

  What it costs: each all-to-all's result is kept from the forward to the
  backward (an MoE layer's dispatched tokens and returned expert outputs),
  besides what `jax.checkpoint_policies.nothing_saveable` keeps.
  `pipeline_loss` uses it by default on TPU for stages that exchange with
  all-to-alls.

  >>> import jax, jax.numpy as jnp, jax_overlap
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((2,), ('ep',),
  ...                      axis_types=(jax.sharding.AxisType.Auto,))
  >>> def f(x):
  ...   y = jax_overlap.all_to_all_start(jnp.tanh(x), 'ep', 0, 0,
  ...                                    tiled=True).done()
  ...   return jnp.sum(jnp.tanh(y) ** 2)
  >>> g = jax.shard_map(
  ...     jax.grad(jax.checkpoint(f, policy=jax_overlap.all_to_alls_saveable)),
  ...     mesh=mesh, in_specs=P('ep'), out_specs=P('ep'))
  >>> x = jnp.arange(8.).reshape(4, 2) / 8
  >>> bool(jnp.allclose(jax.jit(g)(x), jax.jit(jax.shard_map(
  ...     jax.grad(f), mesh=mesh, in_specs=P('ep'), out_specs=P('ep')))(x)))
  True
  """
  del avals
  if prim is collective_done_p:
    return params["comm"].name in _ALL_TO_ALLS
  return prim.name in _ALL_TO_ALLS
