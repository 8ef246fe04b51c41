"""Intervals of time and their unions, so that two streams busy at once are
counted once.

Example:
  >>> u = union([(0, 4), (2, 6), (8, 9)])
  >>> u, length(u), length(intersect(u, [(3, 8.5)]))
  ([(0, 6), (8, 9)], 7.0, 3.5)
"""

from __future__ import annotations

Interval = tuple[float, float]


def union(intervals) -> list[Interval]:
  """The sorted, disjoint union of `(start, end)` pairs."""
  out: list[list[float]] = []
  for start, end in sorted(intervals):
    if end <= start:
      continue
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(s, e) for s, e in out]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
  """The intersection of two sorted, disjoint unions."""
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if start < end:
      out.append((start, end))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def length(intervals: list[Interval]) -> float:
  """Total length of a disjoint union."""
  return sum((end - start for start, end in intervals), 0.0)
