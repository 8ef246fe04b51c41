"""The cost model: modelled seconds for compute, collectives and async copies.

Compute is a roofline: `max(flops / peak, bytes / HBM bandwidth)`. Flops and
bytes come from a `CostSource`: XLA's own cost analysis of the instruction on
a live compile (`xla_cost.py`), else `shape_costs` here:

* dot: 2 * (elements of the result) * (product of contracted sizes);
* convolution: 2 * (elements of the result) * (kernel elements / output
  features);
* gemm custom calls (`__cublas$gemm`, `__cublas$lt$matmul`, any target naming
  gemm or matmul): as a dot, with the contracted dimensions of its
  `gemm_backend_config` (else the last of the left operand);
* a kernel's custom call that states its own flops (a Pallas TPU kernel's
  `custom_call_config.cost_estimate`, from `pallas_call(cost_estimate=...)`):
  those flops;
* fusion: the dots and convolutions inside it;
* bytes: operands in plus result out, for all of them, except that an
  in-place update (`dynamic-update-slice`, or a fusion whose root is one, or a
  tuple of them, updating a fusion parameter) moves only the slice it writes:
  the buffer it updates is neither read nor written whole. A scan stacking
  its residuals does one such update a step, and costing the whole buffer
  made the modelled compute grow with the square of the trip count;
* likewise an operand that is only sliced (`slice`, `dynamic-slice`, or a
  fusion parameter whose every use is one) is read only as much as its
  slices: a ring taking one block of a gathered buffer a step, or a scan
  reading one layer of stacked weights, reads that block, not the buffer
  (XLA's own cost analysis counts a dynamic-slice the same way).

A collective over a group of n devices moving B bytes (its result) over a
link of bandwidth W (one direction) with latency a takes, on a ring:

  all-gather, all-to-all:  a + (n-1)/n * B / W
  reduce-scatter:          a + (n-1)   * B / W   (its input is n * B)
  all-reduce:              a + 2(n-1)/n * B / W
  collective-permute, send, recv, collective-broadcast: a + B / W

and nothing when n == 1. An async copy takes B / (copy bandwidth).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Optional

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.model.hardware import HardwareProfile
from jax_overlap._src.inspection.reading.hlo_module import (
    HloComputation, HloInstruction, HloModule)

#: (instruction, its computation) -> (flops, bytes), or None to fall back.
CostSource = Callable[[HloInstruction, HloComputation],
                      Optional[tuple[float, float]]]

_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
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

  def flops_and_bytes(self, instr: HloInstruction,
                      comp: HloComputation) -> tuple[float, float]:
    key = (comp.name, instr.name)
    if key not in self._cache:
      got = self.source(instr, comp) if self.source else None
      self._cache[key] = got if got is not None else \
          shape_costs(instr, comp, self.module)
    return self._cache[key]

  def compute_seconds(self, instr: HloInstruction,
                      comp: HloComputation) -> float:
    return self.roofline(*self.flops_and_bytes(instr, comp))

  def roofline(self, flops: float, nbytes: float) -> float:
    """Seconds of an op doing `flops` and moving `nbytes` through HBM."""
    return max(flops / (self.hardware.peak_tflops * 1e12),
               nbytes / (self.hardware.hbm_gbytes_per_s * 1e9))

  def collective_seconds(self, kind: str, nbytes: float,
                         group_size: int | None) -> float:
    n = group_size or UNKNOWN_GROUP_SIZE
    if n <= 1:
      return 0.0
    factor = _RING_FACTOR.get(kind, lambda n: 1.0)(n)
    return (self.hardware.collective_latency_us * 1e-6
            + factor * nbytes / (self.hardware.interconnect_gbytes_per_s * 1e9))

  def copy_seconds(self, nbytes: float) -> float:
    bandwidth = self.hardware.copy_gbytes_per_s or \
        self.hardware.hbm_gbytes_per_s / 2
    return nbytes / (bandwidth * 1e9)


def shape_costs(instr: HloInstruction, comp: HloComputation,
                module: HloModule) -> tuple[float, float]:
  """(flops, bytes) of `instr` from the shapes in the text alone."""
  operands = [comp.by_name[o].shape for o in instr.operands
              if o in comp.by_name]
  out = instr.shape
  if instr.opcode == "custom-call" and out.is_tuple and out.elements:
    out = out.elements[0]  # the rest is workspace
  nbytes = sum(s.bytes for s in operands) + out.bytes
  nbytes -= _in_place_savings(instr, comp, module)
  nbytes -= _sliced_read_savings(instr, comp, module)
  return _flops(instr, comp, module, operands), nbytes


_SLICES = frozenset({"slice", "dynamic-slice"})


def _sliced_read_savings(instr, comp, module) -> float:
  """The bytes `shape_costs` counted for operands read whole that are only
  sliced: each such operand's size less what its slices read."""
  if instr.opcode in _SLICES:
    source = comp.by_name.get(instr.operands[0]) if instr.operands else None
    return 0.0 if source is None else max(0.0, source.shape.bytes - instr.shape.bytes)
  if instr.opcode != "fusion" or not instr.callees("calls"):
    return 0.0
  inner = module.computations.get(instr.callees("calls")[0])
  if inner is None:
    return 0.0
  users = inner.users()
  saved = 0.0
  for param in inner.parameters:
    uses = users.get(param.name, [])
    if uses and all(user.opcode in _SLICES and k == 0 for user, k in uses):
      read = sum(user.shape.bytes for user, _ in uses)
      saved += max(0.0, param.shape.bytes - read)
  return saved


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
    updates = [(r, inner, r.operands[0]) for r in roots
               if r.opcode == "dynamic-update-slice" and r.operands]
    fused = inner
  else:
    return 0.0
  saved = 0.0
  for dus, where, buffer in updates:
    if buffer is None or buffer not in where.by_name or len(dus.operands) < 2:
      continue
    if fused is not None and where.by_name[buffer].opcode != "parameter":
      continue  # the buffer is made inside the fusion: it is written whole
    update = where.by_name.get(dus.operands[1])
    update_bytes = update.shape.bytes if update is not None else 0
    whole = dus.shape.bytes
    saved += max(0.0, 2 * whole - update_bytes)  # left: the update read, the slice written
  return saved


def _flops(instr, comp, module, operands) -> float:
  op = instr.opcode
  if op == "dot" and operands:
    contracted = attrs.integer_list(instr.attributes.get("lhs_contracting_dims"))
    return _dot_flops(instr.shape, operands[0], contracted)
  if op == "convolution" and len(operands) >= 2:
    return _convolution_flops(instr, operands[1])
  if op == "custom-call" and operands and _GEMM_TARGET.search(
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
  if op == "fusion":
    total = 0.0
    for callee in instr.callees("calls"):
      inner = module.computations[callee]
      for sub in inner.instructions:
        if sub.opcode in ("dot", "convolution", "fusion", "custom-call"):
          total += shape_costs(sub, inner, module)[0]
    return total
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


def _convolution_flops(instr, kernel) -> float:
  labels = instr.attributes.get("dim_labels", "")
  m = re.fullmatch(r"\w+_(\w+)->\w+", labels.strip())
  if not m or "o" not in m.group(1) or len(m.group(1)) != len(kernel.dims):
    return 0.0
  out_features = kernel.dims[m.group(1).index("o")]
  per_output = math.prod(kernel.dims) / max(out_features, 1)
  return 2.0 * math.prod(instr.shape.dims) * per_output
