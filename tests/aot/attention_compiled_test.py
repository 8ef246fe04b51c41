"""ring_attention on the real TPU v5e and H100 compilers, ahead of time, p = 8:
every rotation an async collective-permute with block matmuls between its
start and its done, forward and backward.

One compile a target, of the gradient (it holds the forward too): zigzag,
causal, GQA (4 heads, 2 kv heads), bfloat16. Which ring a permute belongs to
is read from its metadata, the `moving` name the library gives it ("k, v"
or "dk, dv"). Skips where libtpu or the CUDA plugin is absent
(compilers.target).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, compiled_text, target

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention.ring import ring_attention

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

SEQ_LOCAL = 256

@functools.cache
def _windows(name):
  t = target(name)
  attend = jax.shard_map(
      lambda q, k, v: ring_attention(q, k, v, axis="x", causal=True,
                                     layout="zigzag"),
      mesh=t.mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))
  grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  shape = lambda heads: (1, t.n * SEQ_LOCAL, heads, 64)
  args = [arg(t, shape(h), P(None, "x"), jnp.bfloat16) for h in (4, 2, 2)]
  text = compiled_text(grad, *args)
  comps = schedule.scheduled(text)
  by_leaf = {"k, v": [], "dk, dv": []}
  for w in schedule.windows(text):
    if w.kind != "collective-permute":
      continue
    leaf = re.search(r"jax_overlap\.leaf=([^/\"]*)",
                     comps[w.computation][w.start].line)
    by_leaf[leaf.group(1) if leaf else None] = \
        by_leaf.get(leaf.group(1) if leaf else None, []) + [w]
  return t.n, by_leaf, schedule.is_sync(text, "collective-permute")


@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_kv_rotations_in_flight_over_block_matmuls(name):
  p, by_leaf, sync = _windows(name)
  assert not sync
  kv = by_leaf["k, v"]
  # p - 1 in the forward pass, p - 1 again in the backward pass.
  assert len(kv) == 2 * (p - 1), by_leaf
  assert all(w.matmuls >= 1 for w in kv), [w.matmuls for w in kv]


@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_gradient_rotations_in_flight_over_block_matmuls(name):
  p, by_leaf, _ = _windows(name)
  grads = by_leaf["dk, dv"]
  assert len(grads) == p - 1, by_leaf
  # The last hop home too: part of the device's own block is computed
  # behind it (ring._self_parts).
  assert all(w.matmuls >= 1 for w in grads), [w.matmuls for w in grads]
  assert set(by_leaf) == {"k, v", "dk, dv"}, by_leaf
