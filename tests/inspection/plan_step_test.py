"""The report names the `fsdp_plan` step each of `fsdp_scan`'s collectives is
in flight across (`step`, from the `jax_overlap.step=` scope the engine starts
them in), in the compiled program and in the written one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.patterns.leaf_scope import in_step, step_from_op_name

LAYERS = 4


def _loss():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(None, "d")), out_specs=P())
  def loss(x, params):
    y = jo.fsdp_scan(lambda x, w: jnp.tanh(x @ w["w1"]) @ w["w2"], x, params,
                     axis="d")
    return jax.lax.psum(jnp.sum(y ** 2), "d")
  return loss


def _args():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (LAYERS, 8, 16)) / 4,
            "w2": jax.random.normal(k2, (LAYERS, 16, 8)) / 4}
  return jax.random.normal(k3, (16, 8)), params


@pytest.fixture(scope="module")
def reports():
  grad = jax.jit(jax.grad(_loss(), argnums=1))
  return {schedule: jo.overlap_report(grad, schedule=schedule)(*_args())
          for schedule in ("compiled", "written")}


@pytest.mark.parametrize("schedule", ["compiled", "written"])
def test_each_fsdp_collective_names_its_plan_step(reports, schedule):
  records = [c for c in reports[schedule].collectives if c.leaf]
  assert records
  plan = jo.fsdp_plan(LAYERS)
  # The labels are the plan's own words for its steps.
  words = {f"{name}: {s.says()}" for name, steps in
           (("forward", plan.forward), ("backward", plan.backward))
           for s in steps}
  for c in records:
    assert c.step, c
    head = c.step.removesuffix(" (one loop)").split(" to ")[0]
    assert head in words, (c.step, sorted(words))
  steps = {c.step for c in records}
  assert any(s.startswith("forward: ") for s in steps), steps
  assert any(s.startswith("backward: ") for s in steps), steps
  assert any(s.endswith("(one loop)") for s in steps), steps


def test_the_table_prints_the_step(reports):
  text = reports["compiled"].table(use_rich=False, width=400)
  assert "plan step forward: " in text and "plan step backward: " in text


def test_a_collective_outside_the_plan_has_no_step(reports):
  # The loss's psum is the user's own, not a plan step's (the written
  # program holds it; XLA:CPU's compiled one may not keep it apart).
  outside = [c for c in reports["written"].collectives
             if c.kind == "all-reduce" and not c.leaf]
  assert outside and all(c.step is None for c in outside), outside


@pytest.mark.parametrize("label", ["forward: layer 1 to layer 3 (one loop)",
                                   "backward: layer 0's backward [split by use]",
                                   "a/b@c%"])
def test_step_scope_round_trips(label):
  from jax._src import source_info_util  # noqa: PLC0415
  with in_step(label):
    stack = str(source_info_util.current_name_stack())
  assert step_from_op_name(f"jit(f)/{stack}/all_gather_start") == label
