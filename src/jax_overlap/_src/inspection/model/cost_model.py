"""The cost model: modelled seconds for compute, collectives and async copies.

Compute is a roofline: `max(matmul time, bytes / HBM bandwidth)`, the
matmul time each matmul's flops at the rate of its class (operand type and
precision, `matmul_class.py`) and the bandwidth what memory-bound work
achieves (`HardwareProfile.memory_gbytes_per_s`). Flops and bytes come from
a `CostSource`: XLA's own cost analysis of the instruction on a live compile
(`xla_cost.py`), else `shape_costs` here:

* dot: 2 * (elements of the result) * (product of contracted sizes);
* convolution: the multiply-adds that land on real input elements
  (`convolution.py`: windows, strides, padding, dilations and groups);
* gemm custom calls (`__cublas$gemm`, `__cublas$lt$matmul`, any target naming
  gemm or matmul): as a dot, with the contracted dimensions of its
  `gemm_backend_config` (else the last of the left operand);
* a kernel's custom call that states its own flops (a Pallas TPU kernel's
  `custom_call_config.cost_estimate`, from `pallas_call(cost_estimate=...)`):
  those flops, at the profile's 'kernel' rate (a kernel does not reach
  XLA's own matmuls' rate: on the v5e our flash kernel ran at 0.70 of it);
* fusion: the dots and convolutions inside it;
* a custom call that allocates (`AllocateBuffer`): nothing;
* bytes: operands in plus result out, those in HBM (`hbm_bytes`: not the
  TPU's on-chip memory space), for all of them, except that an
  in-place update (`dynamic-update-slice`, or a fusion whose root is one, or a
  tuple of them, updating a fusion parameter, bitcasts looked through) moves
  only the slice it writes: the buffer it updates is neither read nor
  written whole. A scan stacking its residuals does one such update a step,
  and costing the whole buffer made the modelled compute grow with the
  square of the trip count;
* likewise an operand that is only sliced or gathered from (`slice`,
  `dynamic-slice`, `gather`'s operand, or a fusion parameter whose every use
  is one, through bitcasts, reshapes and transposes) is read only as much as
  its slices: a ring taking one block of a gathered buffer a step, a scan
  reading one layer of stacked weights, or an embedding lookup, reads that
  block, not the buffer (XLA's own cost analysis counts a dynamic-slice the
  same way).

Which instructions are work (fusions, matmuls, and copies, converts,
broadcasts and other data movement standing alone) is `pairing.py`'s
`is_compute`.

A collective over a group of n devices moving B bytes (its result) over a
link of bandwidth W (one direction) with latency a takes, on a ring:

  all-gather, all-to-all:  a + (n-1)/n * B / W
  reduce-scatter:          a + (n-1)   * B / W   (its input is n * B)
  all-reduce:              a + 2(n-1)/n * B / W
  collective-permute, send, recv, collective-broadcast: a + B / W

and nothing when n == 1. An async copy takes B / (copy bandwidth), a
cross-program prefetch nothing (`copy_seconds`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.model.convolution import convolution_flops
from jax_overlap._src.inspection.model.hardware import HardwareProfile
from jax_overlap._src.inspection.model.matmul_class import GEMM_TARGET, matmul_class
from jax_overlap._src.inspection.reading.hlo_module import (
    HloComputation, HloInstruction, HloModule)
from jax_overlap._src.inspection.schedule.pairing import allocates

#: (instruction, its computation) -> (flops, bytes), or None to fall back.
CostSource = Callable[[HloInstruction, HloComputation],
                      Optional[tuple[float, float]]]

_RING_FACTOR = {
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-reduce": lambda n: 2 * (n - 1) / n,
}
#: Modelled group size when the HLO does not say.
UNKNOWN_GROUP_SIZE = 2


class CostModel:
  """Modelled seconds under one hardware profile.

  Args:
    hardware: the profile.
    module: the module the instructions come from.
    source: where flops and bytes come from; `shape_costs` when None.
  """

  def __init__(self, hardware: HardwareProfile, module: HloModule | None,
               source: CostSource | None = None):
    self.hardware = hardware
    self.module = module
    self.source = source
    self._cache: dict[tuple[str, str], tuple[float, float]] = {}
    self._rates: dict[tuple[str, str], float | None] = {}
    #: instruction name -> whether `source` answered for it (else shapes).
    self.answered: dict[str, bool] = {}

  def flops_and_bytes(self, instr: HloInstruction,
                      comp: HloComputation) -> tuple[float, float]:
    key = (comp.name, instr.name)
    if key not in self._cache:
      got = self.source(instr, comp) if self.source else None
      self.answered[instr.name] = got is not None
      self._cache[key] = got if got is not None else \
          shape_costs(instr, comp, self.module)
    return self._cache[key]

  def compute_seconds(self, instr: HloInstruction,
                      comp: HloComputation) -> float:
    flops, nbytes = self.flops_and_bytes(instr, comp)
    return self.roofline(flops, nbytes, self.matmul_tflops(instr, comp))

  def matmul_tflops(self, instr: HloInstruction,
                    comp: HloComputation) -> float | None:
    """The rate `instr`'s flops run at: its matmuls' classes' rates, weighted
    by their flops (a fusion may hold several); None when it holds none."""
    key = (comp.name, instr.name)
    if key not in self._rates:
      by_class = matmul_flops(instr, comp, self.module)
      total = sum(by_class.values())
      self._rates[key] = None if total <= 0 else total / sum(
          f / self.hardware.matmul_rate(c) for c, f in by_class.items())
    return self._rates[key]

  def roofline(self, flops: float, nbytes: float,
               tflops: float | None = None) -> float:
    """Seconds of an op doing `flops` (at `tflops`, default the peak) and
    moving `nbytes` through HBM."""
    return max(flops / ((tflops or self.hardware.peak_tflops) * 1e12),
               nbytes / (self.hardware.memory_gbytes_per_s * 1e9))

  def collective_seconds(self, kind: str, nbytes: float,
                         group_size: int | None) -> float:
    n = group_size or UNKNOWN_GROUP_SIZE
    if n <= 1:
      return 0.0
    factor = _RING_FACTOR.get(kind, lambda n: 1.0)(n)
    return (self.hardware.collective_latency_us * 1e-6
            + factor * nbytes / (self.hardware.interconnect_gbytes_per_s * 1e9))

  def copy_seconds(self, nbytes: float,
                   start: HloInstruction | None = None) -> float:
    """Seconds of an async copy of `nbytes`; nothing for XLA:TPU's
    cross-program prefetch (`copy-start` with `cross_program_prefetch_index`),
    which the previous run of the program issues for the next: a program
    run step after step finds it done (measured on v5e: a 4096^2 matmul
    whose operand it prefetched ran in its matmul time alone)."""
    if start is not None and "cross_program_prefetch_index" in start.attributes:
      return 0.0
    bandwidth = self.hardware.copy_gbytes_per_s or \
        self.hardware.hbm_gbytes_per_s / 2
    return nbytes / (bandwidth * 1e9)


def shape_costs(instr: HloInstruction, comp: HloComputation,
                module: HloModule) -> tuple[float, float]:
  """(flops, bytes) of `instr` from the shapes in the text alone."""
  if allocates(instr):
    return 0.0, 0.0
  operands = [comp.by_name[o].shape for o in instr.operands
              if o in comp.by_name]
  out = instr.shape
  if instr.opcode == "custom-call" and out.is_tuple and out.elements:
    out = out.elements[0]  # the rest is workspace
  nbytes = sum(hbm_bytes(s) for s in operands) + hbm_bytes(out)
  nbytes -= _in_place_savings(instr, comp, module)
  nbytes -= _sliced_read_savings(instr, comp, module)
  return sum(matmul_flops(instr, comp, module).values()), max(0.0, nbytes)


def hbm_bytes(shape) -> float:
  """The bytes of `shape` that live in HBM: all of them, but for arrays in
  the TPU's on-chip memory (memory space 1 of a tiled layout,
  `f32[8,128]{1,0:T(8,128)S(1)}`: where XLA:TPU's memory-space assignment
  puts what it prefetched), which no HBM traffic reads or writes."""
  return sum(s.bytes for s in shape.leaves()
             if not (s.tiled and s.memory_space == 1))


#: Reads of part of their first operand.
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
#: Inside a fusion, renamings of the same elements: no data moves.
_VIEWS = frozenset({"bitcast", "reshape", "transpose"})


def _sliced_read_savings(instr, comp, module) -> float:
  """The bytes `shape_costs` counted for operands read whole that are only
  sliced: each such operand's size less what its slices read."""
  if instr.opcode in _SLICES:
    source = comp.by_name.get(instr.operands[0]) if instr.operands else None
    return 0.0 if source is None else max(
        0.0, hbm_bytes(source.shape) - instr.shape.bytes)
  inner = _fused(instr, module)
  if inner is None:
    return 0.0
  saved = 0.0
  for param in inner.parameters:
    read = _slice_reads(param.name, inner, module)
    if read is not None:
      saved += max(0.0, hbm_bytes(param.shape) - read)
  return saved


def _fused(instr, module):
  """The computation a fusion calls, or None."""
  if instr.opcode != "fusion" or not instr.callees("calls"):
    return None
  return module.computations.get(instr.callees("calls")[0])


def _parameter(comp, number: int):
  for param in comp.parameters:
    if param.operand_text.strip() == str(number):
      return param
  return None


def _slice_reads(name: str, comp, module, depth: int = 0) -> float | None:
  """The bytes the slices of `name` (in `comp`) read, through views and
  into the fusions nested in `comp` (XLA:TPU fuses a dynamic-slice of a
  stacked weight as a fusion of its own inside the matmul's); None when any
  use reads it whole (or it is not used)."""
  uses = comp.users().get(name, [])
  if not uses:
    return None
  read = 0.0
  for user, k in uses:
    if user.opcode in _SLICES and k == 0:
      read += user.shape.bytes
      continue
    if user.opcode in _VIEWS:
      inner = _slice_reads(user.name, comp, module, depth)
    elif user.opcode == "fusion" and depth < 4 and _fused(user, module):
      nested = _fused(user, module)
      param = _parameter(nested, k)
      inner = None if param is None else _slice_reads(
          param.name, nested, module, depth + 1)
    else:
      inner = None
    if inner is None:
      return None
    read += inner
  return read


def _in_place_savings(instr, comp, module) -> float:
  """The bytes `shape_costs` counted for buffers that an in-place update
  leaves where they are: each updated buffer once as an operand and once as
  (part of) the result, less the slice written."""
  if instr.opcode == "dynamic-update-slice":
    updates = [(instr, comp, instr.operands[0] if instr.operands else None)]
    fused = None
  elif instr.opcode == "fusion" and instr.callees("calls"):
    inner = module.computations.get(instr.callees("calls")[0])
    if inner is None:
      return 0.0
    root = inner.root
    roots = ([inner.by_name[o] for o in root.operands if o in inner.by_name]
             if root.opcode == "tuple" else [root])
    roots = [_through_bitcasts(r, inner) for r in roots]
    updates = [(r, inner, r.operands[0]) for r in roots
               if r.opcode == "dynamic-update-slice" and r.operands]
    fused = inner
  else:
    return 0.0
  saved = 0.0
  for dus, where, buffer in updates:
    if buffer is None or buffer not in where.by_name or len(dus.operands) < 2:
      continue
    if fused is not None and _through_bitcasts(
        where.by_name[buffer], where).opcode != "parameter":
      continue  # the buffer is made inside the fusion: it is written whole
    update = where.by_name.get(dus.operands[1])
    update_bytes = hbm_bytes(update.shape) if update is not None else 0
    whole = hbm_bytes(dus.shape)
    saved += max(0.0, 2 * whole - update_bytes)  # left: the update read, the slice written
  return saved


def _through_bitcasts(instr, comp):
  """The instruction a chain of bitcasts starting at `instr` renames."""
  while instr.opcode == "bitcast" and instr.operands and \
      instr.operands[0] in comp.by_name:
    instr = comp.by_name[instr.operands[0]]
  return instr


def matmul_flops(instr: HloInstruction, comp: HloComputation,
                 module: HloModule) -> dict[str, float]:
  """Flops of the matmuls `instr` does (itself, or inside its fusion), by
  class (`matmul_class.CLASSES`)."""
  operands = [comp.by_name[o].shape for o in instr.operands
              if o in comp.by_name]
  op = instr.opcode
  if op == "fusion":
    total: dict[str, float] = {}
    for callee in instr.callees("calls"):
      inner = module.computations[callee]
      for sub in inner.instructions:
        if sub.opcode in ("dot", "convolution", "fusion", "custom-call"):
          for cls, f in matmul_flops(sub, inner, module).items():
            total[cls] = total.get(cls, 0.0) + f
    return total
  flops = _flops(instr, operands)
  return {matmul_class(instr, operands): flops} if flops > 0 else {}


def _flops(instr, operands) -> float:
  op = instr.opcode
  if op == "dot" and operands:
    contracted = attrs.integer_list(instr.attributes.get("lhs_contracting_dims"))
    return _dot_flops(instr.shape, operands[0], contracted)
  if op == "convolution" and len(operands) >= 2:
    return convolution_flops(instr, operands[0], operands[1])
  if op == "custom-call" and operands and GEMM_TARGET.search(
      attrs.string_attribute(instr, "custom_call_target") or ""):
    out = instr.shape.elements[0] if instr.shape.is_tuple else instr.shape
    config = attrs.backend_config(instr).get("gemm_backend_config", {})
    numbers = config.get("dot_dimension_numbers") if isinstance(
        config, dict) else None
    if not isinstance(numbers, dict):
      numbers = {}
    try:
      contracted = [int(d) for d in numbers.get(
          "lhs_contracting_dimensions", [])]
    except (TypeError, ValueError):  # a config we cannot read: as if absent
      contracted = []
    if not contracted and operands[0].dims:
      contracted = [len(operands[0].dims) - 1]
    return _dot_flops(out, operands[0], contracted)
  if op == "custom-call":
    stated = _stated_flops(instr)
    if stated is not None:
      return stated
  return 0.0


def _stated_flops(instr) -> float | None:
  """The flops a kernel's custom call states for itself, or None."""
  config = attrs.backend_config(instr).get("custom_call_config")
  estimate = config.get("cost_estimate") if isinstance(config, dict) else None
  try:
    return float(estimate["flops"]) if isinstance(estimate, dict) else None
  except (KeyError, TypeError, ValueError):
    return None


def _dot_flops(out, lhs, contracted: list[int]) -> float:
  k = math.prod(lhs.dims[d] for d in contracted if 0 <= d < len(lhs.dims))
  return 2.0 * math.prod(out.dims) * k
