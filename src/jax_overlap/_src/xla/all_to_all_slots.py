"""The TPU's one async all-to-all in flight, kept while a module is lowered.

Invariant: in the written order (which `program_order` fences) at most one
TPU-form all-to-all (collectives/tpu_forms.py) is started and not finished
at a time, in the module being lowered: a form's start takes the slot
(`take_slot`) or is lowered synchronously (futures.py, warned), its done
frees it (`free_slot`), and the start waits for the all-to-alls lowered
before it in its block (`after_last_all_to_all`). Why: libtpu fails a module
whose fenced order has two async all-to-alls in flight
("kExceedsOverlapLimit"; no option raises that limit). Pinned by
tests/aot/tpu_forms_compiled_test.py (the forms of one block are chained;
two futures in flight at once: the second runs synchronously).
"""

from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo


# The TPU compiler fails a module whose fenced order puts two async
# all-to-alls in flight at once ("kExceedsOverlapLimit"; no option raises that
# limit): a form's all-to-all starts async only while no other is open. The
# count is kept per module, in the order starts and dones are lowered, which
# is the written order that program_order fences.
_OPEN_KEY = ("jax_overlap", "open TPU all-to-alls")


def take_slot(ctx) -> bool:
  """Takes the module's one all-to-all slot; False if it is taken."""
  cache = ctx.module_context.cached_primitive_lowerings
  if cache.get(_OPEN_KEY, 0) >= 1:
    return False
  cache[_OPEN_KEY] = cache.get(_OPEN_KEY, 0) + 1
  return True


def free_slot(ctx, done) -> None:
  """Frees the slot at the form's `done` (the value the next start waits for)."""
  cache = ctx.module_context.cached_primitive_lowerings
  cache[_OPEN_KEY] = max(cache.get(_OPEN_KEY, 0) - 1, 0)
  cache[_LAST_KEY] = done


# ... and the slot must be free in the compiled order too: XLA may hoist the
# next start (whose operand is ready) above the previous done, and with the
# fences around each then finds no schedule. So a form's start waits for
# the previous form's done, where both are in the same block.
_LAST_KEY = ("jax_overlap", "last TPU all-to-all done")


def after_last_all_to_all(ctx, x):
  """`x`, made to wait for every all-to-all of a form lowered before it:
  the previous form's done where that is in this block, and the results of
  each loop, branch or call before it in this block that holds one (XLA may
  unroll or inline those, and then nothing else orders the two); in a loop
  body, also the body's arguments (the previous iteration's results)."""
  last = ctx.module_context.cached_primitive_lowerings.get(_LAST_KEY)
  here = ir.InsertionPoint.current.block
  waits = []
  if last is not None and _block_of(last) == here:
    waits.append(last)
  for op in here.operations:
    op = op.operation if hasattr(op, "operation") else op
    if op.name in HOLDERS and len(op.results) and _holds_form(ctx, op):
      waits.extend(op.results)
  parent = here.owner
  if parent is not None and getattr(parent, "name", "") == "stablehlo.while":
    waits.extend(here.arguments)
  if not waits:
    return x
  return hlo.OptimizationBarrierOp([x, *waits]).results[0]


HOLDERS = ("stablehlo.while", "stablehlo.case", "stablehlo.if", "func.call")


def _holds_form(ctx, op) -> bool:
  found = []

  def visit(inner):
    if inner.name == "stablehlo.custom_call" and \
        "all-to-all-start" in str(inner.attributes["call_target_name"]):
      found.append(inner)
      return ir.WalkResult.INTERRUPT
    return ir.WalkResult.ADVANCE
  try:
    if op.name == "func.call":
      callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
      op = ctx.module_context.symbol_table[callee].operation
    op.walk(visit)
  except Exception:  # noqa: BLE001 - cannot tell: assume it does
    return True
  return bool(found)


def _block_of(value):
  try:
    owner = value.owner
    owner = owner.operation if hasattr(owner, "operation") else owner
    return owner.block
  except Exception:  # noqa: BLE001 - a block argument, or unknown
    return None
