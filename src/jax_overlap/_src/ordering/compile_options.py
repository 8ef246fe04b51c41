"""Compile options for modules that hold async collective futures.

The latency-hiding schedulers of the TPU and GPU compilers bound how many
async collectives may be in flight at once, and a module whose fenced order
starts more than that fails to compile instead of running them in turn:
`FindAndExtractBestNodeAvailable failed to find a node to schedule ...
kExceedsOverlapLimit`. `fsdp_scan` does (the next layer's gathers, one per
weight, while this layer computes; in the backward pass the regathers and the
gradient reduce-scatters too), and so may any program of futures.

For a module compiled for TPU or GPU that holds more than one future start,
the library raises those bounds to the number of starts in the module (an
upper bound on what can be in flight), unless the user passed the option
themselves (then theirs is kept as given):

* GPU: `xla_gpu_experimental_parallel_collective_overlap_limit` (XLA's default 1);
* TPU: `xla_max_concurrent_async_all_gathers` (libtpu's default 1).

A TPU module that holds an async all-to-all (the TPU form of
`psum_scatter_start`, `psum_start`, `all_to_all_start`, and on v5p of
`all_gather_start`: collectives/tpu_forms.py) also gets
`xla_tpu_enable_async_all_to_all=True`: without it libtpu crashes on the
pair (SIGSEGV), with it the all-to-all is async on v5e and v5p.

Other modules compile exactly as XLA would. Measured with jax 0.12.0.1,
jax-cuda12-plugin 0.12.0.1 (H100 spec) and libtpu 0.0.52 (v5e), tests/aot/.
"""

from __future__ import annotations

from typing import Any

from jax._src.lib.mlir import ir

from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async

GPU_OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
TPU_ALL_GATHER_LIMIT = "xla_max_concurrent_async_all_gathers"
TPU_ASYNC_ALL_TO_ALL = "xla_tpu_enable_async_all_to_all"
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def overlap_options(platform: str, starts: dict[str, int]) -> dict[str, Any]:
  """The options a module with `starts` (kind -> count) gets on `platform`."""
  total = sum(starts.values())
  if platform in _GPU_PLATFORMS and total > 1:
    return {GPU_OVERLAP_LIMIT: total}
  options: dict[str, Any] = {}
  if platform == "tpu" and starts.get("all-gather", 0) > 1:
    options[TPU_ALL_GATHER_LIMIT] = starts["all-gather"]
  if platform == "tpu" and starts.get("all-to-all", 0) > 0:
    options[TPU_ASYNC_ALL_TO_ALL] = True
  return options


_SYNC_COLLECTIVES = {
    "stablehlo.all_gather": "all_gather", "stablehlo.all_reduce": "psum",
    "stablehlo.reduce_scatter": "psum_scatter",
    "stablehlo.all_to_all": "all_to_all",
    "stablehlo.collective_permute": "ppermute"}


def fenced_sync_collectives(computation) -> list[str]:
  """The synchronous collectives of an MLIR module that read a value an
  `optimization_barrier` made: those inside an ordered block (a future that
  had to be lowered synchronously is not one: it was said already)."""
  found: list[str] = []

  def visit(op):
    if op.name in _SYNC_COLLECTIVES and not_async.SYNC_FUTURE_ATTR not in op.attributes:
      for operand in op.operands:
        owner = operand.owner
        if isinstance(owner, ir.Block):
          continue
        owner = owner.operation if hasattr(owner, "operation") else owner
        if owner.name == "stablehlo.optimization_barrier":
          found.append(_SYNC_COLLECTIVES[op.name])
          break
    return ir.WalkResult.ADVANCE
  try:
    computation.operation.walk(visit)
  except AttributeError:  # not an MLIR module
    return []
  return found


def _options_for(computation, platform: str, user_options) -> dict[str, Any]:
  if platform not in (*_GPU_PLATFORMS, "tpu"):
    return {}
  fenced = fenced_sync_collectives(computation)
  if fenced:
    not_async.warn_fenced_sync_collective(platform, fenced)
  wanted = overlap_options(platform, _compat.async_collective_starts(computation))
  return {k: v for k, v in wanted.items() if k not in (user_options or {})}


_INSTALLED = _compat.add_compile_options_hook(_options_for)
