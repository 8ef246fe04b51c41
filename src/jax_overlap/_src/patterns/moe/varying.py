"""Mesh-axis variance (`vma`) of the arrays a pattern makes inside shard_map.

A buffer made with `jnp.zeros` varies over no mesh axis; filling it with
this device's tokens, or a `custom_vjp` cotangent of a varying primal,
must have the varying type, so buffers are cast to vary like the arrays
they hold.
"""

from __future__ import annotations

import jax

from jax_overlap._src.patterns.varying import vary_over, varying


def vary_like(a, *likes, axis=None):
  """`a`, cast to vary over every axis any of `likes` (and `axis`) varies
  over."""
  every = frozenset() if axis is None else frozenset({axis})
  for like in jax.tree.leaves(likes):
    every |= varying(like)
  return vary_over(a, sorted(every, key=str))
