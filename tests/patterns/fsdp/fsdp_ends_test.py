"""The ends of an `fsdp_scan` stack: `before=` (the embedding) and `after=`
(the head and loss) run inside the stack's VJP, so that layer 0's gather,
the last layer's regather and layer 0's reduce-scatter each have compute in
flight (src/jax_overlap/_src/patterns/fsdp/stack_ends.py).

Values and gradients against the same model written plainly (no fsdp_scan,
full weights), in both contexts; the windows in the traced program (CPU
compiles every collective blocking, so there the written schedule is what
shows them; tests/aot/real_compilers_test.py reads H100's and v5e's compiled
schedules). Tiny shapes, one compile per case (CI's budget).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo

HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")
needs_explicit = pytest.mark.skipif(
    not HAS_EXPLICIT, reason="this jax lacks AxisType.Explicit or jax.reshard")
CONTEXTS = ["shard_map", pytest.param("explicit", marks=needs_explicit)]
V, D, B = 16, 8, 16   # vocabulary, width, batch


def block(x, w):
  return x + jnp.tanh(x @ w["w"] + w["b"])


def embed(table, tokens):
  # A one-hot matmul (as TPU models embed): compute the windows can see.
  return jax.nn.one_hot(tokens, V, dtype=table.dtype) @ table


def head_loss(h, head, labels):
  logp = jax.nn.log_softmax(h @ head)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


def _inputs(n_layers):
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"embed": jax.random.normal(k[0], (V, D)),
            "blocks": {"w": jax.random.normal(k[1], (n_layers, D, D)) * 0.3,
                       "b": jax.random.normal(k[2], (n_layers, D)) * 0.1},
            "head": jax.random.normal(k[3], (D, V))}
  tokens = jax.random.randint(k[4], (B,), 0, V)
  return params, tokens, (tokens + 1) % V


SPECS = {"embed": P(), "blocks": {"w": P(None, "d"), "b": P(None, "d")},
         "head": P()}


def reference(params, tokens, labels, scale=1.0):
  """The same model written plainly: no fsdp_scan, nothing ordered."""
  h = embed(params["embed"], tokens)
  h, _ = lax.scan(lambda h, w: (block(h, w) * scale, None), h, params["blocks"])
  return head_loss(h, params["head"], labels)


@functools.cache
def _mesh(explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((8,), ("d",), axis_types=(kind,))


def model(params, tokens, labels, scale=None, **kwargs):
  """The step a user writes: the embedding before the stack, the head and
  the loss after it, all in one fsdp_scan call."""
  layer = block if scale is None else lambda x, w: block(x, w) * scale
  return jo.fsdp_scan(
      layer, tokens, params["blocks"], axis="d",
      before=lambda t: embed(params["embed"], t),
      after=lambda h: head_loss(h, params["head"], labels), **kwargs)


def loss_in(context, **kwargs):
  if context == "shard_map":
    @jax.shard_map(mesh=_mesh(False), in_specs=(SPECS, P("d"), P("d"), P()),
                   out_specs=P())
    def loss(params, tokens, labels, scale):
      return lax.pmean(model(params, tokens, labels, scale, **kwargs), "d")
    return loss, lambda *a: a, contextlib.nullcontext
  mesh = _mesh(True)

  def loss(params, tokens, labels, scale):
    return model(params, tokens, labels, scale, **kwargs)

  def place(params, tokens, labels, scale):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    return (jax.tree.map(put, params, SPECS), put(tokens, P("d")),
            put(labels, P("d")), scale)
  return loss, place, lambda: jax.set_mesh(mesh)


def _close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("context, n_layers, kwargs", [
    ("shard_map", 1, {}), ("shard_map", 3, {}),
    # The default keeps the last layer's weights from the forward pass (no
    # regather behind after's backward); True regathers it there.
    ("shard_map", 3, {"reshard_after_forward": True}),
    pytest.param("explicit", 3, {}, marks=needs_explicit)])
def test_values_and_gradients_match_the_plain_model(context, n_layers, kwargs):
  # The layer closes over a traced scale (lifted into the VJP like the
  # embedding table and the head): its gradient flows too.
  params, tokens, labels = _inputs(n_layers)
  loss, place, ctx = loss_in(context, **kwargs)
  args = place(params, tokens, labels, jnp.float32(0.9))
  with ctx():
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 3)))(*args)
  want = jax.value_and_grad(reference, argnums=(0, 3))(
      params, tokens, labels, jnp.float32(0.9))
  _close(got, want)
  if context == "explicit":   # the gradients come back sharded like params
    for g, p in zip(jax.tree.leaves(got[1][0]), jax.tree.leaves(args[0])):
      assert g.sharding.is_equivalent_to(p.sharding, g.ndim)


def test_before_alone_after_alone_and_hsdp():
  params, tokens, labels = _inputs(3)
  want = jax.value_and_grad(reference)(params, tokens, labels)
  mesh = jax.make_mesh((2, 4), ("replica", "d"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch = P(("replica", "d"))

  @jax.shard_map(mesh=mesh, in_specs=(SPECS, batch, batch), out_specs=P())
  def both(params, tokens, labels):
    kw = dict(axis="d", replica_axis="replica")
    h = jo.fsdp_scan(block, tokens, params["blocks"],
                     before=lambda t: embed(params["embed"], t), **kw)
    only_before = head_loss(h, params["head"], labels)
    only_after = jo.fsdp_scan(
        block, embed(params["embed"], tokens), params["blocks"],
        after=lambda h: head_loss(h, params["head"], labels), **kw)
    return lax.pmean(only_before + only_after, ("replica", "d"))

  # Each is the plain model: their sum, twice its value and gradients (HSDP:
  # not doubled again by the replicas).
  got = jax.jit(jax.value_and_grad(both))(params, tokens, labels)
  _close(got, jax.tree.map(lambda a: 2 * a, want))


def test_every_window_has_compute_with_the_ends():
  from fsdp_test import _windows  # noqa: PLC0415 - the same window finder
  params, tokens, labels = _inputs(3)

  def windows(ends=False, **kw):
    @jax.shard_map(mesh=_mesh(False), in_specs=(SPECS, P("d"), P("d")),
                   out_specs=P())
    def loss(params, tokens, labels):
      if ends:
        out = model(params, tokens, labels, **kw)
      else:
        h = jo.fsdp_scan(block, embed(params["embed"], tokens),
                         params["blocks"], axis="d", **kw)
        out = head_loss(h, params["head"], labels)
      return lax.pmean(out, "d")
    return _windows(jax.jit(jax.grad(loss)).trace(params, tokens,
                                                  labels).jaxpr)

  bare = lambda ws: sorted(k for k, prims in ws if "dot_general" not in prims)
  # Without the ends: the forward's first gather and the last reduce-scatter
  # have nothing written between start and done (one bucket a layer; the
  # default keeps the last layer's weights, so the backward pass starts
  # with no gather) ...
  assert bare(windows()) == ["all_gather", "psum_scatter"]
  # ... nor, with every layer regathered, the backward's first gather ...
  regather = dict(reshard_after_forward=True)
  assert bare(windows(**regather)) == ["all_gather"] * 2 + ["psum_scatter"]
  # ... with them: the embedding's matmul, the head's backward (where that
  # regather is) and the embedding's backward are written there.
  with_ends = windows(ends=True)
  assert bare(with_ends) == [], with_ends
  assert len(with_ends) == len(windows())
  assert bare(windows(ends=True, **regather)) == []
  # The embedding table's and the head's gradients are all-reduced after
  # the stack's backward (stack_ends._varying_like_outputs), not inside a
  # window, where they would queue behind the collective in flight.
  assert not any(p.startswith("psum") for _, prims in with_ends
                 for p in prims), with_ends
