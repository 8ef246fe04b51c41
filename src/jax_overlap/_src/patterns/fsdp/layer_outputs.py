"""`fsdp_scan(..., has_ys=True)`: per-layer outputs, stacked as `lax.scan`'s ys.

The layer returns `(x, y)` and `fsdp_scan` returns `(x, ys)`, layer i's `y`
at `ys[i]` (aux losses, KV caches, sown values). Inside the stack the ys ride
in the carry as one buffer of all layers' ys, which layer i writes at index
i; the index comes in beside `xs[i]`. So both engines, every transfer and
`before`/`after` carry them unchanged, and their cotangents flow back
through the carry like x's. The write's transpose reads the cotangent at
index i only: no layer's residuals hold the buffer
(tests/integration/real_clients_fsdp_test.py, test_has_ys_like_lax_scan).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap._src.patterns.fsdp.weight_split import trace_layer


def _one_layer(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:],
                                                    jnp.result_type(a)), tree)


def _split_output(out, where: str):
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise ValueError(
        f"fsdp_scan(has_ys=True): the layer must return a pair (x, y), as a "
        f"lax.scan body returns (carry, y); {where} it returned "
        f"{type(out).__name__} {jax.tree.structure(out)}.")
  return out


class LayerOutputs:
  """The layer, carry, xs and ends of a stack whose layers also return a y.

  `layer(x, w[, xs_i]) -> (x, y)` becomes `layer((x, ys), w, xs_i') ->
  (x, ys)` with `xs_i'` the layer index (or `(xs_i, index)`)."""

  def __init__(self, layer: Callable, stack_input, gathered, xs, n_layers: int):
    """`stack_input`, `gathered`: the types of x and of one layer's gathered
    weights, on which the layer is traced once for its y's types."""
    self.has_xs, self.n_layers, self._layer = xs is not None, n_layers, layer
    # (xs[0] traced as an input beside the weights: the layer computes on it)
    call = (lambda x, w: layer(x, w)) if xs is None else \
        (lambda x, wx: layer(x, *wx))
    closed, out_tree = trace_layer(
        lambda x, w: _split_output(call(x, w), "given x and params[0]"),
        stack_input, gathered if xs is None else (gathered, _one_layer(xs)))
    _, self.y_types = jax.tree.unflatten(out_tree, closed.out_avals)

  def xs(self, xs):
    index = jnp.arange(self.n_layers)
    return index if xs is None else (xs, index)

  def buffer(self):
    """Zeros for every layer's y (the carry's second half at the start)."""
    return jax.tree.map(
        lambda t: jnp.zeros((self.n_layers, *t.shape), t.dtype), self.y_types)

  def layer(self, carry, w, xs_i):
    x, ys = carry
    user_xs, i = xs_i if self.has_xs else (None, xs_i)
    out = self._layer(x, w) if not self.has_xs else self._layer(x, w, user_xs)
    x, y = _split_output(out, "on a layer")
    ys = jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(
        b, v.astype(b.dtype), i, 0), ys, y)
    return x, ys

  def before(self, before: Callable | None) -> Callable:
    first = before if before is not None else (lambda v: v)
    return lambda v: (first(v), self.buffer())

  def after(self, after: Callable | None) -> Callable | None:
    if after is None:
      return None
    return lambda carry: (after(carry[0]), carry[1])
