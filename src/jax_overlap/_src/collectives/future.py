"""`Future`: a collective that has been started and not yet finished.

A future is a pytree whose one leaf is the in-flight result, so it can be
returned from one `jax.shard_map` (or `program_order` block, or inner jit)
and finished in another inside the same jit. It is not an array: using it as
one, finishing it twice, or letting it leave the jit that started it are
errors (see `collectives.py` for how the last is detected).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax._src import source_info_util
from jax._src import traceback_util

# Errors and "started at" lines point at the user's code, not ours.
source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


class FutureState:
  """What every copy of one future shares: where it began, whether it ended.

  Copies arise when a future crosses a `shard_map` or jit boundary (the pytree
  is flattened and rebuilt), so the state lives here and not on the `Future`.
  Compared by identity.
  """

  __slots__ = ("collective", "where", "finished", "internal")

  def __init__(self, collective: str, where: str, *, internal: bool = False):
    self.collective = collective
    self.where = where
    self.finished = internal
    self.internal = internal

  def describe(self) -> str:
    return f"the future from {self.collective}_start started at {self.where}"

  def __repr__(self):
    return f"FutureState({self.collective!r}, {self.where!r})"


def user_frame() -> str:
  """`file:line (function)` of the user's call, for error messages."""
  info = source_info_util.current()
  try:
    return source_info_util.summarize(info)
  except Exception:  # noqa: BLE001 - best effort: a message must not fail
    return "<unknown location>"


class Future:
  """A started collective; `done()` finishes it and returns its value.

  Made by `all_gather_start`, `psum_start`, `psum_scatter_start`,
  `all_to_all_start` and `ppermute_start`. Finish each future exactly once,
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
    if self._state.finished:
      raise RuntimeError(
          f"done() was called twice on {self._state.describe()}. A future is "
          "finished exactly once; keep the array the first done() returned.")
    self._state.finished = True
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
  return Future(value, None, state, done_fn)


jax.tree_util.register_pytree_node(Future, _flatten, _unflatten)
