"""`ComposedFuture`: one future made of several started futures.

A collective that a compiler takes async only as several smaller ones (on
TPU v5p an all-gather or a reduce-scatter, as collective-permutes:
`permute_forms.py`) is still one future to its user: `done()` finishes every
part, in the order they were started, and combines their values into exactly
the collective's value. It is a `Future` (fsdp_scan and user code find
futures by type) and a pytree whose leaves are the parts' in-flight values
and the arrays the combination needs, so it crosses `shard_map`,
`program_order` and jit boundaries as any future does; finishing it twice
raises as for any future, and a part never finished is reported at lowering
under the collective's name.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src.collectives.future import Future, FutureState

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def _finish_parts(combine, value, operand):
  del operand
  kept, parts = value
  return combine(kept, [part.done() for part in parts])


class ComposedFuture(Future):
  """A future whose `done()` finishes its `parts` (futures) and returns
  `combine(kept, [each part's value])`; `kept` is a pytree of arrays the
  combination reads (it travels with the future)."""

  __slots__ = ()

  def __init__(self, collective: str, where: str, kept: Any,
               parts: Sequence[Future], combine: Callable[..., Any],
               out_aval=None):
    super().__init__((kept, tuple(parts)), None, FutureState(collective, where),
                     (_finish_parts, combine, out_aval))

  def done(self):
    self._state.finish()
    finish, combine, _ = self._done_fn
    return finish(combine, self._value, self._operand)

  @property
  def shape(self):
    return self._done_fn[2].shape

  @property
  def dtype(self):
    return self._done_fn[2].dtype

  def __repr__(self):
    return (f"ComposedFuture({self._state.collective}, started at "
            f"{self._state.where}, {len(self._value[1])} parts)")


def _flatten(fut: ComposedFuture):
  return (fut._value,), (fut._state, fut._done_fn)


def _unflatten(aux, children) -> ComposedFuture:
  state, done_fn = aux
  (value,) = children
  fut = object.__new__(ComposedFuture)
  Future.__init__(fut, value, None, state.copy(), done_fn)
  return fut


jax.tree_util.register_pytree_node(ComposedFuture, _flatten, _unflatten)
