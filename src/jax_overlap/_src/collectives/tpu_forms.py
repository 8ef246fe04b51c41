"""The forms of the futures that the TPU compiler takes as async pairs.

libtpu (0.0.52, v5e and v5p) crashes or refuses an async reduce-scatter, an
async all-reduce and an async all-to-all of a rank-2 buffer, and compiles
every all-gather on v5p synchronously. It does take, under `program_order`,
an async all-to-all whose split and concat dimension is the major dimension
of a rank-3 buffer, once the compile option `xla_tpu_enable_async_all_to_all`
is on (set for such modules by `xla/compile_options.py`). So on TPU:

* `psum_scatter_start`: the N chunks go out by one all-to-all (each device
  gets its own chunk from every device: the bytes of a ring reduce-scatter),
  and `done()` sums them, in device order;
* `psum_start`: every device's whole buffer goes to every device by one
  all-to-all of N copies (an all-gather: N/2 times the bytes of a ring
  all-reduce, all of it in flight), and `done()` sums them in device order;
  used only where ring_psum.py's form (a reduce-scatter, then an all-gather:
  a ring's bytes) is not: buffers the padded ring would not send in fewer
  bytes (a scalar, two elements, an axis of two devices);
* `all_to_all_start`: the split axis moved to the front and the buffer made
  rank 3 for the exchange, put back by `done()`;
* `all_gather_start` on v5p: an all-to-all of N copies of the buffer.

On v5p `all_gather_start` and `psum_scatter_start` first take their permute
form (permute_forms.py: N-1 collective-permutes in flight at once, which
libtpu compiles async there, several at a time); the all-to-all forms above
stand for them only where that form does not apply.

Each form is `start` (x -> the buffer in flight, ending in the all-to-all)
and `done` (that buffer -> exactly the `jax.lax` collective's value), traced
with jax's own ops where the future starts, so its types are jax's. The form
is chosen then, at trace time, for a trace whose mesh is of TPU devices
(`_compat.trace_device`, where jax records the mesh's device), and the value in flight has the
form's own type (`Comm.flight_aval`) in the jaxpr, so that every boundary
and transformation between start and done sees a consistent type. Values
match `jax.lax` up to the order of the sum (device order here; exact for
values whose sums are exact): tests/collectives/tpu_forms_test.py checks values and
gradients on CPU with `forced()`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from jax import lax
import jax.numpy as jnp

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives import comm as comm_lib

#: Marks the async all-to-all start of a form (its done then runs the form's
#: `done`).
FORM_ATTR = "jax_overlap.tpu_form"

#: Collectives whose TPU form is used on every TPU, and those only on a TPU
#: generation (device_kind) that compiles the plain collective synchronous.
EVERY_TPU = frozenset({"psum_scatter", "psum", "all_to_all"})


#: Test switch: `with forced(): ...` chooses the forms on every platform.
_SWITCH = comm_lib.FormSwitch()
forced, is_forced = _SWITCH.forced, _SWITCH.is_forced


def wanted(name: str) -> bool:
  """Whether a future of collective `name` started now gets its TPU form."""
  if is_forced():
    return name in EVERY_TPU or name == "all_gather"
  platform, kind = _compat.trace_device()
  if name in EVERY_TPU:
    return quirks.applies("tpu-collective-forms", platform, kind)
  return name == "all_gather" and quirks.applies("tpu-sync-all-gather",
                                                 platform, kind)


class Form(NamedTuple):
  start: object   # closed jaxpr: x -> buffer in flight (ends in all_to_all)
  done: object    # closed jaxpr: buffer -> the collective's value
  # closed jaxpr: x -> the same buffer, by a synchronous all-gather: for a
  # future started while another's all-to-all is in flight (xla/futures.py).
  sync: object = None
  # Made on the device, no collective (broadcast.py's in-flight copies): no
  # async pair, no all-to-all slot.
  local: bool = False


def _exchange(buf, axis, copies=False):
  """The rank-3 all-to-all over the major dimension (what TPU makes async):
  buf[j] goes to device j, and slot j of the result comes from device j."""
  del copies
  return lax.all_to_all(buf, axis, 0, 0, tiled=False)


def _exchange_by_gather(buf, axis, copies=False):
  """What `_exchange` delivers, by a synchronous all-gather (no all-to-all,
  reduce-scatter or all-reduce: with async all-to-alls on, libtpu counts
  those against the one all-to-all it allows in flight)."""
  if copies:   # every slot of buf is the same: gather one
    return lax.all_gather(buf[0], axis)
  gathered = lax.all_gather(buf, axis)   # [j, k]: device j's slot k
  return lax.dynamic_index_in_dim(gathered, lax.axis_index(axis), 1,
                                  keepdims=False)


def _sum_in_device_order(stack):
  total = stack[0]
  for k in range(1, stack.shape[0]):
    total = total + stack[k]
  return total


def _copies(x, n):
  """x as (n, rows, cols): n copies, for an all-gather by all-to-all."""
  rows = x.shape[0] if x.ndim >= 2 else 1
  flat = x.reshape(rows, -1) if x.size else x.reshape(rows, 0)
  return jnp.broadcast_to(flat[None], (n, *flat.shape))


def _psum_scatter(axis, n, d, tiled, x):
  xt_shape = [x.shape[d], *(e for i, e in enumerate(x.shape) if i != d)]

  def start(x, exchange=_exchange):
    xt = jnp.moveaxis(x, d, 0)
    c = xt.shape[0] // n
    return exchange(xt.reshape(n, c, -1), axis)

  def done(buf):
    total = _sum_in_device_order(buf)   # (c, rest)
    if not tiled:
      return total.reshape(xt_shape[1:])
    return jnp.moveaxis(total.reshape([xt_shape[0] // n, *xt_shape[1:]]), 0, d)
  return start, done


def _psum(axis, n, x):
  def start(x, exchange=_exchange):
    return exchange(_copies(x, n), axis, copies=True)

  def done(buf):
    return _sum_in_device_order(buf).reshape(x.shape)
  return start, done


def _all_gather(axis, n, a, tiled, x):
  def start(x, exchange=_exchange):
    return exchange(_copies(x, n), axis, copies=True)

  def done(buf):
    stack = buf.reshape(n, *x.shape)
    if not tiled:
      return jnp.moveaxis(stack, 0, a)
    moved = jnp.moveaxis(stack, 0, a)
    shape = list(x.shape)
    shape[a] *= n
    return moved.reshape(shape)
  return start, done


def _all_to_all(axis, n, s, k, tiled, x):
  xt_shape = [x.shape[s], *(e for i, e in enumerate(x.shape) if i != s)]

  def start(x, exchange=_exchange):
    xt = jnp.moveaxis(x, s, 0)
    return exchange(xt.reshape(n, xt.shape[0] // n, -1), axis)

  def done(buf):
    # buf[j]: this device's chunk of device j's buffer.
    chunk = buf.reshape(n, xt_shape[0] // n, *xt_shape[1:])
    if not tiled:   # the split axis (size n) goes; a new one of size n comes at k
      return jnp.moveaxis(chunk.reshape(n, *xt_shape[1:]), 0, k)
    blocks = jnp.moveaxis(chunk, 1, s + 1)   # (n, *x.shape with s divided)
    moved = jnp.moveaxis(blocks, 0, k)
    shape = list(blocks.shape[1:])
    shape[k] *= n
    return moved.reshape(shape)
  return start, done


def trace_form(name: str, params: dict, x, *, anyway: bool = False) -> Form | None:
  """The TPU form of collective `name` (with the `jax.lax` call's `params`)
  on a value like `x`, traced here; None where there is none (several or
  positional axes, a shape the exchange cannot split), or where this TPU
  does not want it (`wanted`) and not `anyway`."""
  if not (anyway or wanted(name)):
    return None
  try:
    return _trace_form(name, params, x)
  except Exception:  # noqa: BLE001 - no form: the future stays as it was
    return None


def _trace_form(name: str, params: dict, x) -> Form | None:
  bound = comm_lib.one_bound_axis(params.get("axis_name"))
  if bound is None:
    return None
  axis, n = bound
  x = jnp.asarray(x)
  if name == "psum_scatter":
    d = params["scatter_dimension"] % max(x.ndim, 1)
    tiled = params["tiled"]
    if x.ndim == 0 or x.shape[d] % n or (not tiled and x.shape[d] != n):
      return None
    start, done = _psum_scatter(axis, n, d, tiled, x)
  elif name == "psum":
    if not jnp.issubdtype(x.dtype, jnp.number):
      return None
    start, done = _psum(axis, n, x)
  elif name == "all_gather":
    a = params["axis"] % (x.ndim + (0 if params["tiled"] else 1)) if x.ndim else 0
    if params.get("to") is not None or (params["tiled"] and x.ndim == 0):
      return None
    start, done = _all_gather(axis, n, a, params["tiled"], x)
  elif name == "all_to_all":
    s, k = params["split_axis"], params["concat_axis"]
    if x.ndim == 0 or x.shape[s] % n or (not params["tiled"] and x.shape[s] != n):
      return None
    start, done = _all_to_all(axis, n, s % x.ndim, k, params["tiled"], x)
  else:
    return None
  start_jaxpr = comm_lib.trace_sync(start, x)
  buf = start_jaxpr.out_avals[0]
  if math.prod(buf.shape) == 0:
    return None
  sync = comm_lib.trace_sync(
      functools.partial(start, exchange=_exchange_by_gather), x)
  return Form(start_jaxpr, comm_lib.trace_sync(done, buf), sync)
