"""The TPU form of a transposed future, where it can ride in the forward's
in-flight slot.

Autodiff starts a future's transposed collective where the forward `done()`
was and carries its in-flight value back to where the forward start was, as
the cotangent of one of the forward's values (autodiff.py). The operand slot
has the forward operand's type; a TPU form's buffer (tpu_forms.py: the
rank-3 all-to-all) rarely has it, so transposed futures have no TPU form
there, and on TPU a transposed reduce-scatter or all-reduce is synchronous.
The in-flight slot has the forward's flight type instead, and for two
futures that is the transposed form's buffer exactly:

* `psum_start(to="varying")` on a buffer too small for the ring (the
  copies form): its transpose is a psum of the cotangent, whose copies form
  has the same (N, rows, cols) buffer;
* the all-gather half of its ring (ring_psum.py), which gathers its chunk
  as (1, 1, c) along axis 0: its flight (N, 1, c) is the buffer of the
  reduce-scatter form of its transpose (the cotangent's (N c,) elements);
* an all-to-all whose transpose (its split and concat axes swapped) has a
  form with the forward's buffer: a tiled exchange along axis 0 of an
  (N, w) buffer, as expert_stream's (patterns/moe/stream.py), whose
  forward and transposed forms both exchange (N, 1, w)
  (tests/aot/moe_compiled_test.py::test_a_streams_exchanges_are_all_in_flight).

* `pvary_start` (broadcast.py): its transpose is a psum of the cotangent,
  and its forward's in-flight value is made, locally, as that psum's copies
  form's (N, rows, cols) buffer for this purpose.

For those (`form_in_flight_slot`) the transposed future is started with
its TPU form and carried in the in-flight slot; for every other future
autodiff keeps the operand slot and the plain transposed collective.
Only a transposed jaxpr that holds the expected collective gets a form (a
psum typed invariant transposes to a cast, no sum). Pinned by
tests/collectives/psum_varying_test.py (values and gradients with the forms
forced on CPU) and on the real v5e compiler by
tests/aot/tpu_forms_compiled_test.py::test_varying_psum_backward_halves_are_async.
"""

from __future__ import annotations

from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.collectives.comm import Comm

#: forward collective -> (its transpose, the primitives that compute that)
_TRANSPOSES = {"psum": ("psum", frozenset({"psum", "psum_invariant"})),
               "all_gather": ("psum_scatter", frozenset({"reduce_scatter"})),
               "all_to_all": ("all_to_all", frozenset({"all_to_all"})),
               "pvary": ("psum", frozenset({"psum", "psum_invariant"}))}


def _transposed_params(comm: Comm) -> dict | None:
  params = comm.params
  if params is None:
    return None
  if comm.name in ("psum", "pvary"):
    return dict(axis_name=params["axis_name"])
  if comm.name == "all_gather" and params.get("tiled") and \
      params.get("to") is None:
    return dict(axis_name=params["axis_name"],
                scatter_dimension=params["axis"], tiled=True)
  if comm.name == "all_to_all":
    return dict(axis_name=params["axis_name"],
                split_axis=params["concat_axis"],
                concat_axis=params["split_axis"], tiled=params["tiled"])
  return None


def _holds(jaxpr, names: frozenset) -> bool:
  return any(e.primitive.name in names or any(
      _holds(sub, names) for sub in core.jaxprs_in_params(e.params))
      for e in jaxpr.eqns)


def form_in_flight_slot(comm: Comm, t_comm: Comm, ct) -> tpu_forms.Form | None:
  """The TPU form of `t_comm` (the transposed collective of `comm`, traced
  on the cotangent `ct`) whose buffer has `comm`'s flight type, or None."""
  if comm.name not in _TRANSPOSES or comm.cpu_jaxpr is not None:
    return None
  name, prims = _TRANSPOSES[comm.name]
  params = _transposed_params(comm)
  if params is None or not _holds(_compat.open_jaxpr(t_comm.jaxpr), prims):
    return None
  form = tpu_forms.trace_form(name, params, ct)
  if form is None:
    return None
  buf, flight = form.start.out_avals[0], comm.flight_aval
  if (buf.shape, buf.dtype) != (flight.shape, flight.dtype):
    return None
  return form
