"""Pictures of the measured timeline: per device, the union of its compute
and each collective's kernels, as a PNG or a trace for ui.perfetto.dev.
Times are measured, relative to the first event."""

from __future__ import annotations

import json
import os

_COLOURS = {"compute": "#4C78A8", "comm": "#F58518"}


def _origin(report) -> float:
  starts = [s for t in report.timelines for s, _ in t.compute]
  starts += [o.start for t in report.timelines for o in t.occurrences]
  return min(starts, default=0.0)


def trace_events(report) -> dict:
  """The measured timeline in Trace Event Format (microseconds)."""
  t0, events = _origin(report), []
  for t in report.timelines:
    events.append({"ph": "M", "name": "process_name", "pid": t.device,
                   "args": {"name": f"device {t.device} (measured)"}})
    for tid, name in ((1, "compute (union of streams)"), (2, "collectives")):
      events.append({"ph": "M", "name": "thread_name", "pid": t.device,
                     "tid": tid, "args": {"name": name}})
    for start, end in t.compute:
      events.append({"ph": "X", "name": "compute", "cat": "compute",
                     "pid": t.device, "tid": 1, "ts": (start - t0) * 1e6,
                     "dur": (end - start) * 1e6})
    for occ in t.occurrences:
      for start, end in occ.spans:
        events.append({"ph": "X", "name": occ.key[1], "cat": occ.kind,
                       "pid": t.device, "tid": 2, "ts": (start - t0) * 1e6,
                       "dur": (end - start) * 1e6})
  return {"traceEvents": events, "displayTimeUnit": "ns",
          "otherData": {"source": report.source, "measured": True}}


def write_trace(report, path: str | os.PathLike) -> None:
  with open(path, "w") as f:
    json.dump(trace_events(report), f)


def write_png(report, path: str | os.PathLike) -> None:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    raise ImportError("drawing a timeline needs matplotlib: "
                      "pip install matplotlib") from None
  t0, scale = _origin(report), 1e6
  rows = [(f"device {t.device} compute", "compute",
           [((s - t0) * scale, (e - s) * scale) for s, e in t.compute])
          for t in report.timelines]
  rows += [(f"device {t.device} collectives", "comm",
            [((s - t0) * scale, (e - s) * scale)
             for o in t.occurrences for s, e in o.spans])
           for t in report.timelines]
  rows.sort(key=lambda r: r[0])
  fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
  for k, (_, what, spans) in enumerate(rows):
    ax.broken_barh(spans, (k - 0.4, 0.8), color=_COLOURS[what])
  ax.set_yticks(range(len(rows)), [r[0] for r in rows])
  ax.set_xlabel("us (measured)")
  ax.set_title(f"measured: {os.path.basename(report.source)} ({report.backend})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
