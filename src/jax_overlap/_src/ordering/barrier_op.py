"""`barrier(values)`: one `optimization_barrier` over a flat list of values.

Invariant: each value comes out with the type it went in with (Refs pass
by, their effects keep the order), and the StableHLO op is jax's own
`stablehlo.optimization_barrier`. Why a primitive of our own before jax
0.12 (`_compat.USE_HIJAX` false): there barriers are made in the MLIR
lowering rule, after every type check, and jax's barrier would make all
operands vary over the same mesh axes (see `barrier`). Pinned by
tests/ordering/program_order_test.py and the conformance suite's barrier
counts.
"""

from __future__ import annotations

from typing import Any, Sequence

from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir.dialects import hlo
from jax._src.state.types import AbstractRef

from jax_overlap._src import _compat


def _typed_barrier_abstract_eval(*avals):
  return list(avals)


_typed_barrier_p = core.Primitive("optimization_barrier")
_typed_barrier_p.multiple_results = True
_typed_barrier_p.def_abstract_eval(_typed_barrier_abstract_eval)


def lower_barrier(ctx, *args):
  """The MLIR of one `stablehlo.optimization_barrier` over `args`, each
  result typed as its input (also xla/tick_gate.py's TPU lowering)."""
  flat, _ = mlir.ir_tree_registry.flatten(args)
  op = hlo.OptimizationBarrierOp(flat)
  return [mlir.lower_with_sharding_in_types(ctx, r, aval)
          for r, aval in zip(op.results, ctx.avals_out)]


mlir.register_lowering(_typed_barrier_p, lower_barrier)


def barrier(values: Sequence[Any]) -> list[Any]:
  """One `optimization_barrier` over a flat list, keeping each value's type.

  Before 0.12, jax's barrier asks all operands inside `shard_map` to vary over
  the same mesh axes and makes them so, which changes the types a body was
  traced with (a later `pvary` then fails). There barriers are made in the
  MLIR lowering rule, after every type check, so a barrier that passes each
  operand's type through is both safe and the same StableHLO op.
  """
  values = list(values)
  is_ref = [_is_ref(x) for x in values]
  if _compat.USE_HIJAX:
    if not any(is_ref):
      return list(lax_internal.optimization_barrier_p.bind(*values))
    # jax's own barrier pins Refs as inputs and hands them back unchanged;
    # the primitive alone returns only the non-Ref values.
    return list(lax_internal.optimization_barrier(values))
  # Older barriers can't take a Ref: Refs pass by, their effects keep order.
  outs = iter(_typed_barrier_p.bind(*[x for x, r in zip(values, is_ref) if not r]))
  return [x if r else next(outs) for x, r in zip(values, is_ref)]


def _is_ref(x) -> bool:
  return isinstance(core.typeof(x), AbstractRef)
