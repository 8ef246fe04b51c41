"""A pattern called in an eager `shard_map`, run as one cached program.

Here, not in eager_shard_map.py: that module sits below `program_order`
(its primitives are eager-aware through it), and this wraps a pattern in a
`program_order` block.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jax_overlap._src.ordering.decorator import program_order


def run_as_one(fn: Callable[..., Any], *args) -> Any:
  """`fn(*args)` as one free `program_order` block around `jax.checkpoint`
  (nothing saved), for a pattern called in an eager shard_map.

  Invariant: the same values and gradients as `fn(*args)`; a second eager
  call compiles nothing for `fn` (the block's programs are cached, see
  `eager_shard_map.run_in_one_program`), and under `jax.grad` only `args` cross from the
  forward shard_map to the backward one. Why: jax compiles each primitive of
  an eager shard_map, and each value crossing its boundary, anew at every
  call. Pinned by tests/integration/real_clients_eager_test.py."""
  body = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
  return program_order(body, enforce=False)(*args)
