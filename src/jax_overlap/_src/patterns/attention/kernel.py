"""Blockwise attention: one block of queries against one block of keys.

The softmax is online (running max `m`, running sum `l`, unnormalised
output `o`, all float32), so a query block can meet its key blocks one at a
time, in any order: the ring sees them as they arrive. The backward pass of
a block needs only the block and the row statistics `lse = m + log(l)` and
`delta = sum(do * o)`, never the other blocks' probabilities.

Shapes: queries are grouped by key/value head, `q` (batch, sq, kv_heads,
group, head_dim) and `k`, `v` (batch, sk, kv_heads, head_dim), so that GQA
and MQA (group > 1) need no copy of `k` and `v`. Masks are boolean
(batch or 1, sq, 1, 1, sk): True where a query may see a key.

Pinned by tests/patterns/attention/ring_attention_test.py (values and
gradients against dense attention).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap._src.patterns.varying import vary_over, varying

#: A masked score. Finite, so that a block whose keys are all masked for a
#: row gives exp(0) * 0 terms rather than nan (inf - inf).
_MASKED = -1e30

#: Key blocks longer than this are visited in a `lax.scan` of blocks of this
#: many keys, so that the scores held at once are (sq, _KEY_BLOCK) a head.
KEY_BLOCK = 1024


class Stats(NamedTuple):
  """The online softmax's state for a block of queries."""
  o: jax.Array   # (b, sq, h, g, d) float32, unnormalised
  m: jax.Array   # (b, sq, h, g) float32, running max of the scores
  l: jax.Array   # (b, sq, h, g) float32, running sum of exp(score - m)


def zeros_like_varying(shape, like, fill=0.0):
  """A float32 buffer typed as varying over the mesh axes `like` varies
  over, so that a loop carrying it keeps one type."""
  return vary_over(jnp.full(shape, fill, jnp.float32),
                   sorted(varying(like), key=str))


def empty_stats(q) -> Stats:
  """The state before any key is seen (`q`'s shape, float32)."""
  rows = q.shape[:-1]
  return Stats(zeros_like_varying(q.shape, q),
               zeros_like_varying(rows, q, _MASKED),
               zeros_like_varying(rows, q))


def mask(causal: bool, sq: int, sk: int, q_seg=None, k_seg=None,
         k_offset=0, positions=None, window=None):
  """Where queries 0..sq-1 may see keys k_offset..k_offset+sk-1 of a block
  aligned with them (causal: key position <= query position; `window`,
  `(left, right)`: query position - left <= key position <= query position
  + right, window.py), and where their segment ids are equal; None where
  every key is seen. `positions`: (query positions (sq,), key positions
  (sk,)) to compare instead, for blocks that are not aligned."""
  out = None
  if causal or window is not None:
    if positions is None:
      q_pos, k_pos = jnp.arange(sq), k_offset + jnp.arange(sk)
    else:
      q_pos, k_pos = positions
    q_pos, k_pos = q_pos[:, None], k_pos[None, :]
    if causal:
      out = q_pos >= k_pos
    if window is not None:
      left, right = window
      near = (k_pos >= q_pos - left) & (k_pos <= q_pos + right)
      out = near if out is None else out & near
    out = out[None, :, None, None, :]
  if q_seg is not None:
    same = (q_seg[:, :, None] == k_seg[:, None, :])[:, :, None, None, :]
    out = same if out is None else out & same
  return out


def _scores(q, k, scale):
  return jnp.einsum("bqhgd,bkhd->bqhgk", q, k,
                    preferred_element_type=jnp.float32) * scale


def _update(stats: Stats, q, k, v, where, scale) -> Stats:
  s = _scores(q, k, scale)
  if where is not None:
    s = jnp.where(where, s, _MASKED)
  m = jnp.maximum(stats.m, s.max(-1))
  p = jnp.exp(s - m[..., None])
  if where is not None:
    p = jnp.where(where, p, 0.0)
  fade = jnp.exp(stats.m - m)
  pv = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(v.dtype), v,
                  preferred_element_type=jnp.float32)
  return Stats(stats.o * fade[..., None] + pv, m,
               stats.l * fade + p.sum(-1))


def _block_grads(q, k, v, do, lse, delta, where, scale):
  s = _scores(q, k, scale)
  p = jnp.exp(s - lse[..., None])
  if where is not None:
    p = jnp.where(where, p, 0.0)
  dv = jnp.einsum("bqhgk,bqhgd->bkhd", p.astype(do.dtype), do,
                  preferred_element_type=jnp.float32)
  dp = jnp.einsum("bqhgd,bkhd->bqhgk", do, v,
                  preferred_element_type=jnp.float32)
  ds = p * (dp - delta[..., None]) * scale
  dq = jnp.einsum("bqhgk,bkhd->bqhgd", ds.astype(k.dtype), k,
                  preferred_element_type=jnp.float32)
  dk = jnp.einsum("bqhgk,bqhgd->bkhd", ds.astype(q.dtype), q,
                  preferred_element_type=jnp.float32)
  return dq, dk, dv


def _key_blocks(sk: int) -> int:
  """How many key blocks a block of `sk` keys is visited in."""
  if sk > KEY_BLOCK and sk % KEY_BLOCK == 0:
    return sk // KEY_BLOCK
  return 1


def _split(a, n: int):
  """(b, sk, ...) -> (n, b, sk / n, ...), for `lax.scan`."""
  if a is None:
    return None
  a = a.reshape(a.shape[0], n, a.shape[1] // n, *a.shape[2:])
  return jnp.moveaxis(a, 1, 0)


def _join(a):
  """The inverse of `_split`."""
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _key_positions(positions, n: int):
  """Key positions split as `_split` splits keys, or None."""
  if positions is None:
    return None
  return positions[1].reshape(n, -1)


def _block_positions(positions, k_pos):
  return None if positions is None else (positions[0], k_pos)


def block_forward(stats: Stats, q, k, v, *, causal: bool, scale: float,
                  q_seg=None, k_seg=None, positions=None,
                  window=None) -> Stats:
  """`stats` updated with the keys `k`, `v` (a block aligned with `q`'s
  when `causal` or `window`: key i is at the position of query i, unless
  `positions` gives both blocks' positions)."""
  n = _key_blocks(k.shape[1])
  if n == 1:
    return _update(stats, q, k, v, mask(causal, q.shape[1], k.shape[1],
                                        q_seg, k_seg, positions=positions,
                                        window=window),
                   scale)
  size = k.shape[1] // n

  def body(stats, xs):
    j, kb, vb, sb, pb = xs
    where = mask(causal, q.shape[1], size, q_seg, sb, k_offset=j * size,
                 positions=_block_positions(positions, pb), window=window)
    return _update(stats, q, kb, vb, where, scale), None
  stats, _ = jax.lax.scan(
      body, stats, (jnp.arange(n), _split(k, n), _split(v, n),
                    _split(k_seg, n), _key_positions(positions, n)))
  return stats


def block_backward(q, k, v, do, lse, delta, *, causal: bool, scale: float,
                   q_seg=None, k_seg=None, positions=None, window=None):
  """(dq, dk, dv) of this block's part of the attention, float32."""
  n = _key_blocks(k.shape[1])
  if n == 1:
    where = mask(causal, q.shape[1], k.shape[1], q_seg, k_seg,
                 positions=positions, window=window)
    return _block_grads(q, k, v, do, lse, delta, where, scale)
  size = k.shape[1] // n

  def body(dq, xs):
    j, kb, vb, sb, pb = xs
    where = mask(causal, q.shape[1], size, q_seg, sb, k_offset=j * size,
                 positions=_block_positions(positions, pb), window=window)
    dqb, dkb, dvb = _block_grads(q, kb, vb, do, lse, delta, where, scale)
    return dq + dqb, (dkb, dvb)
  dq, (dk, dv) = jax.lax.scan(
      body, zeros_like_varying(q.shape, q),
      (jnp.arange(n), _split(k, n), _split(v, n), _split(k_seg, n),
       _key_positions(positions, n)))
  return dq, _join(dk), _join(dv)


def finish(stats: Stats):
  """(output, lse): the normalised output (float32) and each row's log-sum-
  exp (+huge where a row saw no key, so that its backward terms are 0)."""
  seen = stats.l > 0
  l = jnp.where(seen, stats.l, 1.0)
  lse = jnp.where(seen, stats.m + jnp.log(l), -_MASKED)
  return stats.o / l[..., None], lse


def row_delta(out, do):
  """sum(do * out) over head_dim, float32: the backward's row term."""
  return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), -1)


def group_heads(q, kv_heads: int):
  """(b, s, heads, d) -> (b, s, kv_heads, heads / kv_heads, d): query head
  i uses key/value head i // group, as GQA defines it."""
  b, s, h, d = q.shape
  return q.reshape(b, s, kv_heads, h // kv_heads, d)


def ungroup_heads(x):
  b, s, h, g, d = x.shape
  return x.reshape(b, s, h * g, d)
