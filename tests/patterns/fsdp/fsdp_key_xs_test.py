"""`fsdp_scan(..., xs=keys)`: per-layer PRNG keys as layer inputs, under
autodiff (issue 45's crash: BERT layers with dropout, one key a layer and
row, sharded like the batch, trained with `value_and_grad`).

A key's cotangent is float0. Sharded like the batch, it is typed as varying
over the fsdp axis; the backward loop used to carry it beside the layer's
weight gradient from zeros that could not be typed so, and `lax.scan`
refused the carry ("float0[2,2] ... float0[2,2]{V:fsdp}"). Values and every
gradient against the same model written plainly (a Python loop over the
whole batch), keys raw (uint32) and typed (`jax.random.key`), sharded and
replicated, used and unused, with `before=`/`after=`, under `jax.grad` and
`jax.value_and_grad`, and with HSDP's two-stage reduction. Three layers: the
default plan folds the last layer into the loops (the carry that failed).
Tiny shapes, one compile a case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
import meshes

V, D, H, B, L = 11, 8, 16, 8, 3   # vocabulary, width, hidden, batch, layers
KEEP = 0.75


def bert_layer(x, w, keys, *, sharded, use=True):
  """x + dropout(gelu(x @ w1)) @ w2, the mask drawn per row (keys sharded
  like the batch: one key a row) or per layer (replicated: one key)."""
  h = jax.nn.gelu(x @ w["w1"])
  if use:
    if sharded:
      keep = jax.vmap(lambda k: jax.random.bernoulli(k, KEEP, (H,)))(keys)
    else:
      keep = jax.random.bernoulli(keys, KEEP, (H,))[None]
    h = jnp.where(keep, h / KEEP, 0.0)
  return x + h @ w["w2"]


def _inputs(typed, sharded):
  k = jax.random.split(jax.random.PRNGKey(0), 6)
  params = {"w1": jax.random.normal(k[0], (L, D, H)) * 0.3,
            "w2": jax.random.normal(k[1], (L, H, D)) * 0.3}
  ends = {"table": jax.random.normal(k[2], (V, D)),
          "head": jax.random.normal(k[3], (D, D)) * 0.3}
  tokens = jax.random.randint(k[4], (B,), 0, V)
  shape = (L, B) if sharded else (L,)
  make = jax.random.key if typed else jax.random.PRNGKey
  seeds = jnp.arange(int(np.prod(shape))).reshape(shape)
  for _ in shape:
    make = jax.vmap(make)
  return params, ends, tokens, make(seeds)


def _before(ends):
  return lambda t: ends["table"][t]


def _after(ends):
  return lambda y: jnp.sum(jnp.tanh(y @ ends["head"]) ** 2)


def plain_loss(params, ends, tokens, keys, *, sharded, use, where):
  """The model written plainly, on the whole batch."""
  x = _before(ends)(tokens)
  for i in range(L):
    x = bert_layer(x, jax.tree.map(lambda a: a[i], params), keys[i],
                   sharded=sharded, use=use)
  return _after(ends)(x) if "after" in where else jnp.sum(x ** 2)


def fsdp_loss(mesh, *, sharded, use, where, hsdp=False):
  batch = P(("r", "d")) if hsdp else P("d")
  keys_spec = P(None, ("r", "d") if hsdp else "d") if sharded else P()
  specs = {"w1": P(None, "d"), "w2": P(None, "d")}
  every = ("r", "d") if hsdp else "d"
  more = {"replica_axis": "r"} if hsdp else {}

  @jax.shard_map(mesh=mesh, in_specs=(specs, P(), batch, keys_spec),
                 out_specs=P())
  def loss(params, ends, tokens, keys):
    layer = lambda x, w, k: bert_layer(x, w, k, sharded=sharded, use=use)
    x = tokens
    if "before" in where:
      kw = dict(before=_before(ends))
    else:
      kw, x = {}, _before(ends)(tokens)
    if "after" in where:
      out = jo.fsdp_scan(layer, x, params, axis="d", xs=keys,
                         after=_after(ends), **kw, **more)
    else:
      out = jnp.sum(jo.fsdp_scan(layer, x, params, axis="d", xs=keys, **kw,
                                 **more) ** 2)
    return lax.psum(out, every)
  return loss


def _close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=2e-5,
                               atol=2e-5 * (float(np.abs(b).max()) or 1.0))


def _check(typed, sharded, where, transform, use=True, hsdp=False):
  mesh = meshes.make((2, 2), ("r", "d")) if hsdp else meshes.make((4,), ("d",))
  params, ends, tokens, keys = _inputs(typed, sharded)
  got_fn = fsdp_loss(mesh, sharded=sharded, use=use, where=where, hsdp=hsdp)
  want_fn = lambda *a: plain_loss(*a, sharded=sharded, use=use, where=where)
  # Every gradient: the weights, the ends' (the embedding table, the head),
  # and the keys' (float0, as jax gives an integer or key input).
  argnums = (0, 1, 3)
  if transform == "grad":
    run = lambda f: jax.jit(jax.grad(f, argnums=argnums, allow_int=True))
    got, want = run(got_fn)(params, ends, tokens, keys), \
        run(want_fn)(params, ends, tokens, keys)
  else:
    run = lambda f: jax.jit(jax.value_and_grad(f, argnums=argnums,
                                               allow_int=True))
    (got_value, got), (want_value, want) = \
        run(got_fn)(params, ends, tokens, keys), \
        run(want_fn)(params, ends, tokens, keys)
    _close(got_value, want_value)
  (gp, ge, gk), (wp, we, wk) = got, want
  _close((gp, ge), (wp, we))
  assert gk.dtype == jax.dtypes.float0 and gk.shape == keys.shape, \
      (gk.dtype, gk.shape, keys.shape)
  assert wk.dtype == jax.dtypes.float0


@pytest.mark.parametrize("where", ["", "after", "before", "before+after"])
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "replicated"])
@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_key_xs_value_and_grad_match_the_plain_model(typed, sharded, where):
  _check(typed, sharded, where, "value_and_grad")


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_key_xs_grad_matches_the_plain_model(typed):
  _check(typed, True, "before+after", "grad")


@pytest.mark.parametrize("where", ["", "after"])
def test_unused_sharded_keys(where):
  _check(True, True, where, "value_and_grad", use=False)


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_key_xs_with_hsdp_two_stage_reduction(typed):
  _check(typed, True, "", "value_and_grad", hsdp=True)
