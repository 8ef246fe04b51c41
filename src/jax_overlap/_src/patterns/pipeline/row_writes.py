"""A switch tick's row writes, made after its `conditional`, not in its
branches.

Invariant: where a tick picks each device's action with `lax.switch`
(executor.py `_switch_tick`), a buffer of more than one row that a branch
writes one row of (`work._put`: a kept stage input, cotangent, residual,
gradient row) leaves the branch as that row and its index, written into the
buffer after the switch, in place; a buffer no branch changes is not an
output of the switch at all; only a value a branch changes otherwise (a
running sum) is returned whole. Why: XLA returns every buffer a
`conditional` gives back in a buffer of its own, a whole copy each tick
(the H100's 1F1B with the weights gathered once: docs/pipeline.md
"Memory"). A branch running two parts (a DualPipeV F&B cell) gives its
second part the buffers as the tick starts (`beside`): the parts touch
different rows, and a read of a row the branch wrote would keep the write,
and its copy, in the branch. Each branch is traced twice: once to learn
what it writes, once in the switch.

Where quirks row "tpu-switch-rows-in-branch" applies (`after_switch`
False) the branches write their rows themselves: XLA:TPU made the moved
rows cost more than the copies they saved (the v5e bench's DualPipeV with
the weights gathered once; docs/pipeline.md "Memory" has the figures).

Values are the branches' own. Pinned by tests/aot/pipeline_compiled_test.py
(`test_switch_ticks_write_their_rows_after_the_conditional`) and, for
values and gradients, by tests/patterns/pipeline/pipeline_row_writes_test.py
(the rows filled with NaN) and pipeline_loss_test.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat, quirks

#: The quirks row under which a switch's branches write their own rows.
QUIRK = "tpu-switch-rows-in-branch"

#: the logs of the branches being traced, innermost last
_LOGS: list[dict] = []


def after_switch() -> bool:
  """Whether the program being traced writes a switch's rows after it: all
  but where `QUIRK` applies (the platform of the mesh traced over, where
  jax says, else `jax.default_backend()`)."""
  platform, kind = _compat.trace_device()
  return not quirks.applies(QUIRK, platform or jax.default_backend(), kind)


def note(result, base, row, index) -> None:
  """Records that `result` is `base` with `row` written at `index` (a no-op
  outside `switch`'s branches)."""
  if _LOGS:
    _LOGS[-1][id(result)] = (result, base, row, index)


@contextlib.contextmanager
def _logging():
  log: dict = {}
  _LOGS.append(log)
  try:
    yield log
  finally:
    _LOGS.pop()


def _written(log, after, before):
  """(row, index) if `after` is `before` with one row written, else None."""
  hit = log.get(id(after))
  if hit is None or hit[0] is not after or hit[1] is not before:
    return None
  return hit[2], hit[3]


def _base(log, leaf):
  """`leaf` before the rows this branch wrote into it."""
  hit = log.get(id(leaf)) if log is not None else None
  while hit is not None and hit[0] is leaf:
    leaf = hit[1]
    hit = log.get(id(leaf))
  return leaf


def beside(state):
  """`state` with the row writes of the branch so far undone: what a
  branch's second part reads (module docstring)."""
  log = _LOGS[-1] if _LOGS else None
  return jax.tree.map(lambda a: _base(log, a), state)


def merged(first, second_in, second_out):
  """The state after both parts: each leaf as the part that changed it left
  it (no leaf is changed by both)."""
  def one(a, b, c):
    if c is b:
      return a
    assert a is b, "both parts of a branch changed one buffer"
    return c
  return jax.tree.map(one, first, second_in, second_out)


_SAME, _ROW, _WHOLE = 0, 1, 2


def switch(index, fns: Sequence[Callable], operands, vary: Callable):
  """`lax.switch(index, fns, operands)` for branches `ops -> (state, *rest)`
  where `state` is `operands[0]`'s structure, with the row writes moved out
  (module docstring). `vary` casts a value to the buffers' varying type.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax_overlap._src.patterns.pipeline import row_writes
    >>> from jax_overlap._src.patterns.pipeline.work import _put
    >>> write = lambda ops: ({"rows": _put(ops[0]["rows"], jnp.ones(2), 1)},)
    >>> idle = lambda ops: (ops[0],)
    >>> state = {"rows": jnp.zeros((3, 2))}
    >>> (out,) = row_writes.switch(0, [write, idle], (state,), lambda a: a)
    >>> out["rows"].tolist()
    [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
  """
  leaves, tree = jax.tree.flatten(operands[0])

  def kinds(fn):
    found = []

    def probe(ops):
      with _logging() as log:
        out = fn(ops)
        found.append(_kinds(log, jax.tree.leaves(ops[0]), tree.flatten_up_to(out[0])))
      return out
    jax.make_jaxpr(probe)(operands)   # traced for its writes, not kept
    return found[0]

  kind = [max(ks) for ks in zip(*[kinds(fn) for fn in fns])]
  rows = [n for n, k in enumerate(kind) if k == _ROW]
  whole = [n for n, k in enumerate(kind) if k == _WHOLE]

  def branch(fn):
    def run(ops):
      with _logging() as log:
        out = fn(ops)
        before = jax.tree.leaves(ops[0])
        after = tree.flatten_up_to(out[0])
        writes = []
        for n in rows:
          w = _written(log, after[n], before[n])
          if w is None:   # leaves the buffer as it is: its row 0 again
            assert after[n] is before[n]
            w = (jax.lax.dynamic_index_in_dim(before[n], 0, 0, keepdims=False), 0)
          writes.append((vary(w[0]), vary(jnp.asarray(w[1], jnp.int32))))
      return ([after[n] for n in whole], writes) + tuple(out[1:])
    return run

  kept, writes, *rest = jax.lax.switch(index, [branch(f) for f in fns], operands)
  new = list(leaves)
  for n, a in zip(whole, kept):
    new[n] = a
  for n, (row, at) in zip(rows, writes):
    new[n] = put_row(leaves[n], row, at)
  return (jax.tree.unflatten(tree, new),) + tuple(rest)


def _kinds(log, before, after) -> list[int]:
  """Per leaf: the same, one row written (of a buffer of more than one row:
  a single row is the whole value) or changed otherwise."""
  return [_SAME if b is a else
          _ROW if jnp.ndim(b) and b.shape[0] > 1 and _written(log, a, b) is not None else _WHOLE
          for b, a in zip(before, after, strict=True)]


def put_row(buffer, row, at):
  """`buffer` with `row` written at `at` (a branch that writes none gives
  its row 0 back)."""
  return jax.lax.dynamic_update_index_in_dim(buffer, row, at, 0)
