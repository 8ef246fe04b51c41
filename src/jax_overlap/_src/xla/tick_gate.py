"""`tick_gate(values)`: the pipeline's per-tick parameter gate, a barrier on TPU only.

Invariant: the values come out unchanged, with their types; lowered for a
TPU where quirks row "tpu-pipeline-tick-gate" applies (jax >= 0.12: before,
a future's gathers are plain collectives the ordering barriers keep in their
tick), the outputs are one `stablehlo.optimization_barrier` over all of
them, and lowered for any other platform they are the inputs (no barrier,
no quirks lookup, no warning). Why:
XLA:TPU starts every lockstep tick's FSDP weight gathers, which need only
the parameters, near the program's start (v5e 1F1B temp 3,112 -> 2,051 MiB
with the gate, docs/pipeline.md), while on the H100 the barrier made the
modelled step 5% longer for nothing. Pinned by
tests/aot/pipeline_compiled_test.py
(`test_lockstep_ticks_gather_their_weights_one_tick_ahead_at_most`) and
tests/ordering/tick_gate_test.py (no barrier off TPU).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax_overlap._src.xla.tick_gate import tick_gate
  >>> w, loss = jnp.ones(3), jnp.float32(0.5)
  >>> [a.tolist() for a in jax.jit(tick_gate)([w, loss])]
  [[1.0, 1.0, 1.0], 0.5]
"""

from __future__ import annotations

from typing import Any, Sequence

from jax._src import core
from jax._src.interpreters import ad, batching, mlir

from jax_overlap._src import _compat, quirks
from jax_overlap._src.ordering.barrier_op import lower_barrier
from jax_overlap._src.xla.futures import device_kind_of

#: The quirks row the TPU lowering asks.
QUIRK = "tpu-pipeline-tick-gate"

tick_gate_p = core.Primitive("jax_overlap_tick_gate")
tick_gate_p.multiple_results = True
tick_gate_p.def_impl(lambda *values: list(values))
tick_gate_p.def_abstract_eval(lambda *avals: list(avals))


def tick_gate(values: Sequence[Any]) -> list[Any]:
  """`values` (a flat list of arrays), tied together by an optimization
  barrier when lowered for a TPU the quirks table names, else as they are."""
  values = list(values)
  return list(tick_gate_p.bind(*values)) if values else values


def _jvp(primals, tangents):
  # The tangents need no tie: only the primal program's schedule is at stake.
  return tick_gate_p.bind(*primals), list(tangents)


ad.primitive_jvps[tick_gate_p] = _jvp
batching.primitive_batchers[tick_gate_p] = (
    lambda args, dims: (tick_gate_p.bind(*args), list(dims)))


def _identity(ctx, *args):
  del ctx
  return list(args)


def _tpu(ctx, *args):
  # Before jax 0.12 a future is its plain collective, placed by the
  # ordering barriers (row "tpu-plain-future"): there the gathers stayed in
  # their tick without the gate (libtpu 0.0.42.1, 0.0.44.1), so the row is
  # not asked.
  if not _compat.ASYNC_CUSTOM_CALLS or \
      not quirks.applies(QUIRK, "tpu", device_kind_of(ctx)):
    return list(args)
  return lower_barrier(ctx, *args)


mlir.register_lowering(tick_gate_p, _identity, cacheable=False)
mlir.register_lowering(tick_gate_p, _tpu, platform="tpu", cacheable=False)
