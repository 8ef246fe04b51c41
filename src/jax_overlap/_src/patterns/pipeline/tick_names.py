"""How a pipeline's collectives name themselves for the report.

The executor starts tick t's sends inside `leaf_scope.moving(label(...))`,
so each collective's `leaf` in the overlap report reads e.g.
"pipeline tick 5 activations: F3 B0 . W1" (every device's action at that
tick, '.' idle, a DualPipeV F&B cell as `F3+B1.1`), in the compiled HLO and in a dump from a cluster alike;
`parse` reads it back for the timeline's per-stage rows, where the idle
ticks are the bubble. Pinned by tests/patterns/pipeline/pipeline_report_test.py.

`pipeline_loss`'s own sums (the loss, which only the last stage holds, and
the gradients of what it takes replicated over the pipeline axis: `xs`,
`targets`, values its functions close over) run inside
`moving(sum_label(...))`, "pipeline_loss sum: the gradient of xs": the
report's hint then says what they are (a pipeline needs them), not to shard
`xs` over the pipeline axis, which `pipeline_loss` refuses
(tests/patterns/pipeline/pipeline_sum_hint_test.py).
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


SUM_PREFIX = "pipeline_loss sum: "


def sum_label(what: str) -> str:
  """The leaf of one of `pipeline_loss`'s own sums (`what`: "the loss",
  "the gradient of xs", ...)."""
  return SUM_PREFIX + what


def summed(leaf: str | None) -> tuple[str, ...]:
  """What a `sum_label` leaf sums (("the gradient of xs",); several where
  XLA combined such sums and the report joined their leaves with '+'), or
  () for any other leaf."""
  if not leaf or not leaf.startswith(SUM_PREFIX):
    return ()
  parts = leaf[len(SUM_PREFIX):].split("+" + SUM_PREFIX)
  return () if any("+" in p for p in parts) else tuple(parts)
