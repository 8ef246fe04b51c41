"""`PipelinePlan`: a schedule as a table of actions, one a tick and device.

`table[t][d]` is what device d runs at tick t: an `Action`, a `Pair`
(DualPipeV's F&B cell: a forward and a backward of different microbatches
at one tick) or None. The planner (placing.py) makes the table from each
schedule's order (orders.py); the executor (executor.py, through
buffers.py) runs it and reads nothing else. `simulate` times the table's
orders under other costs; `key`/`deps` name what an action makes and waits
for, which the planner and `simulate` share. Pinned by
tests/patterns/pipeline/pipeline_schedule_test.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jax_overlap._src.patterns.pipeline.actions import (B, F, I, W, Action,
                                                       Pair, device_chunk,
                                                       global_stage, parts)


class Simulation(NamedTuple):
  """What `PipelinePlan.simulate` returns."""
  makespan: float
  bubble_fraction: float          # idle time over makespan * stages
  peak_activations: tuple[int, ...]  # per device: most microbatches live at once


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """A pipeline schedule: `table[t][d]` is device d's `Action` at tick t, a
  `Pair` (DualPipeV's F&B: a forward and a backward in one tick) or None
  (idle).

  Example:
    >>> import jax_overlap
    >>> plan = jax_overlap.pipeline_schedule("1f1b", stages=2, microbatches=3)
    >>> print(plan)   # what pipeline_loss runs: one kind of action a tick
    tick  stage 0  stage 1
       0  F0       .
       1  F1       F0
       2  .        B0
       3  F2       F1
       4  B0       B1
       5  .        F2
       6  B1       B2
       7  B2       .
    >>> plan.simulate().bubble_fraction   # (p-1)/(m+p-1)
    0.25
  """
  schedule: str
  stages: int
  microbatches: int
  virtual_stages: int
  send_ticks: int | None     # None: one kind of action a tick, alternating
  table: tuple[tuple[Action | Pair | None, ...], ...]
  placement: str = "chunk-major"   # where the global stages sit (actions.py)

  @property
  def ticks(self) -> int:
    return len(self.table)

  def device_orders(self) -> list[list[tuple[int, Action | Pair]]]:
    """Per device, its (tick, cell) in tick order (a cell: an Action or a
    Pair)."""
    return [[(t, row[d]) for t, row in enumerate(self.table) if row[d]]
            for d in range(self.stages)]

  def __str__(self):
    cols = [f"stage {d}" for d in range(self.stages)]
    cells = [[str(a) if a else "." for a in row] for row in self.table]
    width = max([len(c) for c in cols] + [len(c) for r in cells for c in r])
    lines = ["tick  " + "  ".join(c.ljust(width) for c in cols).rstrip()]
    for t, row in enumerate(cells):
      lines.append(f"{t:4d}  " + "  ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)

  def simulate(self, forward: float = 1.0, backward_input: float = 1.0,
               backward_weight: float = 1.0, send: float | None = None,
               forward_backward: float | None = None) -> Simulation:
    """Times each device's actions, in the table's order, under these costs
    (B costs backward_input + backward_weight; a Pair, DualPipeV's F&B
    cell, `forward_backward`, by default its two parts' sum, less where the
    two overlap; `send` is a stage-to-stage
    transfer's time, `send_ticks` by default). Returns the makespan, the
    bubble fraction and each device's peak live activations (a microbatch's
    activations on a chunk are live from its F's start to the end of its B,
    or of its W)."""
    send = float(self.send_ticks or 0) if send is None else send
    cost = {F: forward, B: backward_input + backward_weight,
            I: backward_input, W: backward_weight}
    finish: dict = {}
    free = [0.0] * self.stages
    busy = [0.0] * self.stages
    spans = [dict() for _ in range(self.stages)]
    for t, row in enumerate(self.table):
      for d, cell in enumerate(row):
        acts = parts(cell)
        if not acts:
          continue
        start = free[d]
        for made, dev in cell_deps(cell, d, self.stages, self.virtual_stages,
                                   self.placement):
          start = max(start, finish[made] + (send if dev != d else 0.0))
        paired = len(acts) == 2 and forward_backward is not None
        end = start + (forward_backward if paired
                       else sum(cost[a.kind] for a in acts))
        free[d] = end
        busy[d] += end - start
        for a in acts:
          finish[key(a, d, self.stages, self.placement)] = end
          span = spans[d].setdefault((a.microbatch, a.chunk), [start, end])
          if a.kind in (B, W):
            span[1] = end
    makespan = max(free)
    bubble = 1.0 - sum(busy) / (makespan * self.stages)
    return Simulation(makespan, bubble, tuple(_peak(s.values()) for s in spans))


def key(a: Action, d: int, p: int, placement: str = "chunk-major"):
  """What `a` on device d makes: ('F' or 'grad' or 'W', microbatch, global
  stage)."""
  kind = "grad" if a.kind in (B, I) else a.kind
  return kind, a.microbatch, global_stage(d, a.chunk, p, placement)


def deps(a: Action, d: int, p: int, v: int, placement: str = "chunk-major"):
  """(key, device) of what `a` waits for (a device equal to d: no send)."""
  g = global_stage(d, a.chunk, p, placement)
  if a.kind == F:
    return [] if g == 0 else [(("F", a.microbatch, g - 1),
                               device_chunk(g - 1, p, placement)[0])]
  if a.kind == W:
    return [(("grad", a.microbatch, g), d)]
  deps = [(("F", a.microbatch, g), d)]
  if g < p * v - 1:
    deps.append((("grad", a.microbatch, g + 1),
                 device_chunk(g + 1, p, placement)[0]))
  return deps


def cell_deps(cell, d: int, p: int, v: int, placement: str = "chunk-major"):
  """`_deps` of each part of a cell (a Pair's parts are of different
  microbatches: neither waits for the other)."""
  return [dep for a in parts(cell) for dep in deps(a, d, p, v, placement)]


def _peak(spans) -> int:
  events = sorted([(e, -1) for _, e in spans] + [(s, 1) for s, _ in spans])
  live = peak = 0
  for _, step in events:
    live += step
    peak = max(peak, live)
  return peak
