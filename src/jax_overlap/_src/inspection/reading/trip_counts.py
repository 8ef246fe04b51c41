"""A while loop's trip count from its condition, where XLA wrote none.

GPU and CPU loops carry `backend_config={"known_trip_count":{"n":"N"}}`; TPU
loops do not: their count is in the condition and the induction variable.
This reads the common shape of a counted loop:

* the condition's root is `compare(get-tuple-element(param, i), constant(N))`
  (either side; `direction=LT`, `LE`, `GT`, `GE` or `NE`);
* element `i` of the loop's init tuple is a constant `S` (the start);
* element `i` of the body's root tuple is `add(get-tuple-element(param, i),
  constant(K))` (or `subtract`), the step `K`.

It counts the iterations from S by K until the comparison fails (XLA's
windowed-einsum loops on TPU start at 0 and step by 2, say, to 4: 2 trips).
Anything else (a fused condition, a start computed at run time) stays
unknown, and the report says so rather than guessing. Copies, bitcasts and
converts between these pieces are looked through.

    >>> from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
    >>> m = parse_hlo_text('''HloModule m, is_scheduled=true
    ... %c (p: (s32[])) -> pred[] {
    ...   %p = (s32[]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %n = s32[] constant(4)
    ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
    ... }
    ... %b (p: (s32[])) -> (s32[]) {
    ...   %p = (s32[]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %k = s32[] constant(2)
    ...   %a = s32[] add(%i, %k)
    ...   ROOT %t = (s32[]) tuple(%a)
    ... }
    ... ENTRY %e () -> (s32[]) {
    ...   %z = s32[] constant(0)
    ...   %t = (s32[]) tuple(%z)
    ...   ROOT %w = (s32[]) while(%t), condition=%c, body=%b
    ... }''')
    >>> m.computations["e"].by_name["w"].trip_count
    2
"""

from __future__ import annotations

import math

from jax_overlap._src.inspection.reading.hlo_module import (
    HloComputation, HloInstruction, HloModule)

_LOOK_THROUGH = frozenset({"copy", "bitcast", "convert", "reshape"})
# The comparison `i <op> N` with the induction variable on the left.
_SWAPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}
_MAX_TRIPS = 1 << 40


def annotate_trip_counts(module: HloModule) -> None:
  """Sets `trip_count` on every `while` whose count its condition says."""
  for comp in module.computations.values():
    for instr in comp.instructions:
      if instr.opcode == "while":
        instr.trip_count = condition_trip_count(instr, comp, module)


def condition_trip_count(loop: HloInstruction, caller: HloComputation,
                         module: HloModule) -> int | None:
  """How many times `loop` (a while in `caller`) runs its body, read from its
  condition, init tuple and body; None where they are not in counted form."""
  cond = _callee(loop, "condition", module)
  body = _callee(loop, "body", module)
  if cond is None or body is None or not loop.operands:
    return None
  compare = _through(cond.root, cond)
  if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
    return None
  direction = compare.attributes.get("direction", "").strip()
  a, b = (_through(cond.by_name.get(o), cond) for o in compare.operands)
  index, bound = _element(a), _constant(b)
  if index is None or bound is None:
    index, bound = _element(b), _constant(a)
    direction = _SWAPPED.get(direction, "")
  if index is None or bound is None or not _is_parameter_element(
      a if _element(a) == index else b, cond):
    return None
  start = _init_element(loop, caller, index)
  step = _step(body, index)
  if start is None or step is None:
    return None
  return _count(start, step, bound, direction)


def _count(start: int, step: int, bound: int, direction: str) -> int | None:
  """Iterations of `for i = start; i <direction> bound; i += step`."""
  if direction == "LT":
    span, up = bound - start, True
  elif direction == "LE":
    span, up = bound - start + 1, True
  elif direction == "GT":
    span, up = start - bound, False
  elif direction == "GE":
    span, up = start - bound + 1, False
  elif direction == "NE":
    if step == 0 or (bound - start) % step:
      return None
    n = (bound - start) // step
    return n if 0 <= n <= _MAX_TRIPS else None
  else:
    return None
  if span <= 0:
    return 0
  stride = step if up else -step
  if stride <= 0:
    return None  # it never ends, or we misread it: say unknown
  n = math.ceil(span / stride)
  return n if n <= _MAX_TRIPS else None


def _callee(instr, key, module) -> HloComputation | None:
  names = instr.callees(key)
  return module.computations.get(names[0]) if names else None


def _through(instr: HloInstruction | None, comp: HloComputation):
  """`instr` past copies, bitcasts and converts."""
  seen = 0
  while instr is not None and instr.opcode in _LOOK_THROUGH and instr.operands \
      and seen < 16:
    instr = comp.by_name.get(instr.operands[0])
    seen += 1
  return instr


def _element(instr: HloInstruction | None) -> int | None:
  """i, when `instr` is `get-tuple-element(<the parameter>, index=i)`."""
  if instr is None or instr.opcode != "get-tuple-element":
    return None
  try:
    return int(instr.attributes.get("index", "").strip())
  except ValueError:
    return None


def _constant(instr: HloInstruction | None) -> int | None:
  if instr is None or instr.opcode != "constant":
    return None
  try:
    return int(instr.operand_text.strip())
  except ValueError:
    return None


def _init_element(loop, caller, index) -> int | None:
  init = _through(caller.by_name.get(loop.operands[0]), caller)
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return None
  return _constant(_through(caller.by_name.get(init.operands[index]), caller))


def _step(body: HloComputation, index: int) -> int | None:
  root = _through(body.root, body)
  if root is None or root.opcode != "tuple" or index >= len(root.operands):
    return None
  update = _through(body.by_name.get(root.operands[index]), body)
  if update is None or update.opcode not in ("add", "subtract") or \
      len(update.operands) != 2:
    return None
  x, y = (_through(body.by_name.get(o), body) for o in update.operands)
  sign = 1 if update.opcode == "add" else -1
  if _element(x) == index and _is_parameter_element(x, body) and \
      _constant(y) is not None:
    return sign * _constant(y)
  if update.opcode == "add" and _element(y) == index and \
      _is_parameter_element(y, body) and _constant(x) is not None:
    return _constant(x)
  return None


def _is_parameter_element(instr: HloInstruction, comp: HloComputation) -> bool:
  source = comp.by_name.get(instr.operands[0]) if instr.operands else None
  return source is not None and source.opcode == "parameter"
