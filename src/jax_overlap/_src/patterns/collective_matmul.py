"""Collective matmul: an all-gather or reduce-scatter hidden behind its matmul.

`all_gather_matmul(x, w, axis)` is `all_gather(x, axis, tiled=True) @ w` and
`matmul_reduce_scatter(x, w, axis)` is `psum_scatter(x @ w, axis, tiled=True)`,
both inside `jax.shard_map`. Each collective is a ring of `ppermute_start`
steps (`_ring.py`): while one chunk travels, the matmul of the chunk already
here runs. Each function is the other's transpose, and its `jax.custom_vjp`
backward pass is the other ring, overlapped the same way.

Dimensions: `x` is `(..., k)` and `w` is `(k, n)`; the last dimension of `x`
is contracted. The gathered (or scattered) dimension may be any dimension of
`x` (of `x @ w`) but the last: a row dimension or a leading batch dimension,
negative values counting from the end. Gathering `k` or scattering `n` would
make the transpose gather or scatter over a contracted dimension, which is
another pattern (a sum of block products), so both are refused at the call.

Partial sums travel, and are added, in the dtype of `x @ w`, as
`psum_scatter`'s are; a gradient's local sums of low-precision blocks are
kept in float32 and cast back once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src import _compat
from jax_overlap._src.patterns._ring import (
    Ring, gather_and_scatter_ring, gather_ring, reduce_scatter_ring)
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.varying import vary_over, varying


def all_gather_matmul(x, w, axis, *, gather_dimension: int = 0,
                      bidirectional: bool = False):
  """`all_gather(x, axis, axis=gather_dimension, tiled=True) @ w`, overlapped.

  Each device's block of `x` travels around a ring of devices, one
  `ppermute_start` per step, while the matmul of the block already held
  runs; `program_order` keeps that order. Differentiable with `jax.grad`:
  the backward pass is `matmul_reduce_scatter` (for `x`) and the same ring
  of `x` blocks (for `w`), overlapped too.

  Args:
    x: this device's block, shape `(..., k)`, inside `jax.shard_map`.
    w: the matrix, shape `(k, n)`.
    axis: the mesh axis name (one name) to gather over.
    gather_dimension: the dimension of `x` the blocks are joined along; any
      but the last (negative values count from the end).
    bidirectional: send half of the blocks each way around the ring at once:
      two rings, about half the steps.

  Returns:
    `x`'s shape with `gather_dimension` times the axis size and the last
    dimension `n`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P('i'), P()), out_specs=P('i'))
    ... def f(x, w):
    ...   y = jax_overlap.all_gather_matmul(x, w, 'i')  # (4, 2) on each device
    ...   return y[None]
    >>> f(jnp.arange(4.0).reshape(2, 2), jnp.eye(2))[0]
    Array([[0., 1.],
           [2., 3.]], dtype=float32)
  """
  name = "all_gather_matmul"
  x, w = _operands(name, x, w)
  ring = _ring(name, axis, bidirectional)
  dim = _dimension(name, "gather_dimension", gather_dimension, x.shape,
                   "x", "the one contracted with w")
  x, w = _same_varying(ring.axis, x, w)
  return _all_gather_matmul(ring, dim, x, w)


def matmul_reduce_scatter(x, w, axis, *, scatter_dimension: int = 0,
                          bidirectional: bool = False):
  """`psum_scatter(x @ w, axis, scatter_dimension=..., tiled=True)`, overlapped.

  The partial sums travel around a ring of devices, one `ppermute_start`
  per step, while each device computes its part of the next block;
  `program_order` keeps that order. Differentiable with `jax.grad`: the
  backward pass is one ring of the output's cotangent blocks that feeds both
  `all_gather_matmul`-style products (for `x` and for `w`).

  Args:
    x: this device's operand, shape `(..., k)`, inside `jax.shard_map`.
    w: the matrix, shape `(k, n)`.
    axis: the mesh axis name (one name) to sum and scatter over.
    scatter_dimension: the dimension of `x @ w` that is split between the
      devices; any but the last (negative values count from the end). Its
      size must be a multiple of the axis size.
    bidirectional: send the partial sums both ways around the ring at once:
      two rings, about half the steps.

  Returns:
    `x @ w` summed over the axis, with `scatter_dimension` divided by the
    axis size: this device's block.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(None, 'i'), P('i')),
    ...                out_specs=P('i'))
    ... def f(x, w):   # each device holds half of the contracted dimension
    ...   return jax_overlap.matmul_reduce_scatter(x, w, 'i')
    >>> f(jnp.arange(4.0).reshape(2, 2), jnp.ones((2, 2)))
    Array([[1., 1.],
           [5., 5.]], dtype=float32)
  """
  name = "matmul_reduce_scatter"
  x, w = _operands(name, x, w)
  ring = _ring(name, axis, bidirectional)
  dim = _dimension(name, "scatter_dimension", scatter_dimension,
                   (*x.shape[:-1], w.shape[1]), "x @ w", "the columns of w")
  if x.shape[dim] % ring.size:
    raise ValueError(
        f"{name}(scatter_dimension={scatter_dimension}): dimension {dim} of "
        f"x @ w has size {x.shape[dim]}, which the {ring.size} devices of "
        f"axis {ring.axis!r} cannot split evenly. Make it a multiple of "
        f"{ring.size}, or scatter another dimension.")
  x, w = _same_varying(ring.axis, x, w)
  return _matmul_reduce_scatter(ring, dim, x, w)


# --- the rings ----------------------------------------------------------------------

def _block(a, index, size: int, dim: int):
  """Block `index` (traced) of `a` split along `dim` into blocks of `size`."""
  return jax.lax.dynamic_slice_in_dim(a, index * size, size, dim)


def _put_block(a, block, index, dim: int):
  return jax.lax.dynamic_update_slice_in_dim(
      a, block, index * block.shape[dim], dim)


def _contract_rows(a, b, dtype):
  """`a^T @ b` over every dimension but the last: (..., k), (..., n) -> (k, n)."""
  rows = tuple(range(a.ndim - 1))
  return jax.lax.dot_general(a, b, ((rows, rows), ((), ())),
                             preferred_element_type=dtype)


def _accumulator_dtype(dtype):
  """Local sums of low-precision floats are kept in float32 at least."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return dtype


def _zeros(shape, dtype, *, like):
  """A buffer to fill, typed as varying over the mesh axes `like` varies
  over, so that filling it inside the ring casts nothing there."""
  return vary_over(jnp.zeros(shape, dtype), sorted(varying(like), key=str))


def _gather_then_matmul(ring: Ring, dim: int, x, w):
  out_shape = list(x.shape)
  out_shape[dim] *= ring.size
  out_shape[-1] = w.shape[1]
  out = _zeros(out_shape, jnp.result_type(x, w), like=x)

  def consume(w, out, held, source):
    return _put_block(out, held @ w, source, dim)
  with moving("x"):  # what the ring's sends carry, named in the report
    return gather_ring(ring, x, w, out, consume)


def _matmul_then_scatter(ring: Ring, dim: int, x, w):
  with moving("x @ w"):
    return _scatter_partial_sums(ring, dim, x, w, paced=True)


def _scatter_partial_sums(ring: Ring, dim: int, x, w, *, paced: bool):
  rows = x.shape[dim] // ring.size

  def part(operands, target):
    x, w = operands
    return _block(x, target, rows, dim) @ w
  return reduce_scatter_ring(ring, (x, w), part, paced=paced)


# --- gradients: each is the other's transpose ------------------------------------

def _with_transpose(forward, transpose):
  """`forward(ring, dim, x, w)` as a `jax.custom_vjp` whose backward pass is
  `transpose(ring, dim, x, w, dy) -> (dx, dw)`.

  Only this device's `x` and `w` are saved: a backward pass that needs `x`
  gathered gathers it again in a ring rather than keep it alive.
  """
  fn = jax.custom_vjp(forward, nondiff_argnums=(0, 1))

  def fwd(ring, dim, x, w):
    return forward(ring, dim, x, w), (x, w)

  def bwd(ring, dim, residuals, dy):
    x, w = residuals
    dx, dw = transpose(ring, dim, x, w, dy)
    return dx.astype(x.dtype), dw.astype(w.dtype)

  fn.defvjp(fwd, bwd)
  return fn


def _gather_then_matmul_transpose(ring: Ring, dim: int, x, w, dy):
  # dx: dy's rows, summed over the devices and scattered back to the block
  # each came from; dw: the gathered x against dy, one block at a time.
  rows = x.shape[dim]
  dtype = _accumulator_dtype(jnp.result_type(x, dy))

  def consume(dy, dw, held, source):
    return dw + _contract_rows(held, _block(dy, source, rows, dim), dtype)
  if not _compat.ASYNC_CUSTOM_CALLS:
    # Where a send is its plain collective, left out of the fences, two
    # rings side by side have their sends interleaved by the TPU compiler,
    # some with no block matmul behind them: one ring carries both, x's
    # send then dx's partial sums' (_ring.gather_and_scatter_ring;
    # tests/aot/real_compilers_test.py::
    # test_collective_matmul_sends_behind_block_matmuls, older aot venvs).
    def part(operands, target):
      dy, wt = operands
      return _block(dy, target, rows, dim) @ wt
    return gather_and_scatter_ring(
        ring, x, (dy, w.T), _zeros(w.shape, dtype, like=x),
        lambda operands, *rest: consume(operands[0], *rest), part,
        names=("x", "dy @ w.T"))
  # The dx ring is not paced here, where the sends are fenced: beside the
  # gather ring of x below, whose steps the compiler interleaves with its
  # own, pacing leaves windows empty on TPU (docs/compilers.md has the
  # counts; the same test pins every permute with a block matmul).
  with moving("dy @ w.T"):
    dx = _scatter_partial_sums(ring, dim, dy, w.T, paced=False)
  with moving("x"):
    dw = gather_ring(ring, x, dy, _zeros(w.shape, dtype, like=x), consume)
  return dx, dw


def _matmul_then_scatter_transpose(ring: Ring, dim: int, x, w, dy):
  # The cotangent of x @ w is dy gathered along `dim`; one ring of dy blocks
  # feeds both dx = gathered dy @ w.T and dw = x^T @ gathered dy.
  rows = dy.shape[dim]
  dw_dtype = _accumulator_dtype(jnp.result_type(x, dy))
  state = (_zeros(x.shape, jnp.result_type(dy, w), like=dy),
           _zeros(w.shape, dw_dtype, like=dy))

  def consume(operands, state, held, source):
    x, w = operands
    dx, dw = state
    dx = _put_block(dx, held @ w.T, source, dim)
    dw = dw + _contract_rows(_block(x, source, rows, dim), held, dw_dtype)
    return dx, dw
  with moving("dy"):
    return gather_ring(ring, dy, (x, w), state, consume)


_all_gather_matmul = _with_transpose(_gather_then_matmul,
                                     _gather_then_matmul_transpose)
_matmul_reduce_scatter = _with_transpose(_matmul_then_scatter,
                                         _matmul_then_scatter_transpose)


# --- checks at the call site ---------------------------------------------------------

def _operands(name: str, x, w):
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  w = w if isinstance(w, jax.Array) else jnp.asarray(w)
  if x.ndim < 2:
    raise ValueError(
        f"{name}: x must have at least two dimensions (..., k), got shape "
        f"{tuple(x.shape)}. Add a leading dimension (x[None]) for a single "
        "row.")
  if w.ndim != 2:
    raise ValueError(
        f"{name}: w must be a matrix (k, n), got shape {tuple(w.shape)}.")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"{name}: the last dimension of x (shape {tuple(x.shape)}) must "
        f"equal the first of w (shape {tuple(w.shape)}): x[..., k] is "
        "contracted with w[k, :].")
  return x, w


def _ring(name: str, axis, bidirectional) -> Ring:
  if isinstance(axis, (tuple, list, set, frozenset)):
    raise TypeError(
        f"{name}(axis={axis!r}): give one mesh axis name; a ring over "
        "several axes is not supported.")
  if not isinstance(bidirectional, (bool, np.bool_)):
    raise TypeError(
        f"{name}(bidirectional={bidirectional!r}) must be True or False.")
  try:
    size = jax.lax.axis_size(axis)
  except NameError:
    raise NameError(
        f"{name}(axis={axis!r}): no mesh axis named {axis!r} is bound here. "
        "Call it inside jax.shard_map over a mesh that has this axis.") \
        from None
  return Ring(axis, int(size), bool(bidirectional))


def _dimension(name: str, arg: str, value, shape, what: str,
               last_is: str) -> int:
  """`value` as a dimension of an array of `shape`, any but the last."""
  ndim = len(shape)
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TypeError(f"{name}({arg}={value!r}) must be an int.")
  allowed = ("0 or -2" if ndim == 2 else
             f"in 0 .. {ndim - 2} (or {-ndim} .. -2 from the end)")
  if not -ndim <= value < ndim:
    raise ValueError(
        f"{name}({arg}={value}): {what} has shape {tuple(shape)}, so {arg} "
        f"must be {allowed}, any dimension but the last.")
  dim = int(value) % ndim
  if dim == ndim - 1:
    raise ValueError(
        f"{name}({arg}={value}) names the last dimension of {what} (shape "
        f"{tuple(shape)}), {last_is}; this pattern splits a row or batch "
        f"dimension only: {arg} must be {allowed}.")
  return dim


def _same_varying(axis, *arrays):
  """Casts each array to vary over every mesh axis any of them (or `axis`)
  varies over, so that the custom_vjp's cotangents have their primals'
  types; jax sums the cotangent of a cast back over the axes it added."""
  every = sorted(frozenset({axis}).union(*map(varying, arrays)), key=str)
  return [vary_over(a, every) for a in arrays]
