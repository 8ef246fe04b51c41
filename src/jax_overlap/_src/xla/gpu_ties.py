"""Ties that keep `fsdp_scan`'s moves on an explicit mesh in their step (GPU).

On an explicit-sharding mesh the moves are `jax.reshard`s, and the
collectives are XLA's partitioner's. Left alone, the GPU compiler sees every
layer's gather depend on nothing but the stacked params, unrolls the short
loop and combines them all into one all-gather before the first layer (and
the gradients' reduce-scatters into one after the last): nothing overlaps.
A step here is

    (next shards, pending gradients, this layer's inputs) = barrier(...)
    gather / reduce-scatter them; this layer's compute
    (out, gathered, scattered) = barrier(...)

so layer i+1's gather reads a value that also holds layer i's inputs (it
cannot start before layer i can), and layer i+1's inputs are tied to layer
i's gathered weights and scattered gradients (it cannot run before they are
done). Invariant: no two steps' collectives are independent, so none are
combined, and the latency-hiding scheduler puts each one's start and done
around the compute of its own step: every gather but the first layer's and
every reduce-scatter but the last has a gemm in flight
(tests/aot/real_compilers_test.py::test_fsdp_scan_on_an_explicit_mesh;
docs/compilers.md has the counts).

The ties are lowered for GPU only (`lax.platform_dependent`, resolved when
the program is lowered for its platform;
tests/ordering/compile_options_test.py::
test_fsdp_scan_on_an_explicit_mesh_is_tied_for_gpu_only): on TPU they leave
fewer gathers in flight than no ties do, and CPU runs every collective
blocking. On TPU, where jax can take a future there, the moves are futures
instead (explicit_futures.py).

A module holding these ties gets GPU's bound on collectives in flight
raised (`compile_options.py`, from `count`): a backward step has a
gather and a reduce-scatter in flight at once, and with XLA's default of one
the scheduler makes one of them synchronous.
"""

from __future__ import annotations

import jax
from jax import lax

#: The name scope of the ties, which `count` finds in a lowered module.
SCOPE = "jax_overlap_fsdp_explicit_tie"
_GPU = ("cuda", "rocm")


def tie(values):
  """`values` through one `optimization_barrier` when lowered for GPU, as
  they are elsewhere (values unchanged either way)."""
  def barrier(v):
    with jax.named_scope(SCOPE):
      return lax.optimization_barrier(v)
  return lax.platform_dependent(
      values, default=lambda v: v, **{p: barrier for p in _GPU})


def count(computation) -> int:
  """How many of these ties an MLIR module holds (0 if it cannot tell)."""
  found = [0]

  def visit(op):
    if op.name == "stablehlo.optimization_barrier" and SCOPE in str(op.location):
      found[0] += 1
    return _walk_advance()
  try:
    computation.operation.walk(visit)
  except AttributeError:  # not an MLIR module
    return 0
  return found[0]


def _walk_advance():
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  return ir.WalkResult.ADVANCE
