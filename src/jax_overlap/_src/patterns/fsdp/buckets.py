"""One gather and one reduce-scatter per layer for all its leaves (buckets).

Each collective pays a fixed latency besides its bytes; a block with eight
leaves pays it eight times per gather and eight per reduce-scatter. A
bucket packs the local shards of one layer's leaves (those of one dtype)
into one flat buffer, gathers it once (untiled: one row per device) and
unpacks every leaf from the rows; the gradients are packed the same way,
reduce-scattered once, and unpacked. Packing is a copy of the shards (and
unpacking one of the gathered weights), which is cheap beside the
latencies saved on the hardware the inspector models; a leaf sharded along
another dimension than its first is transposed to put it first.

Rows: device r's shard of leaf k, with its sharded dimension moved first
and flattened, is `buffer[off_k:off_k + n_k]` on device r; the gathered
`(size, total)` array holds device r's buffer in row r, which is exactly the
r-th block of leaf k along its sharded dimension.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


class Bucket:
  """The packing of a set of leaves (by position in the layer's flat
  leaves) that travel together: their sharded dims and local shapes."""

  __slots__ = ("members", "dims", "local_shapes", "sizes")

  def __init__(self, members, dims, local_shapes):
    self.members = list(members)
    self.dims = list(dims)
    self.local_shapes = [tuple(s) for s in local_shapes]
    self.sizes = [math.prod(s) for s in self.local_shapes]

  def pack_shards(self, shards):
    """Local shards -> one flat buffer (a copy)."""
    return jnp.concatenate([
        jnp.moveaxis(s, d, 0).reshape(-1) for s, d in zip(shards, self.dims)])

  def unpack_gathered(self, rows):
    """`(size, total)` gathered rows -> the full leaves."""
    out, offset = [], 0
    for d, shape, n in zip(self.dims, self.local_shapes, self.sizes):
      moved = (shape[d],) + shape[:d] + shape[d + 1:]
      block = rows[:, offset:offset + n].reshape((rows.shape[0],) + moved)
      full = block.reshape((rows.shape[0] * moved[0],) + moved[1:])
      out.append(jnp.moveaxis(full, 0, d))
      offset += n
    return out

  def pack_grads(self, grads, size: int):
    """Full gradients -> `(size, total)` rows, row r for device r."""
    return jnp.concatenate([
        jnp.moveaxis(g, d, 0).reshape(size, -1)
        for g, d in zip(grads, self.dims)], axis=1)

  def unpack_scattered(self, flat):
    """This device's flat reduce-scattered buffer -> the gradient shards."""
    out, offset = [], 0
    for d, shape, n in zip(self.dims, self.local_shapes, self.sizes):
      moved = (shape[d],) + shape[:d] + shape[d + 1:]
      out.append(jnp.moveaxis(flat[offset:offset + n].reshape(moved), 0, d))
      offset += n
    return out


def plan_buckets(dims, local_shapes, dtypes, varying=None):
  """Buckets of the sharded leaves of one layer: one per dtype the gather
  carries and set of mesh axes the leaf varies over (`varying`, inside
  shard_map: packing a leaf with one that varies over more axes, e.g. a
  norm scale with tensor-parallel weights, would type it as varying over
  them too), with at least two members (a lone leaf travels as it is).
  Returns `(buckets, lone)`: lone are the positions gathered one by one."""
  groups = {}
  for k, (d, dtype) in enumerate(zip(dims, dtypes)):
    if d is not None:
      key = (np.dtype(dtype), None if varying is None else varying[k])
      groups.setdefault(key, []).append(k)
  buckets, lone = [], []
  for members in groups.values():
    if len(members) < 2:
      lone.extend(members)
      continue
    buckets.append(Bucket(members, [dims[k] for k in members],
                          [local_shapes[k] for k in members]))
  return buckets, sorted(lone)
