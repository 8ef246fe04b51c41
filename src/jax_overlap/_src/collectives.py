"""Asynchronous collectives: `*_start` returns a `Future`, `done()` ends it.

Two primitives carry every collective:

* `collective_start_p(x; comm)` -> `(in_flight, operand)`. `comm.jaxpr` is the
  synchronous `jax.lax` collective traced on `x` (so values, types and
  varying-axes bookkeeping are jax's own), `in_flight` has its result type and
  `operand` is `x` passed through. The operand output exists for autodiff
  only: it gives the backward pass a slot of `x`'s type in which the
  transposed collective can be in flight (see "Autodiff" below).
* `collective_done_p(in_flight[, operand]; comm)` -> the result.

Lowering. The start lowers `comm.jaxpr` with jax's own rules and rewrites the
one collective op it produces into an async pair:

* GPU/TPU (and jax with the custom-call form): the start emits
  `stablehlo.custom_call @"<op>-start"` and the done emits `@"<op>-done"`, so
  what runs between them is what was written between them, and
  `program_order(enforce=True)` fences that order.
* CPU (and every backend on jax without the custom-call form): the start emits
  the whole pair back to back and the done is the identity. XLA's CPU
  compiler crashes or rejects the pair when an optimization_barrier separates
  its halves, and it makes every collective blocking anyway; this way barriers
  only ever see finished values.

Where the synchronous lowering does not end in one collective op (an untiled
psum_scatter ends in a reshape; a vmapped collective over the vmap axis has
no collective at all) the start lowers to the synchronous form: correct
values, nothing in flight.

Autodiff. All five collectives are linear. The jvp of a start is a start on
the tangent. For transposition the two halves trade places: the transpose of
`done` is the *start* of the transposed collective (all_gather <->
psum_scatter, psum <-> psum (or jax's pvary), all_to_all with its axes
swapped, ppermute with the inverse permutation), put in flight in the
cotangent slot of `operand`; the transpose of `start` is its *done*. So the
backward pass issues the transposed collective where the forward pass
finished the forward one, and an ordered backward overlaps too. A future that
crossed a shard_map boundary lost its operand slot; its backward collective
then runs whole at the forward start's position (still correct, not
overlapped).

Misuse. `done()` twice raises at once (the future's shared `FutureState`).
A future never finished, or returned from the jit that started it, is found
when the jit is lowered: the start's lowering (or DCE of an unused start)
sees that `done()` was never called on it and raises, naming the collective
and the line that started it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np
from jax._src import ad_util
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from jax_overlap._src import _compat
from jax_overlap._src.future import Future, FutureState, user_frame


source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


class FutureNotFinishedError(RuntimeError):
  """A future left the jit that started it without `done()`."""


# --- what a collective is ------------------------------------------------------

class Comm:
  """Static description of one collective: a primitive param.

  Attributes:
    name: the user-facing collective ('all_gather', 'psum', ...).
    jaxpr: closed jaxpr of the synchronous collective, x -> y.
    state: the `FutureState` shared by every copy of the future.
  Compared by identity, like a jaxpr.
  """

  __slots__ = ("name", "jaxpr", "state")

  def __init__(self, name: str, jaxpr, state: FutureState):
    self.name = name
    self.jaxpr = jaxpr
    self.state = state

  def __repr__(self):
    return f"Comm({self.name})"

  @property
  def out_aval(self):
    return self.jaxpr.out_avals[0]

  @property
  def in_aval(self):
    return self.jaxpr.in_avals[0]


def _trace_sync(fn, x):
  """The closed jaxpr of `fn` on a value like `x`, in the current axis env."""
  traced = jax.jit(fn).trace(x)
  return traced.jaxpr


def _transposed(comm: Comm, ct) -> Comm:
  """The collective that carries cotangents of `comm` back (y -> x), traced
  on the cotangent `ct` so it has its exact type."""
  jaxpr = _compat.open_jaxpr(comm.jaxpr)
  consts = _compat.jaxpr_consts(comm.jaxpr)
  x_aval = comm.in_aval

  def transpose(ct):
    (ct_x,) = ad.backward_pass(jaxpr, False, consts,
                               [ad.UndefinedPrimal(x_aval)], [ct])
    if type(ct_x) is ad_util.Zero:
      ct_x = ad.instantiate_zeros(ct_x)
    return ct_x

  return Comm(_TRANSPOSED_NAME.get(comm.name, comm.name),
              _trace_sync(transpose, ct),
              FutureState(comm.name + "_transpose", comm.state.where,
                          internal=True))


_TRANSPOSED_NAME = {"all_gather": "psum_scatter", "psum_scatter": "all_gather",
                    "psum": "psum", "all_to_all": "all_to_all",
                    "ppermute": "ppermute"}


# --- the primitives --------------------------------------------------------------

collective_start_p = core.Primitive("collective_start")
collective_start_p.multiple_results = True
collective_done_p = core.Primitive("collective_done")


def _start_abstract_eval(x_aval, *, comm):
  del x_aval
  return [comm.out_aval, comm.in_aval], comm.jaxpr.effects


collective_start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _done_abstract_eval(in_flight, *operand, comm):
  del operand, comm
  return in_flight


collective_done_p.def_abstract_eval(_done_abstract_eval)


# Outside any jit (e.g. an eager vmap whose collective became local math) the
# start computes the value at once and the done hands it over.
def _start_impl(x, *, comm):
  (y,) = core.jaxpr_as_fun(comm.jaxpr)(x)
  return [y, x]


collective_start_p.def_impl(_start_impl)
collective_done_p.def_impl(lambda in_flight, *operand, comm: in_flight)


def start(comm: Comm, x):
  in_flight, operand = collective_start_p.bind(x, comm=comm)
  return in_flight, operand


def finish(in_flight, operand, comm: Comm):
  args = (in_flight,) if operand is None else (in_flight, operand)
  return collective_done_p.bind(*args, comm=comm)


# --- jvp and transpose -------------------------------------------------------------

def _start_jvp(primals, tangents, *, comm):
  (x,), (t,) = primals, tangents
  outs = collective_start_p.bind(x, comm=comm)
  if type(t) is ad_util.Zero:
    return outs, [ad_util.Zero(comm.out_aval.to_tangent_aval()),
                  ad_util.Zero(comm.in_aval.to_tangent_aval())]
  return outs, collective_start_p.bind(t, comm=comm)


def _done_jvp(primals, tangents, *, comm):
  out = collective_done_p.bind(*primals, comm=comm)
  t_flight = tangents[0]
  if type(t_flight) is ad_util.Zero:
    return out, ad_util.Zero(core.get_aval(primals[0]).to_tangent_aval())
  t_args = [t_flight]
  if len(tangents) == 2 and type(tangents[1]) is not ad_util.Zero:
    t_args.append(tangents[1])
  return out, collective_done_p.bind(*t_args, comm=comm)


ad.primitive_jvps[collective_start_p] = _start_jvp
ad.primitive_jvps[collective_done_p] = _done_jvp


def _done_transpose(ct, in_flight, *operand, comm):
  if not operand:
    # The operand slot was lost at a boundary: pass the cotangent through,
    # and the start's transpose runs the whole transposed collective.
    return [ct]
  flight_aval = _aval(in_flight).to_tangent_aval()
  if type(ct) is ad_util.Zero:
    return [ad_util.Zero(flight_aval),
            ad_util.Zero(_aval(operand[0]).to_tangent_aval())]
  # Start the transposed collective here, where the forward one finished.
  t_flight, _ = start(_transposed(comm, ct), ct)
  return [ad_util.Zero(flight_aval), t_flight]


def _aval(x):
  return x.aval if ad.is_undefined_primal(x) else core.get_aval(x)


def _start_transpose(cts, x, *, comm):
  del x
  ct_flight, ct_operand = cts
  total = None
  if type(ct_operand) is not ad_util.Zero:
    # The transposed collective is in flight since the forward done: end it.
    total = finish(ct_operand, None, comm)
  if type(ct_flight) is not ad_util.Zero:
    t_comm = _transposed(comm, ct_flight)
    whole = finish(*start(t_comm, ct_flight), t_comm)
    total = whole if total is None else total + whole
  if total is None:
    return [ad_util.Zero(comm.in_aval.to_tangent_aval())]
  return [total]


ad.primitive_transposes[collective_start_p] = _start_transpose
ad.primitive_transposes[collective_done_p] = _done_transpose


# --- vmap ------------------------------------------------------------------------------

def _start_batch(axis_data, args, dims, *, comm):
  (x,), (d,) = args, dims
  if d is None:
    return collective_start_p.bind(x, comm=comm), [None] * 2
  x = batching.moveaxis(x, d, 0)
  jaxpr, (out_batched,) = batching.batch_jaxpr(comm.jaxpr, axis_data, [True],
                                               [True])
  del out_batched
  outs = collective_start_p.bind(x, comm=Comm(comm.name, jaxpr, comm.state))
  return outs, [0, 0]


def _done_batch(axis_data, args, dims, *, comm):
  del axis_data
  d = dims[0]
  args = list(args)
  if len(args) == 2 and dims[1] != d:
    # The operand is only carried for autodiff; drop a mismatched one.
    args = args[:1]
  return collective_done_p.bind(*args, comm=comm), d


batching.fancy_primitive_batchers[collective_start_p] = _start_batch
batching.fancy_primitive_batchers[collective_done_p] = _done_batch


# --- DCE: an unused start is a future nobody finished ------------------------------

def _start_dce(used_outputs, eqn):
  if not any(used_outputs):
    _check_finished(eqn.params["comm"])
    return [False], None
  return [True], eqn


def _done_dce(used_outputs, eqn):
  if not any(used_outputs):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


_compat.register_dce_rule(collective_start_p, _start_dce)
_compat.register_dce_rule(collective_done_p, _done_dce)


def _check_finished(comm: Comm):
  state = comm.state
  if not state.finished:
    raise FutureNotFinishedError(
        f"{state.describe()} was never finished: call .done() on it inside "
        "the jit that started it (it may pass through shard_map or "
        "program_order blocks on the way, but may not be returned from the "
        "jit or dropped).")


# --- lowering ----------------------------------------------------------------------------

# op name in StableHLO -> the name XLA's async custom calls use.
_ASYNC_NAME = {
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}


def _lower_start(ctx, x, *, comm, split):
  _check_finished(comm)
  sub_ctx = ctx.replace(avals_in=[comm.in_aval], avals_out=[comm.out_aval])
  (y,) = _compat.lower_jaxpr_inline(sub_ctx, comm.jaxpr, x)
  op = _collective_op(y)
  if op is not None:
    if _compat.ASYNC_CUSTOM_CALLS:
      y = _to_custom_call_pair(ctx, op, comm, split=split)
    elif _fits_async_region(op):
      y = _to_async_region_pair(op)
  return [y, x]


def _collective_op(y):
  owner = y.owner
  if isinstance(owner, ir.Block):
    return None
  op = owner.operation if hasattr(owner, "operation") else owner
  if op.name not in _ASYNC_NAME or len(op.results) != 1:
    return None
  return op


def _replica_groups(ctx, comm: Comm) -> list[list[int]] | None:
  for eqn in _compat.open_jaxpr(comm.jaxpr).eqns:
    names = eqn.params.get("axis_name", eqn.params.get("axes"))
    if names is None:
      continue
    names = names if isinstance(names, (tuple, list)) else (names,)
    names = tuple(n for n in names if not isinstance(n, int))
    groups = pxla.axis_groups(ctx.module_context.axis_context, names)
    return [[int(d) for d in g] for g in groups]
  return None


def _async_config(ctx, op, comm: Comm) -> dict[str, Any]:
  attrs = op.attributes
  name = op.name
  cfg: dict[str, Any] = {}
  if name == "stablehlo.all_gather":
    cfg["all_gather_dimension"] = ir.IntegerAttr(attrs["all_gather_dim"]).value
  elif name == "stablehlo.reduce_scatter":
    cfg["scatter_dimension"] = ir.IntegerAttr(attrs["scatter_dimension"]).value
    cfg["tiled"] = True
  elif name == "stablehlo.all_to_all":
    for key in ("split_dimension", "concat_dimension", "split_count"):
      cfg[key] = ir.IntegerAttr(attrs[key]).value
  if name == "stablehlo.collective_permute":
    pairs = np.array(ir.DenseIntElementsAttr(attrs["source_target_pairs"]))
    cfg["permutation"] = pairs.reshape((-1, 2)).tolist()
  else:
    cfg["replica_groups"] = _replica_groups(ctx, comm)
  if "channel_handle" in attrs:
    cfg["channel_id"] = int(hlo.ChannelHandle(attrs["channel_handle"]).handle)
  if "use_global_device_ids" in attrs:
    cfg["use_global_device_ids"] = True
  return cfg


def _reducer_func(ctx, op) -> str:
  """Moves the reduction region of `op` into a private function; its name."""
  block = op.regions[0].blocks[0]
  arg_types = [a.type for a in block.arguments]
  ret = list(block.operations)[-1]
  fn_type = ir.FunctionType.get(arg_types, [v.type for v in ret.operands])
  with ir.InsertionPoint.at_block_begin(ctx.module_context.module.body):
    fn = func_dialect.FuncOp("async_collective_reducer", fn_type)
  fn.attributes["sym_visibility"] = ir.StringAttr.get("private")
  ctx.module_context.symbol_table.insert(fn)
  entry = fn.add_entry_block()
  for old, new in zip(block.arguments, entry.arguments):
    old.replace_all_uses_with(new)
  for inner in list(block.operations):
    entry.append(inner.operation if hasattr(inner, "operation") else inner)
  with ir.InsertionPoint(ret):
    func_dialect.ReturnOp(list(ret.operands))
  ret.operation.erase() if hasattr(ret, "operation") else ret.erase()
  return ir.StringAttr(fn.attributes["sym_name"]).value


def _to_custom_call_pair(ctx, op, comm, *, split):
  name = _ASYNC_NAME[op.name]
  cfg = _async_config(ctx, op, comm)
  called = []
  if op.name in ("stablehlo.all_reduce", "stablehlo.reduce_scatter"):
    called = [_reducer_func(ctx, op)]
  result = op.results[0]
  with ir.InsertionPoint(op):
    started = mlir.custom_call(
        f"{name}-start", result_types=[result.type],
        operands=[op.operands[0]], api_version=1,
        called_computations=called,
        extra_attributes={"mhlo.frontend_attributes": ir.DictAttr.get(
            {"async_collective_config": ir.StringAttr.get(json.dumps(cfg))})},
    ).result
    out = started if split else _done_custom_call(name, started)
  result.replace_all_uses_with(out)
  op.erase()
  return out


def _done_custom_call(name, started):
  return mlir.custom_call(f"{name}-done", result_types=[started.type],
                          operands=[started], api_version=1).result


def _fits_async_region(op) -> bool:
  # XLA turns an all_to_all whose split and concat dimensions differ into
  # several HLO instructions, and an async region may hold only one.
  if op.name != "stablehlo.all_to_all":
    return True
  dims = [ir.IntegerAttr(op.attributes[k]).value
          for k in ("split_dimension", "concat_dimension")]
  return dims[0] == dims[1]


def _to_async_region_pair(op):
  """Old jax: wraps `op` in `stablehlo.async_start` and finishes it at once."""
  result = op.results[0]
  operand = op.operands[0]
  with ir.InsertionPoint(op):
    started = hlo.AsyncStartOp(hlo.FutureType.get([result.type]), [operand])
    done = hlo.async_done(started.result)
  uses = [(u.owner, u.operand_number) for u in result.uses]
  block = started.regions[0].blocks.append(operand.type)
  block.append(op)
  op.operands[0] = block.arguments[0]
  with ir.InsertionPoint(block):
    hlo.return_([result])
  for owner, index in uses:
    owner.operands[index] = done
  return done


def _lower_done(ctx, in_flight, *operand, comm):
  del ctx, operand, comm
  name = _find_start(in_flight)
  if name is None:
    return [in_flight]
  return [_done_custom_call(name, in_flight)]


def _find_start(value):
  """The '<op>' of an unfinished '<op>-start' custom call `value` comes from.

  Looks through the optimization barriers `program_order` puts between the
  two halves. None when the value is already finished (CPU, old jax) or was
  never async.
  """
  while True:
    owner = value.owner
    if isinstance(owner, ir.Block):
      return None
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name == "stablehlo.optimization_barrier":
      index = list(op.results).index(value)
      value = op.operands[index]
      continue
    if op.name != "stablehlo.custom_call":
      return None
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target.endswith("-start") and target[:-len("-start")] in \
        _ASYNC_NAME.values():
      return target[:-len("-start")]
    return None


mlir.register_lowering(collective_start_p,
                       functools.partial(_lower_start, split=False),
                       cacheable=False)
mlir.register_lowering(collective_done_p, _lower_done, cacheable=False)
if _compat.ASYNC_CUSTOM_CALLS:
  for _platform in ("cuda", "rocm", "tpu"):
    mlir.register_lowering(collective_start_p,
                           functools.partial(_lower_start, split=True),
                           platform=_platform, cacheable=False)


# --- the public functions ----------------------------------------------------------------

def _start_future(name: str, fn, x) -> Future:
  x = jax.numpy.asarray(x) if not isinstance(x, (jax.Array, core.Tracer)) \
      else x
  where = user_frame()
  try:
    jaxpr = _trace_sync(fn, x)
  except NameError as e:
    raise NameError(f"{name}_start: {e}") from None
  state = FutureState(name, where)
  comm = Comm(name, jaxpr, state)
  in_flight, operand = start(comm, x)
  return Future(in_flight, operand, state,
                functools.partial(_finish_future, comm))


def _finish_future(comm: Comm, value, operand):
  return finish(value, operand, comm)


def _check_axis_name(name: str, axis_name):
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  bound = _compat.bound_axis_names()
  if bound is None:
    return
  unknown = [n for n in names if n not in bound]
  if unknown:
    raise NameError(
        f"{name}_start(axis_name={axis_name!r}): unknown axis name "
        f"{unknown[0]!r}; the axis names in scope here are {sorted(map(str, bound))}. "
        "Call it inside jax.shard_map (or vmap with axis_name=...) over that "
        "axis.")


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
  _check_axis_name("all_gather", axis_name)
  kwargs = dict(axis=axis, tiled=tiled)
  if to is not None:
    if not _compat.ALL_GATHER_HAS_TO:
      raise TypeError(
          f"all_gather_start(to={to!r}) needs a jax whose jax.lax.all_gather "
          "takes `to`; this one does not.")
    kwargs["to"] = to
  fn = lambda v: jax.lax.all_gather(v, axis_name, **kwargs)
  return _start_future("all_gather", fn, x)


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
  _check_axis_name("psum", axis_name)
  fn = lambda v: jax.lax.psum(v, axis_name)
  return _start_future("psum", fn, x)


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
  _check_axis_name("psum_scatter", axis_name)
  fn = lambda v: jax.lax.psum_scatter(
      v, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)
  return _start_future("psum_scatter", fn, x)


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
  _check_axis_name("all_to_all", axis_name)
  fn = lambda v: jax.lax.all_to_all(v, axis_name, split_axis, concat_axis,
                                    tiled=tiled)
  return _start_future("all_to_all", fn, x)


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
  _check_axis_name("ppermute", axis_name)
  perm = _check_perm(perm, axis_name)
  fn = lambda v: jax.lax.ppermute(v, axis_name, perm)
  return _start_future("ppermute", fn, x)


def _check_perm(perm, axis_name) -> tuple[tuple[int, int], ...]:
  try:
    pairs = tuple((int(s), int(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise ValueError(
        f"ppermute_start(perm={perm!r}): perm must be a sequence of "
        "(source, destination) pairs of axis indices.") from None
  size = _compat.axis_size(axis_name)
  srcs = [s for s, _ in pairs]
  dsts = [d for _, d in pairs]
  problems = []
  if len(set(srcs)) != len(srcs):
    problems.append("a source appears twice")
  if len(set(dsts)) != len(dsts):
    problems.append("a destination appears twice")
  if size is not None and any(not 0 <= i < size for i in srcs + dsts):
    problems.append(f"an index is outside 0..{size - 1} (axis "
                    f"{axis_name!r} has size {size})")
  if problems:
    raise ValueError(
        f"ppermute_start(perm={list(pairs)!r}) is not a permutation: "
        f"{'; '.join(problems)}. Give each device at most one source and one "
        "destination.")
  return pairs
