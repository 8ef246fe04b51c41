"""What the executor needs from a plan, tick by tick: each device's branch,
its buffer slot, and the sends.

A device keeps the stage inputs of the microbatches it holds (and their
output cotangents) in `slots` rows; a (microbatch, chunk) takes a row from
the moment its input is written (a received send's `done()`, or its F on
global stage 0) to its last backward action, and rows are reused, so the
rows a device needs are the schedule's live activations, not m (1F1B's
memory flat in m). A send made at tick t is finished (`done()`) after tick
t+1's compute unless a device needs it at tick t+1; then before. A
DualPipeV F&B cell (a Pair) gives its device two parts at one tick: the
forward in Tick's per-device fields, the backward in `Tick.second`, each with
its own microbatch, chunk and row. Pinned by
tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

import dataclasses
import heapq

from jax_overlap._src.patterns.pipeline.actions import (B, F, I, device_chunk,
                                                       global_stage, parts)
from jax_overlap._src.patterns.pipeline.plan import PipelinePlan

#: The executor's branches (a device runs one a tick).
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, I_FIRST, I_MID, W_ANY = range(9)


@dataclasses.dataclass(frozen=True)
class Send:
  """One send at a tick, one ppermute: `buffer` "inputs" (activations to
  the next stage) or "dys" (cotangents to the stage before), `perm` pairs
  (source, destination), empty where the hand-over stays on the device
  (ZB-V's turn: the device writes its own output, no collective),
  `slots[d]` the row device d writes the received value into (-1: none),
  `deferred`: finished after the next tick's compute."""
  buffer: str
  perm: tuple[tuple[int, int], ...]
  slots: tuple[int, ...]
  deferred: bool

  @property
  def local(self) -> bool:
    return not self.perm

  @property
  def what(self) -> str:
    return "activations" if self.buffer == "inputs" else "cotangents"


@dataclasses.dataclass(frozen=True)
class Tick:
  branch: tuple[int, ...]       # per device, one of IDLE .. W_ANY
  microbatch: tuple[int, ...]
  chunk: tuple[int, ...]
  slot: tuple[int, ...]
  #: The tick's sends: activations first, then cotangents. One a direction
  #: on the chunk-major placement; on ZB-V's V a device may receive from
  #: both neighbours at a tick, so each way along the devices is a send of
  #: its own, and the turn is a local one.
  sends: tuple[Send, ...] = ()
  #: DualPipeV's F&B cells: the backward half of each device's Pair
  #: (branch IDLE where the device runs one action or none); () where the
  #: tick holds no Pair. The fields above then hold the Pair's forward.
  second: tuple[tuple[int, ...], ...] = ()   # (branch, microbatch, chunk, slot)


@dataclasses.dataclass(frozen=True)
class Program:
  ticks: tuple[Tick, ...]
  slots: int


def _branch(kind: str, g: int, last: int) -> int:
  if kind == F:
    return F_FIRST if g == 0 else F_LAST if g == last else F_MID
  if kind in (B, I):
    first = g == 0
    return (B_FIRST if first else B_MID) if kind == B else (
        I_FIRST if first else I_MID)
  return W_ANY


def _route(src: int, dst: int, placement: str) -> int:
  """Which send of its buffer a transfer from device `src` to `dst` rides:
  0 local; on the chunk-major ring every other one is one send (1), on the
  V one a way (1 down the devices, -1 up), so no device receives twice
  from one send."""
  if src == dst:
    return 0
  return 1 if placement != "v" or dst > src else -1


def program(plan: PipelinePlan) -> Program:
  """The executor's per-tick tables for `plan`."""
  p, v, placement = plan.stages, plan.virtual_stages, plan.placement
  last = p * v - 1
  dev = lambda g: device_chunk(g, p, placement)[0]
  at = {}   # (kind, microbatch, global stage) -> tick
  for t, row in enumerate(plan.table):
    for d, cell in enumerate(row):
      for a in parts(cell):
        at[("grad" if a.kind in (B, I) else a.kind, a.microbatch,
            global_stage(d, a.chunk, p, placement))] = t
  sends = {}     # (tick, buffer, route) -> list of (src, dst, key on dst)
  for (kind, i, g), t in at.items():
    if kind == F and g < last:
      sends.setdefault((t, "inputs", _route(dev(g), dev(g + 1), placement)),
                       []).append((g, g + 1, ("F", i, g + 1)))
    if kind == "grad" and g > 0:
      sends.setdefault((t, "dys", _route(dev(g), dev(g - 1), placement)),
                       []).append((g, g - 1, ("grad", i, g - 1)))
  written = {}   # (microbatch, global stage) -> tick after whose compute its row is written
  for (kind, i, g), t in at.items():
    if kind == F and g == 0:
      written[(i, g)] = t - 1
  deferred = {}
  for (t, buffer, route), items in sends.items():
    deferred[(t, buffer, route)] = route != 0 and all(
        at[key] > t + 1 for _, _, key in items)
    if buffer == "inputs":
      for _, _, (_, i, g) in items:
        written[(i, g)] = t + deferred[(t, buffer, route)]
  released = {}
  for (kind, i, g), t in at.items():   # a row's last reader: its F, B or W
    released[(i, g)] = max(released.get((i, g), -1), t)
  slot_of, slots = _assign_slots(written, released, p, dev)
  by_tick: dict = {}
  for key in sorted(sends, key=lambda k: (k[0], k[1] == "dys", k[2])):
    by_tick.setdefault(key[0], []).append(
        _send(sends[key], key[1], deferred[key], slot_of, p, dev))
  ticks = []
  for t, row in enumerate(plan.table):
    cols = [[], []]   # per part: (branch, microbatch, chunk, slot) per device
    for d, cell in enumerate(row):
      acts = parts(cell)
      for k in range(2):
        if k >= len(acts):
          cols[k].append((IDLE, 0, 0, 0))
          continue
        a = acts[k]
        g = global_stage(d, a.chunk, p, placement)
        cols[k].append((_branch(a.kind, g, last), a.microbatch, a.chunk,
                        slot_of[(a.microbatch, g)]))
    first = tuple(zip(*cols[0]))
    second = tuple(zip(*cols[1]))
    if set(second[0]) == {IDLE}:
      second = ()
    ticks.append(Tick(*first, tuple(by_tick.get(t, ())), second))
  return Program(tuple(ticks), slots)


def _send(items, buffer, deferred, slot_of, p, dev) -> Send:
  slots = [-1] * p
  perm = []
  for src, dst, (_, i, g) in items:
    if dev(src) != dev(dst):
      perm.append((dev(src), dev(dst)))
    slots[dev(dst)] = slot_of[(i, g)]
  return Send(buffer, tuple(sorted(perm)), tuple(slots), deferred)


def _assign_slots(written, released, p, dev):
  """Rows by greedy interval colouring per device: a row written after tick
  w is free again for a write after tick r, its last reader."""
  slot_of = {}
  count = 0
  for d in range(p):
    held = sorted((w, key) for key, w in written.items() if dev(key[1]) == d)
    free: list[int] = []
    busy: list[tuple[int, int]] = []   # (released, row)
    rows = 0
    for w, key in held:
      while busy and busy[0][0] <= w:
        heapq.heappush(free, heapq.heappop(busy)[1])
      row = heapq.heappop(free) if free else rows
      rows = max(rows, row + 1)
      slot_of[key] = row
      heapq.heappush(busy, (released.get(key, w), row))
    count = max(count, rows)
  return slot_of, count
