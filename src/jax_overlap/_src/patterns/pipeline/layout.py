"""The stage-params layout: which global stages each device holds.

Chunk-major (every schedule but ZB-V and DualPipeV): global stage j*p + d is
chunk j of device d. Their V: device d holds stage d (chunk 0) and stage 2p-1-d
(chunk 1). Pinned by tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_overlap._src.patterns.pipeline.actions import (global_stage,
                                                       placement_of)
from jax_overlap._src.patterns.pipeline.orders import SCHEDULES


def pipeline_stage_layout(stacked, stages: int, *, inverse: bool = False,
                          schedule: str | None = None):
  """Reorders a stack of the p*v global stages (leading axis, stage order)
  so that sharding its leading axis over the pipeline axis gives device d
  its v chunks in order, as `pipeline_loss` reads them: the stages d, p+d,
  2p+d, ..., or for `schedule="zb-v"` or `"dualpipev"` the stages d and
  2p-1-d.

  Args:
    stacked: a pytree whose leaves have a leading axis of p*v stages.
    stages: p, devices along the pipeline axis.
    inverse: put a laid-out stack (such as its gradient) back in stage order.
    schedule: the schedule `pipeline_loss` runs (None: chunk-major, every
      schedule's but "zb-v"'s and "dualpipev"'s).

  Example:
    >>> import jax.numpy as jnp
    >>> import jax_overlap
    >>> jax_overlap.pipeline_stage_layout(jnp.arange(6), stages=2)  # v = 3
    Array([0, 2, 4, 1, 3, 5], dtype=int32)
    >>> jax_overlap.pipeline_stage_layout(jnp.array([0, 2, 4, 1, 3, 5]), 2,
    ...                                   inverse=True)
    Array([0, 1, 2, 3, 4, 5], dtype=int32)
    >>> jax_overlap.pipeline_stage_layout(jnp.arange(8), 4, schedule="zb-v")
    Array([0, 7, 1, 6, 2, 5, 3, 4], dtype=int32)
  """
  if schedule is not None and schedule not in SCHEDULES:
    raise ValueError(f"pipeline_stage_layout(schedule={schedule!r}): expected "
                     f"None or one of {SCHEDULES}.")
  placement = placement_of(schedule or "1f1b")

  def move(a):
    n = a.shape[0]
    if n % stages:
      raise ValueError(f"pipeline_stage_layout: a leaf's leading axis is {n}, "
                       f"not a multiple of stages={stages}.")
    v = n // stages
    if placement != "v":
      rest = a.shape[1:]
      if inverse:   # [p, v] -> [v, p]
        return a.reshape((stages, v) + rest).swapaxes(0, 1).reshape(a.shape)
      return a.reshape((v, stages) + rest).swapaxes(0, 1).reshape(a.shape)
    if v != 2:
      raise ValueError(f"pipeline_stage_layout(schedule={schedule!r}): a "
                       f"leaf's leading axis is {n}; the V (ZB-V, "
                       f"DualPipeV) holds 2 stages a device, "
                       f"2*stages={2 * stages}.")
    # row k of the laid-out stack is chunk k % v of device k // v
    order = np.array([global_stage(k // v, k % v, stages, placement)
                      for k in range(n)])
    if inverse:
      order = np.argsort(order)
    return a[order]
  return jax.tree.map(move, stacked)
