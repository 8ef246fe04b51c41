"""Every difference between the jax versions we support, in one place.

Supported: jax 0.10.2, 0.11.0 and 0.12.0.1. Each difference is found by
looking for the feature, never by reading the version number, so a patch
release that back-ports a feature takes the newer path by itself.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
from jax._src import core
from jax._src import source_info_util
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir import ir

from jax_overlap._src import probes

# --- jaxprs ------------------------------------------------------------------

#: On 0.12 a `Jaxpr` carries its consts and `ClosedJaxpr` is gone; on 0.11 the
#: name is an alias of `Jaxpr`; on 0.10.2 it is a class of its own.
HAS_CLOSED_JAXPR_CLASS = (hasattr(core, "ClosedJaxpr")
                          and core.ClosedJaxpr is not core.Jaxpr)


def open_jaxpr(closed) -> core.Jaxpr:
  """The `Jaxpr` with eqns and vars, whichever form `closed` has (an open
  `Jaxpr` as it is: an equation's param may be one, shard_map's, remat's)."""
  return closed.jaxpr if is_closed(closed) else closed


def is_closed(p) -> bool:
  """Whether `p` is a `ClosedJaxpr` of its own class (jax 0.10.2)."""
  return HAS_CLOSED_JAXPR_CLASS and isinstance(p, core.ClosedJaxpr)


def is_jaxpr(p) -> bool:
  """Whether `p` is a jaxpr, open or closed, in either form."""
  return isinstance(p, core.Jaxpr) or is_closed(p)


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
#: jit whose jaxpr holds a high primitive leaves the C++ fast path (a cost on
#: every call), so there we insert barriers in the MLIR lowering rule.
USE_HIJAX = hasattr(core, "eval_jaxpr_p") and hasattr(pe, "lower_jaxpr2")


def lower_to_lojax(closed):
  """The low-level form of a closed jaxpr that may hold high primitives."""
  return pe.lower_jaxpr2(closed)


def jaxpr_is_high(closed) -> bool:
  return bool(getattr(open_jaxpr(closed), "is_high", False))


# --- the device a trace is for ------------------------------------------------

def trace_device() -> tuple[str | None, str | None]:
  """(platform, device_kind) of the mesh the current trace runs on, from
  the abstract mesh's `abstract_device` (jax 0.12: inside a shard_map over a
  mesh of devices); (None, None) where jax does not say."""
  try:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  except Exception:  # noqa: BLE001 - no mesh: unknown
    device = None
  if device is None:
    return None, None
  return getattr(device, "platform", None), getattr(device, "device_kind", None)


# --- tokens ------------------------------------------------------------------

def _barrier_takes_tokens() -> bool:
  # 0.10.2 fails to lower an optimization_barrier over a token operand
  # ('AbstractToken' object has no attribute 'sharding').
  def lower_barrier_over_token() -> bool:
    try:
      jax.jit(lambda: lax_internal.optimization_barrier(
          lax_internal.create_token())).lower()
      return True
    except Exception:  # noqa: BLE001 - any failure here means "no"
      return False
  return probes.probe_once("barrier_takes_tokens", lower_barrier_over_token)


def new_token():
  """A value an optimization_barrier can tie others to; costs nothing."""
  if _barrier_takes_tokens():
    return lax_internal.create_token()
  # A scalar stands in for the token where barriers can't take tokens.
  return lax_internal.full((), False, jax.numpy.bool_)


_has_inline_enum = hasattr(jax, "Inline") and hasattr(jax.Inline, "XLA_LATE")


def call_after_token(fn: Callable[..., list[Any]], token,
                     operands: Sequence[Any] = ()) -> list[Any]:
  """Runs `fn(*operands)` so that XLA sees it depend on `token`.

  The call stays a function until XLA's late inlining, after the scheduling
  decisions that would otherwise hoist an input-free op above the barrier.
  `operands` (an equation's literals) are arguments of the call, made in the
  caller: a constant inside a late-inlined call is cloned by the inliner with
  its `inlineable` attribute and control edges, and XLA's CSE then aborts the
  compile ("cannot remove instruction %constant...clone") on TPU and GPU.
  """
  def after_token(_token, *operands):
    return fn(*operands)
  if _has_inline_enum:
    return list(jax.jit(after_token, inline=jax.Inline.XLA_LATE)(token, *operands))
  # Older jax has no `jax.Inline`: stage the call ourselves.
  traced = jax.jit(after_token).trace(token, *operands)
  return list(_late_call_p.bind(token, *operands, call_jaxpr=traced.jaxpr))


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


# --- async collectives ---------------------------------------------------------

def _jax_async_collectives_use_custom_calls() -> bool:
  # jax >= 0.12 emits `stablehlo.custom_call @"all-gather-start"` and its
  # XLA rewrites that form into async collectives; older jax (and its XLA)
  # use `stablehlo.async_start` / `async_done` around the plain op instead.
  from jax._src.lax import parallel  # noqa: PLC0415
  return hasattr(parallel, "_emit_async_start_custom_call")


#: The async pair form this jax's XLA understands (see above): the one name
#: of this version difference. Where it is false, on TPU/GPU (whose plugins
#: refuse the async region, 'vhlo.async_start_v1'), a future's start is the
#: plain collective, and an ordered block keeps its result out of the
#: barriers until its done: XLA's own async conversion then splits it around
#: the written work (xla/futures.py, ordering/barriers.py; pinned by
#: tests/aot/real_compilers_test.py::test_future_is_an_async_pair_around_the_matmul
#: on the older jax).
ASYNC_CUSTOM_CALLS = _jax_async_collectives_use_custom_calls()

#: `jax.lax.all_gather(..., to='reduced')` exists.
ALL_GATHER_HAS_TO = "to" in inspect.signature(jax.lax.all_gather).parameters


def _axis_sizes() -> dict | None:
  """Named axis -> size in the current trace; None if this jax can't tell."""
  env = getattr(core, "get_axis_env", None)
  return None if env is None else getattr(env(), "axis_sizes", None)


def bound_axis_names() -> frozenset | None:
  """The named axes collectives may use here; None if this jax can't tell."""
  sizes = _axis_sizes()
  return None if sizes is None else frozenset(sizes)


def axis_size(axis_name) -> int | None:
  """The size of a named axis (or the product over a tuple); None if unknown."""
  sizes = _axis_sizes()
  if sizes is None:
    return None
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  size = 1
  for n in names:
    if n not in sizes:
      return None
    size *= sizes[n]
  return size


def scan_counts(params) -> tuple[int, int]:
  """(consts, carry): how many of a `scan` equation's inputs are each.
  0.10.2 gives `num_consts`/`num_carry`; later versions a flat tree `ft_in`
  of (consts, carry, xs)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


# --- transformation rules -----------------------------------------------------

from jax._src.interpreters import remat as _remat  # noqa: E402

# The `jax_remat3` rule table `remat.rules` has had three signatures:
#   0.10.2: rule(policy, *args, **params) -> (outs, rem); rem(*args)
#   0.11.0: rule(trace, *args, **params) -> (outs, rem); rem(*args)
#   0.12.0.1: rule(trace, *args, **params) -> (outs, res, rem); rem(res, *args)
# and `remat.remat_jaxpr` two:
#   0.10.2: (closed, policy) -> (fwd, rem, num_res); fwd ends with the residuals
#   >= 0.11: (jaxpr, policy, custom_vjp_rules, allow_fwds) -> (fwd, rem, fwds)
_REMAT_TRACE_HAS_CUSTOM_VJP_RULES = (
    "custom_vjp_rules" in inspect.signature(_remat.RematTrace.__init__).parameters)
# `rem` takes the residuals first where the rule returns them: the jax whose
# RematTrace takes custom_vjp rules and whose ad has `vjp_node` (0.12), by
# features, not by reading jax's source (tests/integration/compat_test.py pins it on
# each version).
def _remat_rule_returns_residuals() -> bool:
  from jax._src.interpreters import ad  # noqa: PLC0415
  return _REMAT_TRACE_HAS_CUSTOM_VJP_RULES and hasattr(ad, "vjp_node")


_REMAT_RULE_RETURNS_RESIDUALS = _remat_rule_returns_residuals()


def remat_jaxpr(closed, ctx):
  """Splits `closed` as `jax_remat3` would under `ctx`'s policy.

  `ctx` is what the remat rule received first (a policy on 0.10.2, the
  RematTrace later). Returns (fwd, rem, fwds): fwd computes the outputs and
  then the residuals that are not outputs; rem takes all residuals and the
  original inputs; fwds[i] is the output index residual i is, or None.
  """
  if _REMAT_TRACE_HAS_CUSTOM_VJP_RULES:
    return _remat.remat_jaxpr(closed, ctx.policy, ctx.custom_vjp_rules,
                              allow_fwds=True)
  fwd, rem, num_res = _remat.remat_jaxpr(closed, ctx)
  return fwd, rem, [None] * num_res


def register_remat_rule(prim, rule: Callable):
  """Registers `rule(ctx, *args, **params) -> (outs, res, rem)` in the
  `jax_remat3` table, where `rem(res, *args)` recomputes the outputs."""
  if _REMAT_RULE_RETURNS_RESIDUALS:
    _remat.rules[prim] = rule
    return

  def closed_over_residuals(ctx, *args, **params):
    # Older jax calls `rem(*args)` in its own trace: the residuals it closes
    # over become that trace's consts, which is how it saves them.
    outs, res, rem = rule(ctx, *args, **params)
    return outs, lambda *args2: rem(res, *args2)
  _remat.rules[prim] = closed_over_residuals


from jax._src.state import discharge as _discharge  # noqa: E402

# State discharge rules take a `DischargeContext` on 0.12 and
# `(in_avals, out_avals)` before; only 0.12 can strip memory spaces.
_DISCHARGE_RULES_TAKE_CONTEXT = hasattr(_discharge, "DischargeContext")


def register_discharge_rule(prim, rule: Callable):
  """Registers `rule(in_avals, discharge, *args, **params)`, where
  `discharge(closed) -> (discharged, num_outs)` turns a body's Ref inputs
  into values it also returns, after its outputs."""
  if _DISCHARGE_RULES_TAKE_CONTEXT:
    def with_context(ctx, *args, **params):
      def discharge(closed):
        out = _discharge._cached_closed_jaxpr_discharge(
            closed, strip_memory_space=ctx.strip_memory_space)
        return out[0], out[1]
      return rule(ctx.in_avals, discharge, *args, **params)
    _discharge.register_discharge_rule(prim)(with_context)
  else:
    def with_avals(in_avals, out_avals, *args, **params):
      del out_avals
      def discharge(closed):
        out = _discharge._cached_closed_jaxpr_discharge(closed)
        return out[0], out[1]
      return rule(in_avals, discharge, *args, **params)
    _discharge.register_discharge_rule(prim)(with_avals)


from jax._src.interpreters import ad as _ad  # noqa: E402

# Linearize rules (what `jax.vjp` and `jax.linearize` use) get `is_vjp` on
# every supported jax, but `ad.linearize_jaxpr` and the rule's return differ:
#   0.12: linearize_jaxpr -> (fwd, FlatTree of out types, nzs, fwds, tangent);
#         rule -> (outs, nzs, res, structured_res, lin(res, structured, *t))
#   0.10.2, 0.11: linearize_jaxpr -> (fwd, num_res, nzs, fwds, tangent);
#         rule -> (outs, nzs, res, lin(res, *t))
HAS_LINEARIZE_RULES = (
    hasattr(_ad, "primitive_linearizations")
    and "is_vjp" in inspect.signature(_ad.linearize_jaxpr).parameters)
_LINEARIZE_RETURNS_TREE = HAS_LINEARIZE_RULES and hasattr(_ad, "vjp_node")


def linearize_jaxpr(closed, nonzero, *, is_vjp):
  """Returns (fwd, num_made, structured, nonzero_out, res_from_input, tangent).

  fwd returns the outputs, `num_made` residuals, then the leaves of
  `structured` (a FlatTree of types; None where jax has none).
  """
  fwd, out_info, nonzero_out, res_from_input, tangent = _ad.linearize_jaxpr(
      closed, nonzero, is_vjp=is_vjp)
  if _LINEARIZE_RETURNS_TREE:
    _, made, structured = out_info.unpack()
    return fwd, len(list(made)), structured, nonzero_out, res_from_input, tangent
  return fwd, out_info, None, nonzero_out, res_from_input, tangent


def tangent_primitive(prim, is_vjp: bool):
  """`prim`, marked for transposition under vjp where jax has `vjp_node`."""
  return _ad.vjp_node(prim) if is_vjp and hasattr(_ad, "vjp_node") else prim


def register_linearize_rule(prim, rule: Callable):
  """Registers `rule(is_vjp, nonzero, *primals, **params) -> (outs,
  nonzero_out, res, structured, lin(res, structured, *tangents))`."""
  if _LINEARIZE_RETURNS_TREE:
    _ad.primitive_linearizations[prim] = rule
    return

  def four_items(is_vjp, nonzero, *primals, **params):
    outs, nonzero_out, res, structured, lin = rule(is_vjp, nonzero, *primals,
                                                   **params)
    assert structured is None
    return outs, nonzero_out, res, lambda res, *t: lin(res, None, *t)
  _ad.primitive_linearizations[prim] = four_items


# --- the order in the compiled program -------------------------------------------

# XLA's CPU pipeline of jax 0.10.2 and 0.11.0 runs its barrier
# expander, the pass named "cse_barrier_expander", before fusion and
# scheduling: the barriers are gone before they could order anything, and the
# compiled schedule is the one of the undecorated program. Later CPU pipelines
# (jax 0.12) and every GPU pipeline run it after scheduling. Where it runs
# early, compiling a module that holds ordered blocks with that pass disabled
# keeps each barrier until the schedule is made, as the later pipeline does
# (the CPU runtime treats a leftover barrier as a no-op). Such a module's
# small while loops must then stay while loops: "small-while-loop-hoisting"
# turns them into calls emitted by a code generator that has no rule for a
# barrier (XLA aborts the process), so it is disabled too where the module
# has a loop.
KEEP_BARRIERS_PASS = "cse_barrier_expander"
LOOP_HOISTING_PASS = "small-while-loop-hoisting"


def cpu_expands_barriers_before_scheduling() -> bool:
  """Whether this jaxlib's CPU compiler drops barriers before scheduling.

  Found by compiling `a = x * 2; barrier(a); a + 1` on CPU: a compiler that
  drops the barrier first fuses both ops into one instruction, one that keeps
  it until after scheduling leaves two. The probe compiles on this process's
  first CPU device from an abstract argument, outside the user's context
  (see `probes.probe_once`): a compile inside `jax.set_mesh`, or in one process of a
  `jax.distributed` run, sees the same answer. Where the probe itself fails,
  the answer is "yes": keeping barriers until scheduling is harmless on a
  compiler that would have kept them anyway (a leftover barrier is a no-op).
  """
  try:
    return probes.probe_once("cpu_expands_barriers_before_scheduling",
                      _compile_cpu_barrier_probe)
  except Exception:  # noqa: BLE001 - never fail the user's compile for it
    return True


def _compile_cpu_barrier_probe() -> bool:
  try:
    cpu = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend in this process: nothing to keep
    return False

  def probe(x):
    return lax_internal.optimization_barrier(x * 2.0) + 1.0
  x = jax.ShapeDtypeStruct((8,), np.float32,
                           sharding=jax.sharding.SingleDeviceSharding(cpu))
  text = jax.jit(probe).lower(x).compile().as_text()
  entry = text[text.index("\nENTRY"):].split("\n}", 1)[0]
  compute = [line for line in entry.splitlines()[2:]
             if not re.search(r"\b(parameter|tuple|get-tuple-element|"
                              r"opt-barrier|copy)\(", line)]
  return len(compute) < 2


# --- varying manual axes ------------------------------------------------------

def varying_axes(x) -> frozenset | None:
  """The mesh axes `x` varies over inside `shard_map` (its `vma`), or None
  where this trace does not track them (`check_vma=False`)."""
  from jax._src import config as _config
  if not _config._check_vma.value:
    return None
  # (x may be a type already: what a function traced on types returned)
  aval = x if isinstance(x, core.AbstractValue) else jax.typeof(x)
  mat = getattr(aval, "mat", None)   # 0.10.2 - 0.12: aval.mat.varying
  vma = getattr(mat, "varying", None) if mat is not None else None
  if vma is None:
    vma = getattr(aval, "vma", None)
  return None if vma is None else frozenset(vma)


def invariant_over(aval, axis_name):
  """`aval` with `axis_name` taken out of the mesh axes it varies over, as
  jax's `all_gather_invariant` types its result."""
  mat = getattr(aval, "mat", None)   # 0.10.2 - 0.12
  if mat is not None:
    return aval.update(manual_axis_type=mat.update(
        varying=frozenset(mat.varying) - {axis_name}))
  vma = getattr(aval, "vma", None)
  return aval if vma is None else aval.update(vma=frozenset(vma) - {axis_name})


# --- scans whose outputs are reduced ---------------------------------------------

def unroll_saving_reduced(unroll: int) -> int:
  """`unroll` for a `lax.scan` whose stacked outputs are values resharded to
  `P(reduced=...)` (fsdp_scan keeping gathered weights on an explicit mesh):
  1 where this jax cannot lower such a scan unrolled, else `unroll`.

  jax 0.10.2 lowers an unrolled scan's outputs through a reshape whose
  sharding rule indexes the spec, which raises "Using pspec[...] is
  dangerous when PartitionSpec has non-empty unreduced/reduced set"; 0.11
  and later lower it. Found by lowering a two-layer probe once."""
  return unroll if unroll == 1 or _unrolled_scan_saves_reduced() else 1


def _unrolled_scan_saves_reduced() -> bool:
  # Outside the user's context (`probes.probe_once`): jax's mesh and trace
  # contexts are per thread, and the caller is tracing under its own mesh
  # (which the probe's could not replace). An error is raised, not kept.
  def probe():
    answer = _probe_unrolled()
    if isinstance(answer, BaseException):
      raise answer
    return answer
  return probes.probe_once("unrolled_scan_saves_reduced", probe)


def _probe_unrolled():
  axis = "_jax_overlap_probe"
  mesh = jax.sharding.AbstractMesh(
      (1,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))

  def saves(w):
    body = lambda c, wi: (c, jax.reshard(wi, P(None, reduced={axis})))
    return jax.lax.scan(body, 0.0, w, unroll=2)[1]
  arg = jax.ShapeDtypeStruct((4, 2), jnp.float32,
                             sharding=NamedSharding(mesh, P()))
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      jax.jit(saves).trace(arg).lower(lowering_platforms=("cpu",))
  except ValueError as error:
    return False if "dangerous" in str(error) else error
  except Exception as error:  # noqa: BLE001 - re-raised by the caller
    return error
  return True


# --- an all-gather whose result is invariant over the axis ----------------------------

def all_gather_invariant(x, axis_name):
  """`jax.lax.all_gather(x, axis_name, tiled=True)` typed invariant over
  `axis_name` (as `psum`'s result is): jax's `all_gather_invariant`, public in
  its parallel module on 0.10.2 and 0.11.0, private on 0.12.0.1."""
  from jax._src.lax import parallel as _parallel
  fn = getattr(_parallel, "all_gather_invariant", None) or \
      getattr(_parallel, "_all_gather_invariant")
  return fn(x, axis_name, axis=0, tiled=True)


# --- Pallas TPU kernels --------------------------------------------------------------

@functools.cache
def pallas_tpu_missing() -> str | None:
  """What this jax lacks of the Pallas TPU API the flash kernel uses
  (patterns/attention/flash_tpu.py), or None: squeezed block dimensions
  (`pl.Squeezed`), VMEM scratch, `pltpu.CompilerParams` and cost estimates.
  Imported here, at first use: Pallas is costly to import."""
  try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
  except ImportError as error:  # pragma: no cover - every supported jax has it
    return f"jax.experimental.pallas.tpu ({error})"
  for owner, name in ((pl, "Squeezed"), (pl, "CostEstimate"), (pl, "BlockSpec"),
                      (pltpu, "VMEM"), (pltpu, "CompilerParams")):
    if not hasattr(owner, name):
      return f"{owner.__name__}.{name}"
  return None


def squeezed():
  """A block dimension of size 1 that the kernel does not see."""
  from jax.experimental import pallas as pl
  return pl.Squeezed()


#: How `pallas_call` runs a TPU kernel on CPU: Pallas's HLO interpreter.
#: Not `pltpu.InterpretParams()` (the TPU interpreter): it synchronises every
#: device of the mesh at each kernel, and deadlocks where only some devices
#: run it (a `lax.cond` of the ring; measured on 0.12.0.1). The HLO
#: interpreter evaluates the kernel's untyped body on values typed as varying,
#: and fails inside a `shard_map` that checks varying axes (0.10.2 - 0.12.0.1),
#: so it runs under `check_vma=False` only (patterns/attention/dispatch.py).
PALLAS_INTERPRET = True


def struct_like(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """An output type for `pallas_call`, varying over the mesh axes `like`
  varies over: inside `shard_map` with its varying axes checked, Pallas asks
  for them (`manual_axis_type`); outside, there are none."""
  if varying_axes(like) is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.typeof(like).mat)
