"""DualPipeV with an `expert_parallel` MoE block in every stage: values and
gradients equal the sequential model's.

The stage holds all-to-alls over 'ep', so the pipeline runs in lockstep; in
a DualPipeV F&B tick the backward slot reads the rows the tick started with,
through an optimization barrier of its own (pair_fences.py `beside`), not the
forward slot's state. Its values must be
those of the sequential model: the same stages, one after the other, in a
`shard_map` over 'ep' alone. Capacity 3 of an average of 2 a (device,
expert) pair drops some (token, choice) pairs, the same ones on both sides
(dropping depends on the tokens a device holds, not on the pipeline).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.collectives.remat_policy import all_to_alls_saveable
from jax_overlap._src.patterns.moe.expert_parallel import expert_parallel
from jax_overlap._src.patterns.pipeline import buffers, placing
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

P_STAGES, EP, M = 2, 2, 4          # DualPipeV's least m: 2p
T, D, H, LOCAL, K, CAPACITY = 4, 4, 8, 2, 2, 3
E = LOCAL * EP
TOL = dict(rtol=1e-5, atol=1e-6)
W_SPECS = {"a": P("pp"), "r": P("pp"), "e_in": P("pp", "ep"),
           "e_out": P("pp", "ep")}


def expert(p, tokens):
  return jnp.tanh(tokens @ p["w_in"]) @ p["w_out"]


def stage(w, x):   # x: [T, D] this 'ep' device's tokens
  h = jnp.tanh(x @ w["a"])
  top, ids = jax.lax.top_k(h @ w["r"], K)
  y, _ = expert_parallel(expert, h, ids, jax.nn.softmax(top, axis=-1),
                         {"w_in": w["e_in"], "w_out": w["e_out"]}, axis="ep",
                         capacity=CAPACITY, chunks=2)
  return x + y


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _data():
  keys = jax.random.split(jax.random.key(0), 6)
  s = 2 * P_STAGES   # global stages
  w = {"a": jax.random.normal(keys[0], (s, D, D)) / 2,
       "r": jax.random.normal(keys[1], (s, D, E)),
       "e_in": jax.random.normal(keys[2], (s, E, D, H)) / 2,
       "e_out": jax.random.normal(keys[3], (s, E, H, D)) / 2}
  xs = jax.random.normal(keys[4], (M, EP * T, D))
  ts = jax.random.normal(keys[5], (M, EP * T, D))
  return w, xs, ts


def _pipelined(w, xs, ts, recompute=None):
  mesh = jax.make_mesh((P_STAGES, EP), ("pp", "ep"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:P_STAGES * EP])

  def body(w, xs, ts):
    loss = pipeline_loss(stage, mse, w, xs, ts, axis="pp",
                         schedule="dualpipev", virtual_stages=2,
                         recompute=recompute)
    return jax.lax.pmean(loss, "ep")
  laid = pipeline_stage_layout(w, P_STAGES, schedule="dualpipev")
  return jax.shard_map(body, mesh=mesh,
                       in_specs=(W_SPECS, P(None, "ep"), P(None, "ep")),
                       out_specs=P())(laid, xs, ts)


def _sequential(w, xs, ts):
  mesh = jax.make_mesh((EP,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:EP])

  def body(w, xs, ts):
    losses = []
    for i in range(M):
      x = xs[i]
      for g in range(2 * P_STAGES):
        x = stage(jax.tree.map(lambda a: a[g], w), x)
      losses.append(mse(x, ts[i]))
    return jax.lax.pmean(sum(losses) / M, "ep")
  specs = {k: P(*(None if a == "pp" else a for a in s)) for k, s in W_SPECS.items()}
  return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(None, "ep"), P(None, "ep")),
                       out_specs=P())(w, xs, ts)


def test_the_plan_has_pair_ticks():
  """The case below runs F&B cells (else it would not test `beside`)."""
  plan = placing.pipeline_schedule("dualpipev", P_STAGES, M, 2)
  assert any(t.second for t in buffers.program(plan).ticks)


@pytest.mark.slow
# On older jax the default (remat_policy_test runs the policy there).
@pytest.mark.newest_jax(older_jax=[
    "test_values_and_gradients_equal_the_sequential_model[default]"])
@pytest.mark.parametrize("recompute", [None, True, all_to_alls_saveable],
                         ids=["default", "recompute", "all_to_alls_saveable"])
def test_values_and_gradients_equal_the_sequential_model(recompute):
  """The default off TPU keeps the residuals; on TPU it recomputes keeping
  the all-to-alls' results (residuals.py `choose_recompute`)."""
  w, xs, ts = _data()
  pipelined = functools.partial(_pipelined, recompute=recompute)
  got = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1)))(w, xs, ts)
  want = jax.jit(jax.value_and_grad(_sequential, argnums=(0, 1)))(w, xs, ts)
  np.testing.assert_allclose(got[0], want[0], **TOL)
  for path, a in jax.tree_util.tree_leaves_with_path(got[1]):
    b = want[1]
    for k in path:
      b = b[k.key if hasattr(k, "key") else k.idx]
    np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))
  np.testing.assert_allclose(jax.jit(pipelined)(w, xs, ts), want[0], **TOL)
