"""fsdp_scan on what public model code hands it (issue "Real clients").

Each test is a defect met on flax, equinox or gemma code: a replicated leaf
gathered (a silent wrong answer), `jnp.take` in `before`, a scalar
accumulator in the carry, per-layer outputs, and errors that named the
wrong fix. Values and gradients are checked against the same model written
with `jax.lax.all_gather` and a plain `lax.scan`.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import fsdp_scan

# The same small programs compile case after case: shared (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("shared_compiles")

L = 3


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5,
                               atol=2e-6)
  assert any(np.abs(np.asarray(w)).max() > 0 for w in jax.tree.leaves(want))


def _gathered(tree):
  """The reference's weights: every leaf of the stacked shards all-gathered
  along dimension 1 (the one after the layer dimension)."""
  return jax.tree.map(
      lambda a: jax.lax.all_gather(a, "d", axis=1, tiled=True), tree)


def _weights():
  k = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k[0], (L, 16, 16)) * 0.3,
          jax.random.normal(k[1], (L, 16)),
          jax.random.normal(k[2], (8, 16)))


# --- 1. a replicated leaf is never gathered ----------------------------------------

def _bias_layer(x, p):
  w, b = p
  return jnp.tanh(x @ w + jnp.sum(b))   # reduces over the replicated leaf


@pytest.mark.parametrize("shard_dims", [1, (1, None), None])
def test_replicated_leaf_is_never_gathered(mesh, shard_dims):
  """One int for all leaves, with a `P()` leaf beside sharded ones: the
  replicated leaf is used as it is (it was gathered 4-fold: max error 15)."""
  w, b, x = _weights()
  specs = (P("d"), P(None, "d"), P())

  def loss(fsdp, w, b, x):
    @jax.shard_map(mesh=mesh, in_specs=specs, out_specs=P())
    def f(x, w, b):
      if fsdp:
        y = fsdp_scan(_bias_layer, x, (w, b), axis="d", shard_dims=shard_dims)
      else:
        y, _ = jax.lax.scan(lambda x, p: (_bias_layer(x, p), None), x,
                            (_gathered(w), b))
      return jax.lax.pmean(jnp.mean(y ** 2), "d")
    return f(x, w, b)

  got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)),
                static_argnums=0)(True, w, b, x)
  _close(got, jax.value_and_grad(loss, argnums=(1, 2))(False, w, b, x))


def test_a_dim_named_for_a_replicated_leaf_is_refused(mesh):
  w, b, x = _weights()

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(None, "d"), P()),
                 out_specs=P("d"))
  def f(x, w, b):
    return fsdp_scan(_bias_layer, x, {"w": w, "b": b}, axis="d",
                     shard_dims={"w": 1, "b": 1})

  with pytest.raises(ValueError, match=r"dimension 1 of leaf \['b'\].*"
                     r"replicated over axis='d'.*Give None for this leaf"):
    jax.jit(f)(x, w, b)


def test_a_leaf_sharded_over_some_of_the_axes_is_refused():
  mesh = jax.make_mesh((2, 2), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w, b, x = _weights()

  @jax.shard_map(mesh=mesh, in_specs=(P(("a", "b")), P(None, "a"), P()),
                 out_specs=P(("a", "b")))
  def f(x, w, b):
    return fsdp_scan(_bias_layer, x, (w, b), axis=("a", "b"))

  with pytest.raises(ValueError, match=r"leaf \[0\] varies over \('a',\) of "
                     "those axes only"):
    jax.jit(f)(x, w, b)


# --- 2. before= with jnp.take (flax's Embed) under grad -----------------------------

@pytest.mark.parametrize("embed", ["flax.linen.Embed", "jnp.take"])
def test_before_with_jnp_take_under_grad(mesh, embed):
  """flax `nn.Embed` (flax, Apache-2.0) looks tokens up with `jnp.take`, a
  `jax.jit` call holding the table's cast to varying: its gradient was
  refused ("Expected cotangent type float32[32,16]{V:d}")."""
  w, _, _ = _weights()
  module = nn.Embed(32, 16)
  table = module.init(jax.random.key(1), jnp.zeros((1,), jnp.int32))
  tokens = (jnp.arange(8) * 5) % 32
  lookup = (lambda t, tok: module.apply(t, tok)) if embed != "jnp.take" else \
      (lambda t, tok: jnp.take(t["params"]["embedding"], tok, axis=0))

  def loss(fsdp, table, w, tokens):
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "d"), P("d")),
                   out_specs=P())
    def f(table, w, tokens):
      layer = lambda x, w: jnp.tanh(x @ w)
      if fsdp:
        out = fsdp_scan(layer, tokens, w, axis="d",
                        before=lambda t: lookup(table, t),
                        after=lambda y: jnp.mean(y ** 2))
      else:
        y, _ = jax.lax.scan(lambda x, w: (layer(x, w), None),
                            lookup(table, tokens), _gathered(w))
        out = jnp.mean(y ** 2)
      return jax.lax.pmean(out, "d")
    return f(table, w, tokens)

  got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)),
                static_argnums=0)(True, table, w, tokens)
  _close(got, jax.value_and_grad(loss, argnums=(1, 2))(False, table, w, tokens))


# --- 3. a scalar accumulator in the carry --------------------------------------------

def _aux_layer(c, p):
  x, aux = c
  for w in (p if isinstance(p, tuple) else (p,)):
    x = jnp.tanh(x @ w)
  return x, aux + jnp.mean(x ** 2)


@pytest.mark.parametrize("weights", [1, 2])
@pytest.mark.parametrize("closes", [False, True], ids=["", "closes-over"])
def test_scalar_accumulator_in_the_carry(mesh, weights, closes):
  """`(x, jnp.zeros(()))`: the layer makes the accumulator varying. It was
  refused with one weight a layer (the scan's carry types differ), and
  failed with a layer closing over a traced value ("pvary is a
  invariant->variant collective")."""
  w, _, x = _weights()
  params = w if weights == 1 else (w, w[::-1])
  scale = jnp.float32(0.7)

  def loss(fsdp, params, scale, x):
    def layer(c, p):
      x, aux = _aux_layer(c, p)
      return (x * scale, aux) if closes else (x, aux)

    @jax.shard_map(mesh=mesh, in_specs=(P(None, "d"), P(), P("d")),
                   out_specs=P())
    def f(params, scale, x):
      if fsdp:
        y, aux = fsdp_scan(layer, (x, jnp.zeros(())), params, axis="d")
      else:
        aux0 = jax.lax.pcast(jnp.zeros(()), ("d",), to="varying")
        (y, aux), _ = jax.lax.scan(lambda c, p: (layer(c, p), None),
                                   (x, aux0), _gathered(params))
      return jax.lax.pmean(jnp.mean(y) + aux, "d")
    return f(params, scale, x)

  got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)),
                static_argnums=0)(True, params, scale, x)
  _close(got, jax.value_and_grad(loss, argnums=(1, 2))(False, params, scale, x))


# --- 4. per-layer outputs ---------------------------------------------------------------

def _ys_layer(x, w):
  y = jnp.tanh(x @ w)
  return y, {"aux": jnp.mean(y ** 2), "act": y[:2]}   # a scalar and a cache


@pytest.mark.parametrize("setting", [
    {}, {"prefetch": 2}, {"reshard_after_forward": False},
    {"before": lambda v: 2 * v, "after": lambda y: 3 * y}],
    ids=["default", "prefetch2", "keep-all", "ends"])
def test_has_ys_like_lax_scan(mesh, setting):
  """`layer(x, w) -> (x, y)` with `has_ys=True`: `(x, ys)` as lax.scan
  returns them, values and gradients through the ys."""
  w, _, x = _weights()
  weights = jnp.arange(1.0, L + 1)

  def loss(fsdp, w, x):
    @jax.shard_map(mesh=mesh, in_specs=(P(None, "d"), P("d")),
                   out_specs=(P("d"), P(), P(None, "d")))
    def f(w, x):
      if fsdp:
        y, ys = fsdp_scan(_ys_layer, x, w, axis="d", has_ys=True, **setting)
      else:
        h = setting.get("before", lambda v: v)(x)
        y, ys = jax.lax.scan(_ys_layer, h, _gathered(w))
        y = setting.get("after", lambda v: v)(y)
      return y, jax.lax.pmean(ys["aux"], "d"), ys["act"]
    y, aux, act = f(w, x)
    return jnp.sum(y) + jnp.sum(aux * weights) + jnp.sum(act ** 2), (aux, act)

  got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True),
                static_argnums=0)(True, w, x)
  want = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(False, w, x)
  assert got[0][1][0].shape == (L,) and got[0][1][1].shape == (L, 8, 16)
  _close(got, want)


def test_has_ys_needs_a_pair(mesh):
  w, _, x = _weights()

  @jax.shard_map(mesh=mesh, in_specs=(P(None, "d"), P("d")), out_specs=P("d"))
  def f(w, x):
    return fsdp_scan(lambda x, w: x @ w, x, w, axis="d", has_ys=True)

  with pytest.raises(ValueError, match=r"has_ys=True\): the layer must return "
                     r"a pair \(x, y\)"):
    jax.jit(f)(w, x)


# --- 9. errors that named the wrong fix -------------------------------------------------

def test_a_leaf_sharded_on_another_dim_names_shard_dims(mesh):
  """flax's attention `out` kernel (heads, head_dim, features) with fewer
  heads than devices is sharded on its last dim."""
  kernel = jnp.ones((L, 2, 8, 16)) * 0.01
  x = jnp.ones((8, 2, 8))
  layer = lambda x, w: x + jnp.einsum("bhd,hdf->bf", x, w)[:, None, :8]

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(None, None, None, "d")),
                 out_specs=P("d"))
  def f(x, w):
    return fsdp_scan(layer, x, w, axis="d")

  with pytest.raises(ValueError, match=r"gathered along dimension 1 .*say "
                     r"which with shard_dims="):
    jax.jit(f)(x, kernel)


class _Block(eqx.Module):
  """A BERT-style feed-forward block with dropout, as equinox's BERT example
  builds its layers (equinox, Apache-2.0)."""
  lin: eqx.nn.Linear
  norm: eqx.nn.LayerNorm
  drop: eqx.nn.Dropout

  def __call__(self, x):
    return self.norm(x + self.drop(jax.nn.gelu(self.lin(x)), inference=True))


def _stacked_blocks():
  return eqx.filter_vmap(lambda k: _Block(eqx.nn.Linear(16, 16, key=k),
                                          eqx.nn.LayerNorm(16),
                                          eqx.nn.Dropout(0.1)))(
      jax.random.split(jax.random.key(0), L))


def test_a_whole_equinox_module_names_eqx_partition(mesh):
  stacked = _stacked_blocks()
  with pytest.raises(ValueError, match=r"leaf \.drop\.p has shape \(\).*"
                     r"equinox.Module.*eqx\.partition\(stacked, eqx\.is_array\)"):
    fsdp_scan(lambda x, b: jax.vmap(b)(x), jnp.ones((8, 16)), stacked, axis="d")


def test_equinox_blocks_partitioned(mesh):
  """The way docs/fsdp.md shows: the arrays through fsdp_scan, the rest
  combined back inside the layer; equal to a plain scan of the blocks."""
  params, static = eqx.partition(_stacked_blocks(), eqx.is_array)
  specs = jax.tree.map(lambda a: P(None, "d"), params)
  layer = lambda x, p: jax.vmap(eqx.combine(p, static))(x)
  x = jax.random.normal(jax.random.key(3), (8, 16))

  def loss(fsdp, params, x):
    @jax.shard_map(mesh=mesh, in_specs=(specs, P("d")), out_specs=P())
    def f(params, x):
      if fsdp:
        y = fsdp_scan(layer, x, params, axis="d")
      else:
        y, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x,
                            _gathered(params))
      return jax.lax.pmean(jnp.mean(y ** 2), "d")
    return f(params, x)

  got = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
      True, params, x)
  _close(got, jax.value_and_grad(loss, argnums=1)(False, params, x))


def test_equinox_dropout_keys_sharded_like_the_batch_trained_with_optax(mesh):
  """Issue 45: equinox's BERT blocks with dropout on, one key a layer and a
  row sharded like the batch (`xs`), under `value_and_grad` with an optax
  step: lax.scan refused the backward loop's carry (a key's float0
  cotangent typed varying over "d" against zeros that were not). The loss
  and the updated weights equal the plain scan's."""
  import optax  # noqa: PLC0415

  class Block(eqx.Module):
    lin: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout

    def __call__(self, x, key):
      return self.norm(x + self.drop(jax.nn.gelu(self.lin(x)), key=key))

  stacked = eqx.filter_vmap(lambda k: Block(
      eqx.nn.Linear(16, 16, key=k), eqx.nn.LayerNorm(16),
      eqx.nn.Dropout(0.25)))(jax.random.split(jax.random.key(0), L))
  params, static = eqx.partition(stacked, eqx.is_array)
  specs = jax.tree.map(lambda a: P(None, "d"), params)
  layer = lambda x, p, keys: jax.vmap(eqx.combine(p, static))(x, keys)
  x = jax.random.normal(jax.random.key(3), (8, 16))
  keys = jax.random.split(jax.random.key(4), (L, 8))   # (layers, rows)
  head = jax.random.normal(jax.random.key(5), (16,))
  opt = optax.adamw(1e-2)

  def step(fsdp, params, state, x, keys):
    @jax.shard_map(mesh=mesh, in_specs=(specs, P(), P("d"), P(None, "d")),
                   out_specs=P())
    def loss(params, head, x, keys):
      after = lambda y: jnp.mean(jnp.tanh(y @ head) ** 2)
      if fsdp:
        out = fsdp_scan(layer, x, params, axis="d", xs=keys, after=after)
      else:
        y, _ = jax.lax.scan(lambda x, pk: (layer(x, *pk), None), x,
                            (_gathered(params), keys))
        out = after(y)
      return jax.lax.pmean(out, "d")
    value, grads = jax.value_and_grad(loss)(params, head, x, keys)
    updates, state = opt.update(grads, state, params)
    return value, optax.apply_updates(params, updates)

  run = jax.jit(step, static_argnums=0)
  state = opt.init(params)
  _close(run(True, params, state, x, keys), run(False, params, state, x, keys))
