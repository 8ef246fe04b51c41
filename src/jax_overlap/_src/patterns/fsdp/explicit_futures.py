"""`fsdp_scan`'s moves on an explicit mesh as futures (TPU).

On an explicit-sharding mesh the layer computes on global arrays, and a
`jax.reshard` leaves the collective to XLA's partitioner, which the TPU
compilers made mostly synchronous (docs/compilers.md, the explicit-mesh
column). Here only the transfer is manual: each sharded leaf's gather is
started in a `jax.shard_map` over its fsdp axes (`all_gather_start`), the
in-flight buffer leaves it as an ordinary sharded array, the user's layer
computes in global mode, and a second `shard_map` finishes it (`done()`);
a gradient unreduced over exactly the leaf's fsdp axes is reduce-scattered
the same way (`psum_scatter_start`, its TPU form). The step is the ordered
block of the shard_map path (`start...; compute; done...`), so each pair
spans the layer's matmuls: every layer's gather but the first, and every
layer's reduce-scatter but the last, has a matmul in flight
(real_compilers_test.py::test_fsdp_scan_on_an_explicit_mesh, v5e and v5p).
The done finds its start across the two shard_maps by the pair its start
recorded (xla/futures.py).

Chosen where the trace targets a TPU whose all-gather is a plain async pair
(v5e) or N-1 permutes (v5p, collectives/permute_forms.py), with a jax that
lowers a future as its async pair (0.12): arguments.py
`_explicit_futures_here`.

The gathered weight comes out replicated over the fsdp axes and is cast
(`jax.reshard`, no data moves) to the `P(reduced=...)` type the gathers of
`ReshardTransfer` give, so the layer and its gradient see the same types
and values. Leaves this cannot move (a sharded entry that mixes fsdp and
other axes; a gradient also unreduced over batch axes, as in HSDP) are
moved by `jax.reshard` in the same step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.fsdp.precision import Precision
from jax_overlap._src.patterns.fsdp.transfer import (LeafLayout,
                                                     ReshardTransfer,
                                                     ShardMapTransfer,
                                                     futures_step, spec_names)


class FutureReshardTransfer(ReshardTransfer):
  """`ReshardTransfer` whose step's moves are futures in `shard_map`s over
  the fsdp axes around the global-mode compute.

  bucket: the gradients of one layer's leaves (of one dtype) are
    reduce-scattered in one collective (buckets.py), as inside shard_map:
    the TPU form of a reduce-scatter (an all-to-all) is async one at a time,
    so with one a leaf (bucket=False) some are synchronous
    (real_compilers_test.py::
    test_fsdp_scan_buckets_overlap_the_reduce_scatters_on_tpu).
  """

  def __init__(self, axes, layouts, precision=None, dtypes=None, bucket=True):
    super().__init__(axes, layouts, precision, dtypes)
    self.bucket = bucket

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    return futures_step(self, compute, gather, scatter,
                        finish=lambda c: None if c is None else c.finish())

  def _layouts(self):
    return jax.tree.leaves(self.layouts,
                           is_leaf=lambda v: isinstance(v, LeafLayout))

  def gather_starts(self, shards):
    leaves, treedef = jax.tree.flatten(shards)
    reduced = jax.tree.leaves(self.reduced, is_leaf=_is_axes)
    lays = self._layouts()
    cast = [self.precision.for_gather(s) for s in leaves]
    moving = [k for k, lay in enumerate(lays) if _manual_dim(lay) is not None]
    out = list(cast)   # replicated over the fsdp axes: used as they are
    for k, lay in enumerate(lays):
      if lay.fsdp and k not in moving:
        out[k] = jax.reshard(cast[k], _gathered_spec(lay, reduced[k]))

    def finish(k, w):
      return _as(w, _gathered_spec(lays[k], reduced[k]))
    return _Crossing(treedef, out, [
        _Group(self, "gather", members, [cast[k] for k in members],
               [lays[k] for k in members], False, finish)
        for members in _by_axes(moving, lays)])

  def scatter_starts(self, grads):
    leaves, treedef = jax.tree.flatten(grads)
    lays = self._layouts()
    dtypes = self.dtypes or [None] * len(leaves)
    cast = [self.precision.for_reduce(g) if lay.fsdp else g
            for g, lay in zip(leaves, lays, strict=True)]
    moving = [k for k, lay in enumerate(lays)
              if _manual_dim(lay) is not None and _unreduced(cast[k]) == lay.fsdp]
    out = [None if k in moving else
           Precision.back_to(jax.reshard(cast[k], lays[k].spec), dtypes[k])
           for k in range(len(leaves))]

    def finish(k, g):
      return Precision.back_to(_as(g, lays[k].spec), dtypes[k])
    return _Crossing(treedef, out, [
        _Group(self, "scatter", members, [cast[k] for k in members],
               [lays[k] for k in members], self.bucket, finish)
        for members in _by_axes(moving, lays)])


class _Group:
  """The leaves (of one set of fsdp axes) one pair of shard_maps moves: the
  first starts them (`ShardMapTransfer`'s starts, on the local blocks), the
  second finishes them; the futures cross between as sharded arrays."""

  def __init__(self, transfer, kind, members, values, lays, bucket, finish):
    self.members, self.lays, self.finish_one = members, lays, finish
    fsdp = lays[0].fsdp
    self.manual = set(fsdp)
    axis = spec_names(lays[0].spec[_manual_dim(lays[0])])
    self.inner = ShardMapTransfer(axis if len(axis) > 1 else axis[0],
                                  [_manual_dim(lay) for lay in lays],
                                  bucket=bucket)
    self.kind = kind
    self.pending = None   # the start's _Pending (its structure and plan)
    self.flight = P(axis if len(axis) > 1 else axis[0])

    def start(*local):
      local = list(local)
      pend = (self.inner.gather_starts(local) if kind == "gather"
              else self.inner.scatter_starts(local))
      self.pending = pend
      return pend.leaves, pend.started

    if kind == "gather":
      in_specs = tuple(_manual_spec(lay) for lay in lays)
    else:
      in_specs = tuple(P(*[None] * v.ndim, unreduced=set(fsdp)) for v in values)
    self.in_flight = jax.shard_map(
        start, in_specs=in_specs, out_specs=self.flight,
        axis_names=self.manual, check_vma=False)(*values)

  def finish(self):
    pend, lays = self.pending, self.lays

    def done(leaves, started):
      return tuple(_Pending(pend, leaves, started).finish_flat())

    if self.kind == "gather":
      out_specs = tuple(P() for _ in lays)
    else:
      out_specs = tuple(_manual_spec(lay) for lay in lays)
    outs = jax.shard_map(done, in_specs=self.flight, out_specs=out_specs,
                         axis_names=self.manual,
                         check_vma=False)(*self.in_flight)
    return [self.finish_one(k, v) for k, v in zip(self.members, outs,
                                                    strict=True)]


class _Pending:
  """A start's `transfer._Pending` rebuilt on the futures that crossed."""

  def __init__(self, like, leaves, started):
    self.like, self.leaves, self.started = like, leaves, started

  def finish_flat(self):
    like = self.like
    rebuilt = type(like)(like.treedef, self.leaves, like.buckets, self.started,
                         like.unpack, like.post, like.sharded)
    return jax.tree.leaves(rebuilt.finish())


class _Crossing:
  """One step's moves of one kind: leaves moved at once (by reshard, or
  replicated), and the groups in flight; `finish()` the whole tree."""

  def __init__(self, treedef, out, groups):
    self.treedef, self.out, self.groups = treedef, out, groups

  def finish(self):
    out = list(self.out)
    for g in self.groups:
      for k, v in zip(g.members, g.finish(), strict=True):
        out[k] = v
    return jax.tree.unflatten(self.treedef, out)


def _as(v, spec):
  """`v` typed with `spec` (a `jax.reshard` where its type differs; none
  moves data here: the value is already laid out so)."""
  have = getattr(getattr(jax.typeof(v), "sharding", None), "spec", None)
  return v if have == spec else jax.reshard(v, spec)


def _by_axes(members, lays):
  groups: dict = {}
  for k in members:
    groups.setdefault(spec_names(lays[k].spec[_manual_dim(lays[k])]), []).append(k)
  return list(groups.values())


def _gathered_spec(lay, red):
  return P(*lay.gathered, reduced=set(red)) if red else lay.gathered


def _manual_spec(lay):
  """`lay.spec` as the shard_map's in/out spec (fsdp axes only)."""
  return P(*[e if spec_names(e) else None for e in lay.spec])


def _manual_dim(lay):
  """The one dimension sharded over the fsdp axes, where its entry names
  them alone and no other dimension names a mesh axis; else None (moved by
  `jax.reshard`)."""
  dims = [k for k, e in enumerate(lay.spec) if spec_names(e)]
  if len(dims) != 1 or not lay.fsdp:
    return None
  return dims[0] if set(spec_names(lay.spec[dims[0]])) == set(lay.fsdp) else None


def _unreduced(g) -> frozenset:
  spec = getattr(getattr(jax.typeof(g), "sharding", None), "spec", None)
  return frozenset(getattr(spec, "unreduced", ()) or ())


def _is_axes(v) -> bool:
  return isinstance(v, (set, frozenset))
