"""Whether the compiled program keeps the written order, and saying so when not.

Barriers fix the order only if the compiler still sees them when it fuses and
schedules. Where XLA is known to drop them first (the CPU compiler of jaxlib
0.10.2 and 0.11.0), the compile hook (`compile_hook.py`) compiles ordered
modules so that it keeps them; see docs/program-order.md's table "Is the order kept in
the compiled program?" for every (backend, jax version) pair. What cannot be
delivered is said once per process with an `OrderNotKeptWarning`.
"""

from __future__ import annotations

import os
import warnings

import jax
from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.primitives import collective_start_p
from jax_overlap._src.xla import compile_hook, futures, module_marks

#: Set JAX_OVERLAP_KEEP_CPU_ORDER=0 to compile ordered CPU programs as XLA
#: would by itself (then the order is not kept there, and we warn).
KEEP_CPU_ORDER_ENV = "JAX_OVERLAP_KEEP_CPU_ORDER"
_CPU_KEEPER_INSTALLED = compile_hook.keep_cpu_order(
    os.environ.get(KEEP_CPU_ORDER_ENV, "1") != "0")
_warned: set[str] = set()


class OrderNotKeptWarning(UserWarning):
  """The compiled program may not keep an order `program_order` asked for.

  Silence it with
  `warnings.filterwarnings("ignore", category=jax_overlap.OrderNotKeptWarning)`.
  """


def _warn_once(key: str, message: str) -> None:
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(message, OrderNotKeptWarning, stacklevel=2)


def note_ordered_block(ctx, body) -> None:
  """Called while an ordered block is lowered by its MLIR rule (jax < 0.12)."""
  module_marks.mark_module_ordered(ctx.module_context)
  platforms = tuple(ctx.module_context.platforms or ())
  if "cpu" in platforms and not _CPU_KEEPER_INSTALLED:
    _warn_once("cpu", (
        f"program_order: jax {jax.__version__}'s CPU compiler drops "
        "optimization barriers before it schedules, and jax_overlap is not "
        f"keeping them here ({KEEP_CPU_ORDER_ENV}=0, or this jax offers no "
        "way): the compiled CPU program may not keep the written order "
        "(values are unaffected)."))
  accelerators = [p for p in platforms if p != "cpu"]
  if (accelerators and not _compat.ASYNC_CUSTOM_CALLS
      and not futures.leaves_in_flight(platforms)
      and _starts_future(_compat.open_jaxpr(body))):
    _warn_once("async:" + ",".join(accelerators), (
        f"program_order: on this jax ({jax.__version__}) an async "
        "collective's start and done are lowered back to back on "
        f"{'/'.join(accelerators)}, so inside an ordered block the "
        "collective does not overlap the work written between them (values "
        "are unaffected). jax >= 0.12 lowers the two halves apart."))


def _starts_future(jaxpr: core.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is collective_start_p:
      return True
    if any(_starts_future(sub) for sub in core.jaxprs_in_params(eqn.params)):
      return True
  return False
