"""What an fsdp transfer offers: `Transfer`, and `TwoStageTransfer` for HSDP.

The engine (engine.py), the stack's ends (stack_ends.py) and `fsdp_scan`
(scan.py) move weights only through these methods, whichever transfer
`choose_transfer` picked: `ShardMapTransfer` (futures inside `shard_map`),
`ReshardTransfer` (`jax.reshard` on an explicit mesh),
`FutureReshardTransfer` (futures in `shard_map`s around the explicit
mesh's compute, explicit_futures.py) and `PairTransfer` (a transfer of
`(weights, xs_i)` pairs, layer_inputs.py). A transfer whose moves are
futures also offers their starts (`FutureTransfer`: `futures_step` and the
layer-0 split, use_order.py, start them inside their own ordered blocks).

Invariant: no module calls a private method of another module's transfer;
the four classes satisfy these protocols. Pinned by
tests/patterns/fsdp/transfer_protocol_test.py.

>>> from jax_overlap._src.patterns.fsdp.transfer import ShardMapTransfer
>>> t = ShardMapTransfer("x", [0, None])
>>> isinstance(t, Transfer), isinstance(t, TwoStageTransfer), t.stages
(True, True, 1)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class Transfer(Protocol):
  """Moves one layer's weights: gathers of the shards, reduce-scatters of
  the gradients.

  stages: 1, or 2 where each gradient is also all-reduced over replicas
    after its reduce-scatter (HSDP inside shard_map: `TwoStageTransfer`).
  in_shard_map: whether the moves are futures inside `shard_map` (then
    plan.py may split layer 0 by use order).
  """

  stages: int
  in_shard_map: bool

  def gather_now(self, shards) -> Any:
    """The gathered weights of `shards`, at once."""

  def scatter_now(self, grads) -> Any:
    """The gradient shards of `grads` (full gradients), at once."""

  def step(self, compute: Callable[[], Any], gather=None,
           scatter=None) -> tuple[Any, Any, Any]:
    """`(compute(), gathered, scattered)`: the moves of `gather` and
    `scatter` in flight while `compute()` runs, in one ordered step."""


@runtime_checkable
class TwoStageTransfer(Transfer, Protocol):
  """HSDP's transfer (`stages == 2`): a gradient shard is all-reduced over
  the replicas a step after its reduce-scatter."""

  def reduce_now(self, scattered) -> Any:
    """The all-reduce over the replicas of `scattered`, at once."""

  def step2(self, compute: Callable[[], Any], gather=None, scatter=None,
            reduce=None) -> tuple[Any, Any, Any, Any]:
    """`(compute(), gathered, scattered, reduced)`: `step`, with `reduce`
    (shards reduce-scattered a step before) all-reduced meanwhile."""


@runtime_checkable
class FutureTransfer(Transfer, Protocol):
  """A transfer whose moves are futures: their starts, each returning what
  `transfer.finish_moves` waits for."""

  def gather_starts(self, shards) -> Any:
    """The gathers of `shards` started."""

  def scatter_starts(self, grads) -> Any:
    """The reduce-scatters of `grads` started."""
