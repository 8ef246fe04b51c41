"""One layer of an `fsdp_scan` stack: read from the stack, run forward
with its pullback saved (values the weights alone determine left out), and
run backward from that pullback with the regathered weights.

Why: gathered weights are not saved for the backward pass (nor values
computed from them alone, such as a cast); the residuals are activations
only (tests/patterns/fsdp/fsdp_test.py).
"""

from __future__ import annotations

import jax
from jax import lax
from jax._src import core as jax_core

from jax_overlap._src.patterns.fsdp.weight_split import split_by_weights


def layer_at(stacked, i):
  """Layer `i` of a stacked pytree, read in place (no copy of the stack)."""
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False),
                      stacked)


class _Slot:
  """Stands in a saved pullback for frontier value `index`, which is not
  saved: the backward pass computes it again from the regathered weights."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index

  def __repr__(self):
    return f"_Slot({self.index})"


jax.tree_util.register_pytree_node(_Slot, lambda s: ((), s.index),
                                   lambda index, _: _Slot(index))


class Splits:
  """`split_by_weights(layer, x, w)`, traced once per set of x's and w's
  types: one `fsdp_scan` call runs the layer in several places (layer 0
  and the loop in each pass, the backward pass's frontier), and tracing
  the user's layer anew for each made a good part of the call's trace time
  (benchmarks/bench_first_call.py --profile fsdp). A split that captured a
  traced value is not kept (it belongs to the trace that made it)."""

  def __init__(self, layer):
    self.layer, self._made = layer, {}

  def __call__(self, x, w):
    leaves, tree = jax.tree.flatten((x, w))
    key = (tree, tuple(v if isinstance(v, jax_core.AbstractValue)
                       else jax.typeof(v) for v in leaves))
    split = self._made.get(key)
    if split is None:
      split = split_by_weights(self.layer, x, w)
      if split.reusable:
        self._made[key] = split
    return split


def _rest_fn(split, remat_policy):
  if remat_policy is None:
    return split.rest
  return jax.checkpoint(split.rest, policy=remat_policy)


def layer_forward(layer, remat_policy, x, w):
  """The layer's output and its pullback, with every value the weights alone
  determine left out (a `_Slot` in its place). `layer` may be a `Splits`."""
  split = (layer if isinstance(layer, Splits) else Splits(layer))(x, w)
  frontier = split.prep(w)
  y, pullback = jax.vjp(_rest_fn(split, remat_policy), x, frontier)
  leaves, tree = jax.tree.flatten(pullback)
  ids = {id(f): k for k, f in enumerate(frontier)}
  leaves = [_Slot(ids[id(leaf)]) if id(leaf) in ids else leaf for leaf in leaves]
  return y, jax.tree.unflatten(tree, leaves)


def layer_backward(layer, pullback, w, x_avals, y_bar):
  """x's cotangent and the full weights' gradient, from a saved pullback
  (which already recomputes what the remat policy did not save).

  The layer is traced again on x's own types, not on the cotangent's: an
  integer, boolean or PRNG-key part of x has a float0 cotangent, which the
  layer could not index, compare or split with."""
  split = (layer if isinstance(layer, Splits) else Splits(layer))(x_avals, w)
  frontier, prep_pullback = jax.vjp(split.prep, w)
  leaves, tree = jax.tree.flatten(pullback,
                                  is_leaf=lambda v: isinstance(v, _Slot))
  leaves = [frontier[v.index] if isinstance(v, _Slot) else v for v in leaves]
  x_bar, frontier_bar = jax.tree.unflatten(tree, leaves)(y_bar)
  (w_bar,) = prep_pullback(frontier_bar)
  return x_bar, w_bar
