"""`PipelinePlan`: a schedule as a table of actions, one a tick and device.

The planner places each device's order (orders.py) on ticks: an action runs
at the first tick its inputs are there, a stage-to-stage send arriving
`send_ticks` ticks after the tick that made it. With `send_ticks=None` (what
`pipeline_loss` runs by default for 1F1B and interleaved) every tick holds one
kind of action, forward and backward ticks alternating where both are ready:
a send then has a tick of the other kind to be in flight over (only the
warm-up's and the drain's are waited for), the table has the literature's
tick count, and devices of a collective group never run different actions
(lockstep costs nothing). Zero-bubble's W's are placed
here: a device runs a pending W where its next F or I cannot run, or where an
F would hold more activations than 1F1B's stage 0 (so the peak stays
1F1B's).
ZB-V (`_place_zero_bubble_v`) has no fixed order: on its V (device d holds
stages d and 2p-1-d, actions.py) each device runs, of what is ready, an I,
else a forward under twice 1F1B's peak in chunks, else a pending W; under
unit costs and free sends its table is 6m+p-1 ticks, the least any table
on the V can be (device p-1 runs 6m actions and starts at tick p-1 at the
earliest).
DualPipeV's order (orders.py) holds F&B cells, `Pair`s of a forward and a
backward run at one tick; a Pair waits for both parts' inputs.
`simulate` times the same orders under other costs. Pinned by
tests/patterns/pipeline/pipeline_schedule_test.py.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import NamedTuple

from jax_overlap._src.patterns.pipeline import orders as _orders
from jax_overlap._src.patterns.pipeline.actions import (B, F, I, W, Action,
                                                       Pair, device_chunk,
                                                       global_stage, parts,
                                                       placement_of)


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
        for key, dev in _cell_deps(cell, d, self.stages, self.virtual_stages,
                                   self.placement):
          start = max(start, finish[key] + (send if dev != d else 0.0))
        paired = len(acts) == 2 and forward_backward is not None
        end = start + (forward_backward if paired
                       else sum(cost[a.kind] for a in acts))
        free[d] = end
        busy[d] += end - start
        for a in acts:
          finish[_key(a, d, self.stages, self.placement)] = end
          span = spans[d].setdefault((a.microbatch, a.chunk), [start, end])
          if a.kind in (B, W):
            span[1] = end
    makespan = max(free)
    bubble = 1.0 - sum(busy) / (makespan * self.stages)
    return Simulation(makespan, bubble, tuple(_peak(s.values()) for s in spans))


def _key(a: Action, d: int, p: int, placement: str = "chunk-major"):
  kind = "grad" if a.kind in (B, I) else a.kind
  return kind, a.microbatch, global_stage(d, a.chunk, p, placement)


def _deps(a: Action, d: int, p: int, v: int, placement: str = "chunk-major"):
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


def _cell_deps(cell, d: int, p: int, v: int, placement: str = "chunk-major"):
  """`_deps` of each part of a cell (a Pair's parts are of different
  microbatches: neither waits for the other)."""
  return [dep for a in parts(cell) for dep in _deps(a, d, p, v, placement)]


def _peak(spans) -> int:
  events = sorted([(e, -1) for _, e in spans] + [(s, 1) for s, _ in spans])
  live = peak = 0
  for _, step in events:
    live += step
    peak = max(peak, live)
  return peak


#: The schedules whose default table has one kind of action a tick.
ALTERNATING = ("1f1b", "interleaved", "forward")


def default_send_ticks(schedule: str) -> int | None:
  """What `send_ticks=None` means for `schedule`: one kind a tick (None)
  for 1F1B and interleaved; a tick a send (1) for GPipe, whose sends all
  feed the next tick, ZB-H1 and ZB-V, whose W's fill ticks beside F's
  and I's, and DualPipeV, whose F&B cells hold both kinds."""
  return None if schedule in ALTERNATING else 1


def place(schedule: str, p: int, m: int, v: int, send_ticks: int | None,
          placement: str | None = None) -> PipelinePlan:
  """Places the schedule's orders on ticks (see the module docstring).
  `placement`: where the stages sit, the schedule's by default (the
  forward-only plan of a ZB-V loss runs on the V)."""
  placement = placement or placement_of(schedule)
  if schedule == "zb-v":
    return _place_zero_bubble_v(p, m, send_ticks)
  if send_ticks is None:
    return _place_alternating(schedule, p, m, v, placement)
  order = _orders.orders(schedule, p, m, v, send_ticks)
  zero_bubble = schedule == "zb-h1"
  # zb-h1 keeps every device's live activations under 1F1B's peak, stage 0's
  # (Qi et al. count memory as the pipeline's peak, not each stage's).
  cap = min(m, (p - 1) * (1 + send_ticks) + 1)
  done_at: dict = {}
  pointer = [0] * p
  pending_w: list[deque] = [deque() for _ in range(p)]
  live = [0] * p
  todo = sum(len(o) for o in order) + (m * p if zero_bubble else 0)
  table = []
  limit = 8 * (todo + p * (send_ticks + 2))
  while todo:
    t = len(table)
    if t > limit:
      raise AssertionError(f"{schedule}: no progress placing ({p}, {m}, {v})")
    row: list[Action | Pair | None] = [None] * p
    for d in range(p):
      nxt = order[d][pointer[d]] if pointer[d] < len(order[d]) else None
      can = nxt is not None and all(
          key in done_at and done_at[key] + 1 + (send_ticks if dev != d else 0) <= t
          for key, dev in _cell_deps(nxt, d, p, v, placement))
      if can and zero_bubble and nxt.kind == F and live[d] >= cap:
        can = False
      if can:
        row[d] = nxt
        pointer[d] += 1
      elif zero_bubble and pending_w[d]:
        row[d] = pending_w[d].popleft()
    for d, cell in enumerate(row):
      if cell is None:
        continue
      todo -= 1
      for a in parts(cell):
        done_at[_key(a, d, p, placement)] = t
      a = cell
      if zero_bubble:
        live[d] += {F: 1, W: -1}.get(a.kind, 0)
        if a.kind == I:
          pending_w[d].append(Action(W, a.microbatch, a.chunk))
    table.append(tuple(row))
  return PipelinePlan(schedule, p, m, v, send_ticks, tuple(table), placement)


def _place_alternating(schedule: str, p: int, m: int, v: int,
                       placement: str = "chunk-major") -> PipelinePlan:
  """One kind of action a tick: the kind not run the tick before where a
  device is ready for it, else the kind most devices are ready for. 1F1B's
  warm-up is its order for sends a tick long (2 (p-1-d) forwards on device
  d): the forwards of the steady state then alternate with backwards and the
  table is 2 (m+p-1) ticks."""
  order = _orders.orders(schedule, p, m, v, 1 if schedule == "1f1b" else 0)
  done_at: dict = {}
  pointer = [0] * p
  todo = sum(len(o) for o in order)
  table: list[tuple[Action | None, ...]] = []
  last_kind = None
  while todo:
    t = len(table)
    if t > 8 * (todo + p) + len(table):
      raise AssertionError(f"{schedule}: no progress placing ({p}, {m}, {v})")
    ready: dict[str, list[int]] = {}
    for d in range(p):
      nxt = order[d][pointer[d]] if pointer[d] < len(order[d]) else None
      if nxt is not None and all(key in done_at and done_at[key] < t
                                 for key, _ in _deps(nxt, d, p, v, placement)):
        ready.setdefault(nxt.kind, []).append(d)
    row: list[Action | None] = [None] * p
    if ready:
      kind = min(ready, key=lambda k: (k == last_kind, -len(ready[k])))
      for d in ready[kind]:
        row[d] = order[d][pointer[d]]
        pointer[d] += 1
        todo -= 1
        done_at[_key(row[d], d, p, placement)] = t
      last_kind = kind
    table.append(tuple(row))
  return PipelinePlan(schedule, p, m, v, None, tuple(table), placement)


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      virtual_stages: int = 1, *,
                      send_ticks: int | None = None) -> PipelinePlan:
  """The table of a pipeline schedule: for each tick and stage, the action.

  Args:
    schedule: "gpipe", "1f1b", "interleaved" (Megatron's 1F1B over
      `virtual_stages` chunks a device), "zb-h1" (zero bubble: the backward
      split into its input gradient I and weight gradient W, each W run later
      to fill the bubbles) or "zb-v" (zero bubble on a V of two chunks a
      device: `virtual_stages=2`, device d holds stages d and 2p-1-d; its
      bubble under unit costs with free sends, (p-1)/(6m+p-1), is the least
      any table on the V has) or "dualpipev" (DeepSeek's DualPipe cut in
      half, on ZB-V's V, `virtual_stages=2`, m >= 2p: in the steady state a
      device runs a forward of one chunk and a backward of the other, of
      different microbatches, in one tick, an F&B cell printed `F3+B1.1`;
      under unit costs, an F&B costing F+B, each device idles 2(p-1) and
      holds at most 2p+1 chunk-microbatches).
    stages: p, devices along the pipeline axis (at least 2).
    microbatches: m.
    virtual_stages: v, chunks a device; global stage `j*p + d` is chunk j of
      device d (ZB-V, DualPipeV: 2, stage d chunk 0 and stage 2p-1-d chunk
      1).
    send_ticks: None (default): what `pipeline_loss` runs by default: for
      1F1B and interleaved one kind of action a tick, forward and backward
      ticks alternating, each send in flight over a tick of the other kind
      (the literature's tick count; only the warm-up's and the drain's sends
      are waited for); for GPipe, ZB-H1 and ZB-V 1. An int: ticks a send is in
      flight, each a tick of its own (0: the literature's tables with sends
      that take no time; 1: each send in flight while the next tick
      computes).

  Returns:
    A `PipelinePlan`: `print` it; `.simulate(forward=, backward_input=,
    backward_weight=)` gives `bubble_fraction` and `peak_activations`.

  Example:
    >>> import jax_overlap
    >>> plan = jax_overlap.pipeline_schedule("1f1b", 4, 8)
    >>> sim = plan.simulate()
    >>> plan.ticks, round(sim.bubble_fraction, 4), sim.peak_activations
    (22, 0.2727, (7, 5, 3, 1))
    >>> zbv = jax_overlap.pipeline_schedule("zb-v", 4, 8, 2, send_ticks=0)
    >>> sim = zbv.simulate()   # peaks in chunk-microbatches, half a stage each
    >>> zbv.ticks, round(sim.bubble_fraction, 4), sim.peak_activations
    (51, 0.0588, (8, 8, 8, 8))
    >>> dpv = jax_overlap.pipeline_schedule("dualpipev", 4, 8, 2, send_ticks=0)
    >>> sim = dpv.simulate()   # an F&B cell costs its parts' sum
    >>> dpv.ticks, sim.makespan, round(sim.bubble_fraction, 4), sim.peak_activations
    (34, 54.0, 0.1111, (9, 9, 9, 9))
  """
  _orders.check_arguments(schedule, stages, microbatches, virtual_stages)
  if send_ticks is None:
    send_ticks = default_send_ticks(schedule)
  elif not isinstance(send_ticks, int) or isinstance(send_ticks, bool) \
      or send_ticks < 0:
    raise ValueError(f"send_ticks={send_ticks!r}: expected None or an int >= 0.")
  return place(schedule, stages, microbatches, virtual_stages, send_ticks)


#: ZB-V's choice on a device at a tick: the first of these that can run (a
#: forward only under the cap), else its oldest pending W.
_V_PRIORITY = ((I, 0), (I, 1), (F, 1), (F, 0))


def _place_zero_bubble_v(p: int, m: int, send_ticks: int) -> PipelinePlan:
  """ZB-V (Qi et al.): two chunks a device on a V (actions.py), each
  backward split into I and W. A device runs, of the actions whose inputs
  are there, an I (chunk 1's first: it is nearer the loss), else a forward
  (chunk 1's first) while it holds fewer than `cap` chunk-microbatches, else
  its oldest pending W; so the warm-up runs chunk 0's forwards until chunk
  1's arrive, the steady state alternates forwards and I's, and the W's fill
  what would be bubbles. `cap` is 1F1B's stage-0 peak for these sends,
  counted in chunks (a chunk is half a stage): the peak memory stays
  1F1B's."""
  placement = "v"
  cap = 2 * min(m, (p - 1) * (1 + send_ticks) + 1)
  nxt = [dict.fromkeys(_V_PRIORITY, 0) for _ in range(p)]
  pending_w: list[deque] = [deque() for _ in range(p)]
  live = [0] * p
  done_at: dict = {}
  todo = 6 * m * p
  table: list[tuple[Action | None, ...]] = []
  while todo:
    t = len(table)
    if t > 8 * (6 * m * p + p * (send_ticks + 2)):
      raise AssertionError(f"zb-v: no progress placing ({p}, {m})")
    row: list[Action | None] = [None] * p
    for d in range(p):
      for kind, chunk in _V_PRIORITY:
        i = nxt[d][kind, chunk]
        if i >= m or (kind == F and live[d] >= cap):
          continue
        a = Action(kind, i, chunk)
        if all(key in done_at and
               done_at[key] + 1 + (send_ticks if dev != d else 0) <= t
               for key, dev in _deps(a, d, p, 2, placement)):
          row[d] = a
          nxt[d][kind, chunk] += 1
          break
      else:
        if pending_w[d]:
          row[d] = pending_w[d].popleft()
    for d, a in enumerate(row):
      if a is None:
        continue
      todo -= 1
      done_at[_key(a, d, p, placement)] = t
      live[d] += {F: 1, W: -1}.get(a.kind, 0)
      if a.kind == I:
        pending_w[d].append(Action(W, a.microbatch, a.chunk))
    table.append(tuple(row))
  return PipelinePlan("zb-v", p, m, 2, send_ticks, tuple(table), placement)
