"""Layouts and the ring's plan: to_layout/from_layout, which pairs each
step computes, equal work with zigzag."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap._src.patterns.attention.layout import (
    chunks_per_device, device_chunks, from_layout, to_layout)
from jax_overlap._src.patterns.attention.plan import (
    plan, relation, ring_attention_work)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zigzag_gives_device_d_chunks_d_and_2p_minus_1_minus_d(p):
  x = jnp.arange(2 * p * 3).reshape(1, -1)
  laid = np.asarray(to_layout(x, "zigzag", p))
  for d, block in enumerate(laid.reshape(p, 2, 3)):
    assert block[0, 0] == 3 * d and block[1, 0] == 3 * (2 * p - 1 - d)
  np.testing.assert_array_equal(from_layout(to_layout(x, "zigzag", p),
                                            "zigzag", p), x)


def test_layout_along_another_axis_and_contiguous():
  x = jnp.arange(2 * 8 * 3).reshape(2, 8, 3)
  moved = jnp.moveaxis(x, 1, 0)
  np.testing.assert_array_equal(
      jnp.moveaxis(to_layout(moved, "zigzag", 2, seq_axis=0), 0, 1),
      to_layout(x, "zigzag", 2))
  assert to_layout(x, "contiguous", 4) is x


def _unmasked(layout, p, d, step):
  """Brute force: the (local q chunk, local k chunk) pairs with some
  unmasked causal entry at ring step `step` on device d."""
  q = device_chunks(layout, p, d)
  k = device_chunks(layout, p, (d - step) % p)
  return {(i, j) for i in range(len(q)) for j in range(len(k))
          if k[j] <= q[i]}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 16])
def test_the_plan_computes_exactly_the_unmasked_pairs(layout, p):
  table = plan(layout, causal=True)
  for d in range(p):
    for step in range(p):
      pairs = table[relation(d, step)]
      computed = {(i, j) for pr in pairs
                  for i in range(pr.q_first, pr.q_first + pr.q_count)
                  for j in range(pr.k_first, pr.k_first + pr.k_count)}
      assert computed == _unmasked(layout, p, d, step), (d, step)
      assert len(computed) == sum(pr.blocks for pr in pairs)
      # A diagonal pair is one chunk against the same global chunk.
      for pr in pairs:
        if pr.diagonal:
          q = device_chunks(layout, p, d)[pr.q_first]
          assert q == device_chunks(layout, p, (d - step) % p)[pr.k_first]


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_zigzag_causal_work_is_equal_on_every_device(p):
  work = ring_attention_work("zigzag", p, causal=True)
  assert work == (2 * p + 1,) * p
  # Half of the (2p)^2 chunk pairs, and the diagonal: all unmasked ones.
  assert sum(work) == (2 * p) ** 2 // 2 + p
  # Contiguous: device d computes d + 1 chunks, the last all p.
  assert ring_attention_work("contiguous", p, causal=True) == tuple(
      range(1, p + 1))
  n = chunks_per_device("zigzag")
  assert ring_attention_work("zigzag", p, causal=False) == (n * n * p,) * p


@pytest.mark.parametrize("context", ["none", "explicit", "auto"])
def test_layout_of_an_array_on_a_mesh(context):
  # An array sharded along the sequence over a mesh of 8: "none" is
  # jax.make_mesh's default axes without jax.set_mesh (Explicit axes, which
  # jax cannot type a plain gather's output over), "explicit" and "auto"
  # under jax.set_mesh. Eager and under jit, both ways; over Explicit axes
  # the result stays sharded along the sequence.
  kind = {"explicit": jax.sharding.AxisType.Explicit,
          "auto": jax.sharding.AxisType.Auto}.get(context)
  devices = jax.devices()[:8]
  mesh = (jax.make_mesh((8,), ("cp",), devices=devices) if kind is None else
          jax.make_mesh((8,), ("cp",), devices=devices, axis_types=(kind,)))
  x = np.arange(2 * 32 * 3, dtype=np.float32).reshape(2, 32, 3)
  want = np.asarray(to_layout(x, "zigzag", 8))
  scope = contextlib.nullcontext() if kind is None else jax.set_mesh(mesh)
  with scope:
    a = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
    laid = to_layout(a, "zigzag", 8)
    jitted = jax.jit(lambda a: from_layout(to_layout(a, "zigzag", 8),
                                           "zigzag", 8))(a)
    back = from_layout(laid, "zigzag", 8)
  np.testing.assert_array_equal(laid, want)
  np.testing.assert_array_equal(back, x)
  np.testing.assert_array_equal(jitted, x)
  if mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
    assert laid.sharding.spec == P(None, "cp", None), laid.sharding
    assert back.sharding.spec == P(None, "cp", None), back.sharding
