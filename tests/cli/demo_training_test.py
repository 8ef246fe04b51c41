"""The demo's optimizer state starts where its training step returns it, so
the step compiles once (training.init_on_mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap._src.demo import training

optax = pytest.importorskip("optax")


def _traces_over_three_steps(optimizer, params, state) -> int:
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    updates, state = optimizer.update(params, state, params)
    return optax.apply_updates(params, updates), state
  for _ in range(3):
    params, state = step(params, state)
  return len(traces)


def test_the_optimizer_state_is_on_the_mesh_and_the_step_traces_once():
  mesh = training.mesh_of(8)
  params = {"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P(training.AXIS)))}
  optimizer = optax.adamw(1e-2, weight_decay=0.01)
  state = training.init_on_mesh(optimizer, params, mesh)
  for leaf in jax.tree.leaves(state):
    assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh, leaf
  assert _traces_over_three_steps(optimizer, params, state) == 1
  # optax's own init: its step count on one device, traced again at step 2
  assert _traces_over_three_steps(optimizer, params, optimizer.init(params)) == 2
