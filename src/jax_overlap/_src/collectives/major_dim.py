"""Futures that move data along a minor axis, moved along the major one.

Invariant: a future whose gathered, scattered or split dimension is not its
operand's major one runs its collective along axis 0 (the TPU forms aside,
which place the axis themselves). Why: an async collective along a minor dimension fails on the real
compilers: the TPU compiler aborts on such an all-gather (`RET_CHECK
IsMajorDimAllGather`), and the H100 compiler refuses the module for all three
(an entry parameter cannot take the layout it wants; inside `fsdp_scan`,
"Asynchronous computation ... expected to contain only the root and
parameter instructions"). docs/compilers.md has the cases;
tests/aot/real_compilers_test.py (`-k minor_axis`) pins that each such
future is now an async pair with the matmul in its window.

XLA's own synchronous collectives transpose in its partitioner instead. So
such a future moves that axis to the front, runs the collective along axis
0, and `done()` puts the result's axes back: the plain collective's bytes,
values exactly `jax.lax`'s. The transposes are XLA's to fuse or lay out (on
CPU, where every collective blocks, they are copies). The future is a
`composed.ComposedFuture` of one plain future, so misuse reports, autodiff,
vmap and `program_order` treat it as any future.

Taken on every platform and jax version (one behaviour everywhere), after
the TPU forms (permute_forms.py, tpu_forms.py), which place the axis
themselves.

On TPU (quirk "tpu-flat-all-gather") an all-gather of a rank >= 2 operand
goes one step further: the operand (axis moved to the front) is gathered as
one flat row-major buffer and reshaped after the done. Why: layout
assignment may give the gathered result a column-major layout for its
consumer (a weight feeding a matmul of 3-D activations in `fsdp_scan`), so
axis 0 is minor again and the compiler aborts (`RET_CHECK
IsMajorDimAllGather`); a rank-1 buffer has one layout. Only there, so CPU and
GPU programs (and values) stay as they were:
tests/aot/major_dim_compiled_test.py.

On GPU (quirk "gpu-flat-permute") a permute of a rank >= 2 operand is sent
flat for the same reason: given a non-default layout, the H100 compiler's
layout normalization refuses the async computation
(tests/aot/pipeline_compiled_test.py's lockstep ring case); so is the
operand of a psum (quirk "gpu-flat-all-reduce": a matmul's result, in
`matmul_psum`; tests/aot/matmul_psum_compiled_test.py).
"""

from __future__ import annotations

import math

from jax import lax
from jax._src import source_info_util
from jax._src import traceback_util
import jax.numpy as jnp

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives.composed import ComposedFuture

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def compose(name: str, params, x, where: str, out_aval, start_major):
  """The future of collective `name` on `x` (with the `jax.lax` call's
  `params`) made of `start_major(name, x', params')`, the same collective
  along axis 0 of `x` with that axis moved to the front; None where the axis
  is already the major one, or for the other collectives."""
  if params is None or x.ndim == 0:
    return None
  plan = _PLANS.get(name)
  moved = None if plan is None else plan(params, x)
  if moved is None:
    return None
  major, new_params, put_back = moved
  part = start_major(name, major, dict(params, **new_params))
  return ComposedFuture(name, where, None, [part],
                        lambda _, values: put_back(values[0]), out_aval)


def _all_gather(params, x):
  if params.get("to") is not None:
    return None
  tiled = params["tiled"]
  # where the gathered axis is in the result (untiled: a new axis there)
  a = params["axis"] % (x.ndim + (0 if tiled else 1))
  if x.ndim >= 2 and _flat_on_this_platform():
    return _flat_all_gather(x, a, tiled)
  if a == 0:
    return None
  major = jnp.moveaxis(x, a, 0) if tiled else x
  return major, dict(axis=0), lambda y: jnp.moveaxis(y, 0, a)


def _flat_on_this_platform() -> bool:
  platform, kind = _compat.trace_device()
  return quirks.applies("tpu-flat-all-gather", platform, kind)


def _flat_all_gather(x, a, tiled):
  """The gather of `x` (axis `a` of the result) as a tiled gather of one
  flat buffer, put back after the done."""
  major = jnp.moveaxis(x, a, 0) if tiled else x
  shape = major.shape

  def put_back(y):
    n = y.shape[0] // math.prod(shape)
    if tiled:
      return jnp.moveaxis(y.reshape(n * shape[0], *shape[1:]), 0, a)
    return jnp.moveaxis(y.reshape(n, *shape), 0, a)
  return major.reshape(-1), dict(axis=0, tiled=True), put_back


def _psum_scatter(params, x):
  d = params["scatter_dimension"] % x.ndim
  if d == 0:
    return None
  major = jnp.moveaxis(x, d, 0)
  if not params["tiled"]:   # the scattered axis is dropped
    return major, dict(scatter_dimension=0), lambda y: y
  return major, dict(scatter_dimension=0), lambda y: jnp.moveaxis(y, 0, d)


def _all_to_all(params, x):
  s = params["split_axis"] % x.ndim
  c = params["concat_axis"] % x.ndim
  if s == 0 or not params["tiled"]:
    return None
  names = params["axis_name"]
  n = math.prod(lax.axis_size(a) for a in
                (names if isinstance(names, (tuple, list)) else (names,)))

  def put_back(y):
    # y: the chunks received, device i's at rows [i*k, (i+1)*k) of axis 0,
    # each laid out with the split axis first. Back to x's layout, then
    # joined along the concat axis in device order.
    chunks = y.reshape(n, y.shape[0] // n, *y.shape[1:])
    chunks = jnp.moveaxis(chunks, 1, s + 1)          # (n, *a chunk's shape)
    joined = jnp.moveaxis(chunks, 0, c)              # n just before axis c
    shape = list(joined.shape)
    shape[c:c + 2] = [shape[c] * shape[c + 1]]
    return joined.reshape(shape)
  return jnp.moveaxis(x, s, 0), dict(split_axis=0, concat_axis=0), put_back


def _flat_where(quirk: str):
  """The plan of a collective whose rank >= 2 operand travels as one flat
  buffer on GPU (quirk `quirk`), elsewhere as it is. Only where the future
  is an async region: on jax without it (`not _compat.ASYNC_CUSTOM_CALLS`)
  the plain collective holds no layout bitcasts and compiles as it is (jax
  0.10.2 and 0.11.0, tests/aot/pipeline_compiled_test.py's lockstep case)."""
  def plan(params, x):
    del params
    if x.ndim < 2 or not _compat.ASYNC_CUSTOM_CALLS:
      return None
    platform, kind = _compat.trace_device()
    if not quirks.applies(quirk, platform, kind):
      return None
    shape = x.shape
    return x.reshape(-1), {}, lambda y: y.reshape(shape)
  return plan


#: A permute (quirk "gpu-flat-permute") and a psum, whose operand is a
#: matmul's result in `matmul_psum` (quirk "gpu-flat-all-reduce"), for the
#: same reason.
_ppermute = _flat_where("gpu-flat-permute")
_psum = _flat_where("gpu-flat-all-reduce")


_PLANS = {"all_gather": _all_gather, "psum_scatter": _psum_scatter,
          "all_to_all": _all_to_all, "ppermute": _ppermute, "psum": _psum}
