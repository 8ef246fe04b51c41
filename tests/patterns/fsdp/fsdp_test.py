"""`fsdp_scan`: values, gradients, shardings, residuals, memory and overlap.

Every case compares against a plain `lax.scan` over the fully gathered
weights, in both contexts (inside `jax.shard_map`, and on an explicit-sharding
mesh), for an MLP stack and a small transformer block.
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core as jax_core
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap._src.collectives.primitives import (collective_done_p,
                                                     collective_start_p)

N_DEV = 8
AXIS = "d"
HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")

# Shapes chosen apart, so a residual of a gathered weight's shape is one.
B, D, H, S = 40, 16, 24, 8


def _mesh(explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((N_DEV,), (AXIS,), axis_types=(kind,))


def _use_mesh(mesh):
  return (jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh")
          else jax.set_mesh(mesh))


# --- models -------------------------------------------------------------------

def mlp_layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def mlp_params(n_layers, key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (n_layers, D, H)) * 0.3,
          "w2": jax.random.normal(k2, (n_layers, H, D)) * 0.3}


def _norm(x, scale):
  return x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def block_layer(x, w):
  """Pre-norm attention + MLP on x of shape (batch, seq, D)."""
  h = _norm(x, w["ln1"])
  q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
  att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D), axis=-1)
  x = x + jnp.einsum("bqk,bkd->bqd", att, v) @ w["wo"]
  h = _norm(x, w["ln2"])
  return x + jax.nn.gelu(h @ w["w1"]) @ w["w2"]


def block_params(n_layers, key):
  ks = jax.random.split(key, 6)
  mat = lambda k, a, b: jax.random.normal(k, (n_layers, a, b)) / np.sqrt(a)
  return {"ln1": jnp.ones((n_layers, D)), "ln2": jnp.ones((n_layers, D)) * 0.9,
          "wq": mat(ks[0], D, D), "wk": mat(ks[1], D, D), "wv": mat(ks[2], D, D),
          "wo": mat(ks[3], D, D), "w1": mat(ks[4], D, H), "w2": mat(ks[5], H, D)}


MODELS = {
    "mlp": (mlp_layer, mlp_params, (B, D)),
    "transformer": (block_layer, block_params, (B // 5, S, D)),
}


def _inputs(model, n_layers):
  _, make, x_shape = MODELS[model]
  kx, kp = jax.random.split(jax.random.PRNGKey(n_layers))
  return jax.random.normal(kx, x_shape), make(n_layers, kp)


def _param_specs(params):
  # Every leaf sharded over its first dimension after the layer dimension.
  return jax.tree.map(lambda p: P(None, AXIS, *[None] * (p.ndim - 2)), params)


def reference_loss(layer):
  def loss(x, params):
    y, _ = lax.scan(lambda x, w: (layer(x, w), None), x, params)
    return jnp.sum(y ** 2)
  return loss


@functools.cache
def _reference_value_and_grad(model, n_layers):
  """The plain scan's loss and gradients on `_inputs(model, n_layers)`: one
  compile a (model, n_layers), shared by both contexts' grids and every unroll."""
  x, params = _inputs(model, n_layers)
  return jax.jit(jax.value_and_grad(reference_loss(MODELS[model][0]), argnums=(0, 1)))(
      x, params)


def shard_map_loss(layer, params, **kwargs):
  mesh = _mesh(False)

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), _param_specs(params)),
                 out_specs=P())
  def loss(x, params):
    y = jo.fsdp_scan(layer, x, params, axis=AXIS, **kwargs)
    return lax.psum(jnp.sum(y ** 2), AXIS)
  return loss


def _explicit_args(x, params):
  mesh = _mesh(True)
  x = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
  params = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)),
                        params, _param_specs(params))
  return mesh, x, params


def explicit_loss(layer, **kwargs):
  def loss(x, params):
    return jnp.sum(jo.fsdp_scan(layer, x, params, axis=AXIS, **kwargs) ** 2)
  return loss


def _close(got, want, rtol=1e-4, atol=1e-5):
  """Equal up to float32 sums in another order: `atol` is relative to the
  largest magnitude of each array (per-device partial sums, then a psum)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = float(np.abs(b).max()) or 1.0
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale)


# --- values and gradients -----------------------------------------------------------

#: The grids' older-jax subset (CI's budget): each layer count and each unroll
#: once per model, with 3 layers at unroll 4 (not a divisor) among them.
GRID_ON_OLDER_JAX = [f"{test}[{model}-{cell}]"
                     for test in ("test_shard_map_matches_plain_scan",
                                  "test_explicit_mesh_matches_plain_scan")
                     for model in ("mlp", "transformer")
                     for cell in ("1-1", "2-2", "3-4", "8-2")]


@pytest.mark.newest_jax(older_jax=GRID_ON_OLDER_JAX)
@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("n_layers", [1, 2, 3, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_shard_map_matches_plain_scan(model, n_layers, unroll):
  layer = MODELS[model][0]
  x, params = _inputs(model, n_layers)
  want = _reference_value_and_grad(model, n_layers)
  got = jax.jit(jax.value_and_grad(shard_map_loss(layer, params, unroll=unroll),
                                   argnums=(0, 1)))(x, params)
  _close(got, want)


@pytest.mark.skipif(not HAS_EXPLICIT, reason="this jax lacks AxisType.Explicit "
                    "or jax.reshard")
@pytest.mark.newest_jax(older_jax=GRID_ON_OLDER_JAX)
@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("n_layers", [1, 2, 3, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_explicit_mesh_matches_plain_scan(model, n_layers, unroll):
  layer = MODELS[model][0]
  x, params = _inputs(model, n_layers)
  want = _reference_value_and_grad(model, n_layers)
  mesh, xs, ps = _explicit_args(x, params)
  with _use_mesh(mesh):
    got = jax.jit(jax.value_and_grad(explicit_loss(layer, unroll=unroll),
                                     argnums=(0, 1)))(xs, ps)
  _close(got, want)
  # Gradients come back sharded exactly like the parameters.
  for g, p in zip(jax.tree.leaves(got[1][1]), jax.tree.leaves(ps)):
    assert g.sharding.spec == p.sharding.spec, (g.sharding, p.sharding)


def test_eager_shard_map_and_primal_only():
  x, params = _inputs("mlp", 3)
  want = reference_loss(mlp_layer)(x, params)
  loss = shard_map_loss(mlp_layer, params)
  np.testing.assert_allclose(loss(x, params), want, rtol=2e-5)          # eager
  np.testing.assert_allclose(jax.jit(loss)(x, params), want, rtol=2e-5)
  g = jax.grad(loss, argnums=1)(x, params)                               # eager grad
  _close(g, jax.grad(reference_loss(mlp_layer), argnums=1)(x, params))


def test_remat_policy_values_and_fewer_residuals():
  x, params = _inputs("transformer", 3)
  want = jax.value_and_grad(reference_loss(block_layer), argnums=(0, 1))(x, params)
  policy = jax.checkpoint_policies.nothing_saveable
  loss = shard_map_loss(block_layer, params, remat_policy=policy)
  _close(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params), want)
  full = shard_map_loss(block_layer, params)
  n_remat = len(saved_residuals(loss, x, params))
  n_full = len(saved_residuals(full, x, params))
  assert n_remat < n_full, (n_remat, n_full)


def test_pytree_activations_and_bf16_weights():
  # x may be any pytree; a cast of the weights inside the layer is fine.
  def layer(x, w):
    h, skip = x
    w1 = w["w1"].astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.tanh(h @ w1) @ w["w2"] + skip, skip * 0.5
  x, params = _inputs("mlp", 3)
  mesh = _mesh(False)

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), _param_specs(params)), out_specs=P())
  def loss(x, params):
    h, s = jo.fsdp_scan(layer, (x, x * 0.1), params, axis=AXIS)
    return lax.psum(jnp.sum(h ** 2) + jnp.sum(s), AXIS)

  def ref(x, params):
    (h, s), _ = lax.scan(lambda c, w: (layer(c, w), None), (x, x * 0.1), params)
    return jnp.sum(h ** 2) + jnp.sum(s)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(x, params)
  # Each device's partial weight gradient goes back through the bf16 cast
  # before the reduce-scatter sums them: bf16 rounding, not a bug.
  _close(got, want, rtol=1e-2, atol=1e-2)


def test_optax_update_step():
  optax = pytest.importorskip("optax", reason="optax is not installed")
  x, params = _inputs("transformer", 3)
  opt = optax.adamw(1e-2)

  def step(loss):
    @jax.jit
    def update(params, state, x):
      value, grads = jax.value_and_grad(loss, argnums=1)(x, params)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value
    return update
  ours = step(shard_map_loss(block_layer, params))
  ref = step(reference_loss(block_layer))
  # ours's parameters and step count where its step returns them (sharded,
  # replicated): one compile of the step, not a second at step 2
  mesh = _mesh(False)
  p1 = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                    params, _param_specs(params))
  s1 = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding)
                    else jax.device_put(a, NamedSharding(mesh, P())), opt.init(p1))
  p2, s2 = params, opt.init(params)
  for _ in range(3):
    p1, s1, v1 = ours(p1, s1, x)
    p2, s2, v2 = ref(p2, s2, x)
    np.testing.assert_allclose(v1, v2, rtol=1e-4)
  _close(p1, p2, rtol=1e-4, atol=1e-5)


# --- no gathered weight is saved ------------------------------------------------------

def _full_weight_shapes(params):
  return {tuple(p.shape[1:]) for p in jax.tree.leaves(params)}


def test_residuals_are_activations_only():
  def layer(x, w):   # also uses a cast and a transpose of the weights
    w1 = w["w1"].astype(jnp.bfloat16).astype(jnp.float32)
    return x + jnp.tanh(x @ w1) @ w["w2"].T.T
  x, params = _inputs("mlp", 3)
  # Every layer regathered in the backward pass (reshard_after_forward=True).
  loss = shard_map_loss(layer, params, reshard_after_forward=True)
  full = _full_weight_shapes(params)
  n = jax.device_count()
  # A residual of the shard_map shows each device's value stacked along its
  # first dimension: a full weight (W, ...) on every device reads (n * W, ...).
  per_device = lambda s: (s[0] // n, *s[1:]) if s and s[0] % n == 0 else s
  is_full = lambda aval: (tuple(aval.shape) in full
                          or per_device(tuple(aval.shape)) in full)
  saved = saved_residuals(loss, x, params)
  assert saved, "nothing saved at all?"
  for aval, why in saved:
    # A full weight has no leading layer dimension and no sharding.
    assert not is_full(aval), (aval, why)
  # The default (reshard_after_forward=1) saves the last layer's gathered
  # weights, each once, and nothing computed from them (the cast, the
  # transposes).
  kept = [per_device(tuple(a.shape)) for a, _ in
          saved_residuals(shard_map_loss(layer, params), x, params)
          if is_full(a)]
  assert sorted(kept) == sorted(full), kept
  # The plain scan does save them: the check can fail.
  plain = saved_residuals(reference_loss(layer), x, params)
  assert any(tuple(a.shape[1:]) in full or tuple(a.shape) in full
             for a, _ in plain)


def test_memory_grows_by_activations_only():
  """The compiled gradient step's temp bytes (benchmarks/bench_fsdp_memory.py,
  which the docs quote): fsdp_scan grows with depth like a scan that saves
  activations but no weight, and stays well below one that saves the
  gathered weights."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
  import bench_fsdp_memory as bench
  names = ["(a) plain scan, gather saved",
           "(c) plain scan, layer checkpointed, all but the gather saved",
           "fsdp_scan, unroll=None (default: 1 layer an iteration)",
           "fsdp_scan, unroll=2"]
  by_depth = {}
  for n in (8, 16):
    mesh, x, params, specs = bench.setup(n)
    losses = bench.losses(mesh, specs)
    by_depth[n] = {k: bench.temp_bytes(losses[k], x, params) for k in names}
  grow = {k: by_depth[16][k] - by_depth[8][k] for k in names}
  layer_weights = 2 * 64 * 512 * 4
  saved_weights, activations_only = grow[names[0]], grow[names[1]]
  assert saved_weights >= activations_only + 0.9 * 8 * layer_weights, grow
  for ours in names[2:]:
    assert grow[ours] <= 1.1 * activations_only + 65536, grow
    assert by_depth[8][ours] < 0.7 * by_depth[8][names[0]], by_depth


# --- the program shows the overlap ------------------------------------------------------

def _windows(jaxpr):
  """For each collective start, the primitives written before its done."""
  order = []

  def walk(j):
    j = j.jaxpr if type(j).__name__ == "ClosedJaxpr" else j
    for eqn in j.eqns:
      order.append(eqn)
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr)
  windows = []
  for i, eqn in enumerate(order):
    if eqn.primitive is collective_start_p:
      flight = eqn.outvars[0]
      # (By position, not order.index: a scan body traced once and used by two
      # scans, as the remainder-first scan does, appears twice in `order`.)
      end = next(j for j in range(i + 1, len(order))
                 if order[j].primitive is collective_done_p
                 and order[j].invars[0] is flight)
      between = order[i + 1:end]
      windows.append((eqn.params["comm"].name,
                      [e.primitive.name for e in between]))
  return windows


def test_traced_program_has_compute_inside_every_window():
  x, params = _inputs("mlp", 4)
  grad = jax.grad(shard_map_loss(mlp_layer, params), argnums=(0, 1))
  windows = _windows(jax.jit(grad).trace(x, params).jaxpr)
  kinds = {k for k, _ in windows}
  assert {"all_gather", "psum_scatter"} <= kinds, kinds
  # (The traced program holds each code site once: a scan body is one.)
  # Every gather but the first of each pass, and every reduce-scatter but
  # the last, has a layer's matmuls written between its start and its done;
  # the 2 leaves of a layer travel in one bucket (bucket=True, the default),
  # which leaves 1 gather and 1 scatter bare (2 and 2 unbucketed): the
  # backward pass's first layer is the forward's last, whose gathered
  # weights the default (reshard_after_forward=1) keeps.
  bare = sorted(k for k, prims in windows if "dot_general" not in prims)
  assert bare == ["all_gather", "psum_scatter"], windows
  assert len(windows) > len(bare)
  # Every layer regathered (reshard_after_forward=True): that regather,
  # before the backward's loop, is bare as well.
  grad = jax.grad(shard_map_loss(mlp_layer, params, reshard_after_forward=True),
                  argnums=(0, 1))
  windows = _windows(jax.jit(grad).trace(x, params).jaxpr)
  bare = sorted(k for k, prims in windows if "dot_general" not in prims)
  assert bare == ["all_gather"] * 2 + ["psum_scatter"], windows


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax has no custom-call async form to split")
def test_gpu_lowering_keeps_collectives_in_flight_across_matmuls():
  x, params = _inputs("mlp", 4)
  grad = jax.jit(jax.grad(shard_map_loss(mlp_layer, params, unroll=1),
                          argnums=(0, 1)))
  text = grad.trace(x, params).lower(lowering_platforms=("cuda",)).as_text()
  ops = re.findall(r'"((?:all-gather|reduce-scatter)-(?:start|done))"|'
                   r"stablehlo\.(dot_general)", text)
  ops = [a or b for a, b in ops]
  for kind in ("all-gather", "reduce-scatter"):
    inside = 0
    open_ = False
    seen_dot = False
    for op in ops:
      if op == f"{kind}-start":
        open_, seen_dot = True, False
      elif op == "dot_general" and open_:
        seen_dot = True
      elif op == f"{kind}-done":
        inside += seen_dot
        open_ = False
    assert inside >= 2, (kind, ops)


# --- errors ---------------------------------------------------------------------------

def _call(fn, params, **kwargs):
  mesh = _mesh(False)
  specs = jax.tree.map(lambda p: P(*[None] * jnp.ndim(p)), params)
  f = jax.shard_map(lambda x, p: fn(x, p, **kwargs), mesh=mesh,
                    in_specs=(P(AXIS), specs), out_specs=P(AXIS))
  return jax.jit(f)(jnp.ones((B, D)), params)


@pytest.mark.parametrize("kwargs, params, error, message", [
    (dict(layer=42), {"w": jnp.ones((2, D, D))}, TypeError,
     r"fsdp_scan\(layer=...\) must be a function layer\(x, params\[i\]\)"),
    (dict(unroll=0), {"w": jnp.ones((2, D, D))}, ValueError,
     r"unroll=...\) must be an int >= 1 or None, got 0"),
    (dict(), {"w": jnp.ones((D,))}, ValueError,
     r"leaf \['w'\] has shape \(16,\); every leaf needs a leading layer"),
    (dict(), {"a": jnp.ones((2, D, D)), "b": jnp.ones((3, D, D))}, ValueError,
     r"the leading \(layer\) dimension differs between leaves"),
    (dict(shard_dims=3), {"w": jnp.ones((2, D, D))}, ValueError,
     r"shard_dims=...\): 3 is not a dimension after the layer dimension"),
    (dict(shard_dims={"v": 1}), {"w": jnp.ones((2, D, D))}, ValueError,
     r"shard_dims=...\) must be one int or a pytree of ints shaped like params"),
])
def test_bad_arguments(kwargs, params, error, message):
  layer = kwargs.pop("layer", lambda x, w: x @ w["w"] if "w" in w else x)
  with pytest.raises(error, match=message):
    _call(lambda x, p, **kw: jo.fsdp_scan(layer, x, p, axis=AXIS, **kw),
          params, **kwargs)


def test_outside_shard_map_without_explicit_sharding():
  with pytest.raises(ValueError, match=r"leaf \['w'\] is not sharded over a "
                     r"mesh axis 'd'. Call fsdp_scan inside jax.shard_map"):
    jax.jit(lambda x, p: jo.fsdp_scan(lambda x, w: x @ w["w"], x, p, axis=AXIS))(
        jnp.ones((B, D)), {"w": jnp.ones((2, D, D))})
