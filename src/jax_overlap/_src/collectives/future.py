"""`Future`: a collective that has been started and not yet finished.

A future is a pytree whose one leaf is the in-flight result, so it can be
returned from one `jax.shard_map` (or `program_order` block, or inner jit)
and finished in another inside the same jit. It is not an array: using it as
one, finishing it twice, or letting it leave the jit that started it are
errors (see `misuse.py` for how the last is detected).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable

import jax
from jax._src import source_info_util
from jax._src import traceback_util

# Errors and "started at" lines point at the user's code, not ours.
source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


class FutureState:
  """Where a future began and whether it ended, shared along its copies.

  A future is copied each time it crosses a `shard_map`, `program_order` or
  jit boundary: flattened on one side, rebuilt on the other. Each rebuilt
  copy gets a state of its own whose `parent` is the state it was copied
  from, so that:

  * `done()` on a copy whose original was already finished, or on an
    original one of whose copies was finished, raises (done twice);
  * two copies rebuilt from one cached trace (a block or jit called twice
    traces once, and jax rebuilds its outputs at each call) are two futures,
    each finished once.

  The root state (the start's, kept in `Comm.state`) is finished when any
  copy is; lowering reads it to find futures never finished. Compared by
  identity.
  """

  __slots__ = ("collective", "where", "internal", "parent", "_flags",
               "_watched", "__weakref__")

  def __init__(self, collective: str, where: str, *, internal: bool = False,
               parent: FutureState | None = None):
    self.collective = collective
    self.where = where
    self.internal = internal
    self.parent = parent
    # [done() called on this copy, done() called on a copy made from it,
    # reported unfinished already]. A list, so that `watch`'s finalizer can
    # read it without keeping the state alive.
    self._flags = [internal, False, False]
    self._watched = False

  def copy(self) -> FutureState:
    return FutureState(self.collective, self.where, internal=self.internal,
                       parent=self)

  @property
  def finished(self) -> bool:
    """done() was called on this future or on a copy made from it."""
    return self._flags[0] or self._flags[1]

  def _ancestors(self):
    node = self.parent
    while node is not None:
      yield node
      node = node.parent

  def finish(self) -> None:
    """Marks done(); raises if this future was already finished."""
    if self.finished or any(a._flags[0] for a in self._ancestors()):
      raise RuntimeError(
          f"done() was called twice on {self.describe()}. A future is "
          "finished exactly once; keep the array the first done() returned.")
    self._flags[0] = True
    for a in self._ancestors():
      a._flags[1] = True

  def reported(self) -> None:
    """Marks that an error said this future was never finished, so that
    `watch`'s warning does not say it again when the future is collected
    (under `jax.grad` of an eager `shard_map` the primal start runs eagerly
    and is watched, and the linearized program's DCE raises for it)."""
    self._flags[2] = True

  def describe(self) -> str:
    return f"the future from {self.collective}_start started at {self.where}"

  def watch(self) -> None:
    """For a future that ran eagerly, where no lowering can check it: warn
    when the last copy is collected if done() was never called (and no
    error said so already: `reported`)."""
    if self._watched or self.finished:
      return
    self._watched = True
    finalizer = weakref.finalize(self, _warn_if_unfinished, self._flags,
                                 self.describe())
    finalizer.atexit = False  # a jax cache may hold it until exit: no use then

  def __repr__(self):
    # jax prints this when a future is where only arrays may be (a loop
    # carry, a cond branch's output): say what to do there.
    return (f"<{self.describe()}: a future cannot be a lax.scan/fori_loop/"
            "while_loop carry or a lax.cond/switch output; call .done() "
            "inside the iteration or branch that started it and pass the "
            "array>")


class FutureNotFinishedWarning(RuntimeWarning):
  """An eagerly run future was dropped without `done()`."""


def _warn_if_unfinished(flags: list[bool], description: str) -> None:
  if not any(flags):  # neither finished nor reported by an error
    warnings.warn(
        f"{description} was never finished: call .done() on it (it ran "
        "eagerly, outside any jit, so its value was computed but never used).",
        FutureNotFinishedWarning, stacklevel=2)


def user_frame() -> str:
  """`file:line (function)` of the user's call, for error messages and the
  overlap report; '' when no frame on the stack is the user's."""
  info = source_info_util.current()
  try:
    where = source_info_util.summarize(info)
  except Exception:  # noqa: BLE001 - best effort: a message must not fail
    return "<unknown location>"
  # jax keeps only the innermost frames of a traceback: a start deep inside
  # a pattern (fsdp_scan's scan body) keeps none of the user's. The Python
  # stack still has them.
  return where or _python_user_frame()


def _python_user_frame() -> str:
  frame = sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if source_info_util.is_user_filename(code.co_filename):
      return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
    frame = frame.f_back
  return ""


class Future:
  """A started collective; `done()` finishes it and returns its value.

  Made by `all_gather_start`, `psum_start`, `psum_scatter_start`,
  `all_to_all_start`, `ppermute_start` and `ragged_all_to_all_start`. Finish each future exactly once,
  inside the jit that started it. Between start and `done()` the
  communication may run at the same time as the code written in between;
  under `program_order(enforce=True)` that order is kept.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P())
    ... def f(x):
    ...   fut = jax_overlap.psum_start(x, 'i')
    ...   return fut.done()
    >>> f(jnp.arange(4.0))
    Array([2., 4.], dtype=float32)
  """

  __slots__ = ("_value", "_operand", "_state", "_done_fn")

  def __init__(self, value, operand, state: FutureState,
               done_fn: Callable[..., Any]):
    self._value = value
    self._operand = operand   # None once the future has crossed a boundary
    self._state = state
    self._done_fn = done_fn

  @property
  def collective(self) -> str:
    return self._state.collective

  @property
  def shape(self):
    return jax.typeof(self._value).shape

  @property
  def dtype(self):
    return self._value.dtype

  def done(self):
    """Waits for the collective and returns its value (an array)."""
    self._state.finish()
    return self._done_fn(self._value, self._operand)

  def __repr__(self):
    return (f"Future({self._state.collective}, started at "
            f"{self._state.where}, value={self._value!r})")

  # --- not an array ----------------------------------------------------------

  def _not_an_array(self, *_, **__):
    raise TypeError(
        f"{self._state.describe()} is not an array. Call .done() on it first "
        "and use the array it returns.")

  __jax_array__ = _not_an_array
  __array__ = _not_an_array
  __bool__ = _not_an_array
  __float__ = __int__ = __index__ = _not_an_array
  __getitem__ = _not_an_array
  for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                "matmul", "and", "or", "xor", "lshift", "rshift"):
    locals()[f"__{_name}__"] = _not_an_array
    locals()[f"__r{_name}__"] = _not_an_array
  for _name in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"):
    locals()[f"__{_name}__"] = _not_an_array
  del _name
  __hash__ = object.__hash__


def _flatten(fut: Future):
  # The operand is a private detail of the same trace; it does not travel.
  return (fut._value,), (fut._state, fut._done_fn)


def _unflatten(aux, children) -> Future:
  state, done_fn = aux
  (value,) = children
  return Future(value, None, state.copy(), done_fn)


jax.tree_util.register_pytree_node(Future, _flatten, _unflatten)
