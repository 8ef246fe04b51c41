"""Saying when `fsdp_scan(bucket=False)` on TPU v5p loses part of the
reduce-scatters' overlap.

On v5p each `psum_scatter_start` is N-1 collective-permutes in flight at once
(collectives/permute_forms.py). With one reduce-scatter a weight
(`bucket=False`, a layer of several sharded leaves of one dtype), libtpu
0.0.52 finishes some steps' reduce-scatters before the next step's matmuls
and runs their permutes one after another, though nothing in the program
holds them there: in the HLO its latency-hiding scheduler gets, those
matmuls neither read the dones nor feed the starts, the permute limit
(`ordering/compile_options.py`) is far above what is in flight, and neither
raising it, nor its memory-pressure tracking off, nor larger operands changed
it (measured, tests/aot/). One reduce-scatter a layer (`bucket=True`, the
default) keeps each but the last in flight, so the user is told to bucket.

A layer with one sharded leaf per dtype is the same program either way and
is not warned; its shortfall (one weight over 3 or 4 layers: one step's
reduce-scatter with nothing in flight) cannot be told at trace time, and is
written in the README.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async, permute_forms
from jax_overlap._src.patterns.fsdp.buckets import plan_buckets

MESSAGE = (
    "fsdp_scan(bucket=False) on TPU v5p: each weight's gradient is "
    "reduce-scattered by its own psum_scatter_start, N-1 collective-permutes "
    "each, and libtpu 0.0.52 finishes some steps' reduce-scatters before the "
    "next step's matmuls (measured, 2 weights a layer: 4 of the 6 wanted over "
    "4 layers, 2 of 5 over 3, have a matmul in flight). Pass bucket=True (the "
    "default: one reduce-scatter a layer, each but the last in flight). "
    "Silence with warnings.filterwarnings('ignore', "
    "category=jax_overlap.CollectiveNotAsyncWarning).")


def warn_if_bucketing_would_help(dims, grads) -> None:
  """Called with an unbucketed layer's gradients (flattened, already cast)
  as their reduce-scatters start: warns where they are v5p permute futures
  and buckets would merge some of them."""
  if not (_compat.ASYNC_CUSTOM_CALLS and permute_forms.wanted("psum_scatter")):
    return
  buckets, _ = plan_buckets(dims, [jnp.shape(g) for g in grads],
                            [g.dtype for g in grads],
                            [_compat.varying_axes(g) for g in grads])
  if buckets:
    not_async.warn_once("tpu-v5p:fsdp-unbucketed-scatters", MESSAGE)
