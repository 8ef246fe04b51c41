"""How `program_order_p` behaves under jvp, partial eval, transposition,
remat, DCE and vmap.

Every rule transforms the body as jax would transform any function, and
binds `program_order_p` again on the result with the same `enforce`,
`strict_in` and `strict_out`. So a differentiated ordered block gives an
ordered forward block and an ordered backward block, and a free block stays
free. The one piece of bookkeeping is `excluded`: each new input inherits
the flag of the input it came from (a tangent or cotangent inherits its
primal's flag), and inputs the rule creates (residuals) are not excluded.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax._src import ad_util
from jax._src import core
from jax._src import source_info_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as pe

from jax_overlap._src import _compat
from jax_overlap._src.ordering.primitive import program_order_p


def _rebind(args, params, body, excluded):
  """Binds program_order_p on `args` with `body`, keeping the other params."""
  return program_order_p.bind(
      *args, **dict(params, call_jaxpr=body, excluded=tuple(excluded)))


def _pick(flags: Sequence[bool], xs: Sequence[Any]) -> list[Any]:
  return [x for f, x in zip(flags, xs, strict=True) if f]


def _scatter(flags: Sequence[bool], present: Sequence[Any], missing) -> list[Any]:
  """Puts `present` where `flags` is True and `missing(i)` elsewhere."""
  it = iter(present)
  out = [next(it) if f else missing(i) for i, f in enumerate(flags)]
  assert next(it, None) is None
  return out


# --- jvp ----------------------------------------------------------------------

def _jvp(primals, tangents, *, call_jaxpr, excluded, **params):
  nonzero = [type(t) is not ad_util.Zero for t in tangents]
  body, nonzero_out = ad.jvp_jaxpr(call_jaxpr, nonzero, False)
  outs = _rebind([*primals, *_pick(nonzero, tangents)], params, body,
                 [*excluded, *_pick(nonzero, excluded)])
  n = len(call_jaxpr.out_avals)
  out_avals = call_jaxpr.out_avals
  tangents_out = _scatter(
      nonzero_out, outs[n:],
      lambda i: ad_util.Zero(out_avals[i].to_tangent_aval()))
  return outs[:n], tangents_out


ad.primitive_jvps[program_order_p] = _jvp


# --- partial eval (linearize, vjp) -------------------------------------------

def _partial_eval(trace, *tracers, call_jaxpr, excluded, **params):
  unknown = [not t.pval.is_known() for t in tracers]
  known_body, staged_body, unknown_out, res_avals, res_from_input = (
      pe.partial_eval_jaxpr_nounits_fwd(call_jaxpr, unknown, instantiate=False))
  known_body, res_from_output = _dedup_residual_outputs(
      known_body, len(res_avals))
  known_in = [t.pval.get_known() for t, u in zip(tracers, unknown) if not u]
  known_excluded = [e for e, u in zip(excluded, unknown) if not u]
  known_outs = _rebind(known_in, params, known_body, known_excluded)
  n_known_out = len(unknown_out) - sum(unknown_out)
  known_outs, res_made = known_outs[:n_known_out], known_outs[n_known_out:]
  residuals = _residuals(call_jaxpr, known_in, known_outs, res_made,
                         res_from_input, res_from_output)
  res_tracers = [trace.new_instantiated_const(r) for r in residuals]
  unknown_in = [t for t, u in zip(tracers, unknown) if u]
  out_tracers = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None)
                 for a in staged_body.out_avals]
  staged_excluded = [False] * len(res_tracers) + _pick(unknown, excluded)
  staged_params = dict(params, call_jaxpr=staged_body,
                       excluded=tuple(staged_excluded))
  recipe = pe.new_eqn_recipe(
      trace, [*res_tracers, *unknown_in], out_tracers, program_order_p,
      staged_params, core.positional_effects(staged_body),
      source_info_util.current())
  for t in out_tracers:
    t.recipe = recipe
  it_known, it_unknown = iter(known_outs), iter(out_tracers)
  return [next(it_unknown) if u else next(it_known) for u in unknown_out]


def _residuals(call_jaxpr, inputs, outputs, made, res_from_input,
               res_from_output):
  """Each residual of a split body, as the value it already is.

  A residual that is just an input (or a const) is passed on rather than
  returned from the forward block, which would copy it; one that is an
  output of the block, or another residual, is that value, not a second one
  (otherwise a second derivative saves the same array twice).
  """
  made_it = iter([outputs[i] if from_output else made[i]
                  for from_output, i in res_from_output])
  sources = [*_compat.jaxpr_consts(call_jaxpr), *inputs]
  residuals = [next(made_it) if i is None else sources[i] for i in res_from_input]
  assert next(made_it, None) is None
  return residuals


def _dedup_residual_outputs(body, n_res, n_after=0):
  """Drops residual outputs of `body` that repeat an earlier output.

  `body` returns its primal outputs, then `n_res` residuals, then `n_after`
  outputs kept as they are. Returns the pruned body and, per residual,
  (True, k) if it is primal output k or (False, j) if it is residual j of
  the pruned body.
  """
  outvars = _compat.open_jaxpr(body).outvars
  n_out = len(outvars) - n_res - n_after
  seen: dict[core.Var, tuple[bool, int]] = {}
  for k, v in enumerate(outvars[:n_out]):
    if not isinstance(v, core.Literal):
      seen.setdefault(v, (True, k))
  where, keep = [], []
  for v in outvars[n_out:n_out + n_res]:
    if not isinstance(v, core.Literal) and v in seen:
      where.append(seen[v])
      keep.append(False)
    else:
      where.append((False, sum(keep)))
      keep.append(True)
      if not isinstance(v, core.Literal):
        seen[v] = where[-1]
  if all(keep):
    return body, where
  used = [True] * n_out + keep + [True] * n_after
  return pe.prune_closed_jaxpr_outputs(body, used), where


pe.custom_partial_eval_rules[program_order_p] = _partial_eval


def _linearize(is_vjp, nonzero, *primals, call_jaxpr, excluded, **params):
  """An ordered forward block that also returns the residuals, and an ordered
  tangent block (the one transposed under vjp).

  Linearizing the body as a whole, rather than by jvp and partial eval,
  keeps what only the tangent needs (jax_remat3's saved names, a Ref the
  body creates) inside the blocks.
  """
  fwd, n_made, structured_types, nonzero_out, res_from_input, tangent_body = (
      _compat.linearize_jaxpr(call_jaxpr, nonzero, is_vjp=is_vjp))
  n_structured = 0 if structured_types is None else len(list(structured_types))
  fwd, res_from_output = _dedup_residual_outputs(fwd, n_made, n_structured)
  outs = _rebind(primals, params, fwd, excluded)
  n_out = len(call_jaxpr.out_avals)
  primals_out = outs[:n_out]
  kept = outs[n_out:len(outs) - n_structured]
  residuals = _residuals(call_jaxpr, primals, primals_out, kept,
                         res_from_input, res_from_output)
  structured = None if structured_types is None else \
      structured_types.update(outs[len(outs) - n_structured:]).unflatten()
  tangent_excluded = _pick(nonzero, excluded)
  out_avals = call_jaxpr.out_avals

  def linearized(residuals, structured, *tangents):
    structured_flat = jax.tree_util.tree_leaves(structured)
    nonzero_tangents = [ad.instantiate_zeros(t)
                        for t, nz in zip(tangents, nonzero) if nz]
    prim = _compat.tangent_primitive(program_order_p, is_vjp)
    tangents_out = prim.bind(
        *residuals, *nonzero_tangents, *structured_flat,
        **dict(params, call_jaxpr=tangent_body,
               excluded=(*[False] * len(residuals), *tangent_excluded,
                         *[False] * len(structured_flat))))
    return _scatter(nonzero_out, tangents_out,
                    lambda i: ad_util.Zero(out_avals[i].to_tangent_aval()))
  return primals_out, nonzero_out, residuals, structured, linearized


if _compat.HAS_LINEARIZE_RULES:
  _compat.register_linearize_rule(program_order_p, _linearize)


def _remat_params(unks_in, inst_in, kept_outs_known, kept_outs_staged,
                  num_res_out, num_res_in, params_known, params_staged):
  """Splits `excluded` between the known and staged blocks of remat."""
  del kept_outs_known, kept_outs_staged, num_res_out
  excluded = params_known["excluded"]
  known = [e for e, u in zip(excluded, unks_in) if not u]
  n_known_in = len(_compat.open_jaxpr(params_known["call_jaxpr"]).invars)
  known += [False] * (n_known_in - len(known))  # trailing residual refs
  staged = [False] * num_res_in + _pick(inst_in, excluded)
  return (dict(params_known, excluded=tuple(known)),
          dict(params_staged, excluded=tuple(staged)))


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
  return pe.closed_call_partial_eval_custom_rule(
      "call_jaxpr", _remat_params, saveable, unks_in, inst_in, eqn)


pe.partial_eval_jaxpr_custom_rules[program_order_p] = _partial_eval_custom


# --- remat with jax_remat3 -------------------------------------------------------

def _remat(ctx, *args, call_jaxpr, excluded, **params):
  """Splits the body by the remat policy into an ordered forward block, which
  also returns the residuals the policy saves, and an ordered block that
  recomputes the rest from them."""
  fwd, rem, fwds = _compat.remat_jaxpr(call_jaxpr, ctx)
  n_out = len(call_jaxpr.out_avals)
  outs_and_res = _rebind(args, params, fwd, excluded)
  outs, made = outs_and_res[:n_out], iter(outs_and_res[n_out:])
  res = [next(made) if f is None else outs[f] for f in fwds]
  assert next(made, None) is None

  def recompute(res, *args):
    return _rebind([*res, *args], params, rem, [False] * len(res) + list(excluded))
  return outs, res, recompute


_compat.register_remat_rule(program_order_p, _remat)


# --- transpose ----------------------------------------------------------------

def _transpose(cts, *args, call_jaxpr, excluded, **params):
  kept, specs = ad.project_accums(args)
  kinds = [kind for kind, _ in specs]
  if any(k not in (None, ad.ValAccum, getattr(ad, "NullAccum", None))
         for k in kinds):
    raise NotImplementedError(
        "program_order: transposing a block that writes to a mutable Ref "
        "argument is not supported yet; move the Ref update out of the block.")
  kept_excluded = [e for e, k in zip(excluded, kinds) if k is None]
  nonzero_ct = [type(ct) is not ad_util.Zero for ct in cts]
  ct_avals = [v.aval.to_ct_aval() if hasattr(v.aval, "to_ct_aval")
              else v.aval.to_tangent_aval()
              for v in _compat.open_jaxpr(call_jaxpr).outvars]
  jaxpr = _compat.open_jaxpr(call_jaxpr)
  consts = _compat.jaxpr_consts(call_jaxpr)
  n_kept = len(kept)

  def backward(*flat):
    kept_vals, ct_vals = flat[:n_kept], flat[n_kept:]
    accums = ad.unproject_accums(specs, list(kept_vals))
    full_cts = _scatter(nonzero_ct, ct_vals, lambda i: ad_util.Zero(ct_avals[i]))
    logs = ad.backward_pass3(jaxpr, False, consts, accums, full_cts)
    if logs:
      raise NotImplementedError(
          "program_order: backward-pass log entries inside a block are not "
          "supported yet.")
    outs = []
    for x in accums:
      if isinstance(x, ad.ValAccum):
        ct = x.freeze()
        outs.append(None if type(ct) is ad_util.Zero else ct)
      else:
        outs.append(None)
    return outs

  flat_in = [*kept, *_pick(nonzero_ct, cts)]
  traced = jax.jit(backward).trace(*flat_in)
  closed_over = list(getattr(traced, "_consts", ()))
  outs = _rebind([*closed_over, *flat_in], params, traced.jaxpr,
                 [False] * len(closed_over) + kept_excluded
                 + [False] * sum(nonzero_ct))
  cts_out = jax.tree_util.tree_unflatten(traced.out_tree, outs)
  for x, ct in zip(args, cts_out):
    if isinstance(x, ad.ValAccum) and ct is not None:
      x.accum(ct)


ad.fancy_transposes[program_order_p] = _transpose


# --- dce ----------------------------------------------------------------------

def _dce(used_outputs, eqn):
  body = eqn.params["call_jaxpr"]
  if not any(used_outputs) and not body.effects:
    return [False] * len(eqn.invars), None
  new_body, used_inputs = _compat.dce(body, used_outputs)
  if all(used_outputs) and all(used_inputs) and _same_eqns(new_body, body):
    return used_inputs, eqn
  new_params = dict(eqn.params, call_jaxpr=new_body,
                    excluded=tuple(_pick(used_inputs, eqn.params["excluded"])))
  new_eqn = pe.new_jaxpr_eqn(
      _pick(used_inputs, eqn.invars), _pick(used_outputs, eqn.outvars),
      program_order_p, new_params, core.positional_effects(new_body),
      eqn.source_info, eqn.ctx)
  return used_inputs, new_eqn


def _same_eqns(new_body, body) -> bool:
  # Dead code nested in an equation (a jit's unused output) changes that
  # equation only: a body whose every output is used may still have shrunk.
  new_eqns = _compat.open_jaxpr(new_body).eqns
  old_eqns = _compat.open_jaxpr(body).eqns
  return len(new_eqns) == len(old_eqns) and all(
      a is b for a, b in zip(new_eqns, old_eqns))


_compat.register_dce_rule(program_order_p, _dce)


# --- vmap ---------------------------------------------------------------------

def _batch(axis_data, args, dims, *, call_jaxpr, **params):
  # An unbatched value has dim None (`batching.not_mapped` on old jax only).
  batched = [d is not None for d in dims]
  body, batched_out = batching.batch_jaxpr(call_jaxpr, axis_data, batched, False)
  args = [batching.matchaxis(axis_data, d, 0, x) if b and d != 0 else x
          for x, d, b in zip(args, dims, batched)]
  outs = program_order_p.bind(*args, **dict(params, call_jaxpr=body))
  return outs, [0 if b else None for b in batched_out]


batching.fancy_primitive_batchers[program_order_p] = _batch


# --- mutable refs ------------------------------------------------------------------

def _discharge(in_avals, discharge, *args, call_jaxpr, **params):
  """A body that writes Ref inputs becomes one that returns their new values."""
  from jax._src.state.types import AbstractRef  # noqa: PLC0415
  body, num_outs = discharge(call_jaxpr)
  outs = program_order_p.bind(*args, **dict(params, call_jaxpr=body))
  ref_vals = iter(outs[num_outs:])
  new_invals = [next(ref_vals) if isinstance(a, AbstractRef) else None
                for a in in_avals]
  assert next(ref_vals, None) is None
  return new_invals, outs[:num_outs]


_compat.register_discharge_rule(program_order_p, _discharge)


# --- eager calls ----------------------------------------------------------------

def _impl(*args, **params):
  from jax._src import dispatch  # noqa: PLC0415 - avoid an import cycle
  return dispatch.apply_primitive(program_order_p, *args, **params)


program_order_p.def_impl(_impl)
