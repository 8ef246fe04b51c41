"""`ulysses_attention`: sequence-sharded to head-sharded and back.

Two all-to-alls (DeepSpeed Ulysses): each device gives every other its
share of the heads for its stretch of the sequence, attends over the whole
sequence for heads / p heads, and sends the outputs back. The key/value
exchange (k and v as one array) is started first and finished after the
query exchange, so that the two are in flight together. Where
kv_heads is not a multiple of p, each key/value head is repeated the fewest
times that make it one (GQA with fewer kv heads than devices).

With `ring_axis` the sequence is sharded over two mesh axes, the ring's
major: the all-to-alls over `axis` give each device the ring's stretch of
the sequence (its devices' pieces, in order) for heads / p heads, and
`ring_attention` over `ring_axis` attends it against the rest of the
sequence (Ulysses x ring, "unified sequence parallelism"), so that more
devices than kv heads share the sequence without repeating k and v p-fold.
Pinned by tests/patterns/attention/ulysses_ring_test.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_overlap._src.collectives.api import all_to_all_start
from jax_overlap._src.patterns.attention import checks
from jax_overlap._src.patterns.attention import dispatch
from jax_overlap._src.patterns.attention.layout import check_layout
from jax_overlap._src.patterns.attention.local import local_attention
from jax_overlap._src.patterns.attention.ring import ring_attention
from jax_overlap._src.patterns.attention.window import check_window
from jax_overlap._src.patterns.leaf_scope import moving


def ulysses_attention(q, k, v, *, axis, attention_fn=None,
                      causal: bool = False, segment_ids=None, window=None,
                      ring_axis=None, layout: str = "contiguous",
                      implementation=None):
  """Attention over a sequence sharded over `axis` by two all-to-alls.

  Inside `jax.shard_map` with the sequence sharded contiguously over `axis`
  (p devices): q, k and v are exchanged so that each device holds the whole
  sequence for heads / p heads (`all_to_all_start`), attention runs there,
  and the output is exchanged back.

  With `ring_axis`, on a 2-D context mesh: the sequence is sharded over
  `(ring_axis, axis)` (in that order, the ring's axis major: in_specs
  `P(None, (ring_axis, axis))`), the all-to-alls over `axis` give each
  device its ring device's stretch of the sequence for heads / p heads, and
  `ring_attention` over `ring_axis` attends it to the whole sequence. For
  more devices than heads (or kv heads): heads need only be a multiple of
  `axis`'s size.

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
    segment_ids: (batch, seq_local) integers, sharded like q's sequence; a
      query sees only keys of its own id (packed sequences). Default
      kernel only.
    window: sliding-window attention, as in `ring_attention` (an int w or
      `(left, right)`: the query at position i sees keys i - left .. i +
      right; Mistral's `sliding_window=W` is `causal=True, window=(W - 1,
      0)`). Default kernel only.
    ring_axis: a second mesh axis the sequence is sharded over (see
      above); None: the sequence is sharded over `axis` alone.
    layout: with `ring_axis`, the ring's layout ("contiguous" or
      "zigzag"): lay the global sequence out with
      `to_layout(x, layout, ring_size)` before sharding it over
      `(ring_axis, axis)`.
    implementation: what computes the default kernel's attention: None (a
      Pallas flash kernel on TPU, XLA's operations elsewhere), "xla" or
      "pallas" (the kernel; on CPU in Pallas's interpreter, for tests).

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

    Ulysses over 'heads' within a ring over 'ring' (4 devices, 2 heads):

    >>> mesh2 = jax.make_mesh((2, 2), ('ring', 'heads'),
    ...                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh2, in_specs=P(None, ('ring', 'heads')),
    ...                out_specs=P(None, ('ring', 'heads')))
    ... def attend2(q, k, v):
    ...   return jax_overlap.ulysses_attention(
    ...       q, k, v, axis='heads', ring_axis='ring', causal=True)
    >>> attend2(q, k, v).shape
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
        f"attends for heads / {size} heads. Use ring_attention, a mesh "
        "axis whose size divides the number of heads, or such an axis with "
        "a ring over another (ring_axis=).")
  if not isinstance(causal, bool):
    raise TypeError(
        f"ulysses_attention(causal={causal!r}) must be True or False.")
  segment_ids = checks.segment_ids(name, segment_ids, q)
  window = check_window(name, window)
  implementation = dispatch.check(name, implementation)
  if attention_fn is not None:
    _check_attention_fn(attention_fn, causal=causal, segment_ids=segment_ids,
                        window=window, ring_axis=ring_axis,
                        implementation=implementation)
  if ring_axis is not None:
    checks.axis_size(name, ring_axis, arg="ring_axis")
    if ring_axis == axis:
      raise ValueError(
          f"ulysses_attention(ring_axis={ring_axis!r}) must be another mesh "
          f"axis than axis={axis!r}: the heads are exchanged over one, the "
          "ring runs over the other.")
    layout = check_layout(name, layout)
  elif layout != "contiguous":
    raise ValueError(
        f"ulysses_attention(layout={layout!r}): the layout is the ring's; "
        "give ring_axis= too, or leave layout 'contiguous' (the sequence "
        f"sharded contiguously over {axis!r}).")
  repeat = size // math.gcd(kv_heads, size)
  if repeat > 1:
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
  if segment_ids is not None:
    # The ids of the stretch each device attends over: the whole sequence,
    # or with a ring, its ring device's.
    segment_ids = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
  if attention_fn is None:
    scale = checks.scale(name, None, q.shape[-1])
    if ring_axis is None:
      attention_fn = lambda q, k, v: local_attention(
          q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
          window=window, implementation=implementation)
    else:
      attention_fn = lambda q, k, v: ring_attention(
          q, k, v, axis=ring_axis, causal=causal, layout=layout, scale=scale,
          segment_ids=segment_ids, window=window,
          implementation=implementation)

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


def _check_attention_fn(attention_fn, **given):
  """A user's `attention_fn` applies its own mask and sees the whole
  sequence: the default kernel's arguments are refused beside it."""
  if not callable(attention_fn):
    raise TypeError(
        f"ulysses_attention(attention_fn={attention_fn!r}) must be callable "
        "as attention_fn(q, k, v).")
  for arg, value in given.items():
    if value is None or value is False:
      continue
    if arg == "ring_axis":
      raise ValueError(
          "ulysses_attention: ring_axis= runs ring_attention over that axis "
          "as the attention; leave attention_fn None to use it.")
    if arg == "implementation":
      raise ValueError(
          "ulysses_attention: implementation= chooses the default kernel's "
          "code; give it or attention_fn, not both.")
    if arg == "causal":
      raise ValueError(
          "ulysses_attention: causal=True applies to the default kernel only; "
          "give an attention_fn that masks itself (e.g. functools.partial("
          "jax.nn.dot_product_attention, is_causal=True)) and leave causal "
          "False.")
    raise ValueError(
        f"ulysses_attention: {arg}= applies to the default kernel only; an "
        "attention_fn masks itself (jax.nn.dot_product_attention takes "
        "local_window_size= and a mask=), so leave attention_fn None or "
        f"{arg} unset.")
