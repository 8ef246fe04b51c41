"""The first leaf of a stacked pytree whose leading axis is not the stack's.

One loop for every argument stacked over layers, stages or microbatches
(`fsdp_scan`'s `xs`, `pipeline_loss`'s `stage_params` and `targets`), so that
each caller only words its own error. Pinned by tests/integration/misuse_test.py
(the misuse rows that name these arguments).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def wrong_leading_axis(tree, n: int) -> tuple[str, tuple] | None:
  """(key path, shape) of the first leaf of `tree` that is a scalar or whose
  axis 0 is not `n`; None when every leaf is stacked `n` deep."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = jnp.shape(leaf)
    if not shape or shape[0] != n:
      return jax.tree_util.keystr(path), shape
  return None
