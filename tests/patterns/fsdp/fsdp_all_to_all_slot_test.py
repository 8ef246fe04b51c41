"""fsdp_scan beside a layer that starts all-to-all futures (an expert
stream): where the TPU v5e's one all-to-all slot is at stake, its gathers
and reduce-scatters are permute futures (patterns/fsdp/all_to_all_slot.py;
the compiled schedule: tests/aot/moe_compiled_test.py::
test_fsdp_beside_an_expert_stream_keeps_every_collective_async). Here, on
CPU with the quirk made to apply: the permutes are taken, and values and
every gradient equal fsdp_scan's as it moves elsewhere and the layers run
without fsdp_scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import quirks
from jax_overlap._src.patterns.fsdp import all_to_all_slot

FSDP, EP, T, D, H, LOCAL, K, LAYERS = 2, 4, 8, 8, 16, 2, 2, 2


def expert(w, tokens):
  return jnp.tanh(tokens @ w["w_in"]) @ w["w_out"]


def layer(w, x):
  """A projection and a router (sharded over fsdp), then the tokens' 2
  halves streamed through the experts (sharded over ep and fsdp)."""
  half = x.shape[0] // 2
  stream = jo.expert_stream(expert, {"w_in": w["w_in"], "w_out": w["w_out"]},
                            axis="ep", capacity=half)
  parts = [x[:half], x[half:]]
  for part in parts:
    h = jnp.tanh(part @ w["proj"])
    weights, ids = jax.lax.top_k(jax.nn.softmax(h @ w["router"]), K)
    stream.send(h, ids, weights)
  return jnp.concatenate([p + out.done()[0] for p, out in zip(parts, stream.close())])


SPECS = {"proj": P(None, "fsdp"), "router": P(None, "fsdp"),
         "w_in": P(None, "ep", "fsdp"), "w_out": P(None, "ep", None, "fsdp")}


def _params(seed=0):
  rng = np.random.default_rng(seed)
  e = EP * LOCAL
  normal = lambda *s: (rng.normal(size=s) / np.sqrt(s[-2])).astype(np.float32)
  return {"proj": normal(LAYERS, D, D), "router": normal(LAYERS, D, e),
          "w_in": normal(LAYERS, e, D, H), "w_out": normal(LAYERS, e, H, D)}


def _loss(fsdp: bool):
  mesh = jax.make_mesh((FSDP, EP), ("fsdp", "ep"), devices=jax.devices()[:FSDP * EP],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def body(x, params):
    if fsdp:
      y = jo.fsdp_scan(layer, x, params, axis="fsdp", params_first=True,
                       shard_dims={"proj": 1, "router": 1, "w_in": 2, "w_out": 3})
    else:
      y = jax.lax.scan(lambda x, w: (layer(w, x), None), x, params)[0]
    return jnp.sum(y ** 2)[None]

  specs = SPECS if fsdp else {k: P(*(None if a == "fsdp" else a for a in s))
                              for k, s in SPECS.items()}
  batch = P(("fsdp", "ep"))
  f = jax.shard_map(body, mesh=mesh, in_specs=(batch, specs), out_specs=batch)
  return lambda x, params: f(x, params).sum()


@pytest.fixture
def slot_quirk_applies(monkeypatch):
  """The v5e's quirk, made to apply on this CPU."""
  applies = quirks.applies
  monkeypatch.setattr(quirks, "applies", lambda name, *a, **k: (
      name == all_to_all_slot.QUIRK or applies(name, *a, **k)))


def _run(x, params):
  f = jax.jit(jax.value_and_grad(_loss(fsdp=True), argnums=(0, 1)))
  return f(x, params), str(jax.make_jaxpr(_loss(fsdp=True))(x, params))


def test_beside_all_to_alls_fsdp_moves_by_permutes(slot_quirk_applies):
  x = np.random.default_rng(1).normal(size=(FSDP * EP * T, D)).astype(np.float32)
  params = _params()
  got, jaxpr = _run(x, params)
  assert "ppermute" in jaxpr     # the permute forms were taken
  want = jax.jit(jax.value_and_grad(_loss(fsdp=False), argnums=(0, 1)))(x, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_elsewhere_fsdp_moves_as_before():
  x = np.random.default_rng(1).normal(size=(FSDP * EP * T, D)).astype(np.float32)
  _, jaxpr = _run(x, _params())
  assert "ppermute" not in jaxpr
