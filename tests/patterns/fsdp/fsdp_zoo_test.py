"""A model zoo through `fsdp_scan` on a 1-axis mesh of 8 devices.

Each model is one loss written against a `scan(layer, x, params)` argument:
the reference passes a plain `lax.scan` over the fully gathered weights (no
jax_overlap), the others `fsdp_scan` over mesh axis "d", in both contexts
(inside `jax.shard_map`, with futures; on an Explicit mesh, outside
shard_map). One jit of `value_and_grad` per model and context checks the
loss and the gradients with respect to x and params together.

The models: params as dicts, tuples, lists, registered dataclasses,
flax.linen `nn.scan`-stacked variables and flax.nnx state; carries holding
float32, bfloat16, int32 positions, bool flags and a PRNG key (dropout);
replicated and sharded leaves side by side; 1 and 33 layers, unroll larger
than the number of layers; two stacks in one step; fsdp_scan under
`jax.checkpoint` and inside a `lax.scan` over microbatches; a layer wrapped
in `jax.jit`. Multi-axis meshes are in fsdp_zoo_meshes_test.py.

flax is a test-only dependency (pinned per jax in constraints/); its models
are skipped where it is not installed.

The full zoo runs on the newest jax (0.12); on older ones (0.10.2, 0.11.0)
only the tests named in OLDER_JAX_SUBSET run (CI's budget): one case per
defect the zoo pins (tuple/list params, every carry type with a replicated
leaf, shard_dims None, float0 gradients, the jit layer's residuals, a
closed-over differentiated value, flax.nnx state, flax.linen), the rest are
skipped there with that reason.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo

N_DEV = 8
AXIS = "d"
HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")
CONTEXTS = ["shard_map",
            pytest.param("explicit", marks=pytest.mark.skipif(
                not HAS_EXPLICIT, reason="this jax lacks AxisType.Explicit "
                "or jax.reshard"))]

OLDER_JAX_SUBSET = [
    "test_params_as_pytrees[tuple-shard_map]",
    "test_params_as_pytrees[list-shard_map]",
    "test_carry_of_every_type_with_a_replicated_leaf[shard_map]",
    "test_carry_of_every_type_with_a_replicated_leaf[explicit]",
    "test_replicated_leaf_by_shard_dims_none",
    "test_grad_of_non_float_carry_is_float0",
    "test_jit_wrapped_layer_saves_no_gathered_weight",
    "test_layer_closing_over_a_differentiated_value[shard_map]",
    "test_flax_nnx_state[shard_map]",
    "test_flax_linen_scan_stacked[explicit]",
]
pytestmark = pytest.mark.newest_jax(older_jax=OLDER_JAX_SUBSET)


# Shapes chosen apart, so a residual of a gathered weight's shape is one.
B, D, H = 40, 16, 24


def _mesh(explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh((N_DEV,), (AXIS,), axis_types=(kind,))


def _use_mesh(mesh):
  return (jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh")
          else jax.set_mesh(mesh))


def plain_scan(layer, x, params, **_):
  return lax.scan(lambda c, w: (layer(c, w), None), x, params)[0]


def fsdp(layer, x, params, **kwargs):
  return jo.fsdp_scan(layer, x, params, axis=AXIS, **kwargs)


def _sharded(params, replicated=lambda path: False):
  """Each leaf's spec: sharded over its first dimension after the layer
  dimension, or replicated (P()) where `replicated(path)`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: P() if replicated(jax.tree_util.keystr(path))
      else P(None, AXIS, *[None] * (p.ndim - 2)), params)


def _close(got, want, rtol=1e-4, atol=1e-5):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), (jax.tree.structure(got),
                                               jax.tree.structure(want))
  for a, b in zip(got_leaves, want_leaves):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = float(np.abs(b).max()) or 1.0
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale)


def check(context, body, x, params, aux=(), *, x_spec=P(AXIS), param_specs=None,
          aux_specs=(), rtol=1e-4, atol=1e-5, **kwargs):
  """`body(scan, x, params, *aux)` -> this device's (or the whole) loss, with
  `scan` the reference or `fsdp_scan`: values and gradients agree."""
  param_specs = _sharded(params) if param_specs is None else param_specs
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  want = grad(lambda x, p, *a: body(plain_scan, x, p, *a))(x, params, *aux)
  ours = functools.partial(fsdp, **kwargs)
  if context == "shard_map":
    loss = jax.shard_map(lambda x, p, *a: lax.psum(body(ours, x, p, *a), AXIS),
                         mesh=_mesh(False), out_specs=P(),
                         in_specs=(x_spec, param_specs, *aux_specs))
    got = grad(loss)(x, params, *aux)
  else:
    mesh = _mesh(True)
    put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
    args = (put(x, x_spec), jax.tree.map(put, params, param_specs),
            *[put(a, s) for a, s in zip(aux, aux_specs)])
    with _use_mesh(mesh):
      got = grad(lambda x, p, *a: body(ours, x, p, *a))(*args)
  _close(got, want, rtol=rtol, atol=atol)
  return got


# --- the layers ---------------------------------------------------------------------

def _mlp(x, w1, w2):
  return x + jnp.tanh(x @ w1) @ w2


def _weights(n_layers, key=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(key))
  return (jax.random.normal(k1, (n_layers, D, H)) * 0.3,
          jax.random.normal(k2, (n_layers, H, D)) * 0.3)


X = jax.random.normal(jax.random.PRNGKey(42), (B, D))


@dataclasses.dataclass
class MLPParams:
  w1: jax.Array
  w2: jax.Array


jax.tree_util.register_dataclass(MLPParams, data_fields=["w1", "w2"],
                                 meta_fields=[])


PARAM_KINDS = {
    "dict": (lambda w1, w2: {"w1": w1, "w2": w2},
             lambda x, w: _mlp(x, w["w1"], w["w2"])),
    "tuple": (lambda w1, w2: (w1, w2), lambda x, w: _mlp(x, *w)),
    "list": (lambda w1, w2: [w1, w2], lambda x, w: _mlp(x, *w)),
    "dataclass": (MLPParams, lambda x, w: _mlp(x, w.w1, w.w2)),
}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", sorted(PARAM_KINDS))
def test_params_as_pytrees(kind, context):
  make, layer = PARAM_KINDS[kind]
  body = lambda scan, x, p: jnp.sum(scan(layer, x, p) ** 2)
  check(context, body, X, make(*_weights(3)))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("n_layers, unroll", [(1, 2), (33, 2), (3, 40)])
def test_depths_and_unroll(n_layers, unroll, context):
  layer = lambda x, w: _mlp(x, w["w1"], w["w2"])
  body = lambda scan, x, p: jnp.sum(scan(layer, x, p) ** 2)
  w1, w2 = _weights(n_layers)
  check(context, body, X, {"w1": w1 * 0.5, "w2": w2 * 0.5}, unroll=unroll)


# --- carries of every type --------------------------------------------------------

def _rich_layer(carry, w):
  """float32 activations, a bfloat16 side stream, int32 positions (RoPE-like
  phases), bool flags and a PRNG key for dropout. The dropout mask of a row
  depends on its global position only, so it is the same on every device
  layout."""
  x, side, pos, flag, key = carry
  key, sub = jax.random.split(key)
  keep = jax.vmap(lambda p: jax.random.bernoulli(jax.random.fold_in(sub, p),
                                                 0.8, (H,)))(pos)
  phase = jnp.cos(pos[:, None].astype(jnp.float32) * 0.1
                  + jnp.arange(D, dtype=jnp.float32))
  h = jnp.tanh((x * phase) @ w["w1"]) * w["scale"]
  h = jnp.where(keep & flag[:, None], h / 0.8, 0.0)
  x = x + h @ w["w2"]
  side = side + (x @ w["w1"]).astype(jnp.bfloat16)[:, :D]
  return x, side, pos + 1, jnp.logical_not(flag), key


def _rich_body(scan, x, p, pos):
  flag = pos % 3 != 0
  carry = (x, x.astype(jnp.bfloat16), pos, flag, jax.random.key(7))
  y, side, pos, flag, _ = scan(_rich_layer, carry, p)
  return jnp.sum(y ** 2) + jnp.sum(side.astype(jnp.float32)) + jnp.sum(
      jnp.where(flag, pos, 0).astype(jnp.float32)) * 0.0


def _rich_params(n_layers):
  w1, w2 = _weights(n_layers)
  return {"w1": w1, "w2": w2, "scale": 1.0 + 0.1 * jnp.arange(
      n_layers * H, dtype=jnp.float32).reshape(n_layers, H) / H}


@pytest.mark.parametrize("context", CONTEXTS)
def test_carry_of_every_type_with_a_replicated_leaf(context):
  # "scale" is kept replicated (P()) beside the sharded matmul weights.
  params = _rich_params(3)
  specs = _sharded(params, replicated=lambda path: "scale" in path)
  pos = jnp.arange(B, dtype=jnp.int32) * 5
  check(context, _rich_body, X, params, (pos,), param_specs=specs,
        aux_specs=(P(AXIS),), rtol=2e-2, atol=2e-2)


def test_replicated_leaf_by_shard_dims_none():
  # Without vma tracking (check_vma=False) a P() leaf cannot be told from
  # its type: shard_dims says it, None for the replicated leaf.
  params = _rich_params(2)
  specs = _sharded(params, replicated=lambda path: "scale" in path)
  pos = jnp.arange(B, dtype=jnp.int32)
  dims = {"w1": 1, "w2": 1, "scale": None}

  def loss(x, p, pos):
    ours = functools.partial(fsdp, shard_dims=dims)
    return lax.psum(_rich_body(ours, x, p, pos), AXIS)
  f = jax.shard_map(loss, mesh=_mesh(False), in_specs=(P(AXIS), specs, P(AXIS)),
                    out_specs=P(), check_vma=False)
  got = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(X, params, pos)
  ref = lambda x, p, pos: _rich_body(plain_scan, x, p, pos)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(X, params, pos)
  _close(got, want, rtol=2e-2, atol=2e-2)


def test_grad_of_non_float_carry_is_float0():
  params = _rich_params(2)
  specs = _sharded(params, replicated=lambda path: "scale" in path)

  def loss(carry, p):
    y = fsdp(_rich_layer, carry, p)
    return lax.psum(jnp.sum(y[0] ** 2), AXIS)
  f = jax.shard_map(loss, mesh=_mesh(False), out_specs=P(),
                    in_specs=((P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()), specs))
  pos = jnp.arange(B, dtype=jnp.int32)
  carry = (X, X.astype(jnp.bfloat16), pos, pos % 2 == 0, jax.random.key(0))
  g = jax.jit(jax.grad(f, allow_int=True))(carry, params)
  assert [a.dtype for a in g[2:4]] == [jax.dtypes.float0] * 2, g
  assert g[0].dtype == jnp.float32 and g[1].dtype == jnp.bfloat16


# --- compositions -----------------------------------------------------------------

@pytest.mark.parametrize("context", CONTEXTS)
def test_two_stacks_in_one_step(context):
  layer = lambda x, w: _mlp(x, w["w1"], w["w2"])
  (a1, a2), (b1, b2) = _weights(2, key=1), _weights(3, key=2)

  def body(scan, x, p):
    y = scan(layer, x, p["first"])
    return jnp.sum(scan(layer, jnp.sin(y), p["second"]) ** 2)
  check(context, body, X, {"first": {"w1": a1, "w2": a2},
                           "second": {"w1": b1, "w2": b2}})


@pytest.mark.parametrize("context", CONTEXTS)
def test_under_checkpoint(context):
  layer = lambda x, w: _mlp(x, w["w1"], w["w2"])
  w1, w2 = _weights(3)

  def body(scan, x, p):
    return jnp.sum(jax.checkpoint(lambda x, p: scan(layer, x, p))(x, p) ** 2)
  check(context, body, X, {"w1": w1, "w2": w2})


@pytest.mark.parametrize("context", CONTEXTS)
def test_gradient_accumulation_over_microbatches(context):
  layer = lambda x, w: _mlp(x, w["w1"], w["w2"])
  w1, w2 = _weights(3)

  def body(scan, xs, p):
    def micro(total, x):
      return total + jnp.sum(scan(layer, x, p) ** 2), None
    # (The total starts from xs, so that it varies like the sum it adds.)
    return lax.scan(micro, jnp.sum(xs) * 0.0, xs)[0]
  xs = jax.random.normal(jax.random.PRNGKey(3), (2, B, D))
  check(context, body, xs, {"w1": w1, "w2": w2}, x_spec=P(None, AXIS))


def _jit_bf16_layer():
  @jax.jit
  def layer(x, w):   # casts its weights to bf16, reads x
    w1, w2 = w["w1"].astype(jnp.bfloat16), w["w2"].astype(jnp.bfloat16)
    h = jnp.tanh(x.astype(jnp.bfloat16) @ w1)
    return x + (h @ w2).astype(jnp.float32)
  return layer


@pytest.mark.parametrize("context", CONTEXTS)
def test_jit_wrapped_layer(context):
  layer = _jit_bf16_layer()
  w1, w2 = _weights(3)
  body = lambda scan, x, p: jnp.sum(scan(layer, x, p) ** 2)
  check(context, body, X, {"w1": w1, "w2": w2}, rtol=5e-2, atol=5e-2)


def test_jit_wrapped_layer_saves_no_gathered_weight():
  # The same residuals as the same layer not wrapped in jit: neither the
  # gathered weights nor their bf16 casts (before the fix a jit call that
  # also read x stayed whole, and saved both: 64000 bytes here, not 27136).
  w1, w2 = _weights(3)
  params = {"w1": w1, "w2": w2}

  def saved(layer):
    loss = jax.shard_map(
        lambda x, p: lax.psum(jnp.sum(fsdp(layer, x, p) ** 2), AXIS),
        mesh=_mesh(False), in_specs=(P(AXIS), _sharded(params)), out_specs=P())
    return saved_residuals(loss, X, params)
  jitted, plain = saved(_jit_bf16_layer()), saved(_jit_bf16_layer().__wrapped__)
  nbytes = lambda res: sum(int(np.prod(a.shape)) * a.dtype.itemsize
                           for a, _ in res)
  assert nbytes(jitted) == nbytes(plain), (jitted, plain)
  for aval, why in jitted:
    if not why.startswith("from the argument"):   # (the sharded stacks)
      assert tuple(aval.shape[-2:]) not in {(D, H), (H, D)}, (aval, why)


# --- a layer closing over a value being differentiated ----------------------------

@pytest.mark.parametrize("context", CONTEXTS)
def test_layer_closing_over_a_differentiated_value(context):
  w1, w2 = _weights(3)

  def body(scan, x, p):
    gain = p["gain"]   # a per-model value, closed over by the layer
    layer = lambda x, w: _mlp(x, w["w1"] * gain, w["w2"])
    return jnp.sum(scan(layer, x, {"w1": p["w1"], "w2": p["w2"]}) ** 2)
  params = {"w1": w1, "w2": w2, "gain": jnp.full((3, D), 0.7)}
  specs = _sharded(params, replicated=lambda path: "gain" in path)
  # gain has a layer dimension only to share _sharded; the layer reads it whole.
  check(context, lambda scan, x, p: body(scan, x, {**p, "gain": p["gain"][0, :, None]}),
        X, params, param_specs=specs)


# --- flax ---------------------------------------------------------------------------

def _flax():
  return pytest.importorskip("flax", reason="flax is not installed (a test "
                             "extra pinned in constraints/jax-*.txt)")


@pytest.mark.parametrize("context", CONTEXTS)
def test_flax_linen_scan_stacked(context):
  _flax()
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = jnp.tanh(nn.Dense(H)(x))
      return x + nn.Dense(D, use_bias=False)(h), None
  stack = nn.scan(Block, variable_axes={"params": 0},
                  split_rngs={"params": True}, length=3)
  params = stack().init(jax.random.PRNGKey(0), X, None)["params"]
  layer = lambda x, w: Block().apply({"params": w}, x, None)[0]
  body = lambda scan, x, p: jnp.sum(scan(layer, x, p) ** 2)
  check(context, body, X, params)


@pytest.mark.parametrize("context", CONTEXTS)
def test_flax_nnx_state(context):
  _flax()
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(D, H, rngs=rngs)
      self.down = nnx.Linear(H, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return x + self.down(jnp.tanh(self.up(x)))
  states = []
  for k in range(3):
    graphdef, state = nnx.split(Block(nnx.Rngs(k)))
    states.append(state)
  params = jax.tree.map(lambda *a: jnp.stack(a), *states)
  layer = lambda x, w: nnx.merge(graphdef, w)(x)
  body = lambda scan, x, p: jnp.sum(scan(layer, x, p) ** 2)
  check(context, body, X, params)
