"""How `fsdp_scan` moves weights: gathers and reduce-scatters, overlapped.

Two contexts, one interface. `step(compute, gather=..., scatter=...)` runs
`compute()` while the gathers of `gather` (sharded leaves) and the
reduce-scatters of `scatter` (full gradients) are in flight, fenced with
`program_order` so that XLA keeps the communication inside the step, and
returns `(compute(), gathered, scattered)`.

* Inside `jax.shard_map` over the axis: our futures. The step is an ordered
  block `start…; compute (a free block); done…`, so the collectives are in
  flight across exactly the written compute.
* On an explicit-sharding mesh, outside shard_map: `jax.reshard` to
  `P(reduced={axis})` gathers (its cotangent stays unreduced) and resharding
  a gradient back to the leaf's own spec reduce-scatters. jax allows a
  reduced value only where it does not meet a value sharded over the same
  axis elementwise (a matmul weight: yes; a norm's scale times activations
  sharded over the batch: no), so a leaf the layer uses that way is gathered
  to replicated instead (its gradient is then all-reduced, not
  reduce-scattered). These are not futures; the step is an ordered block
  holding one free block with the reshards and the compute, which XLA's
  scheduler may overlap.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from jax_overlap import all_gather_start, program_order, psum_scatter_start
from jax_overlap._src.collectives.future import Future
from jax_overlap._src.patterns.leaf_scope import moving_leaf


class ShardMapTransfer:
  """Futures over a mesh axis bound by the enclosing `shard_map`.

  dims: one entry per leaf of one layer's params (flattened): the dimension
    of that per-layer leaf that is sharded over `axis`, or None for a leaf
    kept replicated: used as is, never gathered nor scattered (its gradient
    is reduced by autodiff itself, as for any replicated shard_map input).
  """

  def __init__(self, axis, dims):
    self.axis = axis
    self.dims = list(dims)

  def _per_leaf(self, fn, tree):
    """`fn(path, leaf, dim)` on each leaf with a dim; a None dim (a
    replicated leaf) leaves the leaf as it is."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(treedef, [
        a if d is None else fn(path, a, d)
        for (path, a), d in zip(leaves, self.dims, strict=True)])

  def _gather_starts(self, shards):
    def start(path, s, d):
      with moving_leaf(path):  # the report names the leaf (leaf_scope.py)
        return all_gather_start(s, self.axis, axis=d, tiled=True)
    return self._per_leaf(start, shards)

  def _scatter_starts(self, grads):
    def start(path, g, d):
      with moving_leaf(path):
        return psum_scatter_start(g, self.axis, scatter_dimension=d, tiled=True)
    return self._per_leaf(start, grads)

  def gather_now(self, shards):
    return _finish(self._gather_starts(shards))

  def scatter_now(self, grads):
    return _finish(self._scatter_starts(grads))

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    @program_order(enforce=True)
    def ordered():
      gathering = None if gather is None else self._gather_starts(gather)
      scattering = None if scatter is None else self._scatter_starts(scatter)
      out = program_order(enforce=False)(compute)()
      return out, _finish(gathering), _finish(scattering)
    return ordered()


class ReshardTransfer:
  """`jax.reshard` on an explicit-sharding mesh.

  specs: a pytree like one layer's params: each per-layer leaf's own
    PartitionSpec (where the gradients go back to).
  reduced: a pytree of bools like it: gather to `P(reduced={axis})` (else to
    replicated); see `reducible_leaves`.
  """

  def __init__(self, axis, specs, reduced=True):
    self.axis = axis
    self.specs = specs
    self.reduced = (jax.tree.map(lambda _: reduced, specs,
                                 is_leaf=lambda v: isinstance(v, P))
                    if isinstance(reduced, bool) else reduced)

  def gather_now(self, shards):
    def gather(s, reduced):
      spec = P(*[None] * s.ndim, reduced={self.axis}) if reduced else \
          P(*[None] * s.ndim)
      return jax.reshard(s, spec)
    return jax.tree.map(gather, shards, self.reduced)

  def reducible_leaves(self, layer: Callable, x, shards):
    """Which leaves `layer(x, w)` accepts gathered as reduced: all where it
    can, else those it accepts one at a time, else none."""
    def accepts(mask) -> bool:
      trial = ReshardTransfer(self.axis, self.specs, mask)
      try:
        jax.eval_shape(lambda x, s: layer(x, trial.gather_now(s)), x, shards)
        return True
      except Exception:  # noqa: BLE001 - any refusal means "not this way"
        return False
    every = jax.tree.map(lambda _: True, shards)
    if accepts(every):
      return every
    leaves, tree = jax.tree.flatten(shards)
    alone = [accepts(jax.tree.unflatten(tree, [j == k for j in range(len(leaves))]))
             for k in range(len(leaves))]
    mixed = jax.tree.unflatten(tree, alone)
    return mixed if accepts(mixed) else jax.tree.map(lambda _: False, shards)

  def scatter_now(self, grads):
    return jax.tree.map(jax.reshard, grads, self.specs)

  def step(self, compute: Callable[[], Any], gather=None, scatter=None):
    @program_order(enforce=True)
    def ordered():
      @program_order(enforce=False)
      def together():
        gathered = None if gather is None else self.gather_now(gather)
        scattered = None if scatter is None else self.scatter_now(scatter)
        return compute(), gathered, scattered
      return together()
    return ordered()


def _finish(futures):
  # Futures are found by type: a container leaf such as a flax.nnx Variable
  # forwards attribute access to its value, so `hasattr(v, "done")` would
  # finish the Future inside it and drop the container.
  if futures is None:
    return None
  return jax.tree.map(lambda f: f.done() if isinstance(f, Future) else f,
                      futures, is_leaf=lambda f: isinstance(f, Future))
