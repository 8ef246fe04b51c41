"""The flops of an HLO `convolution`, counted as the hardware does them.

A convolution multiplies each output element's window of the (padded,
dilated) input by the kernel and sums over the kernel's input features. Only
the window positions that land on real input elements cost anything: a
position on padding, or in a hole `lhs_dilate` opens between input elements,
multiplies a zero that no compiler computes. So

  flops = 2 * (output batch) * (output features) * (kernel input features)
            * prod over spatial dimensions of (the (output, kernel) position
              pairs that land on an input element)

with the kernel's input features already divided by `feature_group_count`,
and the output batch by `batch_group_count`. XLA:TPU writes batched matmuls
(attention's einsums) this way: `window={size=16x8 stride=15x7
lhs_dilate=16x8}` puts the batch on spatial dimensions where each output
position meets exactly one input element, so the count is a batched matmul's
2 * B * M * N * K; the kernel's size times the output's counts 128 times that.

Pinned by tests/inspection/convolution_flops_test.py (against XLA's own cost
analysis on CPU, and against einsums compiled by the real TPU compiler).

Example:
  >>> from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
  >>> m = parse_hlo_text('''HloModule m, is_scheduled=true
  ... ENTRY %e (a: f32[4,8,128,64], b: f32[4,128,8,64]) -> f32[4,8,128,128] {
  ...   %a = f32[4,8,128,64]{3,2,1,0} parameter(0)
  ...   %b = f32[4,128,8,64]{3,2,1,0} parameter(1)
  ...   ROOT %c = f32[4,8,128,128]{3,2,1,0} convolution(%a, %b), window={size=4x8 stride=3x7 lhs_dilate=4x8}, dim_labels=01bf_0o1i->01bf
  ... }''')
  >>> c = m.entry.by_name["c"]
  >>> a, b = (m.entry.by_name[o].shape for o in c.operands)
  >>> convolution_flops(c, a, b) == 2 * (4 * 8) * 128 * 128 * 64
  True
"""

from __future__ import annotations

import dataclasses
import math
import re

from jax_overlap._src.inspection.reading.hlo_module import HloInstruction
from jax_overlap._src.inspection.reading.shapes import Shape

_LABELS = re.compile(r"\s*(\w+)_(\w+)->(\w+)\s*")
_FIELD = re.compile(r"(\w+)=([-\d_x]+)")


@dataclasses.dataclass(frozen=True)
class WindowDim:
  """One spatial dimension of a convolution's window."""

  size: int
  stride: int = 1
  pad_low: int = 0
  pad_high: int = 0
  lhs_dilate: int = 1
  rhs_dilate: int = 1


def convolution_flops(instr: HloInstruction, lhs: Shape, rhs: Shape) -> float:
  """2 * the multiply-adds of `instr` on real input elements (0.0 where its
  `dim_labels` cannot be read against the shapes)."""
  labels = _LABELS.fullmatch(instr.attributes.get("dim_labels", ""))
  if labels is None:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  out = instr.shape.elements[0] if instr.shape.is_tuple else instr.shape
  if (len(lhs_l) != len(lhs.dims) or len(rhs_l) != len(rhs.dims)
      or len(out_l) != len(out.dims) or "i" not in rhs_l
      or not {"b", "f"} <= set(out_l)):
    return 0.0
  spatial = sorted(c for c in out_l if c.isdigit())
  if any(c not in lhs_l or c not in rhs_l for c in spatial):
    return 0.0
  window = window_dims(instr.attributes.get("window", ""),
                       [rhs.dims[rhs_l.index(c)] for c in spatial])
  pairs = math.prod(
      landing_pairs(lhs.dims[lhs_l.index(c)], out.dims[out_l.index(c)], w)
      for c, w in zip(spatial, window))
  per_pair = (out.dims[out_l.index("b")] * out.dims[out_l.index("f")]
              * rhs.dims[rhs_l.index("i")])
  return 2.0 * per_pair * pairs


def window_dims(text: str, kernel_sizes: list[int]) -> list[WindowDim]:
  """`{size=4x8 stride=3x7 pad=0_0x7_7 lhs_dilate=4x8 ...}` per spatial
  dimension; where the text says nothing, the kernel's size, stride 1, no
  padding or dilation."""
  fields = {k: v.split("x") for k, v in _FIELD.findall(text or "")}
  dims = []
  for d, kernel in enumerate(kernel_sizes):
    def get(key, default, d=d):
      values = fields.get(key)
      return int(values[d]) if values and d < len(values) else default
    pad = fields.get("pad")
    low, high = (pad[d].split("_") if pad and d < len(pad) else ("0", "0"))
    dims.append(WindowDim(size=get("size", kernel), stride=get("stride", 1),
                          pad_low=int(low), pad_high=int(high),
                          lhs_dilate=get("lhs_dilate", 1),
                          rhs_dilate=get("rhs_dilate", 1)))
  return dims


def landing_pairs(in_size: int, out_size: int, w: WindowDim) -> int:
  """How many (output position, kernel position) pairs of one spatial
  dimension land on an input element: position o*stride + k*rhs_dilate -
  pad_low of the dilated input, inside it and not in a dilation hole."""
  top = (in_size - 1) * w.lhs_dilate   # the last input element's position
  if in_size <= 0 or out_size <= 0 or w.size <= 0:
    return 0
  # Loop over the shorter of the two; count the other in closed form.
  if w.size <= out_size:
    return sum(_count(w.stride, k * w.rhs_dilate - w.pad_low, out_size, top,
                      w.lhs_dilate) for k in range(w.size))
  return sum(_count(w.rhs_dilate, o * w.stride - w.pad_low, w.size, top,
                    w.lhs_dilate) for o in range(out_size))


def _count(a: int, c: int, n: int, top: int, m: int) -> int:
  """How many x in [0, n) have 0 <= a*x + c <= top and m | a*x + c."""
  a = max(a, 1)
  lo = max(0, _ceil_div(-c, a))
  hi = min(n - 1, (top - c) // a)
  if hi < lo:
    return 0
  if m <= 1:
    return hi - lo + 1
  g = math.gcd(a, m)
  if c % g:
    return 0
  step = m // g
  x0 = (-(c // g) * pow(a // g, -1, step)) % step if step > 1 else 0
  first = lo + (x0 - lo) % step
  return 0 if first > hi else (hi - first) // step + 1


def _ceil_div(p: int, q: int) -> int:
  return -((-p) // q)
