"""The stage-params layout: global stage j*p + d is chunk j of device d."""

from __future__ import annotations

import jax


def pipeline_stage_layout(stacked, stages: int, *, inverse: bool = False):
  """Reorders a stack of the p*v global stages (leading axis, stage order)
  so that sharding its leading axis over the pipeline axis gives device d
  the stages d, p+d, 2p+d, ... (its v chunks, as `pipeline_loss` reads them).

  Args:
    stacked: a pytree whose leaves have a leading axis of p*v stages.
    stages: p, devices along the pipeline axis.
    inverse: put a laid-out stack (such as its gradient) back in stage order.

  Example:
    >>> import jax.numpy as jnp
    >>> import jax_overlap
    >>> jax_overlap.pipeline_stage_layout(jnp.arange(6), stages=2)  # v = 3
    Array([0, 2, 4, 1, 3, 5], dtype=int32)
    >>> jax_overlap.pipeline_stage_layout(jnp.array([0, 2, 4, 1, 3, 5]), 2,
    ...                                   inverse=True)
    Array([0, 1, 2, 3, 4, 5], dtype=int32)
  """
  def move(a):
    n = a.shape[0]
    if n % stages:
      raise ValueError(f"pipeline_stage_layout: a leaf's leading axis is {n}, "
                       f"not a multiple of stages={stages}.")
    v = n // stages
    rest = a.shape[1:]
    if inverse:   # [p, v] -> [v, p]
      return a.reshape((stages, v) + rest).swapaxes(0, 1).reshape(a.shape)
    return a.reshape((v, stages) + rest).swapaxes(0, 1).reshape(a.shape)
  return jax.tree.map(move, stacked)
