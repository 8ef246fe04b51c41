"""Reading a TPU device plane: its lines of HLO events, named as `inspect` names them.

A `/device:TPU:N` plane of a `jax.profiler.trace` capture (libtpu 0.0.42,
jax 0.10.2, read on a v5e) holds:

- "XLA Modules": one event per run of a module, named
  `jit_<name>(<fingerprint>)`, with a `run_id` stat;
- "XLA Ops": one event per op that ran on the core, named by the whole HLO
  instruction text (`%fusion.8 = bf16[...] fusion(...), kind=kOutput, ...`),
  with no `hlo_op` or `hlo_module` stat. A loop is one `%while` event that
  spans the events of its body;
- "Async XLA Ops": one event per async pair, from its start to its done,
  named by the start's text, with `hlo_op` the done's name.

So an event's instruction and opcode are read off its text, its module and
run off the "XLA Modules" event around it, and an async pair becomes one
event whose `done` names its second half. Pinned by
tests/inspection/measure_tpu_test.py, on captures taken on the chip.

Example:
  >>> instruction("%while = (s32[]{:T(128)}, f32[8]{0}) while((s32[], f32[8]) %t), body=%b")
  ('while', 'while')
  >>> instruction("fusion.3") is None
  True
"""

from __future__ import annotations

import bisect
import re

OPS_LINE = "XLA Ops"
ASYNC_LINE = "Async XLA Ops"
MODULES_LINE = "XLA Modules"
_HEAD = re.compile(r"^(?:ROOT )?%?([^\s=%]+) = ")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_MODULE = re.compile(r"^(.*?)(?:\((\d+)\))?$")


def instruction(text: str) -> tuple[str, str] | None:
  """(name, opcode) of an HLO instruction's text; None if `text` is not one."""
  head = _HEAD.match(text)
  if head is None:
    return None
  rest = text[head.end():]
  if rest.startswith("("):           # a tuple type: skip to its closing paren
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        rest = rest[i + 1:]
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else ""
  opcode = _OPCODE.match(rest)
  return (head.group(1), opcode.group(1)) if opcode else None


def module_name(event_name: str) -> str:
  """`jit_step(1234)` -> `jit_step`: the name the module's HLO has."""
  return _MODULE.match(event_name).group(1)


class ModuleRuns:
  """The "XLA Modules" events of a plane: which module run holds a time."""

  def __init__(self, runs: list[tuple[float, float, str, int | None]]):
    self.runs = sorted(runs)
    self.starts = [r[0] for r in self.runs]

  def at(self, t: float) -> tuple[str | None, int | None]:
    k = bisect.bisect_right(self.starts, t) - 1
    if k >= 0 and t <= self.runs[k][1]:
      return self.runs[k][2], self.runs[k][3]
    return None, None


def is_tpu_ops_line(name: str) -> bool:
  return name in (OPS_LINE, ASYNC_LINE)
