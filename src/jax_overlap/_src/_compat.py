"""Every difference between the jax versions we support, in one place.

Supported: jax 0.10.2, 0.11.0 and 0.12.0.1. Each difference is found by
looking for the feature, never by reading the version number, so a patch
release that back-ports a feature takes the newer path by itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
from jax._src import core
from jax._src import source_info_util
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

# --- jaxprs ------------------------------------------------------------------

#: On 0.12 a `Jaxpr` carries its consts and `ClosedJaxpr` is gone; on 0.11 the
#: name is an alias of `Jaxpr`; on 0.10.2 it is a class of its own.
HAS_CLOSED_JAXPR_CLASS = (hasattr(core, "ClosedJaxpr")
                          and core.ClosedJaxpr is not core.Jaxpr)


def open_jaxpr(closed) -> core.Jaxpr:
  """The `Jaxpr` with eqns and vars, whichever form `closed` has."""
  return closed.jaxpr if HAS_CLOSED_JAXPR_CLASS else closed


def jaxpr_consts(closed) -> list[Any]:
  return list(closed.consts)


def close_jaxpr(jaxpr: core.Jaxpr, consts: Sequence[Any]):
  """A jaxpr with its consts attached, in the form this jax passes around."""
  if HAS_CLOSED_JAXPR_CLASS:
    return core.ClosedJaxpr(jaxpr, list(consts))
  return jaxpr.with_consts(list(consts)) if consts else jaxpr


def replace_body(closed, new_jaxpr: core.Jaxpr):
  """`closed` with its open jaxpr replaced and its consts kept."""
  return close_jaxpr(new_jaxpr, jaxpr_consts(closed))


def dce(closed, used_outputs: Sequence[bool], instantiate: bool | Sequence[bool] = False):
  """Dead-code-eliminates a closed jaxpr; returns it and the used inputs."""
  jaxpr = open_jaxpr(closed)
  new_jaxpr, used_inputs = pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate)
  return replace_body(closed, new_jaxpr), used_inputs


# --- binding an equation again ----------------------------------------------

def bind_eqn(eqn, invals: Sequence[Any]) -> list[Any]:
  """Binds `eqn`'s primitive on `invals`, in the eqn's source context."""
  params = eqn.primitive.get_bind_params(eqn.params)
  name_stack = (source_info_util.current_name_stack()
                + eqn.source_info.name_stack)
  with (source_info_util.user_context(eqn.source_info.traceback,
                                      name_stack=name_stack),
        eqn.ctx.manager):
    out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


# --- HiJAX -------------------------------------------------------------------

#: jax >= 0.12 reads `Traced.lojax` and lowers high primitives through
#: `to_lojax` at a DCE'd, cached stage. On 0.10.2 the hooks exist too, but a
#: jit whose jaxpr holds a high primitive leaves the C++ fast path (about
#: 200-500 us a call), so there we insert barriers in the MLIR lowering rule.
USE_HIJAX = hasattr(core, "eval_jaxpr_p") and hasattr(pe, "lower_jaxpr2")


def lower_to_lojax(closed):
  """The low-level form of a closed jaxpr that may hold high primitives."""
  return pe.lower_jaxpr2(closed)


def jaxpr_is_high(closed) -> bool:
  return bool(getattr(open_jaxpr(closed), "is_high", False))


# --- barriers ----------------------------------------------------------------

def _typed_barrier_abstract_eval(*avals):
  return list(avals)


_typed_barrier_p = core.Primitive("optimization_barrier")
_typed_barrier_p.multiple_results = True
_typed_barrier_p.def_abstract_eval(_typed_barrier_abstract_eval)


def _typed_barrier_lowering(ctx, *args):
  flat, _ = mlir.ir_tree_registry.flatten(args)
  op = hlo.OptimizationBarrierOp(flat)
  return [mlir.lower_with_sharding_in_types(ctx, r, aval)
          for r, aval in zip(op.results, ctx.avals_out)]


mlir.register_lowering(_typed_barrier_p, _typed_barrier_lowering)


def barrier(values: Sequence[Any]) -> list[Any]:
  """One `optimization_barrier` over a flat list, keeping each value's type.

  Before 0.12, jax's barrier asks all operands inside `shard_map` to vary over
  the same mesh axes and makes them so, which changes the types a body was
  traced with (a later `pvary` then fails). There barriers are made in the
  MLIR lowering rule, after every type check, so a barrier that passes each
  operand's type through is both safe and the same StableHLO op.
  """
  prim = lax_internal.optimization_barrier_p if USE_HIJAX else _typed_barrier_p
  return list(prim.bind(*values))


# --- tokens ------------------------------------------------------------------

@functools.cache
def _barrier_takes_tokens() -> bool:
  # 0.10.2 fails to lower an optimization_barrier over a token operand
  # ('AbstractToken' object has no attribute 'sharding').
  try:
    jax.jit(lambda: lax_internal.optimization_barrier(
        lax_internal.create_token())).lower()
    return True
  except Exception:  # noqa: BLE001 - any failure means "no"
    return False


def new_token():
  """A value an optimization_barrier can tie others to; costs nothing."""
  if _barrier_takes_tokens():
    return lax_internal.create_token()
  # A scalar stands in for the token where barriers can't take tokens.
  return lax_internal.full((), False, jax.numpy.bool_)


_has_inline_enum = hasattr(jax, "Inline") and hasattr(jax.Inline, "XLA_LATE")


def call_after_token(fn: Callable[[], list[Any]], token) -> list[Any]:
  """Runs nullary `fn` so that XLA sees it depend on `token`.

  The call stays a function until XLA's late inlining, after the scheduling
  decisions that would otherwise hoist an input-free op above the barrier.
  """
  def after_token(_token):
    return fn()
  if _has_inline_enum:
    return list(jax.jit(after_token, inline=jax.Inline.XLA_LATE)(token))
  # Older jax has no `jax.Inline`: stage the call ourselves.
  traced = jax.jit(after_token).trace(token)
  return list(_late_call_p.bind(token, call_jaxpr=traced.jaxpr))


_late_call_p = core.Primitive("late_inlined_call")
_late_call_p.multiple_results = True
_late_call_p.def_abstract_eval(
    lambda *_, call_jaxpr: list(call_jaxpr.out_avals))
_late_call_p.def_impl(
    lambda *args, call_jaxpr: core.jaxpr_as_fun(call_jaxpr)(*args))


def _late_call_lowering(ctx, *args, call_jaxpr):
  outs, _ = mlir.call_lowering(
      "after_token", call_jaxpr, None, ctx.module_context, ctx.avals_in,
      ctx.avals_out, ctx.tokens_in.subset([]), *args,
      dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
      attributes={"inlineable": ir.StringAttr.get("xla_late")})
  return outs


mlir.register_lowering(_late_call_p, _late_call_lowering)


# --- MLIR --------------------------------------------------------------------

def lower_jaxpr_inline(ctx, closed, *args):
  """Lowers `closed` into the current MLIR function, with no call around it."""
  jaxpr = open_jaxpr(closed)
  consts = jaxpr_consts(closed)
  const_nodes = mlir.ir_consts(consts, [v.aval for v in jaxpr.constvars]) \
      if consts else []
  sub_ctx = ctx.module_context
  if ctx.platforms is not None:
    sub_ctx = sub_ctx.replace(platforms=ctx.platforms)
  outs, tokens = mlir.jaxpr_subcomp(
      sub_ctx, jaxpr, ctx.name_stack, ctx.tokens_in, const_nodes, *args,
      dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
      outer_traceback=None)
  ctx.set_tokens_out(tokens)
  return outs


# --- rule tables whose signatures changed ------------------------------------

DCE_RULE_TAKES_LIVE_INS = (
    "live_ins" in inspect.signature(pe.dce_jaxpr_closed_call_rule).parameters
    if hasattr(pe, "dce_jaxpr_closed_call_rule") else False)


def register_dce_rule(prim, rule: Callable):
  """Registers `rule(used_outputs, eqn) -> (used_inputs, eqn | None)`."""
  if DCE_RULE_TAKES_LIVE_INS:
    pe.dce_rules[prim] = lambda used_outputs, live_ins, eqn: rule(used_outputs, eqn)
  else:
    pe.dce_rules[prim] = rule
