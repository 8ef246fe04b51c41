"""Rewrites of a whole lowered module for the TPU's one async all-to-all.

The compile options hook (compile_options.py) calls these on a TPU module
holding several TPU-form futures (collectives/tpu_forms.py), before the
compile or when libtpu refused it: `chain_form_starts` ties each form's
start after the all-to-all finished before it in its block (v5e), and
`finish_form_starts_at_once` makes each form finish where it starts (v5p,
or a module libtpu refused). Invariant: values unchanged; only the order
libtpu needs is stated, or the pairs put back to back. Pinned by
tests/ordering/compile_options_test.py (the ties) and
tests/aot/tpu_forms_compiled_test.py (the real compiler: kept in flight on
v5e, finished at once on v5p, compiled again when refused).
"""

from __future__ import annotations

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.xla.all_to_all_slots import HOLDERS


def form_starts(module) -> list:
  """The TPU-form all-to-all starts of `module`, in module order."""
  starts = []

  def visit(op):
    if op.name == "stablehlo.custom_call" and tpu_forms.FORM_ATTR in op.attributes:
      starts.append(op)
    return ir.WalkResult.ADVANCE
  module.operation.walk(visit)
  return starts


def finish_form_starts_at_once(module) -> int:
  """Makes each TPU-form all-to-all of `module` finish right where it
  starts (the pair back to back; what ran between its halves now follows
  it). Returns how many. For a module holding more than one: libtpu allows
  one async all-to-all in flight and fails the compile when the fences (or
  its own unrolling of a short loop) make two overlap."""
  starts = form_starts(module)
  for start_op in starts:
    started = start_op.results[0]
    with start_op.location, ir.InsertionPoint(start_op):
      done = mlir.custom_call("all-to-all-done", result_types=[started.type],
                              operands=[started], api_version=1)
    done_op = done.operation if hasattr(done, "operation") else done
    done_op.move_after(start_op)
    finished = done_op.results[0]
    old_dones = []
    for use in list(started.uses):
      user = use.owner
      user = user.operation if hasattr(user, "operation") else user
      if user == done_op:
        continue
      user.operands[use.operand_number] = finished
    # The old done now reads a finished value through the barriers: drop it.
    frontier = [finished]
    while frontier:
      v = frontier.pop()
      for use in list(v.uses):
        user = use.owner
        user = user.operation if hasattr(user, "operation") else user
        if user.name == "stablehlo.optimization_barrier":
          frontier.append(user.results[use.operand_number])
        elif user.name == "stablehlo.custom_call" and \
            "all-to-all-done" in str(user.attributes["call_target_name"]) and \
            user != done_op:
          old_dones.append(user)
    for old in old_dones:
      old.results[0].replace_all_uses_with(old.operands[0])
      old.erase()
    del start_op.attributes[tpu_forms.FORM_ATTR]
  return len(starts)


def target(op) -> str:
  try:
    return ir.StringAttr(op.attributes["call_target_name"]).value
  except (KeyError, ValueError):
    return ""


def _holds_all_to_all_start(op) -> bool:
  found = []

  def visit(inner):
    if inner.name == "stablehlo.custom_call" and target(inner) == "all-to-all-start":
      found.append(inner)
      return ir.WalkResult.INTERRUPT
    return ir.WalkResult.ADVANCE
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        inner = inner.operation if hasattr(inner, "operation") else inner
        inner.walk(visit)
        if found:
          return True
  return False


def chain_form_starts(module) -> int:
  """Makes each TPU-form start of `module` wait for the async all-to-all
  finished before it in its block (the previous `all-to-all-done`, or a
  loop, branch or call holding an all-to-all start). Returns how many it
  tied. Lowering ties them where both are lowered into one block
  (`all_to_all_slots.after_last_all_to_all`), but jax lowers each step of an unrolled
  scan's ordered blocks apart and splices them together later: without the
  tie XLA may schedule the next start above the previous done, and libtpu,
  which allows one async all-to-all in flight, then refuses the module
  (`kExceedsOverlapLimit`). The tie only states the order libtpu needs; the
  starts can still run ahead of the compute around them."""
  starts = form_starts(module)
  tied = 0
  for start_op in starts:
    last = None
    for op in start_op.block.operations:
      op = op.operation if hasattr(op, "operation") else op
      if op == start_op:
        break
      if op.name == "stablehlo.custom_call" and target(op) == "all-to-all-done":
        last = op
      elif op.name in HOLDERS and len(op.results) and op.regions and \
          _holds_all_to_all_start(op):
        last = op
    if last is None:
      continue
    operand = start_op.operands[0]
    with start_op.location, ir.InsertionPoint(start_op):
      barrier = hlo.OptimizationBarrierOp([operand, *last.results])
    start_op.operands[0] = barrier.results[0]
    tied += 1
  return tied
