"""How a pipeline's sends name their tick for the report.

The executor starts tick t's sends inside `leaf_scope.moving(label(...))`,
so each collective's `leaf` in the overlap report reads e.g.
"pipeline tick 5 activations: F3 B0 . W1" (every device's action at that
tick, '.' idle), in the compiled HLO and in a dump from a cluster alike;
`parse` reads it back for the timeline's per-stage rows, where the idle
ticks are the bubble. Pinned by tests/patterns/pipeline/pipeline_report_test.py.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"^pipeline tick (\d+) (activations|cotangents): (.*)$")


def label(tick: int, direction: str, row) -> str:
  """`row`: each device's action at `tick` (None: idle)."""
  return (f"pipeline tick {tick} {direction}: "
          + " ".join("." if a is None else str(a) for a in row))


def parse(leaf: str | None) -> tuple[int, tuple[str, ...]] | None:
  """(tick, each device's action or '.') from a report's `leaf`, or None."""
  m = _LABEL.match(leaf or "")
  return (int(m.group(1)), tuple(m.group(3).split())) if m else None
