"""examples/llama_4d.py's four 8-device plans equal the model as one program.

Each plan (pp x fsdp x tp with collective matmul, pp x fsdp x cp with ring
attention, pp x dp x tp with psum, pp x fsdp x ep with expert_parallel) runs
the same parameters as `llama_4d.loss`: the loss and every parameter's
gradient at rtol 1e-5 (f32, highest matmul precision), and after STEPS adam
steps the same losses and parameters. Each side is one jitted program (the
steps in a `lax.scan`, the first step's gradients kept), so a case is one
compile of the plan; the single program's side is shared by the plans of one
model and batch.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import numpy as np
import pytest

import jax_overlap
from jax_overlap._src import _compat
from jax_overlap._src.patterns.pipeline import loss as _loss
from jax_overlap._src.patterns.pipeline import residuals as _residuals

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples"))
import llama_4d  # noqa: E402

optax = pytest.importorskip("optax")

STEPS, LR = 3, 1e-2
TOL = dict(rtol=1e-5, atol=1e-6)
# Adam moves each parameter by about LR whatever the size of its gradient, so
# where a gradient is near 0 (a sum that cancels) its rounding decides much
# of the step: parameters after the steps are compared to 5% of one step
# (measured: at most 1.7% of a step, on a few of the experts' weights, with
# every gradient within TOL). The losses of the steps are compared at TOL.
AFTER_TOL = dict(rtol=1e-5, atol=5e-2 * LR)


def _steps(loss_fn):
  """jit of (params, tokens, targets) -> (the STEPS losses, the first step's
  gradients, the parameters after STEPS adam steps)."""
  opt = optax.adam(LR)

  def run(params, tokens, targets):
    def step(carry, _):
      params, state = carry
      value, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), (value, grads)
    (params, _), (values, grads) = jax.lax.scan(
        step, (params, opt.init(params)), None, length=STEPS)
    return values, jax.tree.map(lambda g: g[0], grads), params
  return jax.jit(run)


def _inputs(plan):
  cfg = llama_4d.config_for(plan)
  params = llama_4d.init(cfg, jax.random.key(0))
  tokens, targets = llama_4d.batch(cfg, jax.random.key(1), llama_4d.batch_size(plan), 16)
  return cfg, params, tokens, targets


@functools.cache
def _single_program(cfg, rows):
  plan_like = next(p for p in llama_4d.PLANS.values()
                   if llama_4d.config_for(p) == cfg and llama_4d.batch_size(p) == rows)
  _, params, tokens, targets = _inputs(plan_like)
  with jax.default_matmul_precision("highest"):
    return jax.device_get(_steps(llama_4d.loss)(params, tokens, targets))


def _assert_trees_close(got, want, what, tol=TOL):
  for path, a in jax.tree_util.tree_leaves_with_path(got):
    b = want
    for k in path:
      b = b[k.key]
    np.testing.assert_allclose(a, b, **tol, err_msg=f"{what}{jax.tree_util.keystr(path)}")


# On older jax: the psum plan (no ring in a stage; the cheapest compile).
@pytest.mark.newest_jax(older_jax=["test_plan_equals_the_single_program[pp_dp_tp]"])
@pytest.mark.parametrize("name", [
    "pp_fsdp_tp",
    pytest.param("pp_fsdp_cp", marks=pytest.mark.slow),
    "pp_dp_tp",
    pytest.param("pp_fsdp_ep", marks=pytest.mark.slow),
])
def test_plan_equals_the_single_program(name):
  plan = llama_4d.PLANS[name]
  cfg, params, tokens, targets = _inputs(plan)
  with jax.default_matmul_precision("highest"):
    values, grads, after = jax.device_get(
        _steps(plan.loss)(plan.place(params), tokens, targets))
  want_values, want_grads, want_after = _single_program(cfg, tokens.shape[0])
  np.testing.assert_allclose(values, want_values, **TOL)
  _assert_trees_close(plan.unstage(grads), want_grads, "gradient ")
  _assert_trees_close(plan.unstage(after), want_after, f"after {STEPS} steps ", AFTER_TOL)
  assert values[-1] < values[0]          # it trains


@pytest.mark.slow
@pytest.mark.newest_jax
def test_the_tpu_default_recompute_equals_the_single_program(monkeypatch):
  """On TPU `pipeline_loss` recomputes a stage keeping what its all-to-alls
  received (residuals.py `choose_recompute`): the MoE plan (`expert_stream`
  and `fsdp_scan` in its stages) under that choice, on the CPU devices."""
  chosen = []

  def as_on_tpu(recompute, exchanges=False):
    with monkeypatch.context() as m:
      m.setattr(_compat, "trace_device", lambda: ("tpu", None))
      chosen.append(_residuals.choose_recompute(recompute, exchanges))
    return chosen[-1]
  monkeypatch.setattr(_loss, "choose_recompute", as_on_tpu)
  test_plan_equals_the_single_program("pp_fsdp_ep")
  assert chosen and all(c is jax_overlap.all_to_alls_saveable for c in chosen)


def test_plans_lay_the_same_parameters_out():
  """Each plan's layout holds the model's parameters, each leaf split as its
  dimensions' names say, and unstage undoes stage."""
  for name, plan in llama_4d.PLANS.items():
    cfg = llama_4d.config_for(plan)
    params = llama_4d.init(cfg, jax.random.key(0))
    _assert_trees_close(plan.unstage(plan.stage(params)), params, f"{name} ")
    specs = plan.specs(params)
    assert specs["embed"] == specs["head"] == jax.sharding.PartitionSpec()
    for leaf, spec in specs["blocks"].items():
      assert spec[0] == "pp", (name, leaf, spec)
      dims = llama_4d.dims_of(params["blocks"], leaf)
      assert ("fsdp" in spec) == ("fsdp" in plan.axes and "model" in dims), (name, leaf)


@pytest.mark.parametrize("axes, message", [
    ({"pp": 2, "tp": 2, "cp": 2}, "one of 'tp' / 'cp' / 'ep'"),
    ({"pp": 2, "fsdp": 2, "dp": 2}, "one of 'fsdp' / 'dp'"),
    ({"pp": 2, "sp": 2}, "the axes are"),
])
def test_a_plan_names_its_axes(axes, message):
  with pytest.raises(ValueError, match=message):
    llama_4d.Plan(axes)
