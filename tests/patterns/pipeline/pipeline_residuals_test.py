"""pipeline_loss(recompute=...): the stage's residuals kept from its forward
action to its backward ones (False; the default off TPU), recomputed (True;
the default on TPU, tests/aot/pipeline_compiled_test.py) or kept as a
jax.checkpoint policy says; the same values and gradients each way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src import _compat
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss
from jax_overlap._src.patterns.pipeline.residuals import choose_recompute
from pipeline_model import (SCHEDULES, TOL, model, mse, pipelined_loss,
                            sequential_loss, stage)

CHOICES = (False, True, jax.checkpoint_policies.dots_saveable)


def _value_and_grad(loss, params, xs, ts):
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, xs, ts)


def _same(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.newest_jax(older_jax=[
    "test_each_choice_equals_the_sequential_model[1f1b-1-switch]",
    "test_each_choice_equals_the_sequential_model[zb-h1-1-lockstep]",
    "test_each_choice_equals_the_sequential_model[interleaved-2-switch]",
    "test_each_choice_equals_the_sequential_model[zb-v-2-lockstep]",
    "test_each_choice_equals_the_sequential_model[dualpipev-2-switch]"])
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["switch", "lockstep"])
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_each_choice_equals_the_sequential_model(schedule, v, dispatch):
  p, m = 2, 4
  params, xs, ts = model(p * v, m)
  want = _value_and_grad(sequential_loss, params, xs, ts)
  got = {}
  for recompute in CHOICES:
    got[recompute] = _value_and_grad(
        pipelined_loss(p, schedule=schedule, virtual_stages=v,
                       dispatch=dispatch, recompute=recompute), params, xs, ts)
    _same(got[recompute], want)
  _same(got[False], got[True])


def _count_stage_runs(recompute, schedule="1f1b"):
  """How many times the stage's forward runs in one value_and_grad (a
  callback counts each run; switch dispatch runs a device's own action)."""
  runs = []

  def counted(prm, x):
    jax.debug.callback(lambda: runs.append(1))
    return stage(prm, x)

  p, m = 2, 4
  params, xs, ts = model(p, m)
  loss = pipelined_loss(p, stage_fn=counted, schedule=schedule,
                        dispatch="switch", recompute=recompute)
  jax.block_until_ready(_value_and_grad(loss, params, xs, ts))
  jax.effects_barrier()
  return len(runs), p * m


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_default_runs_each_stage_forward_once(schedule):
  runs, actions = _count_stage_runs(False, schedule)
  assert runs == actions, (runs, actions)


def test_the_default_keeps_the_residuals_off_tpu():
  # None: decided from the platform the program is for (CPU here): kept.
  assert jax.default_backend() != "tpu"
  runs, actions = _count_stage_runs(None)
  assert runs == actions, (runs, actions)


def test_recompute_runs_each_stage_forward_again_in_its_backward():
  runs, actions = _count_stage_runs(True)
  assert runs == 2 * actions, (runs, actions)


def test_a_collective_inside_the_stage_in_lockstep():
  """A tensor-parallel stage (a psum over 'tp'): its residuals are kept and
  the gradients equal the sequential model's and recompute=True's."""
  D, F = 4, 8

  def tp_stage(w, x):
    return x + jax.lax.psum(jnp.tanh(x @ w["up"]) @ w["down"], "tp")

  def reference(w, x):
    return x + jnp.tanh(x @ w["up"]) @ w["down"]

  keys = jax.random.split(jax.random.key(0), 4)
  w = {"up": jax.random.normal(keys[0], (2, D, F)) / 2,
       "down": jax.random.normal(keys[1], (2, F, D)) / 2}
  xs = jax.random.normal(keys[2], (4, 2, D))
  ts = jax.random.normal(keys[3], (4, 2, D))
  mesh = jax.make_mesh((2, 2), ("pp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:4])
  specs = {"up": P("pp", None, "tp"), "down": P("pp", "tp", None)}

  def piped(schedule, recompute):
    def body(w, xs, ts):
      return jax.lax.pmean(pipeline_loss(tp_stage, mse, w, xs, ts, axis="pp",
                                         schedule=schedule, recompute=recompute),
                           "tp")
    return lambda w, xs, ts: jax.shard_map(
        body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P())(
            pipeline_stage_layout(w, 2), xs, ts)

  def sequential(w, xs, ts):
    def one(x, t):
      for g in range(2):
        x = reference(jax.tree.map(lambda a: a[g], w), x)
      return mse(x, t)
    return jnp.mean(jax.vmap(one)(xs, ts))

  want = _value_and_grad(sequential, w, xs, ts)
  for schedule in ("1f1b", "zb-h1"):
    kept = _value_and_grad(piped(schedule, False), w, xs, ts)
    _same(kept, want)
    _same(kept, _value_and_grad(piped(schedule, True), w, xs, ts))


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_a_bad_recompute_is_refused(bad):
  params, xs, ts = model(2, 4)
  with pytest.raises(TypeError, match=r"pipeline_loss\(recompute=.*expected "
                     r"None \(the default: True when the program is for TPU"):
    jax.jit(pipelined_loss(2, recompute=bad))(params, xs, ts)


def _cast_stage(prm, x):
  """A mixed-precision stage: its weight cast to bf16 (and transposed), then
  used; the vjp's residuals hold that cast weight."""
  w = prm["w"].astype(jnp.bfloat16).T
  return jnp.tanh((x.astype(jnp.bfloat16) @ w.T).astype(x.dtype) + prm["b"])


def test_leaves_from_the_weights_alone_are_not_kept_a_row_a_microbatch():
  """The vjp leaves a stage computes from its parameters alone (here the
  weight cast to bf16) are computed again in the backward, not kept in a
  buffer row a microbatch in flight: the kept leaves are the activation's
  alone. A stage's debug callback keeps them (it runs once, as written)."""
  from jax_overlap._src.patterns.pipeline import residuals
  prm = {"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}
  x, i = jnp.zeros((2, 8)), jnp.zeros((), jnp.int32)
  fn = lambda w, c, x, i: _cast_stage(w, x)
  lay = residuals.layout(fn, False, prm, (), x, i, ())
  assert residuals.WEIGHTS in lay.source, lay.source
  assert all(a.shape[0] == 2 for a in lay.kept), lay.kept   # x's rows, not w's

  def noisy(w, c, x, i):
    jax.debug.callback(lambda: None)
    return _cast_stage(w, x)
  lay = residuals.layout(noisy, False, prm, (), x, i, ())
  assert residuals.WEIGHTS not in lay.source, lay.source
  assert any(a.shape == (8, 8) for a in lay.kept), lay.kept


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb-v", 2)])
def test_a_mixed_precision_stage_equals_the_sequential_model(schedule, v):
  p, m = 2, 4
  params, xs, ts = model(p * v, m)
  want = _value_and_grad(lambda *a: sequential_loss(*a, stage_fn=_cast_stage),
                         params, xs, ts)
  for dispatch in ("switch", "lockstep"):
    got = _value_and_grad(pipelined_loss(p, stage_fn=_cast_stage, schedule=schedule,
                                         virtual_stages=v, dispatch=dispatch,
                                         recompute=False), params, xs, ts)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("exchanges,want", [
    (False, True), (True, jax_overlap.all_to_alls_saveable)])
def test_the_tpu_default_keeps_what_the_stages_all_to_alls_received(
    monkeypatch, exchanges, want):
  """On TPU the default recomputes, keeping an all-to-all's result where
  the stage holds one (an MoE layer: tests/aot/dualpipev_moe_compiled_test.py
  has its windows); off TPU it keeps the residuals either way."""
  monkeypatch.setattr(_compat, "trace_device", lambda: ("tpu", None))
  assert choose_recompute(None, exchanges) is want
  monkeypatch.setattr(_compat, "trace_device", lambda: ("gpu", None))
  assert choose_recompute(None, exchanges) is False
