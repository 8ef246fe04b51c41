"""`pvary_start`: a value invariant over an axis made varying, whose gradient's
sum over the axis is a future.

Inside `jax.shard_map`, a value invariant over an axis (a parameter
replicated over `tp`) that meets a value varying over it is cast by jax
(`pvary`, `pcast(..., to="varying")`); the cast's transpose is a `psum` of
the cotangent, which autodiff runs whole where the cotangent is ready. This
future moves no data forward: its `done()` is the cast. Its transpose is a
sum future: autodiff starts the cotangent's sum where the forward `done()`
was and finishes it where the forward start was (autodiff.py), so inside
`program_order(enforce=True)` the backward's sum is in flight across the
backward of everything written between start and `done()`.

On TPU (libtpu has no async all-reduce) the backward sum is `psum_start`'s
copies form, an all-to-all of N copies (tpu_forms.py): its buffer, (N, rows,
cols), is the forward's in-flight value here (N copies of `x`, made locally:
no communication), so the cotangent's form rides that slot
(transposed_forms.py). Over two devices that is a ring's bytes; over N it is
N/2 times them (the ring's two halves would need two slots). Over several
mesh axes on TPU the future is one such future an axis (`_per_axis`): the
first started at the start, the others started and finished by `done()`, so
backward the sums run one axis at a time, each async, and only the first
axis's sum is in flight across the window. Elsewhere (GPU, CPU) several
axes are one plain sum future; a vmap axis likewise (synchronous on TPU).

Pinned by tests/collectives/pvary_start_test.py (values and gradients equal
the cast, with the TPU form forced on CPU, inside ordered blocks; refusals),
in every calling mode by tests/integration/modes_test.py, and on the real
compilers by tests/aot/llama_4d_compiled_test.py (the replicated leaves'
sums of examples/llama_4d.py on the v5e).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src import _compat
from jax_overlap._src.collectives import autodiff as _autodiff  # noqa: F401 - registers rules
from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.collectives.comm import (TRACE_ERRORS, Comm, one_bound_axis,
                                               said_of, trace_sync)
from jax_overlap._src.collectives.composed import ComposedFuture
from jax_overlap._src.collectives.future import Future, FutureState, user_frame
from jax_overlap._src.collectives.misuse import check_axis_name
from jax_overlap._src.collectives.primitives import finish, start
from jax_overlap._src.xla import futures as _futures  # noqa: F401 - registers rules

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def pvary_start(x, axis_name) -> Future:
  """Starts the cast of `x` to vary over `axis_name`; returns its `Future`.

  `done()` returns `jax.lax.pcast(x, axis_name, to="varying")`: the same
  value on every device of the axis, typed varying over it. Nothing is sent.
  Under `jax.grad` its transpose, the sum of the cotangent over the axis, is
  a future: started where `done()` was, finished where the start was, so in
  an ordered block the backward's sum is in flight across the backward of
  the work written between them (a parameter replicated over a
  tensor-parallel axis, started where a layer starts and finished where it
  is used). Without it jax's implicit cast transposes to a `psum` run whole.

  Values and gradients equal the cast's (tests/collectives/pvary_start_test.py).

  Args:
    x: an array invariant over `axis_name`, inside `jax.shard_map`.
    axis_name: the mesh axis name (or tuple of names) to vary over.

  Returns:
    A `Future`; its `done()` returns `x`, typed varying over the axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def loss(scale, x):
    ...   fut = jax_overlap.pvary_start(scale, 'i')   # scale: replicated
    ...   h = jnp.tanh(x)          # the backward's sum in flight across this
    ...   return jax.lax.psum(jnp.sum(h * fut.done()), 'i')
    >>> f = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh,
    ...                           in_specs=(P(), P('i')), out_specs=P()))
    >>> f(jnp.ones(2), jnp.zeros((2, 2)).at[:, 0].set(1.0))
    Array([1.5231884, 0.       ], dtype=float32)
  """
  check_axis_name("pvary", axis_name)
  if isinstance(axis_name, (tuple, list)) and not axis_name:
    raise ValueError("pvary_start(axis_name=()): name at least one mesh axis "
                     "to cast x to vary over.")
  where = user_frame()
  if isinstance(x, Future):
    raise TypeError(f"pvary_start: {x!r} is a Future; call .done() on it first.")
  try:
    if not isinstance(x, (jax.Array, core.Tracer)):
      x = jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise TypeError(f"pvary_start: x must be an array, not {type(x).__name__} "
                    f"({e})") from None
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  have = _compat.varying_axes(x)
  already = [n for n in names if have is not None and n in have]
  if already:
    raise ValueError(
        f"pvary_start(axis_name={axis_name!r}): x already varies over "
        f"{already[0]!r} (its type varies over {sorted(map(str, have))}); "
        "start it on the value before it is cast (a parameter replicated "
        "over the axis), or drop the future: no gradient sum is owed there.")
  try:
    jaxpr = trace_sync(functools.partial(_cast, axis_name=axis_name), x)
  except TRACE_ERRORS as e:
    raise said_of("pvary_start", e) from None
  if len(names) > 1 and tpu_forms.wanted("psum") and all(
      one_bound_axis(n) is not None for n in names):
    return _per_axis(x, names, where)
  state = FutureState("pvary", where)
  comm = Comm("pvary", jaxpr, state, _form(x, axis_name),
              params=dict(axis_name=axis_name))
  in_flight, operand = start(comm, x)
  return Future(in_flight, operand, state, functools.partial(_finish, comm))


def _per_axis(x, names, where) -> Future:
  """`pvary_start(x, names)` on TPU: a future over `names[0]`, whose done
  casts over the other axes by futures started and finished there."""
  def combine(kept, values):
    del kept
    (v,) = values
    for n in names[1:]:
      v = pvary_start(v, n).done()
    return v
  first = pvary_start(x, names[0])
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return ComposedFuture("pvary", where, (), [first], combine, out)


def _finish(comm, value, operand):
  return finish(value, operand, comm)


def _cast(v, axis_name):
  return jax.lax.pcast(v, axis_name, to="varying")


def _form(x, axis_name) -> tpu_forms.Form | None:
  """Where the cotangent's sum takes `psum_start`'s copies form (TPU, one
  mesh axis, a number): the forward's in-flight value is that form's buffer,
  N copies of `x` made locally (and cast), and `done()` takes copy 0."""
  bound = one_bound_axis(axis_name)
  if bound is None or not tpu_forms.wanted("psum") or \
      not jnp.issubdtype(x.dtype, jnp.number) or x.size == 0:
    return None
  axis, n = bound
  shape = x.shape

  def begin(v):
    return _cast(tpu_forms._copies(v, n), axis)

  def done(buf):
    return buf[0].reshape(shape)

  start_jaxpr = trace_sync(begin, x)
  return tpu_forms.Form(start_jaxpr,
                        trace_sync(done, start_jaxpr.out_avals[0]),
                        local=True)
