"""The report's hint for `pipeline_loss`'s own sums over the pipeline axis.

Under `jax.value_and_grad` with respect to `xs`, `pipeline_loss`'s backward
rule sums the gradient of `xs` over the pipeline axis (each device holds
its stages' part; `xs` is replicated over the axis). Read as autodiff's
sum of a replicated input, the hint said to shard those inputs over the
axis, which `pipeline_loss` refuses for `xs`. Its sums now carry a leaf
(patterns/pipeline/tick_names.py `sum_label`), and the hint says what they
are (summary.py `_pipeline_sums`), in the written and the compiled schedule.
"""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.inspection.report import analysis
from jax_overlap._src.patterns.pipeline import tick_names
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss
from pipeline_model import mesh, mse, model, pipelined_loss, stage

P_, M = 2, 4


def _hints(report) -> list[str]:
  text = str(report).split("What to change:\n")[1].split("\n\n")[0]
  return [h[4:] for h in text.splitlines() if h.startswith("  - ")]


@pytest.mark.parametrize("schedule", ["written", "compiled"])
def test_the_sum_of_xs_gradient_is_not_told_to_shard_xs(schedule):
  params, xs, ts = model(P_, M)
  step = jax.jit(jax.value_and_grad(pipelined_loss(P_), argnums=(0, 1)))
  report = jax_overlap.overlap_report(step, hardware="h100",
                                      schedule=schedule)(params, xs, ts)
  hints = _hints(report)
  # No hint says to shard the summed inputs, or to make the sums futures.
  assert not any("shard those weights" in h for h in hints), hints
  assert not any("psum_start" in h for h in hints), hints
  ours = [h for h in hints if "that pipeline_loss writes" in h]
  assert len(ours) == 1, hints
  assert "the gradient" in ours[0] and "xs" in ours[0], ours
  assert "pipeline_loss refuses xs and targets sharded over that axis" in ours[0]
  assert "nothing to change" in ours[0]
  # (compiled, XLA:CPU combines it with the loss's sum: the leaf names both)
  sums = [c for c in report.collectives
          if "the gradient of xs" in tick_names.summed(c.leaf)]
  assert sums, [(c.start, c.leaf) for c in report.collectives]
  assert all(c.kind == "all-reduce" and analysis.FROM_AUTODIFF not in c.flags
             for c in sums), [(c.kind, c.flags) for c in sums]


def test_the_written_schedule_names_each_sum():
  # The loss (only the last stage holds it) and the gradients of xs and of
  # targets, one all-reduce each before the compiler combines them.
  params, xs, ts = model(P_, M)
  step = jax.jit(jax.value_and_grad(pipelined_loss(P_), argnums=(0, 1, 2)))
  report = jax_overlap.overlap_report(step, hardware="tpu-v5e")(params, xs, ts)
  leaves = sorted(c.leaf for c in report.collectives if c.kind == "all-reduce")
  assert leaves == ["pipeline_loss sum: the gradient of targets",
                    "pipeline_loss sum: the gradient of xs",
                    "pipeline_loss sum: the loss"], leaves
  (ours,) = [h for h in _hints(report) if "that pipeline_loss writes" in h]
  assert "over the devices of its pipeline axis, each holding its stages' " \
      "part, they sum the loss and the gradients of targets and xs." in ours, ours


def test_a_combined_sums_leaf_names_each_part():
  assert tick_names.summed("pipeline_loss sum: the loss") == ("the loss",)
  assert tick_names.summed(
      "pipeline_loss sum: the loss+pipeline_loss sum: the gradient of xs") == (
          "the loss", "the gradient of xs")
  # one of them not the pipeline's: not a pipeline sum
  assert tick_names.summed("pipeline_loss sum: the loss+['w']") == ()
  assert tick_names.summed("['w']") == tick_names.summed(None) == ()


def test_xs_sharded_over_the_pipeline_axis_is_refused():
  # What the hint relies on: pipeline_loss refuses xs sharded over its axis.
  params, xs, ts = model(P_, M)
  body = lambda q, x, t: pipeline_loss(stage, mse, q, x, t, axis="pp")
  run = jax.shard_map(body, mesh=mesh(P_), in_specs=(P("pp"), P("pp"), P()),
                      out_specs=P())
  with pytest.raises(ValueError, match="xs"):
    jax.jit(run)(jax_overlap.pipeline_stage_layout(params, P_), xs, ts)


def test_the_sum_of_a_closed_over_tables_gradient_is_the_pipelines():
  # An embedding table `before` closes over, replicated over the pipeline
  # axis: its gradient is summed over it like xs's.
  params, xs, ts = model(P_, M)
  table = jax.numpy.ones((10, xs.shape[-1]))
  tokens = jax.numpy.arange(xs.size // xs.shape[-1]).reshape(xs.shape[:-1]) % 10

  def loss(params, table, tokens, ts):
    body = lambda q, table, x, t: pipeline_loss(
        stage, mse, q, x, t, axis="pp", before=lambda i: table[i])
    return jax.shard_map(body, mesh=mesh(P_), in_specs=(P("pp"), P(), P(), P()),
                         out_specs=P())(
        jax_overlap.pipeline_stage_layout(params, P_), table, tokens, ts)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  report = jax_overlap.overlap_report(step, hardware="h100")(params, table,
                                                             tokens, ts)
  leaves = {c.leaf for c in report.collectives if c.kind == "all-reduce"}
  assert "pipeline_loss sum: the gradient of what before closes over" in leaves, \
      leaves
  (ours,) = [h for h in _hints(report) if "that pipeline_loss writes" in h]
  assert "the gradients of targets and what before closes over" in ours, ours
  assert not any("shard those weights" in h for h in _hints(report))
