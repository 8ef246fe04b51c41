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

from typing import Any, Callable, NamedTuple

import jax
from jax._src import core

from jax_overlap._src import _compat


class WeightSplit(NamedTuple):
  """`layer(x, w) == rest(x, prep(w))`, as pytrees.

  prep: `w -> frontier`, a list of the values computed from the weights alone
    (or the weights themselves) that the rest of the layer reads.
  rest: `(x, frontier) -> y`, every operation that depends on `x`.
  """
  prep: Callable[[Any], list]
  rest: Callable[[Any, list], Any]


def split_by_weights(layer: Callable, x, w) -> WeightSplit:
  """Traces `layer(x, w)` and splits it at its weight-only frontier.

  Operations inside a nested `jax.jit` call that also reads `x` stay on the
  `rest` side whole. Effects stay on the `rest` side.
  """
  x_leaves, x_tree = jax.tree.flatten(x)
  w_leaves, w_tree = jax.tree.flatten(w)
  n_x = len(x_leaves)
  out_tree_box = []

  def flat(*leaves):
    out = layer(jax.tree.unflatten(x_tree, leaves[:n_x]),
                jax.tree.unflatten(w_tree, leaves[n_x:]))
    leaves_out, tree = jax.tree.flatten(out)
    out_tree_box.append(tree)
    return leaves_out

  closed = jax.make_jaxpr(flat)(*x_leaves, *w_leaves)
  jaxpr = _compat.open_jaxpr(closed)
  consts = dict(zip(jaxpr.constvars, _compat.jaxpr_consts(closed)))
  out_tree = out_tree_box[0]

  on_x = set(jaxpr.invars[:n_x])
  rest_eqns, prep_eqns = [], []
  for eqn in jaxpr.eqns:
    reads_x = any(isinstance(v, core.Var) and v in on_x for v in eqn.invars)
    if reads_x or eqn.effects:
      rest_eqns.append(eqn)
      on_x.update(v for v in eqn.outvars if not isinstance(v, core.DropVar))
    else:
      prep_eqns.append(eqn)

  # The frontier: weight-side values (not consts) the rest reads or returns.
  needed = [v for eqn in rest_eqns for v in eqn.invars] + list(jaxpr.outvars)
  frontier, seen = [], set()
  for v in needed:
    if (isinstance(v, core.Var) and v not in on_x and v not in consts
        and v not in seen):
      seen.add(v)
      frontier.append(v)
  w_vars = jaxpr.invars[n_x:]
  x_vars = jaxpr.invars[:n_x]

  def prep(w):
    env = dict(consts)
    env.update(zip(w_vars, jax.tree.leaves(w), strict=True))
    _run(prep_eqns, env)
    return [env[v] for v in frontier]

  def rest(x, frontier_values):
    env = dict(consts)
    env.update(zip(x_vars, jax.tree.leaves(x), strict=True))
    env.update(zip(frontier, frontier_values, strict=True))
    _run(rest_eqns, env)
    return jax.tree.unflatten(
        out_tree, [v.val if isinstance(v, core.Literal) else env[v]
                   for v in jaxpr.outvars])

  return WeightSplit(prep, rest)


def _run(eqns, env) -> None:
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in eqns:
    outs = _compat.bind_eqn(eqn, [read(v) for v in eqn.invars])
    for v, out in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, core.DropVar):
        env[v] = out
