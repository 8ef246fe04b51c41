"""A BERT-like `fsdp_scan` gradient compiles on the real compilers, with its
gathers async.

The model is benchmarks/bench_first_call.py's (attention and MLP over 3-D
activations (batch, sequence, width), dropout, a (256, 64) weight), two
layers. On TPU v5e the plain async all-gather of such a weight aborted the
compiler (`RET_CHECK IsMajorDimAllGather`: layout assignment laid the
gathered weight out column-major); the quirk "tpu-flat-all-gather"
(collectives/major_dim.py) gathers it as one flat buffer there. Nothing
runs; each compile takes a few seconds (.venv-aot).
"""

from __future__ import annotations

import functools

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import schedule
from compilers import Mesh, NamedSharding, P, target

import jax_overlap as jo
from jax_overlap._src import _compat

LAYERS, B, T, D, F = 2, 16, 16, 64, 256
#: Async gather futures whose start and done share a computation, and of
#: those the ones with a matmul in flight (libtpu 0.0.52 and the CUDA plugin
#: of jax 0.12.0.1, each target: 8 and 7; the one without is layer 0's
#: first forward gather, with nothing before it to hide behind).
PAIRS, WITH_MATMULS = 8, 7

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")


def _ln(x, s):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * lax.rsqrt(v + 1e-6) * s


def _dropout(key, x, rate=0.1):
  keep = jax.random.bernoulli(key, 1 - rate, x.shape)
  return jnp.where(keep, x / (1 - rate), 0)


def _layer(x, w, key):
  k1, k2 = jax.random.split(key)
  h = _ln(x, w["ln1"])
  q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
  a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / D ** 0.5, -1)
  x = x + jnp.einsum("bts,bsd->btd", _dropout(k1, a), v) @ w["wo"]
  h = _ln(x, w["ln2"])
  return x + _dropout(k2, jax.nn.gelu(h @ w["w1"]) @ w["w2"])


@functools.cache
def _compiled(name: str) -> str:
  mesh = Mesh(target(name).mesh.devices, ("d",))
  shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D),
            "w1": (D, F), "w2": (F, D), "ln1": (D,), "ln2": (D,)}
  dims = {k: (None if k.startswith("ln") else 1) for k in shapes}
  specs = {k: P() if dims[k] is None else P(None, "d") for k in shapes}
  arg = lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec))
  params = {k: arg((LAYERS, *s), specs[k]) for k, s in shapes.items()}
  x = arg((B, T, D), P("d"))
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("d"), P()),
                     out_specs=P())
  def loss(params, x, key):
    keys = jax.random.split(key, LAYERS)
    y = jo.fsdp_scan(_layer, x, params, axis="d", shard_dims=dims, xs=keys)
    return lax.pmean(jnp.mean(y ** 2), "d")

  step = jax.jit(jax.value_and_grad(loss))
  return step.lower(params, x, key).compile().as_text()


def _gathers(text: str, name: str):
  if name == "tpu_v5p":   # each gather is N-1 permutes (permute_forms.py)
    return [f for f in schedule.permute_futures(text) if f.is_gather]
  return [w for w in schedule.windows(text) if w.kind == "all-gather"]


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100"])
def test_bert_like_fsdp_scan_gradient_compiles_with_async_gathers(name):
  text = _compiled(name)   # v5e: the compiler aborted here before
  assert not schedule.is_sync(text, "all-gather")
  gathers = _gathers(text, name)
  got = sum(w.matmuls >= 1 for w in gathers)
  assert len(gathers) >= PAIRS and got >= WITH_MATMULS, gathers
