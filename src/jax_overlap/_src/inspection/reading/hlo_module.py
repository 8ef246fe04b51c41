"""What we keep of a scheduled HLO module: computations of instructions in order.

Both readers build these: `hlo_text.py` from a dump, `live.py` from a live
compile. Attribute values stay as their text; `attributes.py` reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from jax_overlap._src.inspection.reading.shapes import Shape

MAIN_THREAD = "main"

# Attributes that name computations, and what the callee is to the caller.
_CALLEE_ATTRIBUTES = ("calls", "to_apply", "body", "condition",
                      "branch_computations", "true_computation",
                      "false_computation", "called_computations")


@dataclasses.dataclass
class HloInstruction:
  """One instruction. `operands` are names (no '%'); `attributes` raw text;
  `operand_text` what stands between the opcode's brackets (a constant's
  literal, a parameter's number). `trip_count` is set on a `while` whose
  count its condition says (`trip_counts.py`), for loops without XLA's
  `known_trip_count`."""

  name: str
  opcode: str
  shape: Shape
  operands: tuple[str, ...]
  attributes: dict[str, str]
  is_root: bool = False
  line_number: int = 0
  text: str = ""
  shape_text: str = ""
  operand_text: str = ""
  trip_count: int | None = None

  def callees(self, *keys: str) -> list[str]:
    """Names of the computations this instruction calls through `keys`
    (default: every attribute that names computations)."""
    names = []
    for key in keys or _CALLEE_ATTRIBUTES:
      value = self.attributes.get(key)
      if value is None:
        continue
      value = value.strip()
      if value.startswith("{"):
        value = value[1:-1]
      names += [v.strip().lstrip("%") for v in value.split(",") if v.strip()]
    return names


@dataclasses.dataclass
class HloComputation:
  """A computation; `instructions` in the order the text (or the schedule)
  gives them, which for a scheduled module is the schedule."""

  name: str
  instructions: list[HloInstruction]
  is_entry: bool = False
  execution_thread: str = MAIN_THREAD
  line_number: int = 0

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instructions}
    self.position = {i.name: k for k, i in enumerate(self.instructions)}

  @property
  def root(self) -> HloInstruction:
    for instr in self.instructions:
      if instr.is_root:
        return instr
    return self.instructions[-1]

  @property
  def parameters(self) -> list[HloInstruction]:
    return [i for i in self.instructions if i.opcode == "parameter"]

  def users(self) -> dict[str, list[tuple[HloInstruction, int]]]:
    """name -> [(user, operand index)], in schedule order."""
    out: dict[str, list[tuple[HloInstruction, int]]] = {}
    for instr in self.instructions:
      for k, operand in enumerate(instr.operands):
        out.setdefault(operand, []).append((instr, k))
    return out


@dataclasses.dataclass
class HloModule:
  """A module: its header attributes and its computations by name."""

  name: str
  attributes: dict[str, str]
  computations: dict[str, HloComputation]
  source: str = "<text>"
  #: the dump's stack-frame tables (`stack_frames.StackFrames`), or None
  stack_frames: Any = None

  @property
  def entry(self) -> HloComputation:
    for comp in self.computations.values():
      if comp.is_entry:
        return comp
    raise LookupError("module has no ENTRY computation")

  @property
  def is_scheduled(self) -> bool:
    return self.attributes.get("is_scheduled", "").strip() == "true"

  def instructions(self) -> Iterator[tuple[HloComputation, HloInstruction]]:
    for comp in self.computations.values():
      for instr in comp.instructions:
        yield comp, instr

  def _count(self, key: str) -> int:
    try:
      return max(1, int(self.attributes.get(key, "1")))
    except ValueError:
      return 1

  @property
  def num_devices(self) -> int:
    """Partitions times replicas, from the header (1 when it says nothing)."""
    return self._count("num_partitions") * self._count("replica_count")
