"""`fsdp_scan`'s memory knobs: `reshard_after_forward` (the last k layers
keep their gathered weights for the backward pass) and `prefetch` (gathers
started p layers ahead).

Each setting in both contexts: values and gradients against a plain
`lax.scan`, and how many gathers the program runs (each written gather
times the trips of the loops around it): 2n with every layer regathered,
n fewer... k fewer with k layers kept. Five layers, so that the schedule
has a loop between its special first and last steps. One compile a case
(CI's budget); the memory each setting costs is measured on the real H100
compiler (tests/aot/real_compilers_test.py), not on CPU, whose collectives
are synchronous. On older jax (0.10.2, 0.11.0) only OLDER_JAX_SUBSET runs
(CI's budget): both contexts of the settings that take the step-by-step
schedule, and the schedule itself.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax._src import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from fsdp_knobs_test import (AXIS, CONTEXTS, _close, _hsdp_mesh,
                             _mesh, _specs, mlp_layer)
from jax_overlap._src.collectives.primitives import collective_start_p
from jax_overlap._src.patterns.fsdp import plan as schedule

L, B, D, H = 5, 16, 16, 8
OLDER_JAX_SUBSET = [
    "test_values_gradients_and_gathers_run[keep-all-shard_map]",
    "test_values_gradients_and_gathers_run[keep-all-explicit]",
    "test_values_gradients_and_gathers_run[keep-2-prefetch-2-shard_map]",
    "test_values_gradients_and_gathers_run[keep-2-prefetch-2-explicit]",
    "test_every_layer_is_gathered_before_its_step",   # every case
]
pytestmark = pytest.mark.newest_jax(older_jax=OLDER_JAX_SUBSET)

SETTINGS = {   # name: (reshard_after_forward, prefetch, layers kept, unroll)
    # unroll=2 (the default): on an explicit mesh jax 0.10.2 cannot unroll
    # a scan saving the gathered weights (_compat.unroll_saving_reduced).
    "keep-all": (False, 1, L, 2),
    "keep-last": (1, 1, 1, 1),          # the default schedule, keeping one
    "keep-2-prefetch-2": (2, 2, 2, 1),  # unroll=1: a smaller compile
    "prefetch-3": (True, 3, 0, 1),
}


def _inputs():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
  params = {"w1": jax.random.normal(k1, (L, D, H)) * 0.3,
            "w2": jax.random.normal(k2, (L, H, D)) * 0.3}
  return jax.random.normal(k3, (B, D)), params


def _reference(x, params):
  y, _ = lax.scan(lambda x, w: (mlp_layer(x, w), None), x, params)
  return jnp.sum(y ** 2)


@functools.cache
def _want():
  return jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(*_inputs())


def executed_gathers(context, jaxpr) -> int:
  """Weight gathers the program runs: each written one times the lengths of
  the scans around it. Inside shard_map: all-gather starts (one a layer:
  both leaves in one bucket); on an explicit mesh: reshards that take the
  fsdp axis out of a spec, counted per layer (both leaves)."""
  def count(jaxpr, trips):
    total = 0
    for eqn in jaxpr.eqns:
      if context == "shard_map" and eqn.primitive is collective_start_p \
          and eqn.params["comm"].name == "all_gather":
        total += trips
      elif context == "explicit" and eqn.primitive.name == "reshard" \
          and f"@{AXIS}" in eqn.invars[0].aval.str_short() \
          and f"@{AXIS}" not in eqn.outvars[0].aval.str_short():
        total += trips
      inner = trips * eqn.params.get("length", 1) \
          if eqn.primitive.name == "scan" else trips
      for sub in jax_core.jaxprs_in_params(eqn.params):
        total += count(getattr(sub, "jaxpr", sub), inner)
    return total
  total = count(jaxpr.jaxpr, 1)
  return total if context == "shard_map" else total // 2


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_values_gradients_and_gathers_run(context, name):
  reshard, prefetch, kept, unroll = SETTINGS[name]
  x, params = _inputs()
  kw = dict(axis=AXIS, reshard_after_forward=reshard, prefetch=prefetch,
            unroll=unroll)
  if context == "shard_map":
    @jax.shard_map(mesh=_mesh(False), in_specs=(P(AXIS), _specs(params)),
                   out_specs=P())
    def loss(x, params):
      return lax.psum(jnp.sum(jo.fsdp_scan(mlp_layer, x, params, **kw) ** 2),
                      AXIS)
    args, ctx = (x, params), contextlib.nullcontext()
  else:
    mesh = _mesh(True)
    loss = lambda x, params: jnp.sum(jo.fsdp_scan(mlp_layer, x, params,
                                                  **kw) ** 2)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = (put(x, P(AXIS)), jax.tree.map(put, params, _specs(params)))
    ctx = jax.set_mesh(mesh)
  with ctx:
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    traced = f.trace(*args)
    got = f(*args)
  _close(got, _want(), rtol=1e-4, atol=1e-5)
  # n forward gathers, and the backward pass regathers all but the kept;
  # inside shard_map with at most one layer kept and prefetch=1, layer 0's
  # two weights travel apart (w2 behind w1's matmul: patterns/fsdp/use_order.py).
  # Where the plan runs the last layer in the loops (Step.again), its forward
  # step gathers it once more: the copy the backward pass keeps.
  split = int(context == "shard_map" and kept <= 1 and prefetch == 1)
  again = int(any(s.again for s in jo.fsdp_plan(
      L, reshard_after_forward=reshard, prefetch=prefetch,
      shard_map=context == "shard_map").steps))
  assert again == int(name == "keep-last" and context == "shard_map")
  assert executed_gathers(context, traced.jaxpr) == \
      2 * L - kept + split + again, name


def test_hsdp_and_layer_inputs_keep_and_prefetch():
  # The second stage (HSDP's all-reduce over the replicas) and xs beside
  # the weights, through the step-by-step schedule (shard_map only: on an
  # explicit mesh both go through the one-stage transfer tested above).
  x, params = _inputs()
  xs = {"scale": jnp.linspace(0.5, 1.5, L)}
  layer = lambda x, w, xs_i: x + xs_i["scale"] * (jnp.tanh(x @ w["w1"]) @ w["w2"])
  specs = {"w1": P(None, "fsdp"), "w2": P(None, "fsdp")}
  batch = P(("replica", "fsdp"))

  @jax.shard_map(mesh=_hsdp_mesh(False), in_specs=(batch, specs, P()),
                 out_specs=P())
  def loss(x, params, xs):
    y = jo.fsdp_scan(layer, x, params, xs=xs, axis="fsdp",
                     replica_axis="replica", reshard_after_forward=2,
                     prefetch=2, unroll=1)
    return lax.psum(jnp.sum(y ** 2), ("replica", "fsdp"))

  def ref(x, params, xs):
    y, _ = lax.scan(lambda x, wx: (layer(x, *wx), None), x, (params, xs))
    return jnp.sum(y ** 2)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, params, xs)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(x, params, xs)
  _close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,p,kept", [(1, 1, 1), (2, 1, 1), (5, 2, 0),
                                      (5, 2, 1), (5, 3, 4), (6, 5, 0)])
def test_every_layer_is_gathered_before_its_step(n, p, kept):
  # The schedule itself (no compile): in the forward pass each layer but the
  # first is gathered at most p steps ahead; in the backward pass each layer
  # not kept is regathered exactly once, before its step, and a buffer never
  # holds more than p gathered layers.
  forward = {r: j for j in range(n) for r in schedule.forward_gathers(j, n, p)}
  assert sorted(forward) == list(range(1, n))
  assert all(0 < r - forward[r] <= p for r in forward)
  backward = {}
  for i in range(n - 1, -1, -1):
    for r in schedule.backward_gathers(i, n, p, kept):
      assert r not in backward and r < i
      backward[r] = i
  regathered_now = [n - 1] if kept == 0 else []
  assert sorted(backward) + regathered_now == list(range(n - kept))
  assert all(backward[r] - r <= p for r in backward)
  assert max(schedule.backward_buffered(i, n, p, kept)
             for i in range(n)) <= p


def test_loops_unroll_to_a_multiple_of_prefetch():
  # Each step shifts the carried buffer of gathered layers by one slot; a
  # loop iteration of a multiple of p steps leaves every buffered layer in
  # its slot, else XLA copies each at the iteration's end (H100 compiler,
  # 12 layers, prefetch=3: +2.68 gathered layers over prefetch=2 so, +1.19
  # unrolled by 3). unroll=1 (what jax 0.10.2 needs on explicit meshes that
  # keep layers) stays 1.
  assert [schedule.loop_unroll(u, p) for u, p in
          [(2, 1), (2, 2), (2, 3), (4, 3), (1, 3), (3, 3)]] == [2, 2, 3, 6, 1, 3]
