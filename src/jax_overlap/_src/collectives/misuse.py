"""Misuse of futures and collectives, caught where it can be.

`done()` twice raises at once (the future's shared `FutureState`). A future
never finished, or returned from the jit that started it, is found when the
jit is lowered: the start's lowering (or DCE of an unused start) sees that
`done()` was never called on it and raises, naming the collective and the
line that started it. Axis names and permutations are checked when the
collective is started.
"""

from __future__ import annotations

from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src import _compat
from jax_overlap._src.collectives.comm import Comm
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


class FutureNotFinishedError(RuntimeError):
  """A future left the jit that started it without `done()`."""


def _start_dce(used_outputs, eqn):
  if not any(used_outputs):
    check_finished(eqn.params["comm"])
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


def _done_dce(used_outputs, eqn):
  if not any(used_outputs):
    return [False] * len(eqn.invars), None
  return [True] * len(eqn.invars), eqn


_compat.register_dce_rule(collective_start_p, _start_dce)
_compat.register_dce_rule(collective_done_p, _done_dce)


def check_finished(comm: Comm):
  state = comm.state
  if not state.finished:
    state.reported()
    raise FutureNotFinishedError(
        f"{state.describe()} was never finished: call .done() on it inside "
        "the jit that started it (it may pass through shard_map or "
        "program_order blocks on the way, but may not be returned from the "
        "jit or dropped).")

def check_axis_name(name: str, axis_name):
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  bound = _compat.bound_axis_names()
  if bound is None:
    return
  unknown = [n for n in names if n not in bound]
  if unknown:
    raise NameError(
        f"{name}_start(axis_name={axis_name!r}): unknown axis name "
        f"{unknown[0]!r}; the axis names in scope here are {sorted(map(str, bound))}. "
        "Call it inside jax.shard_map (or vmap with axis_name=...) over that "
        "axis.")

def check_perm(perm, axis_name) -> tuple[tuple[int, int], ...]:
  try:
    pairs = tuple((int(s), int(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise ValueError(
        f"ppermute_start(perm={perm!r}): perm must be a sequence of "
        "(source, destination) pairs of axis indices.") from None
  size = _compat.axis_size(axis_name)
  srcs = [s for s, _ in pairs]
  dsts = [d for _, d in pairs]
  problems = []
  if len(set(srcs)) != len(srcs):
    problems.append("a source appears twice")
  if len(set(dsts)) != len(dsts):
    problems.append("a destination appears twice")
  if size is not None and any(not 0 <= i < size for i in srcs + dsts):
    problems.append(f"an index is outside 0..{size - 1} (axis "
                    f"{axis_name!r} has size {size})")
  if problems:
    raise ValueError(
        f"ppermute_start(perm={list(pairs)!r}) is not a permutation: "
        f"{'; '.join(problems)}. Give each device at most one source and one "
        "destination.")
  return pairs
