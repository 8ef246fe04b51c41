"""Where the barriers appear: lowering of the `program_order` primitive.

An ordered block (enforce=True) is re-emitted by `ordering/barriers.run_in_order`; a
free block (enforce=False) is inlined as it is. On jax >= 0.12 ordered blocks
are "high" primitives, lowered by `to_lojax` into the `lojax` jaxpr (where
jax's own `program_order` puts its barriers too); on older jax the MLIR
lowering rule does the same work. Either way the traced jaxpr, which autodiff,
remat and vmap see, holds no barrier.
"""

from __future__ import annotations


from jax._src.interpreters import mlir

from jax_overlap._src import _compat
from jax_overlap._src.ordering.barriers import run_in_order
from jax_overlap._src.ordering.primitive import bind, program_order_p
from jax_overlap._src.xla import compile_hook, futures
from jax_overlap._src.xla.compiled_order import note_ordered_block


def _ordered_body(closed, args, *, strict_in, strict_out, leave_in_flight=False):
  """DCEs the body, keeping all outputs, then runs it with barriers."""
  n_out = len(_compat.open_jaxpr(closed).outvars)
  closed, _ = _compat.dce(closed, [True] * n_out, instantiate=True)
  return run_in_order(closed, args, strict_in=strict_in, strict_out=strict_out,
                      leave_in_flight=leave_in_flight)


# --- jax >= 0.12: lower through lojax ---------------------------------------

def _is_high(*avals, call_jaxpr, enforce, **_):
  del avals
  return bool(enforce) or _compat.jaxpr_is_high(call_jaxpr)


def _to_lojax(*args, call_jaxpr, enforce, strict_in, strict_out, excluded):
  compile_hook.install()   # (lowering: the compile of this module follows)
  if enforce:
    return _ordered_body(call_jaxpr, args, strict_in=strict_in,
                         strict_out=strict_out)
  # A free block stays one equation; only what's high inside it is lowered.
  return bind(args, call_jaxpr=_compat.lower_to_lojax(call_jaxpr),
              enforce=False, strict_in=strict_in, strict_out=strict_out,
              excluded=excluded)


def _lower_body(*args, call_jaxpr, **params):
  # Older jax: barriers come from the MLIR rule below, but a body holding
  # HiJAX values (jax_remat3's checkpoint names and rematted calls) makes the
  # equation high (jax's default `is_high`), so its body is lowered first.
  return bind(args, call_jaxpr=_compat.lower_to_lojax(call_jaxpr), **params)


if _compat.USE_HIJAX:
  program_order_p.is_high = _is_high
  program_order_p.to_lojax = _to_lojax
else:
  program_order_p.to_lojax = _lower_body


# --- every version: MLIR ------------------------------------------------------

def _mlir_lowering(ctx, *args, call_jaxpr, enforce, strict_in, strict_out,
                   excluded):
  del excluded
  compile_hook.install()
  compile_hook.mark_owned(ctx.module_context)
  if enforce:
    note_ordered_block(ctx, call_jaxpr)
    leave = futures.leaves_in_flight(tuple(ctx.module_context.platforms or ()))
    lowered = mlir.lower_fun(
        lambda *xs: _ordered_body(call_jaxpr, xs, strict_in=strict_in,
                                  strict_out=strict_out, leave_in_flight=leave),
        multiple_results=True)
    return lowered(ctx, *args)
  return _compat.lower_jaxpr_inline(ctx, call_jaxpr, *args)


# Not cacheable: a cached rule becomes a private function named after the
# primitive, and the body must be inlined where it stands.
mlir.register_lowering(program_order_p, _mlir_lowering, cacheable=False)
