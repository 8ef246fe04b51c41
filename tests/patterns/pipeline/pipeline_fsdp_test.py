"""PP x FSDP: each stage an `fsdp_scan` over layers sharded on a second axis."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.fsdp.scan import fsdp_scan
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

D, LAYERS, BATCH = 4, 2, 4


def layer(x, w):
  return jnp.tanh(x @ w)


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _model(stages, m):
  k = jax.random.split(jax.random.key(0), 3)
  ws = jax.random.normal(k[0], (stages, LAYERS, D, D)) / 2
  xs = jax.random.normal(k[1], (m, BATCH, D))
  ts = jax.random.normal(k[2], (m, BATCH, D))
  return ws, xs, ts


def _reference(ws, xs, ts):
  def one(x, t):
    for g in range(ws.shape[0]):
      for i in range(LAYERS):
        x = layer(x, ws[g, i])
    return mse(x, t)
  return jnp.mean(jax.vmap(one)(xs, ts))


def _on_mesh(body, p, fsdp):
  """`body(stage shards, xs, ts)` in shard_map over a (pp, fsdp) mesh, on
  the stacked weights [stages, LAYERS, D, D]."""
  mesh = jax.make_mesh((p, fsdp), ("pp", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:p * fsdp])

  def loss(ws, xs, ts):
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(P("pp", None, "fsdp", None), P(None, "fsdp"), P(None, "fsdp")),
        out_specs=P())(pipeline_stage_layout(ws, p), xs, ts)
  return loss


def _pipelined(p, fsdp, schedule):
  def stage(w, x):   # w: [LAYERS, D/fsdp, D], this device's shard
    return fsdp_scan(layer, x, w, axis="fsdp", shard_dims=1)

  def body(w, xs, ts):
    loss = pipeline_loss(stage, mse, w, xs, ts, axis="pp", schedule=schedule)
    return jax.lax.pmean(loss, "fsdp")
  return _on_mesh(body, p, fsdp)


@pytest.mark.parametrize("p,fsdp,m,schedule", [(2, 2, 4, "1f1b"), (2, 2, 4, "zb-h1"),
                                               (4, 2, 4, "1f1b")])
def test_pp_by_fsdp(p, fsdp, m, schedule):
  ws, xs, ts = _model(p, m)
  loss = _pipelined(p, fsdp, schedule)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(ws, xs, ts)
  want = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(ws, xs, ts)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _gathered_once(p, fsdp):
  """docs/pipeline.md "Gathering a stage's weights once a step": the stage's
  FSDP shards gathered before `pipeline_loss`, a plain scan in the stage."""
  def stage(w, x):   # w: [LAYERS, D, D], this stage's layers, whole
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, w)[0]

  def body(w, xs, ts):
    whole = jax.lax.all_gather(w, "fsdp", axis=2, tiled=True)   # once a step
    loss = pipeline_loss(stage, mse, whole, xs, ts, axis="pp")
    return jax.lax.pmean(loss, "fsdp")
  return _on_mesh(body, p, fsdp)


def test_weights_gathered_once_a_step():
  """Values and gradients equal the plain model's, and the step holds one
  all-gather and one reduce-scatter of the weights, where `fsdp_scan` in the
  stage gathers its layers in every forward and backward."""
  p, fsdp, m = 2, 2, 4
  ws, xs, ts = _model(p, m)
  step = jax.jit(jax.value_and_grad(_gathered_once(p, fsdp), argnums=(0, 1)))
  got = step(ws, xs, ts)
  want = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(ws, xs, ts)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  def count(fn):   # in the compiled module (the futures' forms differ before)
    text = fn.lower(ws, xs, ts).compile().as_text()
    return {op: len(re.findall(rf" {op}(?:-start)?\(", text))
            for op in ("all-gather", "reduce-scatter")}
  once = count(step)
  per_tick = count(jax.jit(jax.value_and_grad(_pipelined(p, fsdp, "1f1b"),
                                              argnums=(0, 1))))
  assert once == {"all-gather": 1, "reduce-scatter": 1}, once
  assert per_tick["reduce-scatter"] >= m, per_tick   # (its gathers take other forms before jax 0.12)
