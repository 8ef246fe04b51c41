"""Tensor parallelism without sequence parallelism: `psum(x @ w)`, chunked.

`matmul_psum(x, w, axis)` is `jax.lax.psum(x @ w, axis)` inside
`jax.shard_map`: Megatron's row-parallel matmul, whose sum the next op needs
at once, so that a plain `psum` has nothing to hide behind. Here the rows of
`x` are cut into `chunks`, and each chunk's sum (`psum_start`) is in flight
while the next chunk's matmul runs, under `program_order(enforce=True)`;
one sum at a time is in flight (the TPU compiler allows one of psum_start's
all-to-all forms: quirks.py, "tpu-collective-forms", "tpu-forms-in-flight").

`to` says how the result is typed, as `jax.lax.all_gather`'s `to=` does:

* "invarying" (the default): as `psum` types it, invariant over `axis`.
  The gradient needs no collective here (psum's transpose); where the
  result meets a value varying over `axis`, jax's cast of it sums the
  cotangent there, after this function, as a plain `psum`.
* "varying": typed varying over `axis` (every device holds the same sum),
  as a residual stream that varies over `axis` needs it (pipeline_loss's
  stage activations vary over every axis an input varies over). The cast's
  transpose, the sum of the cotangent, is then this function's too: the
  backward pass sums the cotangent's chunks in the same way, each in flight
  while the previous chunk's `dx` and `dw` matmuls run.

The first chunk's matmul (forward) and the last chunk's sum have nothing of
this function's own beside them: that much is left for the compiler to put
beside the work around the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src import _compat
from jax_overlap._src.collectives import ring_psum as _ring_psum
from jax_overlap._src.collectives.api import psum_start
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.collective_matmul import (
    _accumulator_dtype, _contract_rows, _dimension, _operands, _same_varying,
    _zeros)
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.varying import vary_over

_TO = ("invarying", "varying")


def matmul_psum(x, w, axis, *, chunks: int = 2, dimension: int = 0,
                to: str = "invarying"):
  """`jax.lax.psum(x @ w, axis)`, each chunk's sum behind the next matmul.

  The rows of `x` along `dimension` are cut into `chunks` parts; part c's
  matmul runs while part c - 1's sum is in flight (`psum_start`), in that
  order (`program_order`). The value is `psum(x @ w)`'s, chunk by chunk
  (tests/patterns/matmul_psum_test.py checks values and gradients against
  it). Differentiable with `jax.grad` (a `jax.custom_vjp`): with
  `to="varying"` the backward pass sums the cotangent in chunks too, each
  sum in flight behind the previous chunk's `dx` and `dw` matmuls.

  Args:
    x: this device's operand, shape `(..., k)`, inside `jax.shard_map`: in
      Megatron's row-parallel layer, the activation whose last dimension
      (heads, hidden units) is split over `axis`.
    w: this device's rows of the matrix, shape `(k, n)`.
    axis: the mesh axis name (one name) to sum over.
    chunks: how many parts the rows are cut into (at least 1, at most the
      size of `dimension`); 1 is a plain matmul and one sum.
    dimension: the dimension of `x` that is cut; any but the last (negative
      values count from the end).
    to: "invarying" (the default) types the result as `psum` does,
      invariant over `axis`; "varying" types it as varying over `axis`,
      for a residual stream that varies over `axis`, and sums its gradient
      here, overlapped (the module's docstring says when each fits).

  Returns:
    `psum(x @ w, axis)`: `x`'s shape with the last dimension `n`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, 'i'), P('i')),
    ...                out_specs=P())
    ... def f(x, w):   # each device holds half of the contracted dimension
    ...   return jax_overlap.matmul_psum(x, w, 'i', chunks=2)
    >>> f(jnp.arange(8.0).reshape(2, 4), jnp.ones((4, 2)))
    Array([[ 6.,  6.],
           [22., 22.]], dtype=float32)
  """
  name = "matmul_psum"
  x, w = _operands(name, x, w)
  axis = _axis(name, axis)
  dim = _dimension(name, "dimension", dimension, x.shape, "x",
                   "the one contracted with w")
  chunks = _chunks(name, chunks, x.shape, dim)
  if to not in _TO:
    raise ValueError(
        f"{name}(to={to!r}): 'invarying' (typed as psum's result) or "
        "'varying' (typed varying over the axis, its gradient summed here).")
  x, w = _same_varying(axis, x, w)
  # Where varying axes are not tracked (check_vma=False) jax transposes a
  # psum to a psum: the cotangent is summed whatever `to` says.
  sums_cotangent = to == "varying" or _compat.varying_axes(x) is None
  return _matmul_psum(axis, dim, chunks, to, sums_cotangent, x, w)


def _parts(a, chunks: int, dim: int) -> list:
  """`a` cut along `dim` into `chunks` parts, the first ones one row longer
  where the size does not divide."""
  size, bounds = a.shape[dim], [0]
  q, r = divmod(size, chunks)
  for c in range(chunks):
    bounds.append(bounds[-1] + q + (c < r))
  return [jax.lax.slice_in_dim(a, lo, hi, axis=dim)
          for lo, hi in zip(bounds[:-1], bounds[1:])]


def _product(part, w, dim: int, axis):
  """`part @ w`; as two matmuls (halves of its rows) where a sum is two
  collectives (TPU's ring form of psum_start, ring_psum.py), so that the
  previous part's sum has one behind each of its halves."""
  shape = (*part.shape[:-1], w.shape[1])
  halves = part.shape[dim] >= 2 and _ring_psum.is_ring(
      jax.ShapeDtypeStruct(shape, jnp.result_type(part, w)), axis)
  if not halves:
    return part @ w
  return jnp.concatenate([p @ w for p in _parts(part, 2, dim)], dim)


def _forward(axis, dim, chunks, to, x, w):
  @program_order(enforce=True)
  def run(x, w):
    parts = _parts(x, chunks, dim)
    sums = []
    with moving("x @ w"):
      future = psum_start(parts[0] @ w, axis)
      for part in parts[1:]:
        y = _product(part, w, dim, axis)   # the previous part's sum in flight
        sums.append(future.done())
        future = psum_start(y, axis)
      sums.append(future.done())
    return jnp.concatenate(sums, dim) if chunks > 1 else sums[0]
  y = run(x, w)
  return vary_over(y, (axis,)) if to == "varying" else y


def _backward(axis, dim, chunks, sums_cotangent, x, w, dy):
  dtype = _accumulator_dtype(jnp.result_type(x, dy))
  if not sums_cotangent:   # psum's transpose: no collective
    return dy @ w.T, _contract_rows(x, dy, dtype)

  @program_order(enforce=True)
  def run(x, w, dy):
    xs, dys = _parts(x, chunks, dim), _parts(dy, chunks, dim)
    dxs, dw = [], _zeros(w.shape, dtype, like=x)
    with moving("dy"):
      future = psum_start(dys[0], axis)
      for c in range(chunks):
        summed = future.done()
        if c + 1 < chunks:
          future = psum_start(dys[c + 1], axis)   # behind this part's matmuls
        dxs.append(summed @ w.T)
        dw = dw + _contract_rows(xs[c], summed, dtype)
    dx = jnp.concatenate(dxs, dim) if chunks > 1 else dxs[0]
    return dx, dw
  return run(x, w, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _matmul_psum(axis, dim, chunks, to, sums_cotangent, x, w):
  return _forward(axis, dim, chunks, to, x, w)


def _fwd(axis, dim, chunks, to, sums_cotangent, x, w):
  return _forward(axis, dim, chunks, to, x, w), (x, w)


def _bwd(axis, dim, chunks, to, sums_cotangent, residuals, dy):
  x, w = residuals
  dx, dw = _backward(axis, dim, chunks, sums_cotangent, x, w, dy)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul_psum.defvjp(_fwd, _bwd)


# --- checks at the call site ---------------------------------------------------------

def _axis(name: str, axis):
  if isinstance(axis, (tuple, list, set, frozenset)):
    raise TypeError(
        f"{name}(axis={axis!r}): give one mesh axis name; a sum over "
        "several axes is not supported.")
  try:
    jax.lax.axis_size(axis)
  except NameError:
    raise NameError(
        f"{name}(axis={axis!r}): no mesh axis named {axis!r} is bound here. "
        "Call it inside jax.shard_map over a mesh that has this axis.") \
        from None
  return axis


def _chunks(name: str, chunks, shape, dim: int) -> int:
  if isinstance(chunks, (bool, np.bool_)) or not isinstance(
      chunks, (int, np.integer)):
    raise TypeError(f"{name}(chunks={chunks!r}) must be an int.")
  if not 1 <= chunks <= shape[dim]:
    raise ValueError(
        f"{name}(chunks={chunks}): dimension {dim} of x (shape "
        f"{tuple(shape)}) has {shape[dim]} rows to cut, so chunks must be in "
        f"1 .. {shape[dim]}.")
  return int(chunks)
