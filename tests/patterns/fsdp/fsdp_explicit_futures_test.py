"""`fsdp_scan` on an explicit mesh with its moves as futures (the form it
takes for TPU v5e with jax 0.12: patterns/fsdp/explicit_futures.py), on CPU.

The form is chosen by the trace's platform; here it is forced
(`arguments._explicit_futures_here`), so its values and gradients are checked
against a plain `lax.scan` with the same settings as the reshard form, and
the program is checked to move the weights by futures started in shard_maps
(a gather a weight, one reduce-scatter a layer). The windows it gives are
checked on the real TPU compiler (tests/aot/real_compilers_test.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax._src import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from fsdp_knobs_test import (AXIS, _close, _hsdp_mesh, _inputs, _mesh, _specs,
                             mlp_layer)
from jax_overlap._src.collectives.primitives import collective_start_p
from jax_overlap._src.patterns.fsdp import arguments

pytestmark = pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 12),
    reason=f"jax {jax.__version__}: the form is for jax 0.12 (older jax "
           "cannot take a future for TPU; there the moves are reshards)")


@pytest.fixture(autouse=True)
def _futures(monkeypatch):
  monkeypatch.setattr(arguments, "_explicit_futures_here", lambda: True)


def norm_layer(x, w):
  # "scale" meets x elementwise: gathered to replicated, by reshard
  h = x * w["scale"]
  return x + jnp.tanh(h @ w["w1"]) @ w["w2"]


SETTINGS = {   # name: (layer, fsdp_scan keywords, extra leaves)
    "default": (mlp_layer, {}, False),
    "bf16-gather-f32-reduce": (mlp_layer, dict(param_dtype=jnp.bfloat16,
                                               reduce_dtype=jnp.float32), False),
    "no-bucket": (mlp_layer, dict(bucket=False), False),
    "keep-2-prefetch-2": (mlp_layer, dict(reshard_after_forward=2, prefetch=2,
                                          unroll=1), False),
    "every-layer-regathered": (mlp_layer, dict(reshard_after_forward=True),
                               False),
    "norm-scale": (norm_layer, {}, True),
}


def _starts(jaxpr) -> dict:
  """{collective: starts written} in the program, inside any shard_map."""
  out: dict = {}

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is collective_start_p:
        name = eqn.params["comm"].name
        out[name] = out.get(name, 0) + 1
      for sub in jax_core.jaxprs_in_params(eqn.params):
        visit(getattr(sub, "jaxpr", sub))
  visit(jaxpr.jaxpr)
  return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_values_gradients_and_moves_are_futures(name):
  layer, kw, scale = SETTINGS[name]
  x, params = _inputs()
  if scale:
    params["scale"] = 1.0 + 0.1 * jax.random.normal(
        jax.random.PRNGKey(3), (params["w1"].shape[0], x.shape[1]))
  dtype = kw.get("param_dtype")

  def reference(x, params):
    def one(x, w):
      w = w if dtype is None else jax.tree.map(lambda a: a.astype(dtype), w)
      return layer(x, w).astype(x.dtype), None
    y, _ = lax.scan(one, x, params)
    return jnp.sum(y ** 2)

  mesh = _mesh(True)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, P(AXIS)), jax.tree.map(put, params, _specs(params)))
  loss = lambda x, p: jnp.sum(jo.fsdp_scan(layer, x, p, axis=AXIS, **kw) ** 2)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    got = f(*args)
    starts = _starts(f.trace(*args).jaxpr)
  want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x, params)
  tol = 2e-2 if dtype is not None else 1e-4
  _close(got, want, rtol=tol, atol=tol / 10)
  # Gathers are futures (one a weight, w1 and w2); the gradients' reduce-
  # scatters too (one a layer with bucket, else one a weight).
  assert starts.get("all_gather", 0) >= 2, starts
  assert starts.get("psum_scatter", 0) >= 1, starts


def test_hsdp_gathers_are_futures_and_gradients_match():
  # A gradient unreduced over the replica axis too goes back by reshard
  # (XLA's reduce-scatter and all-reduce); the gathers are futures.
  x, params = _inputs()
  mesh = _hsdp_mesh(True)
  specs = {"w1": P(None, "fsdp"), "w2": P(None, "fsdp")}
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, P(("replica", "fsdp"))), jax.tree.map(put, params, specs))
  loss = lambda x, p: jnp.sum(jo.fsdp_scan(mlp_layer, x, p, axis="fsdp",
                                           replica_axis="replica") ** 2)

  def reference(x, params):
    y, _ = lax.scan(lambda x, w: (mlp_layer(x, w), None), x, params)
    return jnp.sum(y ** 2)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    got = f(*args)
    starts = _starts(f.trace(*args).jaxpr)
  _close(got, jax.value_and_grad(reference, argnums=(0, 1))(x, params),
         rtol=1e-4, atol=1e-5)
  assert starts.get("all_gather", 0) >= 2, starts


@pytest.mark.parametrize("name", ["default", "no-bucket"])
def test_v5p_permute_futures_values_and_gradients(name):
  # On TPU v5p the futures are N-1 permutes each (permute_forms.py), started
  # in one shard_map and finished in another as the plain pairs are.
  from jax_overlap._src.collectives import permute_forms
  layer, kw, _ = SETTINGS[name]
  x, params = _inputs()

  def reference(x, params):
    y, _ = lax.scan(lambda x, w: (layer(x, w), None), x, params)
    return jnp.sum(y ** 2)
  mesh = _mesh(True)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, P(AXIS)), jax.tree.map(put, params, _specs(params)))
  loss = lambda x, p: jnp.sum(jo.fsdp_scan(layer, x, p, axis=AXIS, **kw) ** 2)
  with jax.set_mesh(mesh), permute_forms.forced():
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    got = f(*args)
    starts = _starts(f.trace(*args).jaxpr)
  _close(got, jax.value_and_grad(reference, argnums=(0, 1))(x, params),
         rtol=1e-4, atol=1e-5)
  n = len(jax.devices())
  # every gather and reduce-scatter made of n - 1 permutes; none left plain
  assert starts.get("ppermute", 0) >= 3 * (n - 1), starts
  assert "all_gather" not in starts and "psum_scatter" not in starts, starts
