"""Who holds the TPU v5e's one async all-to-all: fsdp_scan or its layer.

The v5e compiler keeps one async all-to-all in flight. fsdp_scan's
reduce-scatters take it there (their TPU form, collectives/tpu_forms.py),
each in flight across a layer's backward; a layer that starts all-to-all
futures of its own (an expert stream's exchanges, `expert_stream`) then
finds the slot taken, and its exchanges, or fsdp_scan's, run as their
synchronous fallback. So where the layer starts any such future, fsdp_scan's
gathers and reduce-scatters are collective-permute futures instead
(collectives/permute_forms.py), which the compiler keeps in flight beside
the all-to-alls (quirks.py, "tpu-fsdp-permutes-beside-all-to-alls").

Invariant: `holds_all_to_alls` is checked only where that quirk applies (a
v5e trace), so elsewhere the layer is not traced again. Pinned by
tests/aot/moe_compiled_test.py::
test_fsdp_beside_an_expert_stream_keeps_every_collective_async (values:
tests/patterns/fsdp/fsdp_all_to_all_slot_test.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
from jax._src import core as jax_core

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives import permute_forms
from jax_overlap._src.collectives.primitives import collective_start_p

QUIRK = "tpu-fsdp-permutes-beside-all-to-alls"


def wanted() -> bool:
  """Whether this trace runs on a TPU with the one-slot quirk."""
  return quirks.applies(QUIRK, *_compat.trace_device())


def holds_all_to_alls(fn: Callable, *args) -> bool:
  """Whether `fn(*args)` starts a future whose collective is an all-to-all
  on this TPU (its TPU form, or an all-to-all itself)."""
  closed = jax.make_jaxpr(fn)(*args)
  return _starts_one(_compat.open_jaxpr(closed))


def _starts_one(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is collective_start_p:
      comm = eqn.params["comm"]
      if comm.tpu_form is not None or comm.name in ("all_to_all",
                                                    "ragged_all_to_all"):
        return True
    if any(_starts_one(j) for j in jax_core.jaxprs_in_params(eqn.params)):
      return True
  return False


def forms(permutes: bool):
  """The context fsdp_scan starts its futures in: the permute forms where
  its layer holds the slot, else as the platform chooses."""
  return permute_forms.beside_all_to_alls() if permutes else contextlib.nullcontext()
