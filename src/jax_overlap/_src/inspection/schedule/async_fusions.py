"""TPU async collectives written as a chain of `kCustom` fusions.

On TPU an async all-gather or all-reduce is not an `all-gather-start` /
`-done` pair but a chain of fusions, each holding a copy of the collective
in its fused body:

* the *start*, a fusion whose body's root is
  `custom-call(...), custom_call_target="AsyncCollectiveStart"`;
* zero or more *continuations*, fusions whose backend config has a
  `continuation_config`: they carry the collective's state (the start's
  output tuple) through and fuse some of the program's compute beside it
  (`operand_original_start..end` are the compute's operands,
  `output_tuple_original_start..end` its results, both inclusive);
* the *done*, a fusion whose body's root is
  `custom-call(...), custom_call_target="AsyncCollectiveDone"`; its result is
  the collective's.

The chain is one collective: its bytes are those of the collective inside
(not the state tuples), and the compute fused into its continuations is
compute it overlapped. `pairing.py` follows the state from start to done.

    >>> from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
    >>> m = parse_hlo_text('''HloModule m, is_scheduled=true
    ... %s (p: f32[2]) -> (f32[2], f32[16]) {
    ...   %p = f32[2] parameter(0)
    ...   %ag = f32[16] all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
    ...   ROOT %cc = (f32[2], f32[16]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
    ... }
    ... ENTRY %e (x: f32[2]) -> (f32[2], f32[16]) {
    ...   %x = f32[2] parameter(0)
    ...   ROOT %f = (f32[2], f32[16]) fusion(%x), kind=kCustom, calls=%s
    ... }''')
    >>> f = m.entry.by_name["f"]
    >>> chain_role(f, m), fused_collective(f, m).name
    ('start', 'ag')
"""

from __future__ import annotations

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.reading.hlo_module import HloInstruction, HloModule

START_TARGET = "AsyncCollectiveStart"
DONE_TARGET = "AsyncCollectiveDone"
MARKER_TARGETS = frozenset({START_TARGET, DONE_TARGET})
_COLLECTIVES = frozenset({
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-broadcast", "ragged-all-to-all"})


def chain_role(instr: HloInstruction, module: HloModule) -> str | None:
  """'start', 'continuation' or 'done' for a link of an async collective
  fusion chain; None for anything else."""
  if instr.opcode != "fusion":
    return None
  body = _body(instr, module)
  if body is not None:
    root = body.root
    if root.opcode == "custom-call":
      target = attrs.string_attribute(root, "custom_call_target")
      if target == START_TARGET:
        return "start"
      if target == DONE_TARGET:
        return "done"
  if _continuation_config(instr) is not None and fused_collective(instr, module):
    return "continuation"
  return None


def is_marker(instr: HloInstruction) -> bool:
  """The custom call that marks a fused body as a chain's start or done:
  bookkeeping, not compute."""
  return instr.opcode == "custom-call" and \
      attrs.string_attribute(instr, "custom_call_target") in MARKER_TARGETS


def fused_collective(instr: HloInstruction, module: HloModule) -> HloInstruction | None:
  """The collective in a chain link's fused body."""
  body = _body(instr, module)
  if body is None:
    return None
  for inner in body.instructions:
    if inner.opcode in _COLLECTIVES:
      return inner
  return None


def state_operands(instr: HloInstruction) -> set[int] | None:
  """The operand indices of a continuation that carry the chain's state
  (all but the fused compute's); None when all of them may."""
  return _outside(instr, "operand_original_start", "operand_original_end",
                  len(instr.operands))


def state_outputs(instr: HloInstruction) -> set[int] | None:
  """The output tuple indices of a continuation that carry the state."""
  n = len(instr.shape.elements) if instr.shape.is_tuple else 0
  return _outside(instr, "output_tuple_original_start",
                  "output_tuple_original_end", n)


def compute_outputs(instr: HloInstruction) -> set[int]:
  """The output tuple indices of a continuation that are its fused
  compute's results (the program reads them)."""
  n = len(instr.shape.elements) if instr.shape.is_tuple else 0
  state = state_outputs(instr)
  return set() if state is None else set(range(n)) - state


def fused_compute(instr: HloInstruction, module: HloModule) -> list[str]:
  """Names of the compute instructions fused into a continuation's body
  beside the collective (what the chain overlaps inside it)."""
  body = _body(instr, module)
  if body is None:
    return []
  skip = _COLLECTIVES | {"parameter", "tuple", "get-tuple-element", "constant",
                         "bitcast"}
  return [i.name for i in body.instructions
          if i.opcode not in skip and not is_marker(i)]


def _body(instr, module):
  callees = instr.callees("calls")
  return module.computations.get(callees[0]) if callees else None


def _continuation_config(instr):
  config = attrs.backend_config(instr).get("continuation_config")
  return config if isinstance(config, dict) else None


def _outside(instr, first_key, last_key, n) -> set[int] | None:
  config = _continuation_config(instr)
  if config is None:
    return None
  try:
    first, last = int(config[first_key]), int(config[last_key])
  except (KeyError, TypeError, ValueError):
    return None
  return {k for k in range(n) if not first <= k <= last}
