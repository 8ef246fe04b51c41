"""Dense attention over the whole sequence, the oracle of the attention tests,
and the shard_map around the library's functions."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.attention.layout import from_layout, to_layout


def dense_attention(q, k, v, *, causal=False, segment_ids=None, scale=None,
                    window=None):
  """softmax(q k^T * scale + mask) v on global (b, s, h, d) arrays, float32,
  kv heads repeated for GQA. `window`: an int w or (left, right), the query
  at i seeing keys i - left .. i + right (jax.nn.dot_product_attention's
  local_window_size; test_the_reference_window_is_jaxs pins it)."""
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, 2), jnp.repeat(v, group, 2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  n = q.shape[1]
  keep = jnp.ones((1, 1, n, n), bool)
  if causal:
    keep = keep & jnp.tril(jnp.ones((n, n), bool))
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = keep & ((j >= i - left) & (j <= i + right))
  if segment_ids is not None:
    keep = keep & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  s = jnp.where(keep, s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v,
                    precision="highest")


def mesh(p, name="cp"):
  return jax.make_mesh((p,), (name,), devices=jax.devices()[:p],
                       axis_types=(jax.sharding.AxisType.Auto,))


def inputs(p, *, seq_local=4, heads=8, kv_heads=2, head_dim=8, batch=1,
           dtype=jnp.float32, segments=False, seed=0):
  """Global q, k, v (and segment ids: 3 packed sequences a row, or None)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  s = seq_local * p
  q = jax.random.normal(ks[0], (batch, s, heads, head_dim)).astype(dtype)
  k = jax.random.normal(ks[1], (batch, s, kv_heads, head_dim)).astype(dtype)
  v = jax.random.normal(ks[2], (batch, s, kv_heads, head_dim)).astype(dtype)
  seg = None
  if segments:
    seg = jnp.sort(jax.random.randint(ks[3], (batch, s), 0, 3), axis=1)
  return q, k, v, seg


def sharded(p, attend, layout="contiguous"):
  """`attend(q, k, v, segment_ids)` inside shard_map over "cp", on global
  arrays in their global order (laid out and back with `layout`)."""
  def local(q, k, v, seg):
    return attend(q, k, v, seg)
  smap = jax.shard_map(local, mesh=mesh(p), in_specs=P(None, "cp"),
                       out_specs=P(None, "cp"))

  def run(q, k, v, seg=None):
    lay = lambda x: None if x is None else to_layout(x, layout, p)
    out = smap(lay(q), lay(k), lay(v), lay(seg))
    return from_layout(out, layout, p)
  return run


def value_and_grads(fn, q, k, v, seg, seed=7):
  """(fn's output, d<out * w>/d(q, k, v)) in one jit."""
  w = jax.random.normal(jax.random.key(seed), q.shape, jnp.float32)

  def loss(q, k, v):
    out = fn(q, k, v, seg)
    return (out.astype(jnp.float32) * w).sum(), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                               has_aux=True))(q, k, v)
  return out, grads
