"""The public async collectives: `*_start` returns a `Future`."""

from __future__ import annotations

import functools

import jax
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src import _compat
from jax_overlap._src.collectives import autodiff as _autodiff  # noqa: F401 - registers rules
from jax_overlap._src.collectives import major_dim as _major_dim
from jax_overlap._src.collectives import permute_forms as _permute_forms
from jax_overlap._src.collectives import ragged as _ragged
from jax_overlap._src.collectives import ring_psum as _ring_psum
from jax_overlap._src.collectives import tpu_forms as _tpu_forms
from jax_overlap._src.collectives.comm import TRACE_ERRORS, Comm, said_of, trace_sync
from jax_overlap._src.collectives.future import Future, FutureState, user_frame
from jax_overlap._src.collectives.misuse import check_axis_name, check_perm
from jax_overlap._src.collectives.primitives import finish, start
from jax_overlap._src.xla import compile_options as _compile_options  # noqa: F401 - installs its hook
from jax_overlap._src.xla import futures as _futures  # noqa: F401 - registers rules

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def _start_future(name: str, fn, x, params=None, *, aux=(),
                  cpu_fn=None, sync_note=None, second_half=False,
                  form_anyway=False, first_half=False) -> Future:
  """The future of `fn(x, *aux)`; `cpu_fn` computes the same where XLA:CPU
  cannot run `fn`'s collective; `sync_note` as `Comm.sync_note`;
  `form_anyway`: its TPU form whether or not this TPU wants it;
  `first_half`, `second_half`: as `Comm`'s."""
  where = user_frame()
  try:
    if not isinstance(x, (jax.Array, core.Tracer)):
      x = jax.numpy.asarray(x)
    jaxpr = trace_sync(fn, x, *aux)
    cpu_jaxpr = None if cpu_fn is None else trace_sync(cpu_fn, x, *aux)
  except TRACE_ERRORS as e:
    raise said_of(f"{name}_start", e) from None
  composed = _permute_forms.compose(name, params, x, where,
                                    first_half=first_half)
  if composed is not None:
    return composed
  form = None if params is None else _tpu_forms.trace_form(
      name, params, x, anyway=form_anyway)
  if form is None:
    composed = _major_dim.compose(name, params, x, where, jaxpr.out_avals[0],
                                  _along_major)
    if composed is not None:
      return composed
  state = FutureState(name, where)
  comm = Comm(name, jaxpr, state, form, cpu_jaxpr, sync_note, second_half,
              params, first_half)
  in_flight, operand = start(comm, x, *aux)
  return Future(in_flight, operand, state,
                functools.partial(_finish_future, comm, tuple(aux)))


def _along_major(name, x, params):
  """The plain future of collective `name` on `x` along its axis 0, by the
  public start itself (major_dim.py: `params` already say axis 0)."""
  start = {"all_gather": all_gather_start, "psum_scatter": psum_scatter_start,
           "all_to_all": all_to_all_start, "ppermute": ppermute_start,
           "psum": psum_start}[name]
  keywords = {k: v for k, v in params.items()
              if k != "axis_name" and v is not None}
  return start(x, params["axis_name"], **keywords)


def _finish_future(comm: Comm, aux, value, operand):
  return finish(value, operand, comm, aux)




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


_PSUM_TO = ("invarying", "varying")


def psum_start(x, axis_name, *, to: str = "invarying") -> Future:
  """Starts `jax.lax.psum(x, axis_name)`; returns its `Future`.

  `to` says how the sum is typed, as `matmul_psum`'s `to=` does:

  * "invarying" (the default): as `psum` types it, invariant over the
    axis. Its gradient needs no collective (psum's transpose).
  * "varying": typed varying over the axis (every device holds the same
    sum), `jax.lax.pcast(psum(x), axis_name, to="varying")`, as a residual
    stream that varies over the axis needs it. The cast's transpose, the
    sum of the cotangent, is then this future's too: under `jax.grad` the
    backward pass starts that sum where the forward `done()` was and
    finishes it where the forward start was, so inside
    `program_order(enforce=True)` the backward's sum is in flight across
    the backward of the work written between them, as the forward's is
    (without it, jax's transpose of the cast is a `psum` run whole there).
    On TPU the sum and its cotangent's are each a reduce-scatter then an
    all-gather (ring_psum.py), every half in its async TPU form (the
    forward all-gather an all-to-all of copies, so that the cotangent's
    reduce-scatter form can ride in its slot: transposed_forms.py), and in
    an ordered block each half of either is placed beside half of the
    window's matmuls.

  Values and gradients equal `jax.lax.psum`'s, followed by the cast with
  `to="varying"` (tests/collectives/psum_varying_test.py, and in every mode
  tests/integration/modes_test.py; the order on the GPU compiler's
  lowering: test_backward_sum_is_in_flight_across_the_backward_matmul; on
  the TPU compiler: tests/aot/tpu_forms_compiled_test.py::
  test_varying_psum_backward_halves_are_async).

  Args:
    x: the array to sum, inside `jax.shard_map` (or a named `vmap`).
    axis_name: the mesh axis name (or tuple of names) to sum over.
    to: "invarying" (the default) or "varying", as above.

  Returns:
    A `Future`; its `done()` returns exactly `jax.lax.psum`'s value, typed
    as `to` says.

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
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def g(x):   # the sum, typed varying: one copy per device
    ...   return jax_overlap.psum_start(x, 'i', to='varying').done()
    >>> g(jnp.arange(4.0))
    Array([2., 4., 2., 4.], dtype=float32)
  """
  check_axis_name("psum", axis_name)
  if to not in _PSUM_TO:
    raise ValueError(
        f"psum_start(to={to!r}): 'invarying' (typed as psum's result) or "
        "'varying' (typed varying over the axis, its gradient's sum a "
        "future too).")
  varying = to == "varying"
  composed = _ring_psum.compose(
      x, axis_name, user_frame(),
      _scatter_first_half if varying else _scatter_part,
      _gather_varying if varying else _gather_part)
  if composed is not None:
    return composed
  if varying:
    fn = lambda v: _varying_sum(v, axis_name)
  else:
    fn = lambda v: jax.lax.psum(v, axis_name)
  return _start_future("psum", fn, x, dict(axis_name=axis_name, to=to))


def _varying_sum(v, axis_name):
  """`psum(v)` cast back to vary over `axis_name`'s mesh axes (those of
  them it does not vary over already: a positional or vmap axis is none)."""
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  y = jax.lax.psum(v, axis_name)
  have = _compat.varying_axes(y)
  if have is None:   # check_vma=False: no types to cast, psum transposes to psum
    return y
  missing = tuple(n for n in names
                  if n in _ring_psum.mesh_axes() and n not in have)
  return jax.lax.pcast(y, missing, to="varying") if missing else y


def _scatter_part(flat, axis):
  """The reduce-scatter half of `psum_start`'s ring form (ring_psum.py)."""
  return psum_scatter_start(flat, axis, tiled=True)


def _scatter_first_half(flat, axis):
  """The reduce-scatter half of `psum_start(to="varying")`'s ring form,
  its parts `Comm.first_half`: the cotangent's all-gather, their
  transpose, is then a second half, placed by an ordered block inside the
  cotangent's reduce-scatter window (ring_psum.advance_second_halves)."""
  params = dict(axis_name=axis, scatter_dimension=0, tiled=True)
  fn = lambda v: jax.lax.psum_scatter(v, axis, scatter_dimension=0, tiled=True)
  return _start_future("psum_scatter", fn, flat, params, first_half=True)


def _gather_part(chunk, axis):
  """The all-gather half, typed invariant over `axis` as `psum`'s result is:
  all_gather_start's permute form where it has one (v5p; v5e on jax <
  0.12), else the plain future (no all-to-all form: ring_psum.py)."""
  params = dict(axis_name=axis, axis=0, tiled=True)
  composed = _permute_forms.compose("all_gather", params, chunk, user_frame(),
                                    invariant=True, second_half=True)
  if composed is not None:
    return composed
  return _start_future("all_gather", lambda v: _ring_psum.gather_invariant(v, axis),
                       chunk, second_half=True)


def _gather_varying(chunk, axis):
  """The all-gather half of `psum_start(to="varying")`'s ring form, varying
  over `axis` as the sum's type says there: where the all-gather is not
  permutes (v5p; v5e with jax < 0.12: permute_forms.py), its TPU form, an
  all-to-all of N copies of the chunk as (1, 1, c) (a ring all-gather's
  bytes), whose buffer (N, 1, c) is that of its transpose's form, a
  reduce-scatter, so that the cotangent's sum is async too
  (transposed_forms.py). A plain all-gather on TPU is gathered flat
  (major_dim.py), and its rank-1 flight is no such buffer."""
  params = dict(axis_name=axis, axis=0, tiled=True)
  composed = _permute_forms.compose("all_gather", params, chunk, user_frame(),
                                    second_half=True)
  if composed is not None:
    return composed
  fn = lambda v: jax.lax.all_gather(v, axis, tiled=True)
  return _start_future("all_gather", fn, chunk.reshape(1, 1, -1),
                       dict(params, to=None), second_half=True,
                       form_anyway=True)


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
  # (the params: major_dim.py sends a rank >= 2 operand flat on GPU)
  return _start_future("ppermute", fn, x, dict(axis_name=axis_name, perm=perm))



def ragged_all_to_all_start(operand, output, input_offsets, send_sizes,
                            output_offsets, recv_sizes, *, axis_name,
                            axis_index_groups=None) -> Future:
  """Starts `jax.lax.ragged_all_to_all(operand, output, ...)`; returns its
  `Future`.

  Chunk `i` of this device, `operand[input_offsets[i]:][:send_sizes[i]]`,
  goes to device `i // (K / axis size)` and is written there at row
  `output_offsets[i]`; `recv_sizes[i]` is the size of the chunk received in
  slot `i`. Rows of `output` that nothing is written to keep their value.

  On GPU and TPU this is the real ragged all-to-all, run whole where the
  future starts: XLA has no async form of it that a program can place, so
  under `program_order` nothing is in flight between start and `done()` (a
  `CollectiveNotAsyncWarning` says so; outside it libtpu makes it async by
  itself, the GPU compiler does not). XLA:CPU cannot run one
  (no jax has it there), so on CPU the future runs the same exchange as one
  dense all-to-all of every chunk padded to `min(N, M)` rows (and of
  `output_offsets`), with gathers by the offsets on each side: the same
  values, `K` times the bytes, and (like every collective on CPU) blocking.

  Args:
    operand: `[N, ...]`, the rows to send, inside `jax.shard_map`.
    output: `[M, ...]` (same trailing shape and dtype), the buffer received
      rows are written into; its other rows pass through.
    input_offsets, send_sizes, output_offsets, recv_sizes: 1-D integer
      arrays of one length `K`, a multiple of the number of devices, as in
      `jax.lax.ragged_all_to_all`.
    axis_name: the mesh axis name (or tuple of names).
    axis_index_groups: as in `jax.lax.ragged_all_to_all`.

  Returns:
    A `Future`; its `done()` returns `jax.lax.ragged_all_to_all`'s value
    (`[M, ...]`). Gradients flow to `operand` and `output`, none to the
    integer arrays.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> # device 0 sends 1 row to itself and 2 to device 1; device 1 sends
    >>> # 2 rows to device 0 and 1 to itself. Received rows go to the front.
    >>> sizes = jnp.array([[1, 2], [2, 1]])
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def f(x):
    ...   d = jax.lax.axis_index('i')
    ...   send = sizes[d]
    ...   recv = sizes[:, d]
    ...   in_off = jnp.cumsum(send) - send
    ...   out_off = jnp.array([[0, 0], [1, 2]])[d]
    ...   fut = jax_overlap.ragged_all_to_all_start(
    ...       x, jnp.zeros_like(x), in_off, send, out_off, recv,
    ...       axis_name='i')
    ...   return fut.done()
    >>> f(jnp.arange(1.0, 7.0))
    Array([1., 4., 5., 2., 3., 6.], dtype=float32)
  """
  check_axis_name("ragged_all_to_all", axis_name)
  operand, output = jax.numpy.asarray(operand), jax.numpy.asarray(output)
  ints = tuple(jax.numpy.asarray(a) for a in (
      input_offsets, send_sizes, output_offsets, recv_sizes))
  _ragged.check_arguments(operand, output, ints,
                          _ragged.group_size(axis_name, axis_index_groups))
  if axis_index_groups is not None:
    axis_index_groups = tuple(tuple(int(i) for i in g)
                              for g in axis_index_groups)
  n_rows = operand.shape[0]
  stacked = jax.numpy.concatenate([operand, output], axis=0)
  args = (n_rows, axis_name, axis_index_groups)
  return _start_future("ragged_all_to_all", _ragged.by_real_op(*args), stacked,
                       aux=ints, cpu_fn=_ragged.by_dense_all_to_all(*args))
