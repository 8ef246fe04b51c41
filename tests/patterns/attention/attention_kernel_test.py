"""The blockwise kernel on one device: causal by explicit positions (the
all-gather form of benchmarks/bench_attention.py), key blocks in a scan."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.patterns.attention import kernel
from jax_overlap._src.patterns.attention.layout import to_layout
from jax_overlap._src.patterns.attention.local import local_attention

from attention_reference import dense_attention, inputs


def test_positions_of_a_zigzag_sequence(monkeypatch):
  # Keys in zigzag order, queries a device's two chunks: the mask follows
  # their global positions, and so do the gradients.
  monkeypatch.setattr(kernel, "KEY_BLOCK", 4)
  p = 2
  q, k, v, _ = inputs(p, seq_local=8)
  positions = to_layout(jnp.arange(q.shape[1])[None], "zigzag", p)[0]
  lay = lambda x: to_layout(x, "zigzag", p)
  rows = slice(8, 16)   # device 1's chunks

  def ours(q, k, v):
    return local_attention(lay(q)[:, rows], lay(k), lay(v), causal=True,
                           scale=1 / np.sqrt(q.shape[-1]),
                           positions=(positions[rows], positions))

  def ref(q, k, v):
    return lay(dense_attention(q, k, v, causal=True))[:, rows]
  # Under jit: one compile each instead of a dispatch an operation.
  np.testing.assert_allclose(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v),
                             rtol=1e-5, atol=1e-5)
  grad = lambda f: jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(),
                                    argnums=(0, 1, 2)))
  for g, r in zip(grad(ours)(q, k, v), grad(ref)(q, k, v)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
