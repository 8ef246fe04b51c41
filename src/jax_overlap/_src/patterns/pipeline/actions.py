"""One step of a pipeline schedule: what a device does at a tick."""

from __future__ import annotations

from typing import NamedTuple

#: Forward; backward (input and weight gradients together); the backward's
#: input-gradient half; its weight-gradient half (zero-bubble schedules).
F, B, I, W = "F", "B", "I", "W"
KINDS = (F, B, I, W)


class Action(NamedTuple):
  """`kind` of microbatch `microbatch` on `chunk` (the device's `chunk`-th
  virtual stage: global stage `chunk * stages + device`, or in ZB-V's V
  `device` for chunk 0 and `2 stages - 1 - device` for chunk 1)."""
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self):
    return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class Pair(NamedTuple):
  """DualPipeV's "F&B" cell: a forward and a backward (B or I) of one
  device's two chunks, of different microbatches, run in one tick so that
  one's communication can hide behind the other's compute. Printed
  `F3.1+B2`."""
  forward: Action
  backward: Action

  def __str__(self):
    return f"{self.forward}+{self.backward}"


def parts(cell) -> tuple[Action, ...]:
  """The actions of a table cell: () idle, (a,) one action, (F, B) a Pair."""
  if cell is None:
    return ()
  return tuple(cell) if isinstance(cell, Pair) else (cell,)


#: Where the global stages sit. "chunk-major": stage j*p + d is chunk j of
#: device d (interleaved). "v": stage d is chunk 0 of device d and stage
#: 2p-1-d its chunk 1 (ZB-V, DualPipeV), so device 0 holds the first and the last stage
#: and the turn from stage p-1 to stage p stays on device p-1.
PLACEMENTS = ("chunk-major", "v")


def placement_of(schedule: str) -> str:
  """The placement `schedule` runs on."""
  return "v" if schedule in ("zb-v", "dualpipev") else "chunk-major"


def global_stage(device: int, chunk: int, stages: int,
                 placement: str = "chunk-major") -> int:
  """The global stage of `chunk` on `device` under `placement`, as the layout
  helper stacks them (layout.py)."""
  if placement == "v":
    return device if chunk == 0 else 2 * stages - 1 - device
  return chunk * stages + device


def device_chunk(stage: int, stages: int,
                 placement: str = "chunk-major") -> tuple[int, int]:
  """(device, chunk) of global stage `stage`: the inverse of `global_stage`."""
  if placement == "v":
    return (stage, 0) if stage < stages else (2 * stages - 1 - stage, 1)
  return stage % stages, stage // stages
