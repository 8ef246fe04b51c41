"""jvp and transposition of the collective primitives.

All six collectives are linear in their operand (a ragged all-to-all's
integer offsets and sizes, `aux`, ride along undifferentiated). The jvp of a start is a start on the
tangent. For transposition the two halves trade places: the transpose of
`done` is the *start* of the transposed collective (all_gather <->
psum_scatter, psum <-> psum (or jax's pvary), all_to_all with its axes
swapped, ppermute with the inverse permutation), put in flight in the
cotangent slot of `operand`; the transpose of `start` is its *done*. So the
backward pass issues the transposed collective where the forward pass
finished the forward one, and an ordered backward overlaps too. A future that
crossed a shard_map boundary lost its operand slot; its backward collective
then runs whole at the forward start's position (still correct, not
overlapped). The transposed start and its done carry one `Comm`, the
transposed collective's (`_transposed_of`), so both halves are named for it
(a gather's gradient is `psum_scatter_start` -> `psum_scatter_done`:
tests/collectives/transposed_names_test.py).
"""

from __future__ import annotations

import weakref

from jax._src import ad_util
from jax._src import core
from jax._src.interpreters import ad

from jax_overlap._src import _compat
from jax_overlap._src.collectives import transposed_forms
from jax_overlap._src.collectives.comm import Comm, transposed
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p, finish, start)


def _start_jvp(primals, tangents, *, comm):
  (x, *aux), (t, *_) = primals, tangents
  outs = collective_start_p.bind(x, *aux, comm=comm)
  if type(t) is ad_util.Zero:
    return outs, [ad_util.Zero(comm.flight_aval.to_tangent_aval()),
                  ad_util.Zero(comm.in_aval.to_tangent_aval())]
  return outs, collective_start_p.bind(t, *aux, comm=comm)


def _done_jvp(primals, tangents, *, comm):
  out = collective_done_p.bind(*primals, comm=comm)
  t_flight = tangents[0]
  if type(t_flight) is ad_util.Zero:
    out_aval = comm.out_aval if comm.tpu_form is not None \
        else core.get_aval(primals[0])
    return out, ad_util.Zero(out_aval.to_tangent_aval())
  t_args = [t_flight]
  if len(tangents) >= 2 and type(tangents[1]) is not ad_util.Zero:
    t_args.append(tangents[1])
    t_args.extend(primals[2:])   # aux: primal integers
  return out, collective_done_p.bind(*t_args, comm=comm)


ad.primitive_jvps[collective_start_p] = _start_jvp
ad.primitive_jvps[collective_done_p] = _done_jvp


def _done_transpose(ct, in_flight, *operand, comm):
  operand, aux = operand[:1], operand[1:]
  no_aux = [None] * len(aux)
  flight_aval = _aval(in_flight).to_tangent_aval()
  zero_operand = [ad_util.Zero(_aval(operand[0]).to_tangent_aval())] \
      if operand else []
  if _in_flight_slot(comm):
    # The transposed collective's TPU form, whose buffer has the in-flight
    # value's type, carried in that slot (transposed_forms.py).
    if type(ct) is ad_util.Zero:
      return [ad_util.Zero(flight_aval), *zero_operand, *no_aux]
    t_flight, _ = start(_transposed_of(comm, ct, aux), ct, *aux)
    return [t_flight, *zero_operand, *no_aux]
  if not operand:
    # The operand slot was lost at a boundary: pass the cotangent through
    # (through the TPU form's done, if any), and the start's transpose runs
    # the whole transposed collective.
    if comm.tpu_form is not None:
      return [_backward(comm.tpu_form.done, ct)]
    return [ct]
  if type(ct) is ad_util.Zero:
    return [ad_util.Zero(flight_aval), *zero_operand, *no_aux]
  # Start the transposed collective here, where the forward one finished.
  t_flight, _ = start(_transposed_of(comm, ct, aux), ct, *aux)
  return [ad_util.Zero(flight_aval), t_flight, *no_aux]


def _aval(x):
  return x.aval if ad.is_undefined_primal(x) else core.get_aval(x)


# {forward FutureState: {(forward jaxpr, cpu jaxpr): transposed Comm}}. The
# done's transpose starts the transposed collective and the start's
# transpose finishes it, in either order (in a loop body that carries the
# future, the start's transpose comes first); both take the one Comm kept
# here. Its state is internal (finished), so sharing it between traces is
# safe.
_TRANSPOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _transposed_of(comm: Comm, ct=None, aux=()) -> Comm:
  """The transposed collective of `comm`, one object per forward future;
  traced on `ct`, or on zeros of `comm`'s result type when `ct` is None."""
  table = _TRANSPOSED.setdefault(comm.state, {})
  key = (comm.jaxpr, comm.cpu_jaxpr)
  t_comm = table.get(key)
  if t_comm is None:
    if ct is None:
      ct = ad.instantiate_zeros(ad_util.Zero(comm.out_aval.to_tangent_aval()))
    t_comm = table[key] = transposed(comm, ct, aux)
    t_comm.tpu_form = transposed_forms.form_in_flight_slot(comm, t_comm, ct)
  return t_comm


def _in_flight_slot(comm: Comm) -> bool:
  """Whether `comm`'s transposed future rides in the in-flight slot, with
  its TPU form (transposed_forms.py), instead of the operand slot."""
  if comm.params is None or comm.name not in ("psum", "all_gather",
                                                  "all_to_all", "pvary"):
    return False
  return _transposed_of(comm).tpu_form is not None


def _start_transpose(cts, x, *aux, comm):
  del x
  no_aux = [None] * len(aux)
  ct_flight, ct_operand = cts
  if _in_flight_slot(comm):
    # The transposed collective is in flight in the in-flight slot since
    # the forward done (or across a boundary that dropped the operand slot).
    if type(ct_flight) is ad_util.Zero:
      return [ad_util.Zero(comm.in_aval.to_tangent_aval()), *no_aux]
    return [finish(ct_flight, None, _transposed_of(comm, None, aux)), *no_aux]
  total = None
  if type(ct_operand) is not ad_util.Zero:
    # The transposed collective is in flight since the forward done: end it
    # with its own Comm (started without a TPU form: the plain done).
    total = finish(ct_operand, None, _transposed_of(comm, None, aux))
  if type(ct_flight) is not ad_util.Zero and comm.tpu_form is not None:
    whole = _backward(comm.tpu_form.start, ct_flight)
    total = whole if total is None else total + whole
  elif type(ct_flight) is not ad_util.Zero:
    t_comm = transposed(comm, ct_flight, aux)
    whole = finish(*start(t_comm, ct_flight, *aux), t_comm, aux)
    total = whole if total is None else total + whole
  if total is None:
    return [ad_util.Zero(comm.in_aval.to_tangent_aval()), *no_aux]
  return [total, *no_aux]


def _backward(closed, ct):
  """The transpose of the linear one-in one-out jaxpr `closed` at `ct`."""
  jaxpr = _compat.open_jaxpr(closed)
  (ct_in,) = ad.backward_pass(jaxpr, False, _compat.jaxpr_consts(closed),
                              [ad.UndefinedPrimal(closed.in_avals[0])], [ct])
  if type(ct_in) is ad_util.Zero:
    ct_in = ad.instantiate_zeros(ct_in)
  return ct_in


ad.primitive_transposes[collective_start_p] = _start_transpose
ad.primitive_transposes[collective_done_p] = _done_transpose
