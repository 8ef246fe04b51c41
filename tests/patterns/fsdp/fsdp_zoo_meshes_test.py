"""Model zoo, the mesh part: `fsdp_scan` on 1-, 2- and 3-axis meshes.

Two small models (an MLP block; an attention + MLP block with a norm scale
beside its sharded weights) run through `fsdp_scan` on meshes of the 8 CPU
devices shaped (8,), (2, 4) and (2, 2, 2): the batch over several axes,
tensor parallelism kept inside the layer (a psum over 'tensor' in
shard_map, `out_sharding=` on an explicit mesh), and `axis=` one name or a
tuple (ZeRO-3 over ('data', 'fsdp')). Both contexts: inside `jax.shard_map`
(futures) and on an Explicit mesh outside shard_map (`jax.reshard`). Each
case is one jit of `value_and_grad` (loss, and gradients wrt x and params),
compared with a plain `lax.scan` over the fully gathered weights without
jax_overlap. On Explicit meshes the gradients come back sharded like the
params; in both contexts the layer sees its gathered weights still sharded
over 'tensor' (shapes in shard_map, types on the Explicit mesh).

The MLP runs on every mesh, the block on `BLOCK_MESHES`. On jax 0.10.2 and
0.11.0 only the cases in `OLDER_JAX_CASES` run (CI budget); jax 0.12.0.1
runs them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo

# The same small programs compile case after case: shared (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("shared_compiles")

HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")

L, D, H, NH, HD, B, S = 3, 16, 32, 2, 8, 16, 4

# mesh shape, axis names, batch axes, fsdp axis (name or tuple)
MESHES = {
    "8-fsdp": ((8,), ("fsdp",), ("fsdp",), "fsdp"),
    "2x4-data-fsdp": ((2, 4), ("data", "fsdp"), ("data", "fsdp"), "fsdp"),
    "2x4-zero3": ((2, 4), ("data", "fsdp"), ("data", "fsdp"), ("data", "fsdp")),
    "4x2-fsdp-tensor": ((4, 2), ("fsdp", "tensor"), ("fsdp",), "fsdp"),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"), "fsdp"),
    "2x2x2-zero3": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
                    ("data", "fsdp")),
}
MODELS = ("mlp", "block")
BLOCK_MESHES = ("8-fsdp", "2x4-zero3", "2x2x2")   # the block's (cost)
CONTEXTS = ("shard_map", "explicit")
OLDER_JAX_CASES = [("mlp", "2x4-zero3", "shard_map"),
                   ("block", "2x2x2", "shard_map"),
                   ("mlp", "2x4-data-fsdp", "explicit"),
                   ("block", "2x2x2", "explicit")]


# --- models: what each leaf is, and the layer ------------------------------------

def _leaves(model):
  """name -> (per-layer shape, dim sharded over fsdp, dim over 'tensor')."""
  mlp = {"w1": ((D, H), 0, 1), "w2": ((H, D), 1, 0)}
  if model == "mlp":
    return mlp
  return {"ln": ((D,), None, None),          # a norm scale: replicated
          "wqkv": ((D, 3, NH, HD), 0, 2), "wo": ((NH, HD, D), 2, 0), **mlp}


def _spec(model, name, fsdp, tensor: bool):
  shape, fd, td = _leaves(model)[name]
  entries = [None] * len(shape)
  if fd is not None:
    entries[fd] = fsdp
  if td is not None and tensor:
    entries[td] = "tensor"
  return P(None, *entries)


def _layer(model, row_parallel, seen=None):
  """`row_parallel(h, w, subscripts)`: the matmul whose contraction is
  sharded over 'tensor' (psum in shard_map, out_sharding when explicit)."""
  def mlp(x, w):
    if seen is not None:
      seen.append({k: (jnp.shape(v), getattr(jax.typeof(v), "sharding", None))
                   for k, v in w.items()})
    lead = "bs" if x.ndim == 3 else "b"
    h = jnp.tanh(jnp.einsum(f"{lead}d,dh->{lead}h", x, w["w1"]))
    return x + row_parallel(h, w["w2"], f"{lead}h,hd->{lead}d")

  def block(x, w):
    h = x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w["ln"]
    qkv = jnp.einsum("bsd,dtnh->tbsnh", h, w["wqkv"])
    q, k, v = qkv[0], qkv[1], qkv[2]
    att = jax.nn.softmax(jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(HD), -1)
    o = jnp.einsum("bnqk,bknh->bqnh", att, v)
    x = x + row_parallel(o, w["wo"], "bqnh,nhd->bqd")
    return mlp(x, w)
  return mlp if model == "mlp" else block


def _plain(h, w, subscripts):
  return jnp.einsum(subscripts, h, w)


def _inputs(model):
  kx, *ks = jax.random.split(jax.random.PRNGKey(7), 1 + len(_leaves(model)))
  x = jax.random.normal(kx, (B, D) if model == "mlp" else (B // 2, S, D))
  params = {name: (1.0 + 0.1 * jax.random.normal(k, (L,) + shape))
            if name == "ln" else
            jax.random.normal(k, (L,) + shape) / np.sqrt(shape[0])
            for k, (name, (shape, _, _)) in zip(ks, _leaves(model).items())}
  return x, params


def _reference(model, x, params):
  def loss(x, params):
    y, _ = lax.scan(lambda x, w: (_layer(model, _plain)(x, w), None), x, params)
    return jnp.sum(y ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)


def _close(got, want, rtol=2e-4, atol=2e-5):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=rtol,
                               atol=atol * (float(np.abs(b).max()) or 1.0))


# --- the cases ---------------------------------------------------------------------

def _cases():
  for context in CONTEXTS:
    for mesh_name in MESHES:
      for model in MODELS:
        case = (model, mesh_name, context)
        if model == "block" and mesh_name not in BLOCK_MESHES:
          continue
        marks = []
        if case not in OLDER_JAX_CASES:
          marks.append(pytest.mark.newest_jax)
        if context == "explicit" and not HAS_EXPLICIT:
          marks.append(pytest.mark.skip(reason="this jax lacks "
                                        "AxisType.Explicit or jax.reshard"))
        yield pytest.param(*case, marks=marks, id="-".join(case))


@pytest.mark.parametrize("model, mesh_name, context", list(_cases()))
def test_zoo_mesh_matches_plain_scan(model, mesh_name, context):
  shape, names, batch, fsdp = MESHES[mesh_name]
  tensor = "tensor" in names
  x, params = _inputs(model)
  want = _reference(model, x, params)
  specs = {n: _spec(model, n, fsdp, tensor) for n in params}
  seen = []
  if context == "shard_map":
    got = _shard_map_run(model, shape, names, batch, fsdp, tensor, specs,
                         seen, x, params)
  else:
    got = _explicit_run(model, shape, names, batch, fsdp, specs, seen,
                        x, params)
  _close(got, want)

  # The layer saw its weights gathered over the fsdp axes only: still
  # split over 'tensor' (and a replicated leaf as it is).
  assert seen
  for w in seen:
    for name, (shape_seen, sharding) in w.items():
      full, _, td = _leaves(model)[name]
      if context == "shard_map":
        want_shape = list(full)
        if tensor and td is not None:
          want_shape[td] //= 2
        assert tuple(shape_seen) == tuple(want_shape), (name, shape_seen)
      else:
        gathered = _spec(model, name, None, tensor)
        assert _entries(sharding.spec, len(full)) == tuple(gathered)[1:], \
            (name, sharding.spec)


def _entries(spec, n):
  # (a spec with reduced axes refuses to unpack: read its partitions)
  parts = tuple(getattr(spec, "partitions", None) or ()) \
      if getattr(spec, "reduced", None) else tuple(spec)
  return parts + (None,) * (n - len(parts))


def _shard_map_run(model, shape, names, batch, fsdp, tensor, specs, seen,
                   x, params):
  mesh = jax.make_mesh(shape, names,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  psum = ((lambda h, w, sub: lax.psum(jnp.einsum(sub, h, w), "tensor"))
          if tensor else _plain)
  layer = _layer(model, psum, seen)
  # One int a leaf: the norm scale is sharded over fsdp here, since a
  # replicated leaf in shard_map needs per-leaf shard_dims=None.
  specs = dict(specs)
  dims = {n: 1 + fd for n, (_, fd, _) in _leaves(model).items()
          if fd is not None}
  if "ln" in specs:
    specs["ln"], dims["ln"] = P(None, fsdp), 1
  x_spec = P(batch)

  @jax.shard_map(mesh=mesh, in_specs=(x_spec, specs), out_specs=P())
  def loss(x, params):
    y = jo.fsdp_scan(layer, x, params, axis=fsdp, shard_dims=dims)
    return lax.psum(jnp.sum(y ** 2), batch)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)


def _explicit_run(model, shape, names, batch, fsdp, specs, seen, x, params):
  explicit = jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh(shape, names, axis_types=(explicit,) * len(names))
  x_spec = P(batch, *[None] * (x.ndim - 1))

  def row_parallel(h, w, sub):   # the output sharded like x: psum over 'tensor'
    return jnp.einsum(sub, h, w, out_sharding=x_spec)
  layer = _layer(model, row_parallel, seen)

  def loss(x, params):
    return jnp.sum(jo.fsdp_scan(layer, x, params, axis=fsdp) ** 2)

  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ps = {n: jax.device_put(p, NamedSharding(mesh, specs[n]))
          for n, p in params.items()}
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ps)
  for n, g in got[1][1].items():
    assert _entries(g.sharding.spec, g.ndim) == _entries(specs[n], g.ndim), \
        (n, g.sharding.spec, specs[n])
  return got
