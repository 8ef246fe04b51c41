"""The `program_order` primitive: one equation that carries a function's body.

Params of every `program_order` equation:
  call_jaxpr: the body, a closed jaxpr (its consts attached).
  enforce: True for an ordered block, False for a free block.
  strict_in, strict_out: fence all inputs before / all outputs after the body.
  excluded: one bool per input; True for a free block's `exclude_argnames`
    inputs, which the enclosing ordered block must not tie to anything.

Tracing produces this equation and nothing else; the barriers that enforce
the order are made only when the program is lowered (see `xla/ordered_blocks.py`), so
autodiff, remat and vmap see the same program as without `program_order`.
"""

from __future__ import annotations

from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.eager_shard_map import EagerAwarePrimitive

# In an eager shard_map a block runs as one cached program (eager_shard_map.py).
program_order_p = EagerAwarePrimitive("program_order", body_param="call_jaxpr")
program_order_p.multiple_results = True
# Our inputs are the body's own values: canonicalizing them again at bind
# would change weak types the body was traced with.
program_order_p.skip_canonicalization = True


def _abstract_eval(*avals, call_jaxpr, **_):
  del avals
  # Positional: a body's effect on its i-th input (a Ref it writes) is an
  # effect on the equation's i-th operand, not on a variable of the body.
  return list(call_jaxpr.out_avals), core.positional_effects(call_jaxpr)


program_order_p.def_effectful_abstract_eval(_abstract_eval)


def is_free_block(eqn) -> bool:
  """True for the equation of a `program_order(enforce=False)` block."""
  return eqn.primitive is program_order_p and not eqn.params["enforce"]


def body_of(eqn):
  return eqn.params["call_jaxpr"]


def bind(args, *, call_jaxpr, enforce, strict_in, strict_out, excluded):
  """Binds `program_order_p`; checks the params agree with each other."""
  jaxpr = _compat.open_jaxpr(call_jaxpr)
  assert len(excluded) == len(args) == len(jaxpr.invars), (
      len(excluded), len(args), len(jaxpr.invars))
  return program_order_p.bind(
      *args, call_jaxpr=call_jaxpr, enforce=bool(enforce),
      strict_in=bool(strict_in), strict_out=bool(strict_out),
      excluded=tuple(bool(e) for e in excluded))
