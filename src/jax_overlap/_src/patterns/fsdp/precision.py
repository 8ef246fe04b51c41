"""The dtypes `fsdp_scan`'s weights travel in (mixed precision).

`param_dtype`: each floating shard is cast to it before it is gathered, so
the gather moves (and the layer computes with) e.g. bfloat16 weights of a
float32 master copy. `reduce_dtype`: each floating weight gradient is cast
to it before it is reduce-scattered (e.g. float32 sums of bfloat16
gradients); None reduces in the gradient's own dtype, which is
`param_dtype` where given (as PyTorch FSDP2's `MixedPrecisionPolicy`).
Gradients come back in each param's own dtype. With both None nothing is
cast: the program is the one without mixed precision.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_dtype(name: str, dtype):
  """`dtype` as a numpy dtype, or None; a non-floating dtype is refused."""
  if dtype is None:
    return None
  try:
    d = jnp.dtype(dtype)
  except TypeError:
    d = None
  if d is None or not jnp.issubdtype(d, jnp.floating):
    raise TypeError(
        f"fsdp_scan({name}=...) must be a floating dtype such as "
        f"jnp.bfloat16 or jnp.float32, or None, got {dtype!r}.")
  return d


class Precision:
  """Casts on the way into a gather, into a reduce-scatter, and back.

  Only floating leaves are cast; a cast to the dtype a leaf has already is
  skipped (no op in the program)."""

  __slots__ = ("param_dtype", "reduce_dtype")

  def __init__(self, param_dtype=None, reduce_dtype=None):
    self.param_dtype = check_dtype("param_dtype", param_dtype)
    self.reduce_dtype = check_dtype("reduce_dtype", reduce_dtype)

  def for_gather(self, shard):
    return _cast(shard, self.param_dtype)

  def for_reduce(self, grad):
    return _cast(grad, self.reduce_dtype)

  @staticmethod
  def back_to(grad, dtype):
    """`grad` in its param's own dtype."""
    return _cast(grad, dtype)


def _cast(a, dtype):
  if dtype is None or a.dtype == dtype \
      or not jnp.issubdtype(a.dtype, jnp.floating):
    return a
  return a.astype(dtype)
