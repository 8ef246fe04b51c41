"""A DualPipeV F&B tick in lockstep: its forward and backward slots on their
own sides of optimization barriers, so that neither part's compute waits
for the other's collectives (an MoE stage's all-to-alls). Pinned by
tests/patterns/pipeline/dualpipev_moe_test.py (values) and
tests/aot/dualpipev_moe_compiled_test.py (the windows)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jax_overlap._src.ordering.barrier_op import barrier
from jax_overlap._src.ordering.interleave import interleaved


#: The buffers a backward action only reads (work.py writes them in forward
#: actions): a Pair's backward reads them as its tick starts.
_READ_ONLY = ("inputs", "dys", "res")


def fenced(state):
  """`state` with the buffers a Pair's backward reads passed through one
  optimization barrier: the forward slot writes into the barrier's outputs
  and the backward slot reads the inputs (`beside`), so XLA cannot fuse a
  backward's row read with the forward's in-place write of the same buffer
  (a multi-output fusion that made the v5e's backward wait for the
  forward's loss, hence for its all-to-alls:
  tests/aot/dualpipev_moe_compiled_test.py)."""
  keys = [k for k in _READ_ONLY if k in state]
  leaves, tree = jax.tree.flatten([state[k] for k in keys])
  out = dict(state)
  out.update(zip(keys, jax.tree.unflatten(tree, barrier(leaves))))
  return out


def zipped(run):
  """`run` (a Pair tick's slots) with its forward's and backward's
  equations zipped at their futures (ordering/interleave.py): each part's
  collectives in flight while the other part computes, one at a time (an
  MoE stage's all-to-alls; the v5e takes one in flight)."""
  return interleaved(run, ("pair_forward", "pair_backward"))


def scope(tick, name):
  """`jax.named_scope(name)` in a Pair tick (profiles and
  tests/aot/dualpipev_moe_compiled_test.py tell its two parts apart by it),
  nothing elsewhere."""
  return jax.named_scope(name) if tick.second else contextlib.nullcontext()


def beside(action, before, state, rest, kind):
  """`action` (a backward slot of a Pair tick) reading the rows of
  `before`, the state the tick started with, and accumulating into
  `state`, the forward slot's: the backward's inputs do not depend on the
  forward slot's writes (a Pair's two parts touch different rows), so the
  compiler may run either part's compute while the other's collectives are
  in flight. The values are those of reading `state` (the rows it reads are
  the same); the accumulators (gradients, dconsts) are added to in the same
  order. Pinned by tests/patterns/pipeline/dualpipev_moe_test.py."""
  read = dict(state)
  keys = [k for k in _READ_ONLY if k in before]
  # The backward's own copies of what it reads (one barrier): the H100's
  # sibling fusion merged a backward piece with the forward's residual add
  # through their shared operands, making the backward wait.
  leaves, tree = jax.tree.flatten(([before[k] for k in keys], tuple(rest)))
  at = [k for k, a in enumerate(leaves) if _barrierable(a)]
  for k, a in zip(at, barrier([leaves[k] for k in at])):
    leaves[k] = a
  rows, rest = jax.tree.unflatten(tree, leaves)
  read.update(zip(keys, rows))
  with jax.named_scope("pair_backward"):
    out, fwd, bwd = action((read,) + tuple(rest))
  out = dict(out)
  out.update({k: state[k] for k in _READ_ONLY if k in state})
  return out, fwd, bwd


def _barrierable(a) -> bool:
  """An array an optimization barrier takes (not a key, not a Python
  value)."""
  return isinstance(a, jax.Array) and not jnp.issubdtype(
      a.dtype, jax.dtypes.extended)
