"""What the executor needs from a plan, tick by tick: each device's branch,
its buffer slot, and the sends.

A device keeps the stage inputs of the microbatches it holds (and their
output cotangents) in `slots` rows; a (microbatch, chunk) takes a row from
the moment its input is written (a received send's `done()`, or its F on
global stage 0) to its last backward action, and rows are reused, so the
rows a device needs are the schedule's live activations, not m (1F1B's
memory flat in m). A send made at tick t is finished (`done()`) after tick
t+1's compute unless a device needs it at tick t+1; then before. Pinned by
tests/patterns/pipeline/pipeline_loss_test.py.
"""

from __future__ import annotations

import dataclasses
import heapq

from jax_overlap._src.patterns.pipeline.actions import (B, F, I, device_chunk,
                                                       global_stage)
from jax_overlap._src.patterns.pipeline.plan import PipelinePlan

#: The executor's branches (a device runs one a tick).
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, I_FIRST, I_MID, W_ANY = range(9)


@dataclasses.dataclass(frozen=True)
class Send:
  """One direction's send at a tick: `perm` pairs (source, destination),
  `slots[d]` the row device d writes the received value into (-1: none),
  `deferred`: finished after the next tick's compute."""
  perm: tuple[tuple[int, int], ...]
  slots: tuple[int, ...]
  deferred: bool


@dataclasses.dataclass(frozen=True)
class Tick:
  branch: tuple[int, ...]       # per device, one of IDLE .. W_ANY
  microbatch: tuple[int, ...]
  chunk: tuple[int, ...]
  slot: tuple[int, ...]
  forward: Send | None          # activations to the next stage
  backward: Send | None         # cotangents to the stage before


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


def program(plan: PipelinePlan) -> Program:
  """The executor's per-tick tables for `plan`."""
  p, v = plan.stages, plan.virtual_stages
  last = p * v - 1
  at = {}   # (kind, microbatch, global stage) -> tick
  for t, row in enumerate(plan.table):
    for d, a in enumerate(row):
      if a is not None:
        at[("grad" if a.kind in (B, I) else a.kind, a.microbatch,
            global_stage(d, a.chunk, p))] = t
  sends = {}     # (direction, tick) -> list of (src, dst, key on dst)
  for (kind, i, g), t in at.items():
    if kind == F and g < last:
      sends.setdefault(("fwd", t), []).append((g, g + 1, ("F", i, g + 1)))
    if kind == "grad" and g > 0:
      sends.setdefault(("bwd", t), []).append((g, g - 1, ("grad", i, g - 1)))
  written = {}   # (microbatch, global stage) -> tick after whose compute its row is written
  for (kind, i, g), t in at.items():
    if kind == F and g == 0:
      written[(i, g)] = t - 1
  deferred = {}
  for (direction, t), items in sends.items():
    deferred[(direction, t)] = all(at[key] > t + 1 for _, _, key in items)
    if direction == "fwd":
      for _, dst, (_, i, g) in items:
        written[(i, g)] = t + deferred[(direction, t)]
  released = {}
  for (kind, i, g), t in at.items():   # a row's last reader: its F, B or W
    released[(i, g)] = max(released.get((i, g), -1), t)
  slot_of, slots = _assign_slots(written, released, p)
  ticks = []
  for t, row in enumerate(plan.table):
    branch, mb, ch, sl = [], [], [], []
    for d, a in enumerate(row):
      if a is None:
        branch.append(IDLE)
        mb.append(0)
        ch.append(0)
        sl.append(0)
        continue
      g = global_stage(d, a.chunk, p)
      branch.append(_branch(a.kind, g, last))
      mb.append(a.microbatch)
      ch.append(a.chunk)
      sl.append(slot_of[(a.microbatch, g)])
    ticks.append(Tick(tuple(branch), tuple(mb), tuple(ch), tuple(sl),
                      _send(sends, deferred, slot_of, "fwd", t, p),
                      _send(sends, deferred, slot_of, "bwd", t, p)))
  return Program(tuple(ticks), slots)


def _send(sends, deferred, slot_of, direction, t, p) -> Send | None:
  items = sends.get((direction, t))
  if not items:
    return None
  slots = [-1] * p
  perm = []
  for src, dst, (_, i, g) in items:
    perm.append((device_chunk(src, p)[0], device_chunk(dst, p)[0]))
    slots[device_chunk(dst, p)[0]] = slot_of[(i, g)]
  return Send(tuple(sorted(perm)), tuple(slots), deferred[(direction, t)])


def _assign_slots(written, released, p):
  """Rows by greedy interval colouring per device: a row written after tick
  w is free again for a write after tick r, its last reader."""
  slot_of = {}
  count = 0
  for d in range(p):
    held = sorted((w, key) for key, w in written.items() if key[1] % p == d)
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
