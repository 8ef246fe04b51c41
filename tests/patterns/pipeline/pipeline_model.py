"""A small pipelined model and its sequential reference, for the pipeline tests."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

WIDTH = 4
#: every schedule with its virtual stages a device, as the value grids run them
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
             ("zb-v", 2), ("dualpipev", 2)]
#: the tolerance a pipelined value or gradient keeps to the sequential model's
TOL = dict(rtol=1e-5, atol=1e-6)


def stage(prm, x):
  return jnp.tanh(x @ prm["w"] + prm["b"])


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def model(stages, m, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  params = {"w": jax.random.normal(k[0], (stages, WIDTH, WIDTH)) / 2,
            "b": jax.random.normal(k[1], (stages, WIDTH))}
  xs = jax.random.normal(k[2], (m, 2, WIDTH))
  ts = jax.random.normal(k[3], (m, 2, WIDTH))
  return params, xs, ts


def sequential_loss(params, xs, ts, stage_fn=stage):
  def one(x, t):
    for g in range(params["w"].shape[0]):
      x = stage_fn(jax.tree.map(lambda a: a[g], params), x)
    return mse(x, t)
  return jnp.mean(jax.vmap(one)(xs, ts))


def mesh(p):
  return jax.make_mesh((p,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:p])


def pipelined_loss(p, stage_fn=stage, **kw):
  """(params in stage order, xs, ts) -> the pipelined mean loss."""
  def loss(params, xs, ts):
    laid = pipeline_stage_layout(params, p, schedule=kw.get("schedule"))
    body = lambda q, x, t: pipeline_loss(stage_fn, mse, q, x, t, axis="pp", **kw)
    return jax.shard_map(body, mesh=mesh(p), in_specs=(P("pp"), P(), P()),
                         out_specs=P())(laid, xs, ts)
  return loss
