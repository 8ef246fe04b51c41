"""The ends of an `fsdp_scan` stack split by use order
(src/jax_overlap/_src/patterns/fsdp/use_order.py): layer 0's weights are
gathered in groups cut at its matmuls, each waited for right before the
layer first reads it; its gradients are reduce-scattered group by group as
its backward finishes them.

Values and gradients against the model written plainly, with the keywords
that change layer 0's path (before/after, xs, remat_policy, precision,
HSDP); and the windows in the traced program: only the first group's gather
and the last group's reduce-scatter are left with no matmul written in
their window, and they carry only that group's leaves. Tiny shapes, one
compile per case (CI's budget).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
import lowered
from jax_overlap._src.collectives.primitives import (collective_done_p,
                                                     collective_start_p)
from jax_overlap._src.patterns.fsdp import use_order

V, D, B, L = 16, 8, 16, 3   # vocabulary, width, batch, layers


def block(x, w, scale=None):
  """Read in this order: n1 and a (first matmul), b (after it), n2 and c
  (after b's matmul), d (after c's): four groups."""
  h = jnp.tanh((x * w["n1"]) @ w["a"]) @ w["b"]
  x = x + h * w["n2"]
  y = x + jnp.tanh(x @ w["c"]) @ w["d"]
  return y if scale is None else y * scale


def _inputs():
  k = jax.random.split(jax.random.PRNGKey(0), 8)
  n = lambda i, *s: jax.random.normal(k[i], s) * 0.3
  blocks = {"n1": 1 + n(0, L, D), "a": n(1, L, D, D), "b": n(2, L, D, D),
            "n2": 1 + n(3, L, D), "c": n(4, L, D, 2 * D),
            "d": n(5, L, 2 * D, D)}
  params = {"embed": n(6, V, D), "blocks": blocks}
  tokens = jax.random.randint(k[7], (B,), 0, V)
  return params, tokens, 1 + 0.1 * jnp.arange(L, dtype=jnp.float32)


SPECS = {"embed": P(), "blocks": {k: P(None, "d") for k in
                                  ("n1", "a", "b", "n2", "c", "d")}}


def reference(params, tokens, scales, xs=False):
  x = params["embed"][tokens]
  for i in range(L):
    x = block(x, jax.tree.map(lambda a: a[i], params["blocks"]),
              scales[i] if xs else None)
  return jnp.mean(x ** 2)


def loss_of(ends=True, xs=False, replica=False, **kw):
  mesh = jax.make_mesh((2, 4) if replica else (8,),
                       ("replica", "d") if replica else ("d",),
                       axis_types=(jax.sharding.AxisType.Auto,) *
                       (2 if replica else 1))
  batch = P(("replica", "d")) if replica else P("d")
  axes = ("replica", "d") if replica else "d"
  if replica:
    kw["replica_axis"] = "replica"

  @jax.shard_map(mesh=mesh, in_specs=(SPECS, batch, P()), out_specs=P())
  def loss(params, tokens, scales):
    if xs:
      kw["xs"] = scales
    embed = lambda t: params["embed"][t]
    if ends:
      out = jo.fsdp_scan(block, tokens, params["blocks"], axis="d",
                         before=embed, after=lambda y: jnp.mean(y ** 2), **kw)
    else:
      out = jnp.mean(jo.fsdp_scan(block, embed(tokens), params["blocks"],
                                  axis="d", **kw) ** 2)
    return lax.pmean(out, axes)
  return loss


@pytest.mark.parametrize("kwargs, tol", [
    (dict(), 1e-5),
    (dict(ends=False, xs=True), 1e-5),
    (dict(reshard_after_forward=True,
          remat_policy=jax.checkpoint_policies.nothing_saveable), 1e-5),
    (dict(ends=False, param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
     5e-2),
    (dict(replica=True), 1e-5)])
def test_values_and_gradients_match_the_plain_model(kwargs, tol):
  params, tokens, scales = _inputs()
  xs = kwargs.get("xs", False)
  argnums = (0, 2) if xs else 0   # (without xs the scales are not read)
  got = jax.jit(jax.value_and_grad(loss_of(**kwargs), argnums=argnums))(
      params, tokens, scales)
  want = jax.value_and_grad(reference, argnums=argnums)(params, tokens,
                                                        scales, xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol,
                               atol=tol)


def _windows(jaxpr):
  """For each collective start: (kind, its operand's size, the primitives
  written before its done)."""
  order = list(lowered.flat_eqns(jaxpr))
  out = []
  for i, eqn in enumerate(order):
    if eqn.primitive is collective_start_p:
      end = next(j for j in range(i + 1, len(order))
                 if order[j].primitive is collective_done_p
                 and order[j].invars[0] is eqn.outvars[0])
      out.append((eqn.params["comm"].name, eqn.invars[0].aval.size,
                  [e.primitive.name for e in order[i + 1:end]]))
  return out


@pytest.mark.parametrize("ends", [True, False])
def test_only_the_first_group_and_the_last_group_wait(ends):
  params, tokens, scales = _inputs()
  trace = lambda: _windows(jax.jit(jax.grad(loss_of(ends=ends))).trace(
      params, tokens, scales).jaxpr)
  split = trace()
  with use_order.layer_0_whole():
    whole = trace()
  layer = sum(a[0].size // 8 for a in params["blocks"].values())
  # (a reduce-scatter's operand is the full gradient: 8 shards)
  bare = lambda ws: sorted((k, n // 8 if k == "psum_scatter" else n)
                           for k, n, prims in ws
                           if "dot_general" not in prims)
  # One bucket a layer: layer 0's gather and reduce-scatter wait whole
  # (the embedding is a lookup, its backward a scatter-add).
  assert bare(whole) == [("all_gather", layer), ("psum_scatter", layer)]
  # Split: layer 0's gathers travel in four groups, the first (n1 and a)
  # waits; its gradients in five (d, c, b, a, then the norms' scales, whose
  # gradients are sums finished after the last matmul), the last waits.
  # Every other group's window holds a matmul.
  first, last = (D + D * D) // 8, 2 * D // 8
  assert bare(split) == [("all_gather", first), ("psum_scatter", last)], \
      split
  # The four gathered groups are layer 0 exactly: (n1, a), b, (n2, c), d.
  groups = sorted(n for k, n, _ in split if k == "all_gather" and n < layer)
  assert groups == sorted([first, D * D // 8, (D + 2 * D * D) // 8,
                           2 * D * D // 8]) and sum(groups) == layer, split
