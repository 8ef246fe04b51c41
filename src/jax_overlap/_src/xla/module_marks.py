"""The marks the library leaves on a lowered MLIR module, and the walks
that read a module (the compile hook, the compile options).

Invariant: a walk of something that is not an MLIR module (a serialized
one) finds nothing, it does not fail the user's compile. Pinned by
tests/ordering/compile_options_test.py and compile_hook_test.py.
"""

from __future__ import annotations

from typing import Callable

from jax._src.lib.mlir import ir


#: Set on a module holding an ordered block, by its MLIR rule (jax < 0.12;
#: compiled_order.py): the compile hook keeps its barriers on CPU.
ORDERED_MODULE_ATTR = "jax_overlap.ordered"


def mark_module_ordered(module_context) -> None:
  """Notes on the module being lowered that it holds an ordered block."""
  module_context.module.operation.attributes[ORDERED_MODULE_ATTR] = \
      ir.UnitAttr.get()


def is_marked_ordered(computation) -> bool:
  try:
    return ORDERED_MODULE_ATTR in computation.operation.attributes
  except AttributeError:  # not an MLIR module (e.g. a serialized one)
    return False



#: Marks the plain collective op of a future started on jax without the
#: custom-call pair (`_compat.ASYNC_CUSTOM_CALLS` false): XLA makes it async itself.
IN_FLIGHT_ATTR = "jax_overlap.in_flight"

#: op name in StableHLO -> the name XLA's async custom calls use.
ASYNC_NAME = {
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}


def async_collective_starts(computation) -> dict[str, int]:
  """Kind ("all-gather", ...) -> how many async collective starts the MLIR
  module holds: `custom_call @"X-start"` on jax >= 0.12; before, an
  `async_start` around the collective (CPU) or the plain collective of a
  future (`IN_FLIGHT_ATTR`, TPU/GPU)."""
  counts: dict[str, int] = {}

  def visit(op):
    name = op.name
    kind = None
    if name == "stablehlo.custom_call":
      try:
        target = ir.StringAttr(op.attributes["call_target_name"]).value
      except (KeyError, ValueError):
        target = ""
      if target.endswith("-start"):
        kind = target[: -len("-start")]
    elif name == "stablehlo.async_start":
      kind = "async"
    elif IN_FLIGHT_ATTR in op.attributes:
      kind = ASYNC_NAME.get(name)
    if kind:
      counts[kind] = counts.get(kind, 0) + 1
    return ir.WalkResult.ADVANCE
  try:
    computation.operation.walk(visit)
  except AttributeError:  # not an MLIR module (e.g. a serialized one)
    return {}
  return counts


def holds(computation, match: Callable) -> bool:
  """Whether an op of the MLIR module `computation` satisfies `match` (the
  walk stops at the first); False for anything that is not an MLIR module."""
  found = []

  def visit(op):
    if match(op):
      found.append(op)
      return ir.WalkResult.INTERRUPT
    return ir.WalkResult.ADVANCE
  try:
    computation.operation.walk(visit)
  except AttributeError:  # not an MLIR module
    return False
  return bool(found)


def holds_op(computation, name: str) -> bool:
  """Whether the MLIR module `computation` holds an op named `name`."""
  return holds(computation, lambda op: op.name == name)
