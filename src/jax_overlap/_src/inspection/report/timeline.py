"""Pictures of the modelled timeline: a PNG, and a trace for ui.perfetto.dev.

Both draw the same events (`simulate.Event`): compute on its own row (one
per thread), each collective on its own row, in flight from start to done,
with the link busy and the exposed part (the stall at its done) marked.
Times are modelled, and say so. A pipeline's program (pipeline_loss) gets a
row per stage under the compute row: each tick's action, the idle ticks (the
bubble) marked idle, the ticks read from its sends' names
(patterns/pipeline/tick_names.py). Pinned by
tests/patterns/pipeline/pipeline_report_test.py.
"""

from __future__ import annotations

import json
import os

from jax_overlap._src.inspection.model.simulate import Event
from jax_overlap._src.patterns.pipeline import tick_names

_COLOURS = {"compute": "#4C78A8", "loop": "#9ecae9", "wait": "#E45756", "idle": "#f2f2f2",
            "in flight": "#d9d9d9", "transfer": "#F58518",
            "exposed": "#E45756"}
_MAX_ROWS = 40
_OTHER_ROW = "other collectives"


def _rows_and_events(report) -> tuple[list[str], list[Event]]:
  timeline = report.timeline
  rows = sorted(timeline.rows, key=lambda r: (not r.startswith("compute"),
                                             timeline.rows.index(r)))
  stages, stage_events = _pipeline_stages(report)
  n_compute = sum(r.startswith("compute") for r in rows)
  rows = rows[:n_compute] + stages + rows[n_compute:]
  keep = set(rows[:_MAX_ROWS])
  events = []
  for e in list(timeline.events) + stage_events:
    if e.row not in keep:
      e = Event(_OTHER_ROW, e.name, e.start, e.end, e.category)
    events.append(e)
  rows = rows[:_MAX_ROWS] + ([_OTHER_ROW] if len(rows) > _MAX_ROWS else [])
  return rows, events


def _pipeline_stages(report) -> tuple[list[str], list[Event]]:
  """A row per pipeline stage: at each tick its action (compute) or idle
  (the bubble). Tick t ends where its first send starts; a tick
  that sends nothing shares the time up to the next known end."""
  acts, ends = {}, {}
  first_start = {}
  for e in report.timeline.events:
    first_start[e.row] = min(first_start.get(e.row, e.start), e.start)
  for c in report.collectives:
    found = tick_names.parse(c.leaf)
    at = first_start.get(f"{c.kind} {c.start}")
    if found is None or at is None:
      continue
    t, row = found
    acts[t] = row
    ends[t] = min(ends.get(t, at), at)
  if not acts:
    return [], []
  p = len(next(iter(acts.values())))
  last = max(acts)
  bounds, known = [], sorted(ends.items())
  begin = 0.0
  for t in range(last + 1):
    after = next(((k, v) for k, v in known if k >= t), None)
    if after is None:
      end = report.step_s
    else:
      end = begin + (after[1] - begin) / (after[0] - t + 1)
    bounds.append((begin, end))
    begin = end
  rows = [f"stage {d}" for d in range(p)]
  events = []
  for t, (start, end) in enumerate(bounds):
    row = acts.get(t)
    for d in range(p):
      if row is None:
        events.append(Event(rows[d], f"tick {t}", start, end, "loop"))
      elif row[d] == ".":
        events.append(Event(rows[d], f"tick {t}: idle (bubble)", start, end, "idle"))
      else:
        events.append(Event(rows[d], f"tick {t}: {row[d]}", start, end, "compute"))
  return rows, events


def trace_events(report) -> dict:
  """The timeline in Trace Event Format (times in microseconds)."""
  rows, events = _rows_and_events(report)
  tid = {row: k + 1 for k, row in enumerate(rows)}
  out = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
          "args": {"name": f"{report.schedule} schedule, modelled on "
                           f"{report.hardware.name} (not measured)"}}]
  for row, k in tid.items():
    out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": k,
                "args": {"name": row}})
    out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": k,
                "args": {"sort_index": k}})
  for e in events:
    out.append({"ph": "X", "name": e.name, "cat": e.category, "pid": 1,
                "tid": tid[e.row], "ts": e.start * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {"modelled": True}})
  return {"traceEvents": out, "displayTimeUnit": "ns",
          "otherData": {"source": report.source,
                        "schedule": report.schedule,
                        "hardware": report.hardware.name,
                        "note": "all times are modelled, not measured"}}


def write_trace(report, path: str | os.PathLike) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(trace_events(report), f)


def write_png(report, path: str | os.PathLike) -> None:
  """Draws the timeline with matplotlib (an optional dependency)."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415
  except ImportError:
    raise ImportError(
        "drawing the timeline needs matplotlib: pip install "
        "'jax-overlap[report]'") from None
  rows, events = _rows_and_events(report)
  y = {row: len(rows) - 1 - k for k, row in enumerate(rows)}
  scale, unit = _unit(report.step_s)
  fig, ax = plt.subplots(figsize=(10, 1.6 + 0.4 * len(rows)), dpi=80)
  for category, height, alpha in (
      ("in flight", 0.7, 1.0), ("loop", 0.7, 1.0), ("idle", 0.7, 1.0),
      ("compute", 0.7, 1.0),
      ("wait", 0.7, 1.0), ("transfer", 0.3, 1.0), ("exposed", 0.7, 0.45)):
    bars = [e for e in events if e.category == category]
    for row in rows:
      spans = [(e.start * scale, max(e.end - e.start, 0.0) * scale)
               for e in bars if e.row == row]
      if spans:
        ax.broken_barh(spans, (y[row] - height / 2, height),
                       facecolors=_COLOURS[category], alpha=alpha,
                       edgecolors="white" if category == "compute" else "none",
                       linewidth=0.3,
                       hatch="//" if category in ("wait", "exposed", "idle") else None)
  ax.set_yticks([y[r] for r in rows])
  ax.set_yticklabels([r if len(r) <= 40 else r[:37] + "..." for r in rows],
                     fontsize=8)
  ax.set_ylim(-0.6, len(rows) - 0.4)
  ax.set_xlim(0, max(report.step_s * scale, 1e-9))
  ax.set_xlabel(f"modelled time ({unit}) on {report.hardware.name}; "
                "not measured", fontsize=8)
  fig.suptitle(_title(report), fontsize=9)
  keys = [("compute", "compute"), ("in flight", "start to done"),
          ("transfer", "on the link"), ("exposed", "exposed (waiting)")]
  if any(e.category == "idle" for e in events):
    keys.append(("idle", "idle stage (bubble)"))
  ax.legend(handles=[Patch(color=_COLOURS[c], label=label) for c, label in keys],
            loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(keys), fontsize=8,
            frameon=False)
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _title(report) -> str:
  from jax_overlap._src.inspection.report.table import format_seconds  # noqa: PLC0415
  t = report.totals
  return (f"{os.path.basename(report.source)}, {report.schedule} schedule: "
          "exposed "
          f"{format_seconds(t['exposed_s'])} of "
          f"{format_seconds(t['comm_s'])} communication; a perfect schedule "
          f"exposes {format_seconds(t['bound_exposed_s'])}")


def _unit(seconds: float) -> tuple[float, str]:
  if seconds >= 1:
    return 1.0, "s"
  if seconds >= 1e-3:
    return 1e3, "ms"
  return 1e6, "us"
