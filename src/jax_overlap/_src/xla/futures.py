"""Lowering of the collective primitives to an async pair.

The start lowers `comm.jaxpr` with jax's own rules and rewrites the one
collective op it produces into an async pair:

* GPU/TPU (and jax with the custom-call form): the start emits
  `stablehlo.custom_call @"<op>-start"` and the done emits `@"<op>-done"`, so
  what runs between them is what was written between them, and
  `program_order(enforce=True)` fences that order.
* CPU (on jax without the custom-call form too): the start emits the whole
  pair back to back and the done is the identity. XLA's CPU compiler crashes
  or rejects the pair when an optimization_barrier separates its halves, and
  it makes every collective blocking anyway; this way barriers only ever see
  finished values.
* GPU/TPU on jax without the custom-call form (`not _compat.ASYNC_CUSTOM_CALLS`;
  the plugins refuse the async region, 'vhlo.async_start_v1'): the start
  emits the plain collective, marked `module_marks.IN_FLIGHT_ATTR`, and the done
  is the identity; an ordered block keeps the start's result out of its
  barriers until the done (ordering/barriers.py), so XLA's own async
  conversion splits the collective around the written work (quirks
  "gpu-plain-future" / "tpu-plain-future";
  tests/aot/real_compilers_test.py::test_future_is_an_async_pair_around_the_matmul
  on the older jax).

A future may be finished in another region than the one that started it
(fsdp_scan on an explicit mesh starts a gather in one `jax.shard_map` and
finishes it in a second, patterns/fsdp/explicit_futures.py): its done then
receives the in-flight value as an argument of the second body, and walking
back finds no start. So each start that lowered to an async pair records its
pair in the module's lowering cache, keyed by its `Comm` (the start and done
of one future share it), and a done whose walk finds nothing finishes the
pair recorded: a lone start is refused by XLA ("Custom emitter for
all-gather-start not found" on TPU), which
tests/aot/real_compilers_test.py::test_fsdp_scan_on_an_explicit_mesh pins.
A start that stayed synchronous records nothing.

Where the synchronous lowering does not end in one collective op (an untiled
psum_scatter ends in a reshape; a vmapped collective over the vmap axis has
no collective at all) the start lowers to the synchronous form: correct
values, nothing in flight.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives import not_async
from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.collectives.comm import Comm
from jax_overlap._src.collectives.misuse import check_finished
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)
from jax_overlap._src.xla import all_to_all_slots, compile_hook, form_rewrites, module_marks
from jax_overlap._src.xla.module_marks import ASYNC_NAME


#: The key of the pairs started in a module, in its lowering cache.
_STARTED = "jax_overlap started"


def _started(ctx) -> dict:
  """{Comm: '<op>'} of the async pairs started so far in this module."""
  return ctx.module_context.cached_primitive_lowerings.setdefault(_STARTED, {})


def _lower_start(ctx, x, *aux, comm, split):
  _own(ctx)
  out = _lower_start_here(ctx, x, *aux, comm=comm, split=split)
  name, _ = _find_start(out[0])
  if name is not None:
    _started(ctx)[comm] = name
  else:   # synchronous; or one Comm lowered twice (a block traced once, called twice)
    _started(ctx).pop(comm, None)
  return out


def _own(ctx) -> None:
  """The compile hook, from the first future lowered on (compile_hook.py)."""
  compile_hook.install()
  compile_hook.mark_owned(ctx.module_context)


def _lower_start_here(ctx, x, *aux, comm, split):
  check_finished(comm)
  if comm.tpu_form is not None:
    return [_lower_form_start(ctx, x, comm, split=split), x]
  sub_ctx = ctx.replace(avals_in=[comm.in_aval, *comm.aux_avals],
                        avals_out=[comm.out_aval])
  jaxpr = comm.jaxpr_for(_platforms(ctx))
  (y,) = _compat.lower_jaxpr_inline(sub_ctx, jaxpr, x, *aux)
  if jaxpr is comm.cpu_jaxpr:
    # Its collective is a dense all-to-all inside more ops: whole, like every
    # collective on CPU (values only; XLA:CPU blocks on collectives anyway).
    return [y, x]
  ragged = _ragged_op(y)
  if ragged is not None:
    _say_ragged_is_sync(ctx, ragged, comm)
    return [y, x]
  op = _collective_op(y)
  if op is not None and split and _sync_on_this_platform(ctx, op):
    op.attributes[not_async.SYNC_FUTURE_ATTR] = ir.UnitAttr.get()
    return [y, x]
  if op is not None:
    if _compat.ASYNC_CUSTOM_CALLS:
      y = _to_custom_call_pair(ctx, op, comm, split=split)
    elif _fits_async_region(ctx, op):
      y = _to_async_region_pair(op)
    elif leaves_in_flight(_platforms(ctx)):
      _mark_in_flight(ctx, op, comm)
  return [y, x]


def leaves_in_flight(platforms) -> bool:
  """Whether a future lowered for `platforms` is its plain collective, left
  in flight up to its done (the module docstring): jax without the
  custom-call pair, compiling for TPU or GPU only."""
  if _compat.ASYNC_CUSTOM_CALLS or not platforms or "cpu" in platforms:
    return False
  return any(quirks.applies("gpu-plain-future", p) or
             quirks.applies("tpu-plain-future", p) for p in platforms)


#: Plain collectives libtpu (0.0.42.1, 0.0.44.1) compiles synchronous
#: whatever the barriers leave them (with the async flags too): no window.
_TPU_KEEPS_SYNC = {
    "all-reduce": "libtpu compiles an all-reduce synchronous there",
    "reduce-scatter": "libtpu compiles a reduce-scatter synchronous there",
}


def _mark_in_flight(ctx, op, comm: Comm) -> None:
  op.attributes[module_marks.IN_FLIGHT_ATTR] = ir.UnitAttr.get()
  name = ASYNC_NAME[op.name]
  shard = comm.in_aval
  if name == "all-gather" and "tpu" in _platforms(ctx) and \
      shard.size * shard.dtype.itemsize < quirks.SMALL_PLAIN_TPU_GATHER_BYTES:
    # Said once (tests/aot/real_compilers_test.py::
    # test_a_small_gather_over_two_axes_is_async_or_said).
    not_async.warn_once("tpu:small-plain-all-gather", (
        f"all_gather_start on tpu: on jax {jax.__version__} the future is "
        f"the plain all-gather, and libtpu there turns one of a shard under "
        f"{quirks.SMALL_PLAIN_TPU_GATHER_BYTES} bytes (this one: "
        f"{shard.size * shard.dtype.itemsize}) into a synchronous all-reduce: "
        "nothing in flight between start and done(). On TPU v5e a gather "
        "over one mesh axis inside jax.shard_map is N-1 permutes instead, "
        "which stay async; jax >= 0.12 has an async all-gather pair. "
        "Silence with warnings.filterwarnings('ignore', "
        "category=jax_overlap.CollectiveNotAsyncWarning)."))
  if name == "collective-permute" and "tpu" in _platforms(ctx) and \
      "channel_handle" in op.attributes:
    # A channel of its own, numbered in turn as the custom-call pairs'
    # (`_async_config`): jax gives every collective channel 1, and the
    # parts of a permute form are then one future's only by their
    # channels (tests/aot/schedule.py::permute_futures groups them so).
    op.attributes["channel_handle"] = hlo.ChannelHandle.get(
        int(ctx.module_context.new_channel()), 1)
  if "tpu" in _platforms(ctx) and name in _TPU_KEEPS_SYNC:
    op.attributes[not_async.SYNC_FUTURE_ATTR] = ir.UnitAttr.get()
    not_async.warn_future_lowered_sync("tpu", name, (
        f"on jax {jax.__version__} the future is the plain collective, which "
        f"XLA makes async by itself, but {_TPU_KEEPS_SYNC[name]} (also with "
        "its async flags); jax >= 0.12 has an async form of it on TPU"))


def _platforms(ctx) -> tuple[str, ...]:
  return tuple(ctx.module_context.platforms or ())


def device_kind_of(ctx) -> str | None:
  """The device kind of the mesh lowering `ctx` is for; None where the
  mesh is abstract."""
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  try:
    return mesh.devices.flat[0].device_kind
  except Exception:  # noqa: BLE001 - an abstract mesh: unknown
    return None


def _all_axes_manual(ctx) -> bool:
  """Inside a shard_map over every mesh axis: no sharding annotation is
  emitted on values there, so a value in flight may have its own shape."""
  axis_context = ctx.module_context.axis_context
  manual = getattr(axis_context, "manual_axes", None)
  mesh = getattr(axis_context, "mesh", None)
  return bool(manual) and mesh is not None and \
      set(manual) == set(mesh.axis_names)


def _lower_form_start(ctx, x, comm, *, split):
  """The TPU form's start (tpu_forms.py): its all-to-all is the pair."""
  form = comm.tpu_form
  if form.local:   # made on the device (broadcast.py): no pair, no slot
    sub_ctx = ctx.replace(avals_in=[comm.in_aval], avals_out=[comm.flight_aval])
    (buf,) = _compat.lower_jaxpr_inline(sub_ctx, form.start, x)
    return buf
  if split and _compat.ASYNC_CUSTOM_CALLS and _platforms(ctx) == ("tpu",):
    if not all_to_all_slots.take_slot(ctx):
      return _lower_form_start_sync(ctx, x, comm)
    x = all_to_all_slots.after_last_all_to_all(ctx, x)
  sub_ctx = ctx.replace(avals_in=[comm.in_aval], avals_out=[comm.flight_aval])
  (buf,) = _compat.lower_jaxpr_inline(sub_ctx, form.start, x)
  op = _collective_op(buf)
  if op is None:
    return buf
  if split and _compat.ASYNC_CUSTOM_CALLS:
    started = _to_custom_call_pair(ctx, op, comm, split=True)
    owner = started.owner
    owner = owner.operation if hasattr(owner, "operation") else owner
    owner.attributes[tpu_forms.FORM_ATTR] = ir.UnitAttr.get()
    return started
  if _compat.ASYNC_CUSTOM_CALLS:
    return _to_custom_call_pair(ctx, op, comm, split=False)
  if _fits_async_region(ctx, op):
    return _to_async_region_pair(op)
  if leaves_in_flight(_platforms(ctx)):
    _mark_in_flight(ctx, op, comm)
  return buf


def _lower_form_start_sync(ctx, x, comm):
  """The form's buffer, made by the plain synchronous collective: the
  buffer whose done is that value (for a sum, the value in slot 0 and zeros
  elsewhere). No all-to-all: with async all-to-alls on, TPU would make one
  of any all-to-all and then fail the module."""
  not_async.warn_once("tpu:all-to-all-in-flight", (
      f"{comm.name}_start on tpu: its async TPU form is an all-to-all, and "
      "the TPU compiler allows one async all-to-all at a time (libtpu "
      "0.0.52; no option raises it): while another future's all-to-all is "
      "already in flight, this one runs synchronously (values unchanged). "
      "Finish the first future before starting the next, or use one "
      "collective for all the buffers. Silence with warnings.filterwarnings("
      "'ignore', category=jax_overlap.CollectiveNotAsyncWarning)."))
  sub_ctx = ctx.replace(avals_in=[comm.in_aval], avals_out=[comm.flight_aval])
  (buf,) = _compat.lower_jaxpr_inline(sub_ctx, comm.tpu_form.sync, x)
  _mark_sync_collectives(buf, stop=x)
  return buf


def _mark_sync_collectives(value, stop):
  """Marks the collectives `value` was made of (back to `stop`) as a
  future's, said already: not "a plain collective fenced in a block"."""
  seen, frontier = set(), [value]
  while frontier:
    v = frontier.pop()
    owner = v.owner
    if v == stop or isinstance(owner, ir.Block):
      continue
    op = owner.operation if hasattr(owner, "operation") else owner
    if id(op) in seen or len(seen) > 64:
      continue
    seen.add(id(op))
    if op.name in ASYNC_NAME:
      op.attributes[not_async.SYNC_FUTURE_ATTR] = ir.UnitAttr.get()
    frontier.extend(op.operands)


def _lower_form_done(ctx, buf, comm):
  form = comm.tpu_form
  sub_ctx = ctx.replace(avals_in=[comm.flight_aval], avals_out=[comm.out_aval])
  (y,) = _compat.lower_jaxpr_inline(sub_ctx, form.done, buf)
  return y


def _sync_on_this_platform(ctx, op) -> bool:
  """Whether this backend cannot take `op` as an async pair (then the start
  stays the synchronous collective, and the user is told once). Reached on
  TPU only where the future has no usable TPU form (`_usable_tpu_form`)."""
  platforms = _platforms(ctx)
  if "tpu" not in platforms:
    return False
  name = ASYNC_NAME[op.name]
  why = None
  if name == "reduce-scatter":
    why = ("an async reduce-scatter crashes the TPU compiler (SIGSEGV in "
           "AsyncCollectiveReplacer)")
  elif name == "all-reduce":
    why = ("the TPU compiler has no async all-reduce pair (synchronous, or "
           "'all-reduce-start is not implemented on TPU' with the async flags)")
  elif name == "all-to-all":
    why = ("an async all-to-all of this buffer crashes the TPU compiler "
           "(SIGSEGV, or 'dimension is tiled')")
  elif name == "all-gather" and \
      quirks.applies("tpu-sync-all-gather", "tpu", device_kind_of(ctx)):
    why = ("the TPU v5p compiler makes every all-gather synchronous; "
           "there its async form is N-1 collective-permutes "
           "(permute_forms.py), and before that an all-to-all")
  if why is None:
    return False
  not_async.warn_future_lowered_sync("tpu", name, why + (
      "; its async TPU form (an all-to-all, see docs/compilers.md, 'On the real TPU "
      "and GPU compilers') "
      "needs one mesh axis name, a shard_map over a mesh of TPU devices, and "
      "a split dimension the axis size divides (not under vmap, nor as the "
      "transpose autodiff makes of another future)"))
  return True


def _defining_op(y):
  """The operation that makes `y`, or None for a block argument."""
  owner = y.owner
  if isinstance(owner, ir.Block):
    return None
  return owner.operation if hasattr(owner, "operation") else owner


def _collective_op(y):
  op = _defining_op(y)
  if op is None or op.name not in ASYNC_NAME or len(op.results) != 1:
    return None
  return op


def _ragged_op(y):
  """The `ragged_all_to_all` custom call `y` comes from, or None."""
  op = _defining_op(y)
  if (op is not None and op.name == "stablehlo.custom_call"
      and form_rewrites.target(op) == "ragged_all_to_all"):
    return op
  return None


def _say_ragged_is_sync(ctx, op, comm: Comm) -> None:
  """The real ragged all-to-all stays whole where the future starts: XLA's
  async custom calls (`_compat.ASYNC_CUSTOM_CALLS`) take the five other
  collectives only ("No registered implementation for custom call to
  ragged-all-to-all-start for platform CUDA"; TPU: "Custom emitter for
  ragged-all-to-all-start not found"), and an ordered block's fences then
  finish it there."""
  op.attributes[not_async.SYNC_FUTURE_ATTR] = ir.UnitAttr.get()
  accelerators = [p for p in _platforms(ctx) if p != "cpu"]
  if not accelerators:
    return
  platform = "/".join(accelerators)
  if comm.sync_note is not None:   # the pattern that made it says why
    not_async.warn_once(f"note:{platform}:{comm.sync_note}",
                        comm.sync_note.format(platform=platform))
    return
  not_async.warn_once(f"future:{platform}:ragged-all-to-all", (
      f"ragged_all_to_all_start on {platform}: XLA has no async ragged "
      "all-to-all pair a program can place (its async custom calls take "
      "all-gather, all-reduce, reduce-scatter, all-to-all and "
      "collective-permute only), so the "
      "ragged all-to-all runs whole where the future starts: inside "
      "program_order nothing is in flight between start and done() (values "
      "unchanged; outside program_order XLA may still make it async, as "
      "TPU's compiler does). To overlap it under program_order, send "
      "fixed-capacity buffers with all_to_all_start instead. Silence with "
      "warnings.filterwarnings('ignore', "
      "category=jax_overlap.CollectiveNotAsyncWarning)."))


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
    # jax gives every collective channel 1 (XLA numbers them later), but a
    # start custom call keeps the id it is given: two starts of the same value
    # with the same config (a ring that sends x in the forward and again in
    # the backward) would then be identical, XLA's CSE would merge them, and
    # the verifier refuses the start left with two dones (H100: "Async start
    # collective-permute-start is matched by multiple async done
    # instructions"). A channel of its own keeps each start apart.
    cfg["channel_id"] = int(ctx.module_context.new_channel())
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
  name = ASYNC_NAME[op.name]
  cfg = _async_config(ctx, op, comm)
  called = []
  if op.name in ("stablehlo.all_reduce", "stablehlo.reduce_scatter"):
    called = [_reducer_func(ctx, op)]
  result = op.results[0]
  # XLA's CSE compares a custom call's target, operands and backend_config,
  # not its frontend attributes, where the permutation and channel are: it
  # merges two ppermute starts of one operand (a gather's parts,
  # permute_forms.py; a value sent both ways) into one, on TPU and H100
  # alike, and every result then comes from one permutation; and on H100 two
  # all-gather starts of one weight (fsdp_scan run twice over it, as a
  # pipeline's forward and backward ticks do) into one start with two dones,
  # which the verifier refuses. The config (its channel is the start's own)
  # as the backend config too keeps them apart (tests/aot/
  # real_compilers_test.py::test_two_ppermute_futures_of_one_value_stay_two,
  # ::test_two_fsdp_scans_over_one_weight_compile).
  apart = json.dumps(cfg)
  with ir.InsertionPoint(op):
    started = mlir.custom_call(
        f"{name}-start", result_types=[result.type],
        operands=[op.operands[0]], api_version=1,
        called_computations=called, backend_config=apart,
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


def _fits_async_region(ctx, op) -> bool:
  # Without the async custom calls (`_compat.ASYNC_CUSTOM_CALLS` false) the
  # TPU and GPU plugins refuse the region when StableHLO is serialized for
  # them ("failed to legalize operation 'vhlo.async_start_v1'"; tests/aot/ on
  # the older jax pins it): there the plain op stands, back to back as the
  # region would be.
  if set(_platforms(ctx)) - {"cpu"}:
    return False
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
  del operand
  _own(ctx)
  name, _ = _find_start(in_flight)
  if name is None:
    # Started in another region (see the module docstring), if anywhere.
    name = _started(ctx).get(comm)
  done = in_flight if name is None else _done_custom_call(name, in_flight)
  if name is not None and comm.tpu_form is not None and \
      _platforms(ctx) == ("tpu",):
    all_to_all_slots.free_slot(ctx, done)
  if comm.tpu_form is not None:
    return [_lower_form_done(ctx, done, comm)]
  return [done]


def _find_start(value):
  """The '<op>' of an unfinished '<op>-start' custom call `value` comes
  from, and that custom call.

  Looks through the optimization barriers `program_order` puts between the
  two halves. None when the value is already finished (CPU, old jax) or was
  never async: (None, None).
  """
  while True:
    owner = value.owner
    if isinstance(owner, ir.Block):
      return None, None
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name == "stablehlo.optimization_barrier":
      index = list(op.results).index(value)
      value = op.operands[index]
      continue
    if op.name != "stablehlo.custom_call":
      return None, None
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target.endswith("-start") and target[:-len("-start")] in \
        ASYNC_NAME.values():
      return target[:-len("-start")], op
    return None, None


mlir.register_lowering(collective_start_p,
                       functools.partial(_lower_start, split=False),
                       cacheable=False)
mlir.register_lowering(collective_done_p, _lower_done, cacheable=False)
if _compat.ASYNC_CUSTOM_CALLS:
  for _platform in ("cuda", "rocm", "tpu"):
    mlir.register_lowering(collective_start_p,
                           functools.partial(_lower_start, split=True),
                           platform=_platform, cacheable=False)
