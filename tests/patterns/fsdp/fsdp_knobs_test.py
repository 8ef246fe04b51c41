"""`fsdp_scan`'s tuning knobs: mixed precision (`param_dtype`,
`reduce_dtype`) and per-layer inputs (`xs`).

Each knob is checked in both contexts (inside `jax.shard_map`, and on an
explicit-sharding mesh): values and gradients against a plain `lax.scan`
that does the same casts, and what the program moves (the dtypes its
gathers and reduce-scatters carry). Tiny shapes; each jitted function is
compiled once, the references once a dtype (CI's budget). On jax 0.12 every
test runs; on older jax (0.10.2, 0.11.0) only OLDER_JAX_SUBSET, one case a
knob and context where the knob differs between them, the rest skipped
with that reason.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core as jax_core
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives.primitives import collective_start_p

AXIS = "d"
HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")
needs_explicit = pytest.mark.skipif(
    not HAS_EXPLICIT, reason="this jax lacks AxisType.Explicit or jax.reshard")
B, D, H, L = 16, 16, 8, 3
CONTEXTS = ["shard_map", pytest.param("explicit", marks=needs_explicit)]
OLDER_JAX_SUBSET = [
    "test_mixed_precision_values_gradients_and_moved_dtypes[bf16-gather-f32-reduce-shard_map]",
    "test_mixed_precision_values_gradients_and_moved_dtypes[bf16-gather-f32-reduce-explicit]",
    "test_bf16_params_reduced_in_f32_come_back_bf16[shard_map]",
    "test_xs_per_layer_inputs_like_lax_scan[explicit]",
    "test_bucket_one_gather_and_one_reduce_scatter_per_layer_and_dtype",
    "test_hsdp_gradients_on_a_replica_by_fsdp_mesh[shard_map]",
    "test_hsdp_gradients_on_a_replica_by_fsdp_mesh[explicit]",
]
pytestmark = pytest.mark.newest_jax(older_jax=OLDER_JAX_SUBSET)


def mlp_layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def _inputs():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (L, D, H)) * 0.3,
            "w2": jax.random.normal(k2, (L, H, D)) * 0.3}
  return jax.random.normal(k3, (B, D)), params


def _specs(params):
  return jax.tree.map(lambda p: P(None, AXIS, *[None] * (p.ndim - 2)), params)


@functools.cache
def _mesh(explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((8,), (AXIS,), axis_types=(kind,))


def loss_in(context, layer, params, xs=None, **kwargs):
  """`sum(fsdp_scan(...)**2)` as `f(x, params[, xs])` in `context`, and the
  arguments to call it with (placed on the explicit mesh there)."""
  if context == "shard_map":
    in_specs = (P(AXIS), _specs(params)) + ((P(),) if xs is not None else ())

    @jax.shard_map(mesh=_mesh(False), in_specs=in_specs, out_specs=P())
    def loss(x, params, *rest):
      more = {"xs": rest[0]} if rest else {}
      y = jo.fsdp_scan(layer, x, params, axis=AXIS, **more, **kwargs)
      return lax.psum(jnp.sum(y.astype(jnp.float32) ** 2), AXIS)
    return loss, lambda x, p, *r: (x, p, *r), contextlib.nullcontext

  mesh = _mesh(True)

  def loss(x, params, *rest):
    more = {"xs": rest[0]} if rest else {}
    y = jo.fsdp_scan(layer, x, params, axis=AXIS, **more, **kwargs)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  def place(x, p, *rest):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    return (put(x, P(AXIS)), jax.tree.map(put, p, _specs(p)),
            *[jax.tree.map(lambda a: put(a, P()), r) for r in rest])
  return loss, place, lambda: jax.set_mesh(mesh)


def _close(got, want, rtol, atol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = float(np.abs(b).max()) or 1.0
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale)


def _eqns(jaxpr):
  jaxpr = jaxpr.jaxpr if not hasattr(jaxpr, "eqns") else jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def moved_dtypes(context, jaxpr):
  """{'gather': {dtypes}, 'reduce': {dtypes}}: what the program's weight
  gathers and gradient reduce-scatters carry. Inside shard_map: the operands
  of the collective starts; on an explicit mesh: the operands of the
  reshards that take the fsdp axis out of a spec (gathers) or put it back
  (reduce-scatters)."""
  out = {"gather": set(), "reduce": set()}
  for eqn in _eqns(jaxpr):
    aval = eqn.invars[0].aval if eqn.invars else None
    if context == "shard_map" and eqn.primitive is collective_start_p:
      kind = {"all_gather": "gather", "psum_scatter": "reduce"}.get(
          eqn.params["comm"].name)
      if kind:
        out[kind].add(str(aval.dtype))
    elif context == "explicit" and eqn.primitive.name == "reshard" \
        and aval.ndim == 2:
      src = str(aval.str_short())
      dst = str(eqn.outvars[0].aval.str_short())
      kind = "gather" if f"@{AXIS}" in src else "reduce" if f"@{AXIS}" in dst \
          else None
      if kind:
        out[kind].add(str(aval.dtype))
  return out


# --- mixed precision -----------------------------------------------------------------

@functools.cache
def _cast_want(param_dtype):
  """value_and_grad of `_cast_reference` on `_inputs()`: computed once."""
  x, params = _inputs()
  return jax.jit(jax.value_and_grad(_cast_reference(param_dtype),
                                    argnums=(0, 1)))(x, params)


def _cast_reference(param_dtype):
  def loss(x, params):
    cast = lambda w: jax.tree.map(lambda a: a.astype(param_dtype), w)
    y, _ = lax.scan(lambda x, w: (mlp_layer(x, cast(w)), None), x, params)
    return jnp.sum(y ** 2)
  return loss


PRECISIONS = {   # name: (param_dtype, reduce_dtype, gathered, reduced)
    "bf16-gather-f32-reduce": (jnp.bfloat16, jnp.float32, "bfloat16", "float32"),
    "bf16-gather-bf16-reduce": (jnp.bfloat16, None, "bfloat16", "bfloat16"),
    "default": (None, None, "float32", "float32"),
}
#: (the default on an explicit mesh is fsdp_test.py's)
PRECISION_CASES = [
    case for n in sorted(PRECISIONS) for case in (
        [pytest.param(n, "shard_map")] + ([] if n == "default" else [
            pytest.param(n, "explicit", marks=needs_explicit)]))]


@pytest.mark.parametrize("name,context", PRECISION_CASES)
def test_mixed_precision_values_gradients_and_moved_dtypes(context, name):
  param_dtype, reduce_dtype, gathered, reduced = PRECISIONS[name]
  x, params = _inputs()
  want = _cast_want(param_dtype or jnp.float32)
  loss, place, ctx = loss_in(context, mlp_layer, params,
                             param_dtype=param_dtype, reduce_dtype=reduce_dtype)
  args = place(x, params)
  with ctx():
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    traced = f.trace(*args)
    got = f(*args)
    lowered = traced.lower().as_text()
  # Gradients come back in each param's own dtype (float32 here).
  assert {str(g.dtype) for g in jax.tree.leaves(got[1][1])} == {"float32"}
  moved = moved_dtypes(context, traced.jaxpr)
  assert moved == {"gather": {gathered}, "reduce": {reduced}}, moved
  if context == "shard_map":
    # The lowered program's gathers carry the dtype too (CPU's compiler then
    # widens bfloat16 collectives to float32: the lowered text is the test).
    short = {"bfloat16": "bf16", "float32": "f32"}[gathered]
    lines = [l for l in lowered.splitlines()
             if "all-gather-done" in l or "stablehlo.all_gather" in l]
    assert lines and all(f"x{short}>" in l for l in lines), lines[:2]
  if param_dtype is None:
    assert "bf16" not in lowered   # no cast written where none was asked
    _close(got, want, rtol=1e-4, atol=1e-5)
  else:
    # The reference sums bfloat16 products over the whole batch; ours sums
    # per-device partials in the reduce dtype: bfloat16 rounding apart.
    _close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("context", CONTEXTS)
def test_bf16_params_reduced_in_f32_come_back_bf16(context):
  x, params = _inputs()
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  layer = lambda x, w: x + jnp.tanh(x @ w["w1"].astype(x.dtype)) \
      @ w["w2"].astype(x.dtype)
  loss, place, ctx = loss_in(context, layer, params, reduce_dtype=jnp.float32)
  args = place(x, params)
  with ctx():
    f = jax.jit(jax.grad(loss, argnums=1))
    moved = moved_dtypes(context, f.trace(*args).jaxpr)
    grads = f(*args)
  assert moved == {"gather": {"bfloat16"}, "reduce": {"float32"}}, moved
  assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"bfloat16"}
  want = jax.grad(_cast_reference(jnp.bfloat16), argnums=1)(x, params)
  _close(grads, want, rtol=3e-2, atol=3e-2)


# --- per-layer inputs ----------------------------------------------------------------

def dropout_layer(x, w, xs_i):
  """Dropout from a per-layer key, a per-layer (differentiated) scale, and
  an integer layer index that switches the nonlinearity."""
  key, scale, index = xs_i["key"], xs_i["scale"], xs_i["index"]
  h = x @ w["w1"]
  h = jnp.where(index % 2 == 0, jnp.tanh(h), jax.nn.gelu(h))
  keep = jax.random.bernoulli(key, 0.75, h.shape)
  return x + scale * (jnp.where(keep, h / 0.75, 0.0) @ w["w2"])


def _layer_inputs():
  return {"key": jax.random.split(jax.random.PRNGKey(7), L),
          "scale": jnp.linspace(0.5, 1.5, L),
          "index": jnp.arange(L)}


def _xs_reference(x, params, xs):
  y, _ = lax.scan(lambda x, wx: (dropout_layer(x, *wx), None), x, (params, xs))
  return jnp.sum(y ** 2)


@pytest.mark.parametrize("context", CONTEXTS)
def test_xs_per_layer_inputs_like_lax_scan(context):
  x, params = _inputs()
  xs = _layer_inputs()
  loss, place, ctx = loss_in(context, dropout_layer, params, xs=xs)
  args = place(x, params, xs)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2),
                                              allow_int=True))
  with ctx():
    value, (gx, gp, gxs) = grad(loss)(*args)
  ref = _xs_reference
  if context == "shard_map":
    # Each device draws the mask of its own rows from the layer's key
    # (shape B/8, the same on every device): so does the reference.
    ref = lambda x, p, xs: jax.vmap(lambda part: _xs_reference(part, p, xs))(
        x.reshape(8, -1, *x.shape[1:])).sum()
  wvalue, (wgx, wgp, wgxs) = grad(ref)(x, params, xs)
  _close((value, gx, gp, gxs["scale"]), (wvalue, wgx, wgp, wgxs["scale"]),
         rtol=1e-4, atol=1e-5)
  for name in ("key", "index"):   # not differentiable: float0, as lax.scan
    assert gxs[name].dtype == jax.dtypes.float0, (name, gxs[name].dtype)
    assert gxs[name].shape == jnp.shape(xs[name]), (name, gxs[name].shape)


# --- buckets -------------------------------------------------------------------------

def bucket_layer(x, w):
  h = jnp.tanh(x @ w["w1"] + w["b"].astype(x.dtype)) * w["scale"][:H]
  return x + h @ w["w2"]


def _bucket_inputs():
  x, params = _inputs()
  params = dict(params, b=jnp.linspace(-1, 1, L * H).reshape(L, H).astype(
      jnp.bfloat16), scale=jnp.ones((L, D)) * 0.9)
  # w2 sharded along its last dimension, b (bf16) along its only one, scale
  # kept replicated: a bucket of w1 and w2 (f32), b alone (another dtype).
  dims = {"w1": 1, "w2": 2, "b": 1, "scale": None}
  specs = {"w1": P(None, AXIS), "w2": P(None, None, AXIS), "b": P(None, AXIS),
           "scale": P()}
  return x, params, dims, specs


def _starts(jaxpr):
  return sorted(e.params["comm"].name for e in _eqns(jaxpr)
                if e.primitive is collective_start_p)


@pytest.fixture
def layer_0_whole():
  from jax_overlap._src.patterns.fsdp import use_order  # noqa: PLC0415
  with use_order.layer_0_whole():
    yield


def test_bucket_one_gather_and_one_reduce_scatter_per_layer_and_dtype(
    layer_0_whole):
  # Counted per layer: layer 0 moved whole, not split by use order (that
  # has its own test, tests/patterns/fsdp/fsdp_split_ends_test.py).
  x, params, dims, specs = _bucket_inputs()

  def loss_with(bucket):
    @jax.shard_map(mesh=_mesh(False), in_specs=(P(AXIS), specs), out_specs=P())
    def loss(x, params):
      y = jo.fsdp_scan(bucket_layer, x, params, axis=AXIS, shard_dims=dims,
                       bucket=bucket, unroll=1)
      return lax.psum(jnp.sum(y ** 2), AXIS)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  def ref(x, params):
    y, _ = lax.scan(lambda x, w: (bucket_layer(x, w), None), x, params)
    return jnp.sum(y ** 2)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(x, params)
  starts = {}
  for bucket in (True, False):
    f = loss_with(bucket)
    starts[bucket] = _starts(f.trace(x, params).jaxpr)
    got = f(x, params)
    assert got[1][1]["b"].dtype == jnp.bfloat16
    _close(got, want, rtol=1e-2, atol=1e-2)   # b's gradient is bfloat16
  # Written sites (a scan body once): per layer 3 sharded leaves one by one,
  # 2 collectives (the f32 bucket, b alone) bucketed.
  per_site = lambda s, kind: s.count(kind)
  for kind in ("all_gather", "psum_scatter"):
    assert per_site(starts[True], kind) * 3 == per_site(starts[False], kind) * 2, \
        starts


# --- HSDP: sharded over one axis, replicated over another ----------------------------

@functools.cache
def _hsdp_mesh(explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(kind, kind))


@pytest.mark.parametrize("context", CONTEXTS)
def test_hsdp_gradients_on_a_replica_by_fsdp_mesh(context):
  x, params = _inputs()
  specs = {"w1": P(None, "fsdp"), "w2": P(None, "fsdp")}
  kw = dict(axis="fsdp", replica_axis="replica")
  batch = P(("replica", "fsdp"))
  mesh = _hsdp_mesh(context == "explicit")
  if context == "shard_map":
    @jax.shard_map(mesh=mesh, in_specs=(batch, specs), out_specs=P())
    def loss(x, params):
      y = jo.fsdp_scan(mlp_layer, x, params, **kw)
      return lax.psum(jnp.sum(y ** 2), ("replica", "fsdp"))
    args, ctx = (x, params), contextlib.nullcontext()
  else:
    def loss(x, params):
      return jnp.sum(jo.fsdp_scan(mlp_layer, x, params, **kw) ** 2)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = (put(x, batch), jax.tree.map(put, params, specs))
    ctx = jax.set_mesh(mesh)
  with ctx:
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    got = f(*args)
    jaxpr = f.trace(*args).jaxpr
  want = _cast_want(jnp.float32)
  # Not doubled: jax's own sum over the replicas of a replica-invariant
  # weight's gradient is not made on top of ours.
  _close(got, want, rtol=1e-4, atol=1e-5)
  if context == "explicit":
    for g, p in zip(jax.tree.leaves(got[1][1]), jax.tree.leaves(args[1])):
      assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding,
                                                               p.sharding)
    return
  from fsdp_test import _windows  # noqa: PLC0415 - the same window finder
  windows = _windows(jaxpr)
  reduces = [prims for kind, prims in windows if kind == "psum"]
  # One all-reduce over the replicas per leaf per written site; the one in
  # the loop body (and the one after it) run across a layer's backward.
  assert reduces, windows
  assert sum("dot_general" in prims for prims in reduces) >= 2, windows
