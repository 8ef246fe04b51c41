"""Splits a layer into what its weights alone determine and the rest.

`fsdp_scan` must not save a layer's gathered weights for the backward pass.
Autodiff saves a weight it uses directly as that very array, which is easy
to leave out; but it also saves values the layer computes from the weights
alone (a cast to bfloat16, a transpose), which are as large. Splitting the
layer at that frontier turns both into inputs of the part that is
differentiated, so neither is saved, and the backward pass recomputes the
frontier from the regathered weights (cheap: no activation is involved).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import jax
from jax._src import core

from jax_overlap._src import _compat


class WeightSplit(NamedTuple):
  """`layer(x, w) == rest(x, prep(w))`, as pytrees.

  prep: `w -> frontier`, a list of the values computed from the weights alone
    (or the weights themselves) that the rest of the layer reads.
  rest: `(x, frontier) -> y`, every operation that depends on `x`.
  reusable: no traced value is captured (the layer closes over constants
    only), so the split may be run again under another trace.
  """
  prep: Callable[[Any], list]
  rest: Callable[[Any, list], Any]
  reusable: bool = False


def trace_layer(layer: Callable, x, w):
  """`layer(x, w)` traced over the flat leaves of x then w (arrays or their
  types): `(closed jaxpr, output treedef)`."""
  x_leaves, x_tree = jax.tree.flatten(x)
  w_leaves, w_tree = jax.tree.flatten(w)
  n_x = len(x_leaves)
  out_tree = []

  def flat(*leaves):
    out = layer(jax.tree.unflatten(x_tree, leaves[:n_x]),
                jax.tree.unflatten(w_tree, leaves[n_x:]))
    out_leaves, tree = jax.tree.flatten(out)
    out_tree.append(tree)
    return out_leaves

  closed = jax.make_jaxpr(flat)(*x_leaves, *w_leaves)
  return closed, out_tree[0]


def split_by_weights(layer: Callable, x, w) -> WeightSplit:
  """Traces `layer(x, w)` and splits it at its weight-only frontier.

  `x` may hold arrays or their types (e.g. `jax.typeof(a)`): only its types
  are read. Nested `jax.jit` calls are inlined first, so a cast or transpose
  of the weights inside one goes to the weight side like any other. Effects
  (and effectful calls, whole) stay on the `rest` side.
  """
  n_x = len(jax.tree.leaves(x))
  closed, out_tree = trace_layer(layer, x, w)
  jaxpr = _compat.open_jaxpr(closed)
  consts = {(_TOP, v): c
            for v, c in zip(jaxpr.constvars, _compat.jaxpr_consts(closed))}
  steps, alias = [], {}
  _inline(jaxpr, _TOP, consts, alias, steps, itertools.count(_TOP + 1))
  key = lambda v: _key(alias, _TOP, v)

  x_keys = [key(v) for v in jaxpr.invars[:n_x]]
  w_keys = [key(v) for v in jaxpr.invars[n_x:]]
  out_keys = [key(v) for v in jaxpr.outvars]
  on_x = set(x_keys)
  rest_steps, prep_steps = [], []
  for step in steps:
    reads_x = any(k in on_x for k in step.ins if not _is_literal(k))
    if reads_x or step.eqn.effects:
      rest_steps.append(step)
      on_x.update(k for k in step.outs if k is not None)
    else:
      prep_steps.append(step)

  # The frontier: weight-side values (not consts) the rest reads or returns.
  needed = [k for step in rest_steps for k in step.ins] + out_keys
  frontier, seen = [], set()
  for k in needed:
    if (not _is_literal(k) and k not in on_x and k not in consts
        and k not in seen):
      seen.add(k)
      frontier.append(k)

  def prep(w):
    env = dict(consts)
    env.update(zip(w_keys, jax.tree.leaves(w), strict=True))
    _run(prep_steps, env)
    return [env[k] for k in frontier]

  def rest(x, frontier_values):
    env = dict(consts)
    env.update(zip(x_keys, jax.tree.leaves(x), strict=True))
    env.update(zip(frontier, frontier_values, strict=True))
    _run(rest_steps, env)
    return jax.tree.unflatten(out_tree, [_read(env, k) for k in out_keys])

  return WeightSplit(prep, rest, not any(
      isinstance(c, core.Tracer) for c in consts.values()))


# --- a jaxpr with its nested jit calls inlined ------------------------------------
# A value is named by a key `(scope, var)`: each inlined call gets a scope of
# its own, since one cached inner jaxpr (with the same vars) may be called
# twice. A call's inputs and outputs are aliases of the keys they stand for.

_TOP = 0
_INLINED_CALLS = ("pjit", "jit", "closed_call", "core_call")


class _Step(NamedTuple):
  eqn: Any
  ins: list    # keys, or Literals
  outs: list   # keys, None where the eqn drops an output


def _is_literal(k) -> bool:
  return isinstance(k, core.Literal)


def _key(alias, scope, v):
  if _is_literal(v):
    return v
  k = (scope, v)
  return alias.get(k, k)


def _inline(jaxpr, scope, consts, alias, steps, scopes) -> None:
  for eqn in jaxpr.eqns:
    inner = eqn.params.get("jaxpr")
    if (eqn.primitive.name in _INLINED_CALLS and inner is not None
        and not eqn.effects):
      sub = next(scopes)
      body = _compat.open_jaxpr(inner)
      consts.update(((sub, v), c) for v, c in
                    zip(body.constvars, _compat.jaxpr_consts(inner)))
      for inner_v, outer_v in zip(body.invars, eqn.invars, strict=True):
        alias[(sub, inner_v)] = _key(alias, scope, outer_v)
      _inline(body, sub, consts, alias, steps, scopes)
      for outer_v, inner_v in zip(eqn.outvars, body.outvars, strict=True):
        if not isinstance(outer_v, core.DropVar):
          alias[(scope, outer_v)] = _key(alias, sub, inner_v)
    else:
      steps.append(_Step(
          eqn, [_key(alias, scope, v) for v in eqn.invars],
          [None if isinstance(v, core.DropVar) else (scope, v)
           for v in eqn.outvars]))


def _read(env, k):
  return k.val if _is_literal(k) else env[k]


def _run(steps, env) -> None:
  for step in steps:
    outs = _compat.bind_eqn(step.eqn, [_read(env, k) for k in step.ins])
    for k, out in zip(step.outs, outs, strict=True):
      if k is not None:
        env[k] = out
