"""`compile().as_text()`'s short form of an async op, written as the dump does.

A dump file writes an async op that is not a collective (a fusion, a slice)
as `%fusion-start = ((A, B), C) async-start(%a, %b), calls=%async_computation`,
the wrapped op alone in `%async_computation`. `as_text()` of the same compile
writes the wrapped op's opcode and attributes on the start itself:
`%fusion-start = ((A, B), C, u32[]) fusion-start(%a, %b), kind=kLoop,
calls=%fused_computation` (TPU: `slice-start(...)`, where the dump has
`async-start` of a slice). `expand_async_sugar` rewrites the short form into
the explicit one (names kept; a computation `<start>.wrapped` holds the
wrapped op), so both read the same from here on: the same async thread runs
the same fusion with the same cost.

Collectives' short forms (`all-gather-start`, `reduce-scatter-start`, ...),
`copy-start`, `send`/`recv` and the explicit `async-start`/`call-start` are
left alone; `schedule/pairing.py` reads them.

    >>> from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
    >>> m = parse_hlo_text('''HloModule m, is_scheduled=true
    ... %f (p: f32[8]) -> f32[8] {
    ...   %p = f32[8] parameter(0)
    ...   ROOT %n = f32[8] negate(%p)
    ... }
    ... ENTRY %e (x: f32[8]) -> f32[8] {
    ...   %x = f32[8] parameter(0)
    ...   %s = ((f32[8]), f32[8], u32[]) fusion-start(%x), kind=kLoop, calls=%f
    ...   ROOT %d = f32[8] fusion-done(%s)
    ... }''')
    >>> s = m.entry.by_name["s"]
    >>> s.opcode, s.callees("calls"), [i.opcode for i in m.computations["s.wrapped"].instructions]
    ('async-start', ['s.wrapped'], ['parameter', 'fusion'])
"""

from __future__ import annotations

from jax_overlap._src.inspection.reading.hlo_module import (
    HloComputation, HloInstruction, HloModule)

_LEFT_ALONE = frozenset({
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-broadcast", "ragged-all-to-all",
    "copy", "async", "call"})
# Attributes that describe the async op, not the wrapped one.
_OF_THE_START = ("metadata", "backend_config", "frontend_attributes",
                 "async_execution_thread", "sharding", "statistics")


def expand_async_sugar(module: HloModule) -> None:
  """Rewrites every short-form async start of `module` in place."""
  for comp in list(module.computations.values()):
    for instr in comp.instructions:
      wrapped = _wrapped_opcode(instr)
      if wrapped is not None:
        _expand(instr, wrapped, comp, module)


def _wrapped_opcode(instr: HloInstruction) -> str | None:
  op = instr.opcode
  if not op.endswith("-start"):
    return None
  base = op[:-len("-start")]
  if base in _LEFT_ALONE or not instr.shape.is_tuple or \
      len(instr.shape.elements) < 2:
    return None
  return base


def _expand(start, wrapped, comp, module) -> None:
  name = f"{start.name}.wrapped"
  if name in module.computations:
    return
  operand_shapes = start.shape.elements[0]
  shapes = operand_shapes.elements if operand_shapes.is_tuple else (operand_shapes,)
  params = []
  for k, operand in enumerate(start.operands):
    shape = shapes[k] if k < len(shapes) else comp.by_name[operand].shape
    params.append(HloInstruction(
        name=f"{name}.param.{k}", opcode="parameter", shape=shape, operands=(),
        attributes={}, line_number=start.line_number, operand_text=str(k)))
  attributes = {k: v for k, v in start.attributes.items() if k not in _OF_THE_START}
  inner = HloInstruction(
      name=f"{name}.{wrapped}", opcode=wrapped, shape=start.shape.elements[1],
      operands=tuple(p.name for p in params), attributes=attributes,
      is_root=True, line_number=start.line_number, text=start.text)
  module.computations[name] = HloComputation(
      name, params + [inner], execution_thread=comp.execution_thread,
      line_number=start.line_number)
  start.opcode = "async-start"
  start.attributes = {k: v for k, v in start.attributes.items()
                      if k in _OF_THE_START}
  start.attributes["calls"] = f"%{name}"
  for other in comp.instructions:
    if other.opcode == f"{wrapped}-done" and start.name in other.operands:
      other.opcode = "async-done"
