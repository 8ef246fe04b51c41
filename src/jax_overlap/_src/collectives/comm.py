"""`Comm`: the static description of one collective, and its transpose."""

from __future__ import annotations

import jax
from jax._src import ad_util
from jax._src.interpreters import ad

from jax_overlap._src import _compat
from jax_overlap._src.collectives.future import FutureState


class Comm:
  """Static description of one collective: a primitive param.

  Attributes:
    name: the user-facing collective ('all_gather', 'psum', ...).
    jaxpr: closed jaxpr of the synchronous collective, x -> y.
    state: the `FutureState` shared by every copy of the future.
    tpu_form: the collective as the TPU compiler takes it async
      (`tpu_forms.Form`), or None.
  Compared by identity, like a jaxpr.
  """

  __slots__ = ("name", "jaxpr", "state", "tpu_form")

  def __init__(self, name: str, jaxpr, state: FutureState, tpu_form=None):
    self.name = name
    self.jaxpr = jaxpr
    self.state = state
    self.tpu_form = tpu_form

  def __repr__(self):
    return f"Comm({self.name})"

  @property
  def out_aval(self):
    return self.jaxpr.out_avals[0]

  @property
  def in_aval(self):
    return self.jaxpr.in_avals[0]

  @property
  def flight_aval(self):
    """The type of the value in flight between start and done: the result's,
    or the TPU form's own buffer."""
    if self.tpu_form is not None:
      return self.tpu_form.start.out_avals[0]
    return self.out_aval


def trace_sync(fn, x):
  """The closed jaxpr of `fn` on a value like `x`, in the current axis env."""
  traced = jax.jit(fn).trace(x)
  return traced.jaxpr


def transposed(comm: Comm, ct) -> Comm:
  """The collective that carries cotangents of `comm` back (y -> x), traced
  on the cotangent `ct` so it has its exact type."""
  jaxpr = _compat.open_jaxpr(comm.jaxpr)
  consts = _compat.jaxpr_consts(comm.jaxpr)
  x_aval = comm.in_aval

  def transpose(ct):
    (ct_x,) = ad.backward_pass(jaxpr, False, consts,
                               [ad.UndefinedPrimal(x_aval)], [ct])
    if type(ct_x) is ad_util.Zero:
      ct_x = ad.instantiate_zeros(ct_x)
    return ct_x

  return Comm(_TRANSPOSED_NAME.get(comm.name, comm.name),
              trace_sync(transpose, ct),
              FutureState(comm.name + "_transpose", comm.state.where,
                          internal=True))


_TRANSPOSED_NAME = {"all_gather": "psum_scatter", "psum_scatter": "all_gather",
                    "psum": "psum", "all_to_all": "all_to_all",
                    "ppermute": "ppermute"}
