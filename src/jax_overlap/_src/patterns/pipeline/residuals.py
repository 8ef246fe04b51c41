"""A stage's residuals, kept from its forward action to its backward ones.

By default (`recompute=False`) the forward action takes `jax.vjp` of the
stage and keeps the residuals the backward needs; the backward actions
(B, or zero bubble's I and W) apply that vjp without running the stage's
forward again. The function `jax.vjp` returns is a pytree whose leaves are
the residual arrays: its structure is found once by tracing the stage on
the executor's types (`layout`), the leaves that are the stage's own inputs
(its parameters, the closed-over values, the kept stage input) are read
back from where they already live, and only the others take rows of the
executor's buffers: one row a (microbatch, chunk) in flight, the rows the
kept stage inputs use (buffers.py), so the memory stays flat in m. A
`jax.checkpoint` policy keeps what the policy saves and recomputes the rest
in the backward; `recompute=True` keeps nothing (the backward runs the
stage's forward again from the kept input). Pinned by
tests/patterns/pipeline/pipeline_residuals_test.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


def check_recompute(recompute) -> None:
  """A clear error for a `recompute` that is neither a bool nor a policy."""
  if isinstance(recompute, bool) or callable(recompute):
    return
  raise TypeError(
      f"pipeline_loss(recompute={recompute!r}): expected False (keep the "
      "stage's residuals, the default), True (recompute the stage's forward "
      "in its backward) or a jax.checkpoint policy such as "
      "jax.checkpoint_policies.dots_saveable.")


def stage_vjp(fn: Callable, recompute, chunk, consts, x):
  """`(y, vjp)` of `fn(chunk, consts, x)`; the stage under
  `jax.checkpoint(policy=recompute)` where `recompute` is a policy."""
  if callable(recompute):
    fn = jax.checkpoint(fn, policy=recompute)
  return jax.vjp(fn, chunk, consts, x)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The stage vjp's structure: `tree` its treedef; `source[k]` for its
  k-th leaf the index of the stage input leaf (of `(chunk, consts, x)`) it
  is, or None where it is kept in the buffers; `kept` the kept leaves'
  shapes and dtypes."""
  tree: Any
  source: tuple
  kept: tuple
  recompute: Any

  def split(self, vjp, inputs) -> list:
    """The leaves of `vjp` to keep (the forward action's)."""
    leaves, _ = jax.tree.flatten(vjp)
    source = _sources(leaves, inputs)
    if source != self.source:
      raise AssertionError(
          "pipeline_loss: the stage's vjp has another structure in the "
          "forward action than when traced once; pass recompute=True.")
    return [a for a, k in zip(leaves, source) if k is None]

  def join(self, kept, inputs):
    """The stage's vjp from the kept leaves and the stage inputs (the
    backward action's)."""
    given, kept = jax.tree.leaves(inputs), iter(kept)
    leaves = [next(kept) if k is None else given[k] for k in self.source]
    return jax.tree.unflatten(self.tree, leaves)


def _sources(leaves, inputs) -> tuple:
  where = {id(a): k for k, a in enumerate(jax.tree.leaves(inputs))}
  return tuple(where.get(id(a)) for a in leaves)


def layout(fn: Callable, recompute, chunk, consts, x, i) -> Layout:
  """`fn(chunk, consts, x, i)`'s vjp structure, traced once on these
  (abstract) values."""
  found = {}

  def probe(chunk, consts, x, i):
    inputs = (chunk, consts, x)
    _, vjp = stage_vjp(lambda w, c, x_: fn(w, c, x_, i), recompute, *inputs)
    leaves, tree = jax.tree.flatten(vjp)
    found["tree"], found["source"] = tree, _sources(leaves, inputs)
    return [a for a, k in zip(leaves, found["source"]) if k is None]

  kept = jax.eval_shape(probe, chunk, consts, x, i)
  return Layout(found["tree"], found["source"], tuple(kept), recompute)
