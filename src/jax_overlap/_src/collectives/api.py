"""The public async collectives: `*_start` returns a `Future`."""

from __future__ import annotations

import functools

import jax
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src import _compat
from jax_overlap._src.collectives import autodiff as _autodiff  # noqa: F401 - registers rules
from jax_overlap._src.collectives import lowering as _lowering  # noqa: F401 - registers rules
from jax_overlap._src.collectives import tpu_forms as _tpu_forms
from jax_overlap._src.collectives.comm import Comm, trace_sync
from jax_overlap._src.ordering import compile_options as _compile_options  # noqa: F401 - installs its hook
from jax_overlap._src.collectives.future import Future, FutureState, user_frame
from jax_overlap._src.collectives.misuse import check_axis_name, check_perm
from jax_overlap._src.collectives.primitives import finish, start

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def _start_future(name: str, fn, x, params=None) -> Future:
  where = user_frame()
  try:
    if not isinstance(x, (jax.Array, core.Tracer)):
      x = jax.numpy.asarray(x)
    jaxpr = trace_sync(fn, x)
  except (NameError, TypeError, ValueError) as e:
    # jax's own message, said of the call the user wrote (as the builtin
    # class: jax's subclasses take other constructor arguments).
    kind = next(k for k in (NameError, TypeError, ValueError) if isinstance(e, k))
    raise kind(f"{name}_start: {e}") from None
  form = None if params is None else _tpu_forms.trace_form(name, params, x)
  state = FutureState(name, where)
  comm = Comm(name, jaxpr, state, form)
  in_flight, operand = start(comm, x)
  return Future(in_flight, operand, state,
                functools.partial(_finish_future, comm))


def _finish_future(comm: Comm, value, operand):
  return finish(value, operand, comm)




def all_gather_start(x, axis_name, *, axis: int = 0, tiled: bool = False,
                     to=None) -> Future:
  """Starts `jax.lax.all_gather(x, axis_name, ...)`; returns its `Future`.

  Args:
    x: the array to gather, inside `jax.shard_map` (or a named `vmap`).
    axis_name: the mesh axis name (or tuple of names) to gather over.
    axis: where the gathered axis goes in the result.
    tiled: concatenate along `axis` instead of stacking a new axis.
    to: as `jax.lax.all_gather`'s `to` (e.g. 'reduced'), where jax has it.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.all_gather`'s value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def f(x):
    ...   fut = jax_overlap.all_gather_start(x, 'i', tiled=True)
    ...   y = x * 2          # may run while the gather is in flight
    ...   return fut.done()[None]   # one row per device
    >>> f(jnp.arange(4.0))
    Array([[0., 1., 2., 3.],
           [0., 1., 2., 3.]], dtype=float32)
  """
  check_axis_name("all_gather", axis_name)
  kwargs = dict(axis=axis, tiled=tiled)
  if to is not None:
    if not _compat.ALL_GATHER_HAS_TO:
      raise TypeError(
          f"all_gather_start(to={to!r}) needs a jax whose jax.lax.all_gather "
          "takes `to`; this one does not.")
    kwargs["to"] = to
  fn = lambda v: jax.lax.all_gather(v, axis_name, **kwargs)
  return _start_future("all_gather", fn, x,
                       dict(axis_name=axis_name, axis=axis, tiled=tiled, to=to))


def psum_start(x, axis_name) -> Future:
  """Starts `jax.lax.psum(x, axis_name)`; returns its `Future`.

  Args:
    x: the array to sum, inside `jax.shard_map` (or a named `vmap`).
    axis_name: the mesh axis name (or tuple of names) to sum over.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.psum`'s value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P())
    ... def f(x):
    ...   return jax_overlap.psum_start(x, 'i').done()
    >>> f(jnp.arange(4.0))
    Array([2., 4.], dtype=float32)
  """
  check_axis_name("psum", axis_name)
  fn = lambda v: jax.lax.psum(v, axis_name)
  return _start_future("psum", fn, x, dict(axis_name=axis_name))


def psum_scatter_start(x, axis_name, *, scatter_dimension: int = 0,
                       tiled: bool = False) -> Future:
  """Starts `jax.lax.psum_scatter(x, axis_name, ...)`; returns its `Future`.

  Args:
    x: the array to sum and scatter, inside `jax.shard_map`.
    axis_name: the mesh axis name (or tuple of names).
    scatter_dimension: the dimension of `x` that is split between devices.
    tiled: keep `scatter_dimension` (divided by the axis size) instead of
      removing it. Only tiled=True is asynchronous on every backend; with
      tiled=False the value is right but nothing is in flight.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.psum_scatter`'s value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P(), out_specs=P('i'))
    ... def f(x):
    ...   return jax_overlap.psum_scatter_start(x, 'i', tiled=True).done()
    >>> f(jnp.arange(4.0))
    Array([0., 2., 4., 6.], dtype=float32)
  """
  check_axis_name("psum_scatter", axis_name)
  fn = lambda v: jax.lax.psum_scatter(
      v, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)
  return _start_future("psum_scatter", fn, x, dict(
      axis_name=axis_name, scatter_dimension=scatter_dimension, tiled=tiled))


def all_to_all_start(x, axis_name, split_axis: int, concat_axis: int, *,
                     tiled: bool = False) -> Future:
  """Starts `jax.lax.all_to_all(x, ...)`; returns its `Future`.

  Args:
    x: the array to exchange, inside `jax.shard_map`.
    axis_name: the mesh axis name (or tuple of names).
    split_axis: the axis of `x` split into one chunk per device.
    concat_axis: the axis along which received chunks are joined.
    tiled: as in `jax.lax.all_to_all`.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.all_to_all`'s value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def f(x):
    ...   fut = jax_overlap.all_to_all_start(x, 'i', 0, 0, tiled=True)
    ...   return fut.done()
    >>> f(jnp.arange(4.0))
    Array([0., 2., 1., 3.], dtype=float32)
  """
  check_axis_name("all_to_all", axis_name)
  fn = lambda v: jax.lax.all_to_all(v, axis_name, split_axis, concat_axis,
                                    tiled=tiled)
  return _start_future("all_to_all", fn, x, dict(
      axis_name=axis_name, split_axis=split_axis, concat_axis=concat_axis,
      tiled=tiled))


def ppermute_start(x, axis_name, perm) -> Future:
  """Starts `jax.lax.ppermute(x, axis_name, perm)`; returns its `Future`.

  Args:
    x: the array to send, inside `jax.shard_map`.
    axis_name: the mesh axis name (or tuple of names).
    perm: pairs `(source, destination)` of axis indices; each source and
      each destination at most once.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.ppermute`'s value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def f(x):
    ...   return jax_overlap.ppermute_start(x, 'i', [(0, 1), (1, 0)]).done()
    >>> f(jnp.arange(4.0))
    Array([2., 3., 0., 1.], dtype=float32)
  """
  check_axis_name("ppermute", axis_name)
  perm = check_perm(perm, axis_name)
  fn = lambda v: jax.lax.ppermute(v, axis_name, perm)
  return _start_future("ppermute", fn, x)

