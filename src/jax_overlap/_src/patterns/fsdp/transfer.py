"""How `fsdp_scan` moves weights: gathers and reduce-scatters, overlapped.

Two contexts, one interface (transfer_protocol.py). `step(compute, gather=..., scatter=...)` runs
`compute()` while the gathers of `gather` (sharded leaves) and the
reduce-scatters of `scatter` (full gradients) are in flight, fenced with
`program_order` so that XLA keeps the communication inside the step, and
returns `(compute(), gathered, scattered)`.

* Inside `jax.shard_map` over the axis: our futures. The step is an ordered
  block `start…; compute (a free block); done…`, so the collectives are in
  flight across exactly the written compute.
* On an explicit-sharding mesh, outside shard_map: `jax.reshard` takes the
  fsdp axes out of each leaf's spec (every other axis stays: tensor
  parallelism runs inside the layer) and marks the gathered value
  `P(reduced=...)` over the fsdp and batch axes, so its cotangent stays
  unreduced and resharding the gradient back to the leaf's own spec
  reduce-scatters it. jax allows a reduced value only where a matmul
  contracts over exactly those axes (a weight: yes; a norm's scale times
  activations sharded over the batch: no), so a leaf the layer uses
  otherwise is gathered to plain replicated (its gradient is then
  all-reduced, not reduce-scattered). A leaf replicated over the fsdp axes
  is used as it is. These are not futures; the step is an ordered block
  holding one free block with the reshards and the compute, which XLA's
  scheduler may overlap; on GPU the step's inputs and outputs are tied
  (xla/gpu_ties.py) so that it keeps each step's collectives in the step.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax.sharding import PartitionSpec as P

from jax_overlap._src.collectives.api import (all_gather_start,
                                              psum_scatter_start, psum_start)
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src import _compat
from jax_overlap._src.collectives.future import Future
from jax_overlap._src.xla import gpu_ties
from jax_overlap._src.patterns.fsdp import all_to_all_slot
from jax_overlap._src.patterns.fsdp.buckets import Bucket, plan_buckets
from jax_overlap._src.patterns.fsdp.precision import Precision
from jax_overlap._src.patterns.fsdp.transfer_protocol import FutureTransfer
from jax_overlap._src.patterns.leaf_scope import moving, moving_leaf
from jax_overlap._src.patterns.varying import vary_over


#: A step's outputs are fenced together after its last operation: every
#: collective of the step is finished before anything reads any of its
#: results. Why: unfenced, a reduce-scatter's done (read only by the gradient
#: stack) sinks below the next steps and keeps a whole layer's gradient live
#: (docs/fsdp.md has the temp bytes with and without). The inputs are not
#: fenced: tying a gather's start to the step's other inputs cost TPU v5e a
#: window. Pinned by real_compilers_test.py::
#: test_fsdp_scan_memory_knobs_temp_bytes_on_h100.
_DONE_BY_THE_END = (False, True)


def futures_step(transfer: FutureTransfer, compute: Callable[[], Any],
                 gather=None, scatter=None, finish=None, own=None):
  """One step of futures: `transfer`'s starts of `gather` and `scatter`,
  `compute()` in a free block, the dones, in one ordered block (its outputs
  fenced together, `_DONE_BY_THE_END`). `finish` waits for what a start
  returned (default `finish_moves`); `own` maps the scattered gradients to their
  leaves' own dtypes. Returns `(compute(), gathered, scattered)`."""
  finish = finish or finish_moves
  @program_order(enforce=True, strict_in_out=_DONE_BY_THE_END)
  def ordered():
    gathering = None if gather is None else transfer.gather_starts(gather)
    scattering = None if scatter is None else transfer.scatter_starts(scatter)
    out = program_order(enforce=False)(compute)()
    gathered, scattered = finish(gathering), finish(scattering)
    return out, gathered, scattered if own is None else own(scattered)
  return ordered()


class ShardMapTransfer:
  """Futures over a mesh axis bound by the enclosing `shard_map`.

  dims: one entry per leaf of one layer's params (flattened): the dimension
    of that per-layer leaf that is sharded over `axis`, or None for a leaf
    kept replicated: used as is, never gathered nor scattered (its gradient
    is reduced by autodiff itself, as for any replicated shard_map input).
  precision: the dtypes gathers and reduce-scatters carry (precision.py).
  dtypes: each leaf's own dtype (flattened), the one its gradient returns in.
  """

  in_shard_map = True   # the moves are futures; plan.py splits layer 0
  # the permute forms, beside a layer's all-to-alls (all_to_all_slot.py)
  permutes = False

  def __init__(self, axis, dims, precision=None, dtypes=None, bucket=False,
               replica=None):
    self.axis = axis
    # HSDP: the axis (or axes) the params are replicated over; each layer's
    # gradient is reduce-scattered over `axis`, then all-reduced over it.
    self.replica = replica
    self.stages = 1 if replica is None else 2
    self.dims = list(dims)
    self.precision = precision or Precision()
    self.dtypes = list(dtypes) if dtypes is not None else [None] * len(self.dims)
    self.bucket = bucket   # buckets.py: one collective per layer and dtype

  def _per_leaf(self, fn, tree, keep=lambda a: a):
    """`fn(path, leaf, dim)` on each leaf with a dim; a None dim (a
    replicated leaf) gets `keep(leaf)`."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(treedef, [
        keep(a) if d is None else fn(path, a, d)
        for (path, a), d in zip(leaves, self.dims, strict=True)])

  def _plan(self, leaves):
    """`(buckets, lone)`: the buckets of these (local, already cast) leaves
    and the positions that travel one by one. Over an axis of one device
    nothing travels (`moves`)."""
    if not self.moves():
      return [], []
    if not self.bucket:
      return [], [k for k, d in enumerate(self.dims) if d is not None]
    return plan_buckets(self.dims, [jnp.shape(a) for a in leaves],
                        [a.dtype for a in leaves],
                        [_compat.varying_axes(a) for a in leaves])

  def gather_starts(self, shards):
    with all_to_all_slot.forms(self.permutes):
      return self._gather_starts(shards)

  def _gather_starts(self, shards):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shards)
    cast = [self.precision.for_gather(a) for _, a in leaves]
    buckets, lone = self._plan(cast)
    out = list(cast)   # replicated leaves: used as they are
    for k in lone:
      with moving_leaf(leaves[k][0]):  # the report names the leaf (leaf_scope.py)
        out[k] = all_gather_start(cast[k], self.axis, axis=self.dims[k],
                                  tiled=True)
    started = []
    for b in buckets:
      with moving(_bucket_name(leaves, b)):
        started.append(all_gather_start(
            b.pack_shards([cast[k] for k in b.members]), self.axis, tiled=True))
    return _Pending(treedef, out, buckets, started,
                    lambda b, flat: b.unpack_gathered(
                        flat.reshape(self._size(), -1)),
                    post=self._varying_over_replicas,
                    sharded=[d is not None for d in self.dims])

  def _varying_over_replicas(self, w):
    """HSDP: a gathered weight typed as varying over the replica axes, so
    that its gradient is left unreduced over them by autodiff and the one
    all-reduce is ours (after the reduce-scatter); else jax would sum the
    gradient of a replica-invariant input over them itself, and ours would
    double it."""
    if self.replica is None:
      return w
    replicas = self.replica if isinstance(self.replica, tuple) \
        else (self.replica,)
    return vary_over(w, replicas)

  def _reduce_starts(self, shards):
    """HSDP: all-reduce each reduce-scattered gradient shard over the
    replica axes."""
    def start(path, s, d):
      with moving_leaf(path), all_to_all_slot.forms(self.permutes):
        return psum_start(s, self.replica)
    return self._per_leaf(start, shards)

  def scatter_starts(self, grads):
    with all_to_all_slot.forms(self.permutes):
      return self._scatter_starts(grads)

  def _scatter_starts(self, grads):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    grads_ = [a for _, a in leaves]
    # (Planned on the gradients' dtypes, which are the gathered weights'.)
    buckets, lone = self._plan(grads_)
    buckets = [_with_local_shapes(b, grads_, self._size()) for b in buckets]
    out = list(grads_) if self.moves() else [   # (one device: cast as sent)
        a if d is None else self.precision.for_reduce(a)
        for a, d in zip(grads_, self.dims, strict=True)]
    for k in lone:
      with moving_leaf(leaves[k][0]):
        out[k] = psum_scatter_start(self.precision.for_reduce(grads_[k]),
                                    self.axis, scatter_dimension=self.dims[k],
                                    tiled=True)
    started = []
    for b in buckets:
      rows = b.pack_grads([self.precision.for_reduce(grads_[k])
                           for k in b.members], self._size())
      with moving(_bucket_name(leaves, b)):
        started.append(psum_scatter_start(rows.reshape(-1), self.axis,
                                          tiled=True))
    return _Pending(treedef, out, buckets, started,
                    lambda b, flat: b.unpack_scattered(flat))

  def _size(self) -> int:
    axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
    return math.prod(lax.axis_size(a) for a in axes)

  def moves(self) -> bool:
    """Whether a gather or reduce-scatter moves anything: over an axis of
    one device each is the identity, and the shards are used as they are
    (cast as the gather would cast them), no collective, no bucket.

    Why: XLA removes such a collective, but not what we build around it:
    on a TPU v5e the buckets' packing and unpacking and the reduce-scatter's
    all-to-all form (collectives/tpu_forms.py) stayed, a reduce over the
    one-device axis in half-empty tiles among them, and made the 1-device
    bf16 train step 2.7x a plain scan's (docs/fsdp.md, "On a TPU v5e").
    Pinned by tests/patterns/fsdp/fsdp_one_device_test.py."""
    return self._size() > 1

  def own_dtypes(self, grads):
    if grads is None:
      return None
    leaves, treedef = jax.tree.flatten(grads)
    return jax.tree.unflatten(treedef, [
        Precision.back_to(g, d) for g, d in zip(leaves, self.dtypes,
                                                 strict=True)])

  def only(self, members):
    """A copy of this transfer that moves the leaves at positions `members`
    only (the others are used as they are, as replicated leaves are)."""
    part = copy.copy(self)
    part.dims = [d if k in members else None for k, d in enumerate(self.dims)]
    return part

  def for_layer(self, layer: Callable, x, shards):
    """This transfer, fitted to `layer`: as it is, but on a v5e whose
    layer starts all-to-all futures, a copy that moves by permutes
    (all_to_all_slot.py)."""
    if not (self.moves() and all_to_all_slot.wanted()):
      return self
    if not all_to_all_slot.holds_all_to_alls(
        lambda x, s: layer(x, self.gather_now(s)), x, shards):
      return self
    fitted = copy.copy(self)
    fitted.permutes = True
    return fitted

  def gather_now(self, shards):
    return finish_moves(self.gather_starts(shards))

  def scatter_now(self, grads):
    scattered = finish_moves(self.scatter_starts(grads))
    if self.replica is not None:
      return self.reduce_now(scattered)
    return self.own_dtypes(scattered)

  def reduce_now(self, scattered):
    """HSDP's second stage at once: the all-reduce over the replicas."""
    return self.own_dtypes(finish_moves(self._reduce_starts(scattered)))

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    return futures_step(self, compute, gather, scatter,
                        own=self.own_dtypes)

  def step2(self, compute: Callable[[], Any], gather=None, scatter=None,
            reduce=None):
    """HSDP's step: `reduce` (shards reduce-scattered a step before) is
    all-reduced over the replicas while `scatter` is reduce-scattered and
    `compute` runs. Returns `(compute(), gathered, scattered, reduced)`;
    `scattered` is the next step's `reduce`, `reduced` final gradients."""
    @program_order(enforce=True, strict_in_out=_DONE_BY_THE_END)
    def ordered():
      gathering = None if gather is None else self.gather_starts(gather)
      scattering = None if scatter is None else self.scatter_starts(scatter)
      reducing = None if reduce is None else self._reduce_starts(reduce)
      out = program_order(enforce=False)(compute)()
      return (out, finish_moves(gathering), finish_moves(scattering),
              self.own_dtypes(finish_moves(reducing)))
    return ordered()


class LeafLayout:
  """How one per-layer leaf lives and is gathered on an explicit mesh.

  spec: the leaf's own PartitionSpec (where its gradient goes back to).
  gathered: `spec` with the fsdp axes taken out of every entry and every
    other axis kept, so tensor parallelism stays inside the layer.
  fsdp: the fsdp axes the leaf is sharded over; none: the leaf is
    replicated over them and used as it is (never resharded).
  """

  __slots__ = ("spec", "gathered", "fsdp")

  def __init__(self, spec: P, axes):
    self.spec = spec
    self.gathered = P(*[_without(e, axes) for e in spec])
    self.fsdp = frozenset(a for e in spec for a in spec_names(e) if a in axes)

  def __repr__(self):
    return f"LeafLayout({self.spec} -> {self.gathered})"


def spec_names(entry) -> tuple:
  """The mesh axis names of one entry of a `PartitionSpec` (None: none)."""
  return () if entry is None else tuple(entry) if isinstance(entry, tuple) \
      else (entry,)


def _without(entry, axes):
  kept = tuple(a for a in spec_names(entry) if a not in axes)
  return None if not kept else kept[0] if len(kept) == 1 else kept


class ReshardTransfer:
  """`jax.reshard` on an explicit-sharding mesh.

  axes: the fsdp mesh axes.
  layouts: a pytree like one layer's params, a `LeafLayout` per leaf.
  reduced: a pytree like it: the axes each gathered leaf is
    `P(reduced=...)` over (its cotangent is then unreduced over them, and
    resharding it back reduce-scatters); empty: gathered to plain
    replicated. See `reduced_axes`.
  """

  stages = 1   # HSDP's all-reduce over replicas is the partitioner's here
  in_shard_map = False

  def __init__(self, axes, layouts, precision=None, dtypes=None):
    self.axes = tuple(axes)
    self.layouts = layouts
    self.precision = precision or Precision()
    # each leaf's own dtype (flattened), the one its gradient returns in
    self.dtypes = list(dtypes) if dtypes is not None else None
    self.reduced = self._each(lambda lay: lay.fsdp)

  def for_layer(self, layer: Callable, x, shards):
    """A copy of this transfer whose `reduced` axes are those `layer(x, w)`
    and its gradient accept (`reduced_axes`); this one is left as it is."""
    fitted = copy.copy(self)
    fitted.reduced = self.reduced_axes(layer, x, shards)
    return fitted

  def _each(self, fn):
    return jax.tree.map(fn, self.layouts,
                        is_leaf=lambda v: isinstance(v, LeafLayout))

  def gather_now(self, shards):
    return self._gather(shards, self.reduced)

  def _gather(self, shards, reduced):
    def gather(s, lay, red):
      s = self.precision.for_gather(s)
      if not lay.fsdp:
        return s   # replicated over the fsdp axes: used as it is
      spec = P(*lay.gathered, reduced=set(red)) if red else lay.gathered
      return jax.reshard(s, spec)
    return jax.tree.map(gather, shards, self.layouts, reduced)

  def reduced_axes(self, layer: Callable, x, shards):
    """The `reduced` axes of each leaf that `layer(x, w)` and its gradient
    with respect to `w` accept.

    jax requires a matmul's unreduced cotangent to be unreduced over exactly
    the axes its contracted dimension is sharded over: for a weight, the
    axes of the batch (those of `x`'s shardings) and the fsdp axes. A leaf
    that meets `x` elementwise (a norm's scale) accepts no reduced axis and
    is gathered to replicated (its gradient is all-reduced instead of
    reduce-scattered). Tried all leaves at once, else one leaf at a time.
    """
    batch = frozenset(a for leaf in jax.tree.leaves(x)
                      for e in getattr(getattr(_type(leaf), "sharding",
                                               None), "spec", ()) or ()
                      for a in spec_names(e))

    def choices(lay):
      if not lay.fsdp:
        return [frozenset()]
      kept = {a for e in lay.gathered for a in spec_names(e)}
      out = []
      for c in ((lay.fsdp | batch) - kept, lay.fsdp - kept, frozenset()):
        if c not in out:
          out.append(c)
      return out

    def accepts(reduced) -> bool:
      def grad(x, s):
        def total(s):
          y = layer(x, self._gather(s, reduced))
          return sum(jax.numpy.sum(leaf).astype("float32")
                     for leaf in jax.tree.leaves(y)
                     if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating))
        return jax.grad(total)(s)
      try:
        jax.eval_shape(grad, x, shards)
        return True
      except Exception:  # noqa: BLE001 - any refusal means "not this way"
        return False

    options, tree = jax.tree.flatten(
        self._each(choices), is_leaf=lambda v: isinstance(v, list))
    first = jax.tree.unflatten(tree, [o[0] for o in options])
    if accepts(first):
      return first
    none = [frozenset()] * len(options)
    alone = []
    for k, opts in enumerate(options):
      alone.append(next(
          (c for c in opts[:-1]
           if accepts(jax.tree.unflatten(tree, none[:k] + [c] + none[k + 1:]))),
          frozenset()))
    mixed = jax.tree.unflatten(tree, alone)
    return mixed if accepts(mixed) else jax.tree.unflatten(tree, none)

  def scatter_now(self, grads):
    leaves, treedef = jax.tree.flatten(grads)
    layouts = jax.tree.leaves(self.layouts,
                              is_leaf=lambda v: isinstance(v, LeafLayout))
    dtypes = self.dtypes or [None] * len(leaves)

    def scatter(g, lay, dtype):
      g = self.precision.for_reduce(g) if lay.fsdp else g
      return Precision.back_to(jax.reshard(g, lay.spec), dtype)
    return jax.tree.unflatten(treedef, [
        scatter(*a) for a in zip(leaves, layouts, dtypes, strict=True)])

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    @program_order(enforce=True)
    def ordered():
      @program_order(enforce=False)
      def together():
        # The values `compute` reads, as arguments: they are tied with the
        # shards and gradients to move, and its outputs with the moved ones
        # (xla/gpu_ties.py: on GPU that keeps each step's collectives in
        # it, where XLA would combine them all outside the loop).
        run, inputs = jax.closure_convert(compute)
        shards, grads, inputs = gpu_ties.tie((gather, scatter, inputs))
        gathered = None if shards is None else self.gather_now(shards)
        scattered = None if grads is None else self.scatter_now(grads)
        return gpu_ties.tie((run(*inputs), gathered, scattered))
      return together()
    return ordered()


class _Pending:
  """One layer's collectives in flight: a future per lone leaf, one per
  bucket; `finish()` waits for them all and unpacks the buckets."""

  def __init__(self, treedef, leaves, buckets, started, unpack, post=None,
               sharded=None):
    self.treedef, self.leaves = treedef, leaves
    self.buckets, self.started, self.unpack = buckets, started, unpack
    self.post, self.sharded = post, sharded   # post: on each sharded leaf

  def finish(self):
    out = [f.done() if isinstance(f, Future) else f for f in self.leaves]
    for b, f in zip(self.buckets, self.started):
      for k, leaf in zip(b.members, self.unpack(b, f.done())):
        out[k] = leaf
    if self.post is not None:
      out = [self.post(a) if moved else a
             for a, moved in zip(out, self.sharded, strict=True)]
    return jax.tree.unflatten(self.treedef, out)


def _type(v):
  # x may be types already (the output types of fsdp_scan's `before`)
  return v if isinstance(v, jax_core.AbstractValue) else jax.typeof(v)


def _bucket_name(leaves, bucket) -> str:
  return "+".join(jax.tree_util.keystr(leaves[k][0]) for k in bucket.members)


def _with_local_shapes(bucket, grads, size):
  """`bucket` planned on full gradients, with the shards' shapes."""
  shapes = []
  for k, d in zip(bucket.members, bucket.dims):
    shape = list(jnp.shape(grads[k]))
    shape[d] //= size
    shapes.append(tuple(shape))
  return Bucket(bucket.members, bucket.dims, shapes)


def finish_moves(futures):
  """What a transfer's starts returned (`gather_starts`, `scatter_starts`),
  finished: the moved values; None for None."""
  # Futures are found by type: a container leaf such as a flax.nnx Variable
  # forwards attribute access to its value, so `hasattr(v, "done")` would
  # finish the Future inside it and drop the container.
  if futures is None:
    return None
  if isinstance(futures, _Pending):
    return futures.finish()
  return jax.tree.map(lambda f: f.done() if isinstance(f, Future) else f,
                      futures, is_leaf=lambda f: isinstance(f, Future))
