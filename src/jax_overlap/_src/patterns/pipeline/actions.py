"""One step of a pipeline schedule: what a device does at a tick."""

from __future__ import annotations

from typing import NamedTuple

#: Forward; backward (input and weight gradients together); the backward's
#: input-gradient half; its weight-gradient half (zero-bubble schedules).
F, B, I, W = "F", "B", "I", "W"
KINDS = (F, B, I, W)


class Action(NamedTuple):
  """`kind` of microbatch `microbatch` on `chunk` (the device's `chunk`-th
  virtual stage, global stage `chunk * stages + device`)."""
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self):
    return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def global_stage(device: int, chunk: int, stages: int) -> int:
  """The global stage of `chunk` on `device`: chunk-major, as the layout
  helper stacks them (layout.py)."""
  return chunk * stages + device


def device_chunk(stage: int, stages: int) -> tuple[int, int]:
  """Inverse of `global_stage`."""
  return stage % stages, stage // stages
