"""Which rate a matmul runs at: its operands' type and the precision asked.

A chip's matrix unit runs each operand type at its own rate, and an f32
matmul at the precision its `operand_precision` (or `algorithm`) asks: on
TPU the default is one bf16 pass (the bf16 rate), `high` three passes and
`highest` six; on NVIDIA GPUs the default is TF32 and `highest` plain FP32.
A profile's `matmul_tflops` gives the rate of each class (`hardware.py`);
a class it does not name runs at `peak_tflops`.

Pinned by tests/inspection/inspect_model_test.py::test_matmul_classes.

Example:
  >>> from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
  >>> m = parse_hlo_text('''HloModule m, is_scheduled=true
  ... ENTRY %e (a: f32[8,8], b: f32[8,8]) -> f32[8,8] {
  ...   %a = f32[8,8]{1,0} parameter(0)
  ...   %b = f32[8,8]{1,0} parameter(1)
  ...   ROOT %d = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  ... }''')
  >>> d = m.entry.by_name["d"]
  >>> matmul_class(d, [m.entry.by_name[o].shape for o in d.operands])
  'f32-highest'
"""

from __future__ import annotations

import re

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.reading.hlo_module import HloInstruction
from jax_overlap._src.inspection.reading.shapes import Shape

#: The classes, and what each means (a profile's `matmul_tflops` keys).
CLASSES = {
    "bf16": "bf16 or f16 operands",
    "f32": "f32 operands at the default precision (TPU: one bf16 pass; "
           "NVIDIA: TF32)",
    "f32-high": "f32 operands at precision HIGH (TPU: three bf16 passes)",
    "f32-highest": "f32 operands at precision HIGHEST (TPU: six bf16 passes; "
                   "NVIDIA: FP32)",
    "f8": "8-bit (or narrower) float operands",
    "int8": "8-bit (or narrower) integer operands",
    "f64": "f64 operands",
    "kernel": "a kernel's custom call that states its own flops (a Pallas "
              "kernel's cost_estimate): what such a kernel achieves, below "
              "XLA's own matmuls (its softmax, masks and block edges)",
}
_RANK = {"default": 0, "high": 1, "highest": 2}
_F8 = re.compile(r"f(8|6|4)e\d+m\d+\w*")
#: Custom-call targets that are a library's gemm (cost_model.py costs them
#: as a dot): cuBLAS's, and any target naming gemm or matmul.
GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
_INTS = {"s8", "u8", "s4", "u4", "s2", "u2", "s1", "u1"}
#: `algorithm=` names (and the GPU config's ALG_ names), by what they run.
_ALGORITHMS = (
    (re.compile(r"x6|f32_f32_f32"), "f32-highest"),
    (re.compile(r"x3"), "f32-high"),
    (re.compile(r"tf32"), "f32"),
    (re.compile(r"f64"), "f64"),
    (re.compile(r"bf16|f16"), "bf16"),
)


def matmul_class(instr: HloInstruction, operands: list[Shape]) -> str:
  """The class of a `dot`, `convolution` or gemm custom call with these
  operand shapes (the first two are the matrices); any other custom call
  (a kernel stating its own flops) is 'kernel'."""
  if instr.opcode == "custom-call" and not _gemm_config(instr) and \
      not GEMM_TARGET.search(attrs.string_attribute(
          instr, "custom_call_target") or ""):
    return "kernel"
  algorithm = _algorithm(instr)
  if algorithm:
    for pattern, cls in _ALGORITHMS:
      if pattern.search(algorithm):
        return cls
  dtypes = {s.dtype for s in operands[:2] if s.dtype}
  if dtypes & {"f64", "c128"}:
    return "f64"
  if dtypes & {"f32", "c64"}:
    level = max((_RANK.get(p, 0) for p in _precisions(instr)), default=0)
    return ("f32", "f32-high", "f32-highest")[level]
  if dtypes and all(_F8.fullmatch(d) for d in dtypes):
    return "f8"
  if dtypes and dtypes <= _INTS:
    return "int8"
  return "bf16"


def _precisions(instr: HloInstruction) -> list[str]:
  text = instr.attributes.get("operand_precision")
  if text:
    return [p.strip().lower() for p in text.strip("{} ").split(",")]
  config = _gemm_config(instr).get("precision_config", {})
  found = config.get("operand_precision", []) if isinstance(config, dict) else []
  return [str(p).lower() for p in found] if isinstance(found, list) else []


def _algorithm(instr: HloInstruction) -> str:
  text = instr.attributes.get("algorithm")
  if text:
    return text.lower()
  config = _gemm_config(instr).get("precision_config", {})
  found = config.get("algorithm", "") if isinstance(config, dict) else ""
  found = str(found).lower()
  return "" if found in ("", "alg_unset") else found


def _gemm_config(instr: HloInstruction) -> dict:
  if instr.opcode != "custom-call":
    return {}
  config = attrs.backend_config(instr).get("gemm_backend_config", {})
  return config if isinstance(config, dict) else {}
