"""Meshes for tests: one place that builds them (tests/conftest.py's fixtures
and the files whose meshes differ per case)."""

from __future__ import annotations

import functools
import math

import jax


@functools.cache
def make(shape: tuple[int, ...], names: tuple[str, ...], *,
         explicit: bool = False) -> jax.sharding.Mesh:
  """A mesh over the first `prod(shape)` devices, every axis Auto (or Explicit)."""
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  n = math.prod(shape)
  return jax.make_mesh(shape, names, devices=jax.devices()[:n],
                       axis_types=(kind,) * len(shape))
