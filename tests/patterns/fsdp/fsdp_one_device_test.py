"""`fsdp_scan` over an axis of one device: nothing moves.

Over a one-device axis every gather and reduce-scatter is the identity, so
the program holds no collective and no bucket packing (what XLA left of them
on a TPU v5e cost the 1-device bf16 train step 2.7x a plain scan's,
docs/fsdp.md), and the layer once a pass: layer 0 is not split by use order
and its backward runs in the loop (the compile time of a second copy,
docs/fsdp.md). Values and gradients stay a plain scan's, with buckets or
without, with mixed precision, remat, unroll, the ends, xs and ys, and with
HSDP over a one-device replica axis.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.patterns.fsdp import engine

B, D, H, L = 8, 16, 8, 3


def layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"] * w["s"]


def _inputs():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (L, D, H)) * 0.3,
            "w2": jax.random.normal(k2, (L, H, D)) * 0.3,
            "s": jnp.ones((L, D))}
  return jax.random.normal(k3, (B, D)), params


def _loss(mesh, axes, **options):
  axis = axes[-1]
  specs = {"w1": P(None, axis), "w2": P(None, axis), "s": P(None, axis)}

  @jax.shard_map(mesh=mesh, in_specs=(P(axes), specs), out_specs=P())
  def loss(x, params):
    y = jo.fsdp_scan(layer, x, params, axis=axis, **options)
    return lax.psum(jnp.sum(y.astype(jnp.float32) ** 2), axes)
  return loss


def _plain(x, params):
  y = lax.scan(lambda x, w: (layer(x, w), None), x, params)[0]
  return jnp.sum(y ** 2)


def _collectives(jaxpr) -> list[str]:
  """The collectives in a jaxpr's text (its sub-jaxprs included)."""
  return re.findall(r"\b(collective_start|all_gather|psum_scatter|"
                    r"reduce_scatter|all_to_all)\[", str(jaxpr))


@pytest.mark.parametrize("options", [
    {}, {"bucket": False}, {"param_dtype": jnp.bfloat16},
    {"reduce_dtype": jnp.bfloat16}, {"reshard_after_forward": True},
    {"prefetch": 2}, {"unroll": 2},
    {"remat_policy": jax.checkpoint_policies.nothing_saveable}],
    ids=["bucket", "no-bucket", "bf16-gather", "bf16-reduce", "regather-all",
         "prefetch2", "unroll2", "remat"])
def test_one_device_moves_nothing_and_matches_a_plain_scan(options):
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  x, params = _inputs()
  loss = _loss(mesh, ("d",), **options)
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  assert _collectives(jax.make_jaxpr(grad)(x, params).jaxpr) == []
  (value, grads), (ref, ref_grads) = jax.jit(grad)(x, params), jax.value_and_grad(
      _plain, argnums=(0, 1))(x, params)
  tol = 1e-5 if not options.get("param_dtype") and not options.get(
      "reduce_dtype") else 3e-2
  np.testing.assert_allclose(value, ref, rtol=tol)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert a.dtype == b.dtype
    assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (a, b)


def test_hsdp_with_one_device_an_axis_matches_a_plain_scan():
  mesh = jax.make_mesh((1, 1), ("r", "d"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:1])
  x, params = _inputs()
  loss = _loss(mesh, ("r", "d"), replica_axis="r")
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  # (the all-reduce over the replicas stays: it types the gradient)
  (value, grads), (ref, ref_grads) = jax.jit(grad)(x, params), jax.value_and_grad(
      _plain, argnums=(0, 1))(x, params)
  np.testing.assert_allclose(value, ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _mesh1():
  return jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])


def test_one_device_holds_the_layer_once_a_pass(monkeypatch):
  # Nothing moves, so layer 0 is not split by use order (plan.py) and its
  # backward step runs in the loop (gathering layer 0 again, which moves
  # nothing): the gradient step holds the layer's 2 matmuls forward and 4
  # backward, as a plain scan's does (with more devices: 12, layer 0 apart
  # in each pass, fsdp_plan_test::test_the_default_program_holds_the_layer_
  # once_a_loop). It runs the plan fsdp_plan(axis_size=1) prints.
  seen = []
  run = engine.run
  monkeypatch.setattr(engine, "run", lambda p, *a, **k: (seen.append(p),
                                                          run(p, *a, **k))[1])
  x, params = _inputs()
  grad = jax.value_and_grad(_loss(_mesh1(), ("d",)), argnums=(0, 1))
  text = jax.jit(grad).lower(x, params).as_text()
  plain = jax.jit(jax.value_and_grad(_plain, argnums=(0, 1))).lower(
      x, params).as_text()
  assert text.count("stablehlo.dot_general") == \
      plain.count("stablehlo.dot_general") == 6
  # without a gradient too (the last layer gathers itself again, in the loop)
  forward = jax.jit(_loss(_mesh1(), ("d",))).lower(x, params).as_text()
  assert forward.count("stablehlo.dot_general") == 2
  one = jo.fsdp_plan(L, axis_size=1)
  assert [str(p) for p in seen] == [str(one)] * 2
  assert not any(s.split for s in one.steps)
  assert [r.kind for r in one.runs["backward"]] == [
      "leave_back", "layers_back", "enter_back"]
  assert "0 again" in one.table().splitlines()[-2]


@pytest.mark.parametrize("devices", [1, 2])
def test_ends_xs_and_ys_match_a_plain_scan(devices):
  # (with 2 devices: has_ys with xs, which failed at the call before
  # layer_outputs.py traced xs[0] as an input)
  x, params = _inputs()
  scales = jnp.linspace(0.5, 1.5, L)
  table = jnp.linspace(-1.0, 1.0, 4 * D).reshape(4, D)
  tokens = jnp.arange(B) % 4

  def scaled(x, w, a):
    y = layer(x, w) * a
    return y, jnp.sum(y)

  specs = {"w1": P(None, "d"), "w2": P(None, "d"), "s": P(None, "d")}

  mesh = jax.make_mesh((devices,), ("d",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:devices])

  @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("d"), P()),
                 out_specs=P())
  def loss(table, params, tokens, scales):
    out, ys = jo.fsdp_scan(scaled, tokens, params, axis="d", xs=scales,
                           has_ys=True, before=lambda t: table[t],
                           after=lambda y: jnp.sum(y ** 2))
    return lax.psum(out + jnp.sum(ys), "d")

  def ref(table, params, tokens, scales):
    y, ys = lax.scan(lambda x, wa: scaled(x, *wa), table[tokens],
                     (params, scales))
    return jnp.sum(y ** 2) + jnp.sum(ys)
  args = (table, params, tokens, scales)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3)))(*args)
  want = jax.value_and_grad(ref, argnums=(0, 1, 3))(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
