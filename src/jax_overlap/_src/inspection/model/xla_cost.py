"""Flops and bytes of one instruction from XLA's own cost analysis.

For a live compile: the instruction (with the computations it calls) is
copied into a module of its own, its operands made parameters, and XLA's
`hlo_module_cost_analysis` run on it with the compiling client. Where the
jaxlib lacks the pieces, or XLA reports no cost (-1, as for most custom
calls), the cost model falls back to shapes; where the client cannot analyse
at all (the TPU's PJRT C API: `UNIMPLEMENTED: PJRT C API does not support
GetHloCostAnalysis`), `failure` keeps XLA's words and no instruction is
asked again, and the report says its costs came from shapes
(report/analysis.py, `said_cost_source`).
"""

from __future__ import annotations

from jax_overlap._src.inspection.reading.hlo_module import (
    MAIN_THREAD, HloComputation, HloInstruction, HloModule)

LABEL = "XLA's cost analysis of each instruction"
_DROP = ("metadata", "control-predecessors", "sharding", "frontend_attributes")


def _xla_functions():
  """(hlo_module_from_text, hlo_module_cost_analysis) or None."""
  try:
    from jax._src.lib import _jax  # noqa: PLC0415
    from jaxlib import _hlo  # noqa: PLC0415
    return _hlo.hlo_module_from_text, _jax.hlo_module_cost_analysis
  except (ImportError, AttributeError):
    return None


class XlaCosts:
  """A `CostSource` for `module`, answered by XLA on `client`."""

  def __init__(self, module: HloModule, client):
    self.module = module
    self.client = client
    self.functions = _xla_functions()
    #: XLA's words when the client cannot analyse at all (then not asked again).
    self.failure: str | None = None

  @property
  def available(self) -> bool:
    return self.functions is not None and self.client is not None

  def __call__(self, instr: HloInstruction,
               comp: HloComputation) -> tuple[float, float] | None:
    if not self.available or self.failure is not None:
      return None
    from_text, analyse = self.functions
    try:
      costs = analyse(self.client, from_text(single_instruction_module(
          instr, comp, self.module)))
    except Exception as e:  # noqa: BLE001 - any failure: fall back to shapes
      if "UNIMPLEMENTED" in str(e):
        self.failure = " ".join(str(e).split())[:200]
      return None
    # XLA leaves out what is zero (an elementwise fusion has no "flops");
    # -1, or no bytes at all, is a cost it does not know.
    flops = costs.get("flops", 0.0)
    nbytes = costs.get("bytes accessed", -1.0)
    if flops < 0 or nbytes < 0:
      return None
    return float(flops), float(nbytes)


def single_instruction_module(instr: HloInstruction, comp: HloComputation,
                              module: HloModule) -> str:
  """HLO text of a module whose entry is `instr` on parameters."""
  lines = ["HloModule single_instruction", ""]
  for name in _callees_in_order(instr, module):
    callee = module.computations[name]
    lines.append(f"%{name} {{")
    lines += ["  " + render(i) for i in callee.instructions]
    thread = "" if callee.execution_thread == MAIN_THREAD else \
        f', execution_thread="{callee.execution_thread}"'
    lines += ["}" + thread, ""]
  lines.append("ENTRY %single {")
  params = []
  for k, operand in enumerate(instr.operands):
    shape = comp.by_name[operand].shape_text
    lines.append(f"  %p{k} = {shape} parameter({k})")
    params.append(f"%p{k}")
  lines.append("  " + render(instr, params, root=True))
  lines.append("}")
  return "\n".join(lines)


def render(instr: HloInstruction, operands: list[str] | None = None,
           root: bool | None = None) -> str:
  """An instruction as HLO text, without metadata and scheduling hints."""
  if operands is None:
    inner = instr.operand_text if not instr.operands else \
        ", ".join(f"%{o}" for o in instr.operands)
  else:
    inner = ", ".join(operands)
  attributes = "".join(f", {k}={v}" for k, v in instr.attributes.items()
                       if k not in _DROP)
  is_root = instr.is_root if root is None else root
  return (f"{'ROOT ' if is_root else ''}%{instr.name} = {instr.shape_text} "
          f"{instr.opcode}({inner}){attributes}")


def _callees_in_order(instr: HloInstruction, module: HloModule) -> list[str]:
  """Computations `instr` calls, transitively, callees before callers."""
  order: list[str] = []

  def visit(name):
    if name in order:
      return
    for inner in module.computations[name].instructions:
      for callee in inner.callees():
        visit(callee)
    order.append(name)

  for callee in instr.callees():
    visit(callee)
  return order
