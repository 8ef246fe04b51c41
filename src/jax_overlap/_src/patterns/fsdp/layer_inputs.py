"""`fsdp_scan(..., xs=...)`: per-layer inputs beside the weights.

`xs` is stacked over layers like `params` (PRNG keys for dropout, layer
indices, per-layer flags or scales) and layer i is called as
`layer(params[i], x, xs[i])` (with `params_first=True`; the executor's
order, which this module sees, is `layer(x, params[i], xs[i])`), the way
`lax.scan` passes its `xs` after the carry. Inside
`fsdp_scan` layer i's inputs travel as one pair `(params[i], xs[i])`: the
weights through the transfer (gathered, reduce-scattered), `xs[i]` as it
is. To the weight split the pair is "what the layer is given besides x", so
values computed from `xs[i]` alone (a dropout mask from a key) are
recomputed in the backward pass, not saved, like a cast of the weights.
Float parts of `xs` get gradients, as with `lax.scan`; integer, boolean and
key parts get float0 ones.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.patterns.leading_axis import wrong_leading_axis


def check_xs(xs, n_layers: int) -> None:
  bad = wrong_leading_axis(xs, n_layers)
  if bad:
    path, shape = bad
    raise ValueError(
        f"fsdp_scan(xs=...): leaf {path or '(xs itself)'} "
        f"has shape {shape}; every leaf of xs is stacked over the layers "
        f"like params (a leading dimension of {n_layers}, the number of "
        "layers of params), as lax.scan's xs.")


def with_layer_inputs(layer: Callable) -> Callable:
  """`layer(x, w, xs_i)` as a layer of the pair: `f(x, (w, xs_i))`."""
  return lambda x, pair: layer(x, pair[0], pair[1])


def differentiable(leaf) -> bool:
  return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def float0_zeros(leaf):
  return np.zeros(jnp.shape(leaf), dtype=jax.dtypes.float0)


NO_COTANGENT = np.zeros((), dtype=jax.dtypes.float0)


def without_float0(tree):
  """`tree` with each float0 leaf (the cotangent of an integer, boolean or
  key part of xs) replaced by `NO_COTANGENT`, one float0 scalar typed alike
  everywhere.

  Why: the backward loop carries each layer's gradient to the next step's
  reduce-scatter. A float0 cotangent there is typed as varying where xs[i]
  is (keys sharded like the batch), which the zeros that start the loop
  cannot be (a float0 array takes no `pcast`), and `lax.scan` refuses the
  carry. Nothing reads these leaves: the stack's gradient of such a leaf is
  float0 zeros of its shape (engine.run's last line).
  Pinned by tests/patterns/fsdp/fsdp_key_xs_test.py."""
  return jax.tree.map(
      lambda g: NO_COTANGENT if jnp.result_type(g) == jax.dtypes.float0
      else g, tree)


class PairTransfer:
  """A transfer (transfer.py) of `(weights, xs_i)` pairs: the weights go
  through `inner`, `xs_i` (and its cotangent) as they are."""

  def __init__(self, inner):
    self.inner = inner
    self.stages = inner.stages
    self.in_shard_map = inner.in_shard_map

  def reduce_now(self, pair):
    return self.inner.reduce_now(pair[0]), pair[1]

  def step2(self, compute: Callable[[], Any], gather=None, scatter=None,
            reduce=None):
    out, gathered, scattered, reduced = self.inner.step2(
        compute, gather=None if gather is None else gather[0],
        scatter=None if scatter is None else scatter[0],
        reduce=None if reduce is None else reduce[0])
    # xs[i]'s cotangent rides beside its layer's gradient through both
    # stages, so it is put at that layer's index with it.
    return (out,
            None if gather is None else (gathered, gather[1]),
            None if scatter is None else (scattered, scatter[1]),
            None if reduce is None else (reduced, reduce[1]))

  def gather_now(self, pair):
    return self.inner.gather_now(pair[0]), pair[1]

  def scatter_now(self, pair):
    return self.inner.scatter_now(pair[0]), pair[1]

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    out, gathered, scattered = self.inner.step(
        compute, gather=None if gather is None else gather[0],
        scatter=None if scatter is None else scatter[0])
    return (out,
            None if gather is None else (gathered, gather[1]),
            None if scatter is None else (scattered, scatter[1]))
