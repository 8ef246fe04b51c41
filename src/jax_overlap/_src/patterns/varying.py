"""Casting an array inside `shard_map` to vary over more mesh axes.

A pattern's buffers, the values a user function closes over and the
cotangents of a `custom_vjp` must often have a varying type (`vma`) they
were not made with; which axes to add is each caller's choice (every axis
the arrays it holds vary over, or the axes every output varies over), the
cast is this module's. Reading an array's axes differs across jax versions
and lives in `_compat.varying_axes`.
"""

from __future__ import annotations

from typing import Iterable

import jax

from jax_overlap._src import _compat


def varying(a) -> frozenset:
  """The mesh axes `a` varies over; empty where they are not tracked."""
  return _compat.varying_axes(a) or frozenset()


def vary_over(a, axes: Iterable):
  """`a`, cast to vary over those of `axes` it does not vary over already,
  in the order given; `a` itself where it lacks none, or where this trace
  does not track varying axes (`check_vma=False`, where the cast is the
  identity anyway). jax refuses a cast to an axis `a` varies over already,
  so only the missing ones are cast to.

  Example (inside `shard_map` over a mesh axis "x", `w` replicated):

    w = vary_over(w, ("x",))   # now typed as varying over "x"
  """
  have = _compat.varying_axes(a)
  if have is None:
    return a
  missing = tuple(ax for ax in axes if ax not in have)
  return jax.lax.pcast(a, missing, to="varying") if missing else a
