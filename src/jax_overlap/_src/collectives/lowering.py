"""Lowering of the collective primitives to an async pair.

The start lowers `comm.jaxpr` with jax's own rules and rewrites the one
collective op it produces into an async pair:

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
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async
from jax_overlap._src.collectives.comm import Comm
from jax_overlap._src.collectives.misuse import check_finished
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)


# op name in StableHLO -> the name XLA's async custom calls use.
_ASYNC_NAME = {
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}


def _lower_start(ctx, x, *, comm, split):
  check_finished(comm)
  sub_ctx = ctx.replace(avals_in=[comm.in_aval], avals_out=[comm.out_aval])
  (y,) = _compat.lower_jaxpr_inline(sub_ctx, comm.jaxpr, x)
  op = _collective_op(y)
  if op is not None and split and _sync_on_this_platform(ctx, op):
    op.attributes[not_async.SYNC_FUTURE_ATTR] = ir.UnitAttr.get()
    return [y, x]
  if op is not None:
    if _compat.ASYNC_CUSTOM_CALLS:
      y = _to_custom_call_pair(ctx, op, comm, split=split)
    elif _fits_async_region(op):
      y = _to_async_region_pair(op)
  return [y, x]


def _sync_on_this_platform(ctx, op) -> bool:
  """Whether this backend cannot take `op` as an async pair (then the start
  stays the synchronous collective, and the user is told once)."""
  platforms = tuple(ctx.module_context.platforms or ())
  if "tpu" not in platforms:
    return False
  name = _ASYNC_NAME[op.name]
  why = None
  if name == "reduce-scatter":
    why = ("an async reduce-scatter under program_order crashes the TPU "
           "compiler (SIGSEGV in AsyncCollectiveReplacer, libtpu 0.0.52)")
  elif name == "all-reduce":
    why = ("the TPU compiler has no async all-reduce pair (synchronous, or "
           "'all-reduce-start is not implemented on TPU' with the async flags)")
  elif name == "all-to-all":
    why = ("an async all-to-all under program_order crashes the TPU compiler "
           "(SIGSEGV with XLA's default flags, of rank 2 and 3 alike, libtpu 0.0.52)")
  if why is None:
    return False
  not_async.warn_future_lowered_sync("tpu", name, why)
  return True


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
