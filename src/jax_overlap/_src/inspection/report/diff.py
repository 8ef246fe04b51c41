"""What changed between two reports of the same program (say, before and
after a flag): collectives whose overlap or exposed time moved.

Collectives are matched by kind and start/done names; those left over are
matched by kind and order (XLA renames instructions between compiles).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jax_overlap._src.inspection.report.overlap_report import OverlapReport
from jax_overlap._src.inspection.report.records import CollectiveRecord
from jax_overlap._src.inspection.report.table import format_seconds, same_time

_TOTALS = ("comm_s", "exposed_s", "bound_exposed_s", "serial_link_bound_s")


@dataclasses.dataclass
class CollectiveChange:
  """One collective present in both reports whose window or time moved."""

  kind: str
  a: CollectiveRecord
  b: CollectiveRecord

  @property
  def gained(self) -> list[str]:
    return [n for n in self.b.overlapped if n not in self.a.overlapped]

  @property
  def lost(self) -> list[str]:
    return [n for n in self.a.overlapped if n not in self.b.overlapped]

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.kind,
            "start": [self.a.start, self.b.start],
            "done": [self.a.done, self.b.done],
            "async": [self.a.is_async, self.b.is_async],
            "overlapped": [self.a.overlapped, self.b.overlapped],
            "exposed_s": [self.a.exposed_s, self.b.exposed_s],
            "comm_s": [self.a.comm_s, self.b.comm_s]}


@dataclasses.dataclass
class ReportDiff:
  """`a` against `b`: changed pairs, pairs only in one, unchanged count."""

  a: OverlapReport
  b: OverlapReport
  changed: list[CollectiveChange]
  only_in_a: list[CollectiveRecord]
  only_in_b: list[CollectiveRecord]
  unchanged: int

  def to_dict(self) -> dict[str, Any]:
    return {
        "a": self.a.source, "b": self.b.source,
        "modelled": (f"all times are modelled on {self.a.hardware.name}, "
                     "not measured"),
        "changed": [c.to_dict() for c in self.changed],
        "only_in_a": [c.to_dict() for c in self.only_in_a],
        "only_in_b": [c.to_dict() for c in self.only_in_b],
        "unchanged": self.unchanged,
        "totals": {k: [self.a.totals[k], self.b.totals[k]] for k in _TOTALS},
    }

  def __str__(self) -> str:
    lines = [f"A: {self.a.source}", f"B: {self.b.source}",
             f"(times modelled on {self.a.hardware.name}, not measured)", ""]
    for c in self.changed:
      name = c.a.start if c.a.start == c.b.start else f"{c.a.start} / {c.b.start}"
      lines.append(f"changed  {c.kind} {name}")
      if c.a.is_async != c.b.is_async:
        lines.append(f"  async: {c.a.is_async} -> {c.b.is_async}")
      if c.gained or c.lost:
        moved = [f"+{n}" for n in c.gained] + [f"-{n}" for n in c.lost]
        lines.append(f"  overlapped: {len(c.a.overlapped)} -> "
                     f"{len(c.b.overlapped)} ops ({', '.join(moved)})")
      if not same_time(c.a.exposed_s, c.b.exposed_s):
        lines.append(f"  exposed: {format_seconds(c.a.exposed_s)} -> "
                     f"{format_seconds(c.b.exposed_s)} "
                     f"({_signed(c.b.exposed_s - c.a.exposed_s)})")
    for label, records in (("only in A", self.only_in_a),
                           ("only in B", self.only_in_b)):
      for r in records:
        lines.append(f"{label}  {r.kind} {r.start} -> {r.done} (exposed "
                     f"{format_seconds(r.exposed_s)})")
    if self.changed or self.only_in_a or self.only_in_b:
      lines.append("")
    lines.append(f"{self.unchanged} collective(s) unchanged.")
    names = {"comm_s": "communication", "exposed_s": "exposed",
             "bound_exposed_s": "no schedule can hide",
             "serial_link_bound_s": "serial-link bound"}
    for key in _TOTALS:
      a, b = self.a.totals[key], self.b.totals[key]
      change = "no change" if same_time(a, b) else _signed(b - a)
      lines.append(f"{names[key]}: {format_seconds(a)} -> "
                   f"{format_seconds(b)} ({change})")
    return "\n".join(lines) + "\n"


def diff_reports(a: OverlapReport, b: OverlapReport) -> ReportDiff:
  """The collectives whose overlap or exposed time differ from `a` to `b`."""
  pairs, left_a, left_b = _match(a.collectives, b.collectives)
  changed, unchanged = [], 0
  for ra, rb in pairs:
    if _same(ra, rb):
      unchanged += 1
    else:
      changed.append(CollectiveChange(ra.kind, ra, rb))
  return ReportDiff(a, b, changed, left_a, left_b, unchanged)


def _match(a: list[CollectiveRecord], b: list[CollectiveRecord]):
  by_name = {(r.kind, r.start, r.done): r for r in b}
  pairs, left_a = [], []
  for r in a:
    other = by_name.pop((r.kind, r.start, r.done), None)
    if other is None:
      left_a.append(r)
    else:
      pairs.append((r, other))
  left_b = [r for r in b if (r.kind, r.start, r.done) in by_name]
  # What is left is matched by kind, in schedule order.
  queues = collections.defaultdict(list)
  for r in left_b:
    queues[r.kind].append(r)
  still_a = []
  for r in left_a:
    if queues[r.kind]:
      pairs.append((r, queues[r.kind].pop(0)))
    else:
      still_a.append(r)
  still_b = [r for q in queues.values() for r in q]
  return pairs, still_a, still_b


def _same(a: CollectiveRecord, b: CollectiveRecord) -> bool:
  """Same window, same kind of start, and exposed times the model cannot
  tell apart (`table.same_time`)."""
  return (a.overlapped == b.overlapped and a.is_async == b.is_async
          and same_time(a.exposed_s, b.exposed_s))


def _signed(seconds: float) -> str:
  return ("+" if seconds >= 0 else "-") + format_seconds(abs(seconds))
