"""The overlap report names a pipeline's ticks and shows its bubble."""

import jax
import pytest

import jax_overlap
from jax_overlap._src.inspection.report import timeline
from jax_overlap._src.patterns.pipeline import placing as plan_lib, tick_names
from pipeline_model import model, pipelined_loss

P_, M = 2, 4


@pytest.fixture(scope="module")
def report():
  params, xs, ts = model(P_, M)
  return jax_overlap.overlap_report(jax.jit(jax.grad(pipelined_loss(P_))),
                                    hardware="h100")(params, xs, ts)


def _row(plan, t):
  return tuple("." if a is None else str(a) for a in plan.table[t])


def test_each_send_names_its_tick_and_every_stage_action(report):
  plan = plan_lib.pipeline_schedule("1f1b", P_, M)
  named = [tick_names.parse(c.leaf) for c in report.collectives
           if c.kind == "collective-permute"]
  assert named and None not in named
  for t, row in named:
    assert row == _row(plan, t)
  sending = {t for t, tick in enumerate(plan.table) if any(
      a is not None and (a.kind == "F" and d < P_ - 1 or a.kind == "B" and d > 0)
      for d, a in enumerate(tick))}
  assert {t for t, _ in named} == sending


def test_the_timeline_has_a_row_a_stage_with_the_bubble_idle(report):
  plan = plan_lib.pipeline_schedule("1f1b", P_, M)
  rows, events = timeline._rows_and_events(report)
  last = max(tick_names.parse(c.leaf)[0] for c in report.collectives
             if tick_names.parse(c.leaf))
  assert rows[1:1 + P_] == [f"stage {d}" for d in range(P_)]
  for d in range(P_):
    mine = [e for e in events if e.row == f"stage {d}"]
    assert len(mine) == last + 1          # up to the last tick that sends
    for t, e in enumerate(mine):
      if e.category == "loop":                          # a tick that sends nothing
        continue
      assert (e.category == "idle") == (plan.table[t][d] is None), (t, d, e)
      assert e.name.startswith(f"tick {t}:")
    assert all(a.end >= a.start and b.start == a.end for a, b in zip(mine, mine[1:]))
  trace = timeline.trace_events(report)["traceEvents"]
  assert any(e.get("name") == "tick 0: F0" for e in trace)


def test_the_label_round_trips():
  plan = plan_lib.pipeline_schedule("interleaved", 2, 4, 2)
  row = plan.table[3]
  assert tick_names.parse(tick_names.label(3, "cotangents", row)) == (3, _row(plan, 3))
  assert tick_names.parse("['w1']") is None and tick_names.parse(None) is None


def test_a_note_said_once_for_all_ticks(report):
  """A switch a tick is one cond written once: one note, with its count."""
  conds = [n for n in report.notes if n.startswith("A cond")]
  assert len(conds) == 1 and "conds)" in conds[0], conds
