"""`ulysses_attention`: sequence-sharded to head-sharded and back.

Two all-to-alls (DeepSpeed Ulysses): each device gives every other its
share of the heads for its stretch of the sequence, attends over the whole
sequence for heads / p heads, and sends the outputs back. The key/value
exchange (k and v as one array) is started first and finished after the
query exchange, so that the two are in flight together. Where
kv_heads is not a multiple of p, each key/value head is repeated the fewest
times that make it one (GQA with fewer kv heads than devices).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_overlap._src.collectives.api import all_to_all_start
from jax_overlap._src.patterns.attention import checks
from jax_overlap._src.patterns.attention import dispatch
from jax_overlap._src.patterns.attention.local import local_attention
from jax_overlap._src.patterns.leaf_scope import moving


def ulysses_attention(q, k, v, *, axis, attention_fn=None,
                      causal: bool = False, implementation=None):
  """Attention over a sequence sharded over `axis` by two all-to-alls.

  Inside `jax.shard_map` with the sequence sharded contiguously over `axis`
  (p devices): q, k and v are exchanged so that each device holds the whole
  sequence for heads / p heads (`all_to_all_start`), attention runs there,
  and the output is exchanged back.

  Args:
    q: (batch, seq_local, heads, head_dim); heads must be a multiple of p.
    k, v: (batch, seq_local, kv_heads, head_dim); kv_heads divides heads.
    axis: the mesh axis name the sequence is sharded over.
    attention_fn: `attention_fn(q, k, v)` on (batch, seq, heads / p,
      head_dim) queries and (batch, seq, kv heads / p, head_dim) keys and
      values, returning q's shape; default: the library's blockwise kernel
      (an online softmax in float32, differentiable without saving the
      probabilities). It applies its own mask: give `causal` only to the
      default.
    causal: with the default kernel, mask each query to the keys at or
      before it.
    implementation: what computes the default kernel: None (a Pallas flash
      kernel on TPU, XLA's operations elsewhere), "xla" or "pallas" (the
      kernel; on CPU in Pallas's interpreter, for tests).

  Returns:
    (batch, seq_local, heads, head_dim) in q's dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('cp',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P(None, 'cp'), out_specs=P(None, 'cp'))
    ... def attend(q, k, v):
    ...   return jax_overlap.ulysses_attention(q, k, v, axis='cp', causal=True)
    >>> attend(q, k, v).shape
    (1, 8, 2, 4)
  """
  name = "ulysses_attention"
  q, k, v = checks.qkv(name, q, k, v)
  size = checks.axis_size(name, axis)
  heads, kv_heads = q.shape[2], k.shape[2]
  if heads % size:
    raise ValueError(
        f"ulysses_attention: heads ({heads}, q shape {tuple(q.shape)}) must be "
        f"a multiple of the {size} devices of axis {axis!r}: each device "
        f"attends for heads / {size} heads. Use ring_attention, or a mesh "
        "axis whose size divides the number of heads.")
  if not isinstance(causal, bool):
    raise TypeError(
        f"ulysses_attention(causal={causal!r}) must be True or False.")
  if attention_fn is not None and causal:
    raise ValueError(
        "ulysses_attention: causal=True applies to the default kernel only; "
        "give an attention_fn that masks itself (e.g. functools.partial("
        "jax.nn.dot_product_attention, is_causal=True)) and leave causal "
        "False.")
  if attention_fn is not None and not callable(attention_fn):
    raise TypeError(
        f"ulysses_attention(attention_fn={attention_fn!r}) must be callable "
        "as attention_fn(q, k, v).")
  implementation = dispatch.check(name, implementation)
  if attention_fn is not None and implementation is not None:
    raise ValueError(
        "ulysses_attention: implementation= chooses the default kernel's "
        "code; give it or attention_fn, not both.")
  repeat = size // math.gcd(kv_heads, size)
  if repeat > 1:
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
  if attention_fn is None:
    scale = checks.scale(name, None, q.shape[-1])
    attention_fn = lambda q, k, v: local_attention(
        q, k, v, causal=causal, scale=scale, implementation=implementation)

  # Sequence-sharded (b, s / p, h, d) -> head-sharded (b, s, h / p, d).
  to_heads = lambda x: all_to_all_start(x, axis, 2, 1, tiled=True)
  # k and v as one array, each kv head's k beside its v, so that a device's
  # share of the heads holds both.
  b, s, h, d = k.shape
  with moving("k, v"):
    kv = to_heads(jnp.stack([k, v], axis=3).reshape(b, s, 2 * h, d))
  with moving("q"):
    q = to_heads(q).done()
  kv = kv.done()
  kv = kv.reshape(*kv.shape[:2], kv.shape[2] // 2, 2, d)
  k, v = kv[:, :, :, 0], kv[:, :, :, 1]
  out = attention_fn(q, k, v)
  with moving("attention output"):
    return all_to_all_start(out, axis, 1, 2, tiled=True).done()
