"""`Comm`: the static description of one collective, and its transpose."""

from __future__ import annotations

import contextlib

import jax
from jax._src import ad_util
from jax._src.interpreters import ad

from jax_overlap._src import _compat
from jax_overlap._src.collectives.future import FutureState


def one_bound_axis(axis_name) -> tuple[str, int] | None:
  """(name, size) of the one named mesh axis `axis_name` gives, bound in the
  current trace; None for several or positional axes, or an unbound name."""
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if len(names) != 1 or not isinstance(names[0], str):
    return None
  try:
    return names[0], jax.lax.axis_size(names[0])
  except Exception:  # noqa: BLE001 - not a bound axis: none
    return None


class Comm:
  """Static description of one collective: a primitive param.

  Attributes:
    name: the user-facing collective ('all_gather', 'psum', ...).
    jaxpr: closed jaxpr of the synchronous collective, x -> y.
    state: the `FutureState` shared by every copy of the future.
    tpu_form: the collective as the TPU compiler takes it async
      (`tpu_forms.Form`), or None.
    cpu_jaxpr: the same collective (same inputs and values) by ops XLA:CPU
      runs, where XLA:CPU cannot run `jaxpr`'s (ragged all-to-all); None
      where `jaxpr` runs everywhere.
    second_half: the start of a collective's second half, whose operand
      is the first half's result (`ring_psum.py`'s all-gather): an ordered
      block lowers it, with the first half's done, inside the first half's
      window (`ring_psum.advance_second_halves`).
    first_half: the start of a collective's first half whose transpose is
      a second half (`psum_start(to="varying")`'s reduce-scatter: the
      cotangent's all-gather follows the cotangent's reduce-scatter).
    params: the `jax.lax` call's keyword arguments (axis_name, ...), where
      the start gave them; what `transposed_forms.py` reads to choose the
      TPU form of the transposed collective. None elsewhere.
    sync_note: for a ragged all-to-all (synchronous on GPU and TPU), what to
      say instead of the generic `CollectiveNotAsyncWarning`: a message with
      `{platform}` in it, said once per platform; None for the generic one.
  `jaxpr` takes the operand `x` first and then the collective's integer
  arguments (`aux`: a ragged all-to-all's offsets and sizes), which are
  passed along the primitives (never differentiated). Compared by identity,
  like a jaxpr.
  """

  __slots__ = ("name", "jaxpr", "state", "tpu_form", "cpu_jaxpr",
               "sync_note", "second_half", "params", "first_half")

  def __init__(self, name: str, jaxpr, state: FutureState, tpu_form=None,
               cpu_jaxpr=None, sync_note: str | None = None,
               second_half: bool = False, params: dict | None = None,
               first_half: bool = False):
    self.second_half = second_half
    self.first_half = first_half
    self.params = params
    self.name = name
    self.jaxpr = jaxpr
    self.state = state
    self.tpu_form = tpu_form
    self.cpu_jaxpr = cpu_jaxpr
    self.sync_note = sync_note

  def jaxpr_for(self, platforms) -> object:
    """The jaxpr to run or lower for `platforms` (a tuple of names)."""
    if self.cpu_jaxpr is not None and "cpu" in tuple(platforms):
      return self.cpu_jaxpr
    return self.jaxpr

  @property
  def n_aux(self) -> int:
    return len(self.jaxpr.in_avals) - 1

  @property
  def aux_avals(self):
    return list(self.jaxpr.in_avals[1:])

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


def trace_sync(fn, x, *aux):
  """The closed jaxpr of `fn` on values like `x` (and `aux`), in the current
  axis env."""
  traced = jax.jit(fn).trace(x, *aux)
  return traced.jaxpr


#: The errors jax raises for a bad collective call, said again of the call
#: the user wrote (`said_of`).
TRACE_ERRORS = (NameError, TypeError, ValueError)


def said_of(call: str, e: Exception) -> Exception:
  """jax's error `e` (one of TRACE_ERRORS), said of `call` (e.g.
  "psum_start"), as its builtin class: jax's subclasses take other
  constructor arguments."""
  kind = next(k for k in TRACE_ERRORS if isinstance(e, k))
  return kind(f"{call}: {e}")


def _transpose_of(closed, x_aval):
  jaxpr = _compat.open_jaxpr(closed)
  consts = _compat.jaxpr_consts(closed)

  def transpose(ct, *aux):
    (ct_x, *_) = ad.backward_pass(jaxpr, False, consts,
                                  [ad.UndefinedPrimal(x_aval), *aux], [ct])
    if type(ct_x) is ad_util.Zero:
      ct_x = ad.instantiate_zeros(ct_x)
    return ct_x
  return transpose


def transposed(comm: Comm, ct, aux=()) -> Comm:
  """The collective that carries cotangents of `comm` back (y -> x), traced
  on the cotangent `ct` (and `comm`'s integer arguments `aux`) so it has its
  exact type."""
  cpu = None
  if comm.cpu_jaxpr is not None:
    cpu = trace_sync(_transpose_of(comm.cpu_jaxpr, comm.in_aval), ct, *aux)
  return Comm(_TRANSPOSED_NAME.get(comm.name, comm.name),
              trace_sync(_transpose_of(comm.jaxpr, comm.in_aval), ct, *aux),
              FutureState(comm.name + "_transpose", comm.state.where,
                          internal=True), cpu_jaxpr=cpu,
              second_half=comm.first_half)


_TRANSPOSED_NAME = {"all_gather": "psum_scatter", "psum_scatter": "all_gather",
                    "psum": "psum", "pvary": "psum", "all_to_all": "all_to_all",
                    "ppermute": "ppermute",
                    "ragged_all_to_all": "ragged_all_to_all"}


class FormSwitch:
  """A test switch of a module of collective forms: within `forced()`,
  traces choose the forms on every platform (`on`), or by the device as
  outside it (`on=False`); how their values are checked on CPU
  (tests/collectives/tpu_forms_test.py, permute_forms_test.py).

  >>> switch = FormSwitch()
  >>> with switch.forced():
  ...   assert switch.is_forced()
  >>> switch.is_forced()
  False
  """

  def __init__(self):
    self._on = False

  @contextlib.contextmanager
  def forced(self, on: bool = True):
    before, self._on = self._on, on
    try:
      yield
    finally:
      self._on = before

  def is_forced(self) -> bool:
    return self._on
