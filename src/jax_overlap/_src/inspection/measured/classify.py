"""What a timed event ran: a collective (and which), compute, or neither.

With the module's HLO, an event's `hlo_op` is looked up: its opcode says
(a collective started through `async-start` counts as that start). Without
it, the opcode the event's own text gives (TPU names events by their HLO
text) says, else the name: `all-gather-start.1`, `psum_invariant.7`,
`ncclDevKernel_AllGather_RING_LL(...)`, Triton-named collectives.

Example:
  >>> kind_from_name("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)")
  'all-gather'
  >>> kind_from_name("all-reduce-done.2"), kind_from_name("fusion.3")
  (None, None)
"""

from __future__ import annotations

import re

from jax_overlap._src.inspection.reading.hlo_module import HloModule

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
         "collective-permute")
# Squeezed (lower case, no '-', '_' or space) name pieces, most specific first.
_NAME_PIECES = (
    ("reducescatter", "reduce-scatter"), ("psumscatter", "reduce-scatter"),
    ("allgather", "all-gather"), ("allreduce", "all-reduce"),
    ("psum", "all-reduce"), ("pmax", "all-reduce"), ("pmin", "all-reduce"),
    ("alltoall", "all-to-all"), ("collectivepermute", "collective-permute"),
    ("ppermute", "collective-permute"), ("sendrecv", "collective-permute"),
    ("collectivebroadcast", "collective-permute"))
_DONE = re.compile(r"-done(\.\d+)?$")
_COLLECTIVE_OPCODES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-permute"}
# Ops that run nothing of their own, or whose event spans what they call.
_NOT_COMPUTE = {"parameter", "constant", "tuple", "get-tuple-element",
                "bitcast", "while", "call", "conditional", "opt-barrier",
                "after-all", "add-dependency", "send", "recv", "send-done",
                "recv-done", "partition-id", "replica-id"}
_CONTROL_FLOW_NAME = re.compile(r"^(while|conditional|call|cond)([._-]|$)")


def kind_from_name(name: str) -> str | None:
  """The collective kind a name says, or None (a done, or not a collective)."""
  if _DONE.search(name):
    return None
  squeezed = re.sub(r"[-_\s]", "", name.split("(")[0].lower())
  for piece, kind in _NAME_PIECES:
    if piece in squeezed:
      return kind
  return None


class OpKinds:
  """Classifies one module's events; `module` None classifies by names."""

  def __init__(self, module: HloModule | None):
    self.module = module
    self.opcodes: dict[str, str] = {}
    self.alias: dict[str, str] = {}
    if module is None:
      return
    for comp, instr in module.instructions():
      self.opcodes[instr.name] = instr.opcode
      if instr.opcode in ("async-start", "call-start"):
        for callee in instr.callees("calls", "called_computations"):
          inner = module.computations.get(callee)
          for wrapped in inner.instructions if inner else ():
            if wrapped.opcode in _COLLECTIVE_OPCODES:
              self.alias[wrapped.name] = instr.name
              self.opcodes[instr.name] = wrapped.opcode + "-start"

  def instruction(self, op: str) -> str:
    """The instruction an op's event is reported under."""
    return self.alias.get(op, op)

  def collective_kind(self, hlo_op: str | None, event_name: str,
                      event_opcode: str | None = None) -> str | None:
    """The kind if the event ran a collective's transfer, else None;
    `event_opcode` is the opcode the event's text gives, if any."""
    if hlo_op is not None and self.module is not None:
      opcode = self.opcodes.get(self.instruction(hlo_op))
      if opcode is not None:
        return _COLLECTIVE_OPCODES.get(opcode)
    if event_opcode is not None and event_opcode not in ("async-start", "fusion",
                                                         "custom-call"):
      return _COLLECTIVE_OPCODES.get(event_opcode)
    if hlo_op is not None:
      return kind_from_name(hlo_op)
    return kind_from_name(event_name)

  def is_compute(self, hlo_op: str | None, event_opcode: str | None = None) -> bool:
    """Whether a non-collective event is compute (it keeps the device busy):
    not a loop, call or conditional (their events span their bodies', whose
    own events count), nor a done (a wait)."""
    if hlo_op is None:
      return False
    opcode = self.opcodes.get(hlo_op) if self.module is not None else None
    opcode = opcode or event_opcode
    if opcode is not None:
      return opcode not in _NOT_COMPUTE and not opcode.endswith("-done")
    return not (_DONE.search(hlo_op) or _CONTROL_FLOW_NAME.match(hlo_op))

  def is_async(self, op: str) -> bool:
    opcode = self.opcodes.get(self.instruction(op), re.sub(r"\.\d+$", "", op))
    return opcode.endswith("-start")
