"""The report says where its costs came from, as it happened: XLA's cost
analysis only where XLA answered (on TPU every call fails, `UNIMPLEMENTED:
PJRT C API does not support GetHloCostAnalysis`), shapes otherwise, and per
row where a window's compute was costed otherwise than the rest."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import HardwareProfile, OverlapReport
from jax_overlap._src.inspection.model import xla_cost
from jax_overlap._src.inspection.reading.hlo_text import load_hlo
from jax_overlap._src.inspection.report import analysis

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
TPU_REFUSAL = ("UNIMPLEMENTED: PJRT C API does not support "
               "GetHloCostAnalysis")


class _Answers:
  """A stand-in for XLA's analysis: `costs(name)` -> dict, or raises."""

  def __init__(self, answer):
    self.answer = answer
    self.calls = 0

  def functions(self):
    def from_text(text):
      return text

    def analyse(client, text):
      del client
      self.calls += 1
      # The entry's root, the instruction asked about, comes last.
      root = [line for line in text.splitlines() if "ROOT %" in line][-1]
      return self.answer(root.split("=")[0].replace("ROOT %", "").strip())
    return from_text, analyse


def _report(answer):
  module = load_hlo(FIXTURES / "gpu_prefetch.txt")
  answers = _Answers(answer)
  costs = xla_cost.XlaCosts(module, client=object())
  costs.functions = answers.functions()
  report = OverlapReport.build(
      module, HardwareProfile.named("h100"), source="test", cost_source=costs,
      cost_label=xla_cost.LABEL)
  return report, answers


def test_every_call_refused_is_said_and_not_asked_again():
  def refuse(name):
    raise RuntimeError(TPU_REFUSAL)
  report, answers = _report(refuse)
  assert report.cost_source.startswith(analysis.SHAPES_LABEL), report.cost_source
  assert f"{xla_cost.LABEL} failed: {TPU_REFUSAL}" in report.cost_source
  assert answers.calls == 1          # UNIMPLEMENTED: not asked again
  assert f"from {report.cost_source}" in report.notes[0]
  assert all(c.cost_source is None for c in report.collectives)
  # The same times as a report that never asked.
  shapes = OverlapReport.from_hlo(FIXTURES / "gpu_prefetch.txt", hardware="h100")
  assert report.step_s == shapes.step_s
  assert shapes.cost_source == analysis.SHAPES_LABEL


def test_every_call_answered_is_xlas():
  report, _ = _report(lambda name: {"flops": 1e9, "bytes accessed": 1e6})
  assert report.cost_source == xla_cost.LABEL
  assert all(c.cost_source is None for c in report.collectives)


def test_some_answered_is_said_once_and_by_the_rows_it_concerns():
  # XLA knows no cost for the custom calls (-1), as on a real GPU module.
  def gemms_unknown(name):
    if name.startswith("cublas"):
      return {"flops": -1.0, "bytes accessed": -1.0}
    return {"bytes accessed": 1e6}       # no "flops": zero, as XLA writes it
  report, _ = _report(gemms_unknown)
  assert report.cost_source.startswith(f"{xla_cost.LABEL} (2 of 4; "), \
      report.cost_source
  by_start = {c.start: c for c in report.collectives}
  # The gather's window holds cublas-gemm.1 (costed from shapes).
  gather = by_start["all-gather-start"]
  assert "cublas-gemm.1" in gather.overlapped
  assert gather.cost_source == analysis.SHAPES_LABEL
  assert analysis.COSTED_FROM_SHAPES in gather.flags
  assert gather.to_dict()["cost_source"] == analysis.SHAPES_LABEL
  # The all-reduce's window is empty: nothing to say.
  assert by_start["all-reduce-start"].cost_source is None


def test_a_live_report_that_xla_could_not_cost_says_shapes(monkeypatch):
  # The TPU client: every per-instruction analysis is refused.
  def refused(client, module):
    raise RuntimeError(TPU_REFUSAL)
  functions = xla_cost._xla_functions()
  if functions is None:
    pytest.skip(f"jax {jax.__version__}'s jaxlib has no hlo_module_cost_analysis")
  monkeypatch.setattr(xla_cost, "_xla_functions",
                      lambda: (functions[0], refused))
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
  def f(w, x):
    return jnp.tanh(x @ x) @ jax.lax.all_gather(w, "d", tiled=True)
  report = jax_overlap.overlap_report(f)(jnp.ones((64, 64)), jnp.ones((64, 64)))
  assert TPU_REFUSAL in report.cost_source
  assert "XLA's cost analysis of each instruction failed" in str(report)
  monkeypatch.undo()
  live = jax_overlap.overlap_report(f)(jnp.ones((64, 64)), jnp.ones((64, 64)))
  assert live.cost_source == xla_cost.LABEL
