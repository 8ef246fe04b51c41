"""Which platform a module was compiled for, as its text says it.

A scheduled dump names neither its platform nor its chip in the header
(`HloModule jit_step, ...`), but each backend leaves marks of its own:
XLA:TPU writes tiled layouts on its arrays (`f32[8,128]{1,0:T(8,128)}`);
XLA:GPU gives its instructions a stream in their backend config
(`"operation_queue_id"`) and calls cuBLAS, cuDNN or Triton
(`custom_call_target="__cublas$gemm"`). Nothing tells a v5e from a v5p, nor
an H100 from an A100.
"""

from __future__ import annotations

from jax_overlap._src.inspection.reading.hlo_module import HloModule

TPU = "tpu"
GPU = "gpu"

_GPU_CALL_TARGETS = ("__cublas", "__cudnn", "__triton")
_GPU_BACKEND_CONFIG = "operation_queue_id"


def compiled_for(module: HloModule) -> str | None:
  """'tpu' or 'gpu' where the module's text says which, else None (a CPU
  module, or one written by hand without the marks)."""
  tiled = False
  for _, instr in module.instructions():
    target = instr.attributes.get("custom_call_target", "").strip().strip('"')
    if (target.startswith(_GPU_CALL_TARGETS)
        or _GPU_BACKEND_CONFIG in instr.attributes.get("backend_config", "")):
      return GPU
    tiled = tiled or ":T(" in instr.shape_text
  return TPU if tiled else None
