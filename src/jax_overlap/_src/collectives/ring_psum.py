"""`psum_start` on TPU: a reduce-scatter future, then an all-gather of its chunk.

libtpu has no async all-reduce (quirks.py, "tpu-collective-forms"). The
all-to-all of N copies (tpu_forms.py's `psum` form) is async there but sends
N - 1 copies of the buffer from each device, N/2 times the bytes of a ring
all-reduce. So on TPU `psum_start(x)` over an axis of N devices is:

* at the start, `psum_scatter_start` of `x` flattened (zeros padded to a
  multiple of N): its own TPU form (an all-to-all of chunks on v5e, N - 1
  permutes on v5p), (N - 1)/N of the buffer from each device, in flight;
* after it, that future finished and its chunk gathered back in
  `all_gather_start`'s form there (an all-gather; N - 1 permutes on v5p and
  on v5e with jax < 0.12, where a plain all-gather is synchronous: quirks
  "tpu-permute-forms", "tpu-plain-permute-gathers"), its result invariant
  over the axis (`psum`'s type; the permutes' by
  `permute_forms.gathered_invariant`), (N - 1)/N of the buffer again; at
  `done()` the padding is cut off.

2 (N - 1)/N of the buffer in all, a ring's bytes, each half async
(tests/aot/tpu_forms_compiled_test.py::
test_psum_start_moves_a_ring_all_reduces_bytes, v5e and v5p, every jax).
The all-gather can start only once the sum is known. Traced, it is started by
`done()`; an ordered block lowers it earlier, inside the reduce-scatter's
window after half of the matmuls written there (`advance_second_halves`), so
each half is in flight across part of the window. With no matmul written
there it starts after half of the window's equations.

Buffers where the padded ring would send no fewer bytes than the copies,
2 ceil(S / N) >= S elements of S, keep the copies form: a scalar, two
elements, any buffer over two devices (one collective, not two;
tests/aot/fsdp_settings_compiled_test.py's HSDP replicas).

Values: each chunk is summed on one device, so every device gets the same
value; it matches `jax.lax.psum` up to the order of the sum
(tests/collectives/tpu_forms_test.py checks values and gradients on CPU with
`tpu_forms.forced()`, the all-gather moved up or not, and as permutes).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util

from jax_overlap._src import _compat
from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.collectives.comm import one_bound_axis
from jax_overlap._src.collectives.composed import ComposedFuture
from jax_overlap._src.collectives.future import Future
from jax_overlap._src.ordering import block_collectives

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)


def mesh_axes() -> tuple:
  """The names of the current abstract mesh's axes; () where none."""
  try:
    return tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no mesh: none
    return ()


def compose(x, axis_name, where: str, scatter_start: Callable,
            gather_start: Callable) -> Future | None:
  """The future of `jax.lax.psum(x, axis_name)` as a reduce-scatter then an
  all-gather (`scatter_start(flat, axis)` and `gather_start(chunk, axis)`
  start each), or None where `psum_start` keeps its own form: off TPU, a
  vmap axis, several or positional axes, a non-numeric dtype, or a buffer
  the ring would not send in fewer bytes."""
  if not tpu_forms.wanted("psum"):
    return None   # before asarray: psum_start's own check names bad operands
  x = jnp.asarray(x)
  if not is_ring(x, axis_name):
    return None
  axis, n = one_bound_axis(axis_name)
  out_aval = jax.eval_shape(lambda v: jax.lax.psum(v, axis), x)
  flat = x.reshape(-1)
  padded = -(-flat.size // n) * n
  if padded != flat.size:
    flat = jnp.pad(flat, (0, padded - flat.size))
  part = scatter_start(flat, axis)
  combine = functools.partial(_gathered, axis, x.shape, gather_start)
  return ComposedFuture("psum", where, (), [part], combine, out_aval)


def is_ring(x, axis_name) -> bool:
  """Whether `psum_start(x, axis_name)` (`x`: an array, or anything with its
  shape and dtype) here is this module's two halves
  (a reduce-scatter, then an all-gather), each wanting compute in its own
  window; not off TPU, over a vmap axis, several or positional axes, for a
  non-numeric dtype, or for a buffer the ring would not send in fewer
  bytes than the copies."""
  if not tpu_forms.wanted("psum"):
    return False
  bound = one_bound_axis(axis_name)
  if bound is None:
    return False
  axis, n = bound
  if not tpu_forms.is_forced() and axis not in mesh_axes():
    return False   # a vmap axis: the plain future
  size = math.prod(x.shape)
  return bool(jnp.issubdtype(x.dtype, jnp.number)) and 2 * -(-size // n) < size


def _gathered(axis, shape, gather_start, kept, parts):
  del kept
  (chunk,) = parts
  whole = gather_start(chunk, axis).done()
  return whole.reshape(-1)[:math.prod(shape)].reshape(shape)


def gather_invariant(chunk, axis):
  """`jax.lax.all_gather(chunk, axis, tiled=True)`, typed as `psum`'s result."""
  return _compat.all_gather_invariant(chunk, axis)


# --- the all-gather inside the window ----------------------------------------------

_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def _has_matmul(eqn) -> bool:
  if eqn.primitive.name in _MATMULS:
    return True
  return any(_has_matmul(e) for sub in core.jaxprs_in_params(eqn.params)
             for e in sub.eqns)


def _second_half_chain(eqns, g, producer):
  """(index of the first half's last start, indices of the equations from
  its dones to the second half's start at `g`), or None where the start's
  operand does not come by local equations from the dones of one future
  (one collective, or its parts: v5p's N-1 permutes). Equations up to the
  last other start before `g` are inputs, not part of the chain: `done()`
  writes the chain after every start of the window."""
  floor = max((k for k in range(g) if eqns[k].primitive.name == "collective_start"
               and not getattr(eqns[k].params.get("comm"), "second_half", False)),
              default=-1)
  chain, stack, firsts, owner = {g}, [g], [], None
  while stack:
    for v in eqns[stack.pop()].invars:
      p = producer.get(v) if isinstance(v, core.Var) else None
      if p is None or p in chain or p <= floor:
        continue
      eqn = eqns[p]
      if eqn.primitive.name == "collective_done":
        start = producer.get(eqn.invars[0])
        if start is None or eqns[start].primitive.name != "collective_start":
          return None
        state = eqns[start].params["comm"].state
        if owner not in (None, (state.collective, state.where)):
          return None
        owner = (state.collective, state.where)
        firsts.append(start)
        chain.add(p)
        continue
      if eqn.effects:
        return None
      chain.add(p)
      stack.append(p)
  return (max(firsts), sorted(chain)) if firsts else None


def _midpoint(eqns, first: int, until: int) -> int:
  """Where in the window (first, until) the second half starts: after half
  of its matmuls (rounded up), or after half of its equations."""
  window = range(first + 1, until)
  heavy = [k for k in window if _has_matmul(eqns[k])]
  if heavy:
    return heavy[(len(heavy) + 1) // 2 - 1] + 1
  return first + 1 + len(window) // 2


def _moved_down(eqns, first: int, until: int, chain: list):
  """`eqns` with the `chain` (from a first half's dones, the first at
  `until`, to its second half's starts; the first half started at `first`)
  moved down into the second half's window, where more matmuls are written
  there than in the first half's: after as many of them as make the first
  half's window hold half of both windows' matmuls (rounded up). So a
  transposed ring is split as a forward one is: the cotangent's
  reduce-scatter starts and ends where the forward all-gather did, both at
  the forward's done(), and the backward's work lies in the all-gather's
  window. None where the second half's window holds no more matmuls than
  the first's (every forward ring: its second half ends at done()), or
  where something before that point reads what the chain makes."""
  members = set(chain)
  last = max(chain)
  started = {eqns[k].outvars[0] for k in chain
             if eqns[k].primitive.name == "collective_start"}
  ends = [k for k in range(last + 1, len(eqns))
          if eqns[k].primitive.name == "collective_done"
          and eqns[k].invars and eqns[k].invars[0] in started]
  if not ends:
    return None
  up = [k for k in range(first + 1, until) if _has_matmul(eqns[k])]
  down = [k for k in range(last + 1, min(ends)) if _has_matmul(eqns[k])]
  if len(down) <= len(up):
    return None
  to = down[(len(up) + len(down) + 1) // 2 - len(up) - 1]
  made = {v for k in chain for v in eqns[k].outvars}
  if any(isinstance(v, core.Var) and v in made
         for k in range(until, to + 1) if k not in members
         for v in eqns[k].invars):
    return None
  kept = [(k, e) for k, e in enumerate(eqns) if k not in members]
  at = sum(1 for k, _ in kept if k <= to)
  rest = [e for _, e in kept]
  return rest[:at] + [eqns[k] for k in chain] + rest[at:]


def advance_second_halves(jaxpr):
  """`jaxpr` with each second half's start (`Comm.second_half`), and the
  equations from the first half's done that make its operand, moved up into
  the first half's window: after half of the matmuls written there. So in an
  ordered block both halves of psum_start's ring form are in flight
  (tests/aot/tpu_forms_compiled_test.py::
  test_psum_start_ring_halves_each_hide_behind_a_matmul). Equations are
  moved up only where every input of theirs is ready there; the starts of
  one second half's parts (its N-1 permutes) move together; a jaxpr with no
  such start is returned as it is. Where the second half's window holds more
  matmuls than the first's (the transpose of psum_start(to="varying")'s
  ring) the chain moves down instead (`_moved_down`;
  test_varying_psum_backward_halves_are_async)."""
  eqns = list(jaxpr.eqns)
  starts = [k for k, e in enumerate(eqns)
            if e.primitive.name == "collective_start"
            and getattr(e.params.get("comm"), "second_half", False)]
  if not starts:
    return jaxpr
  producer = {v: k for k, e in enumerate(eqns) for v in e.outvars
              if not isinstance(v, core.DropVar)}
  groups: dict = {}   # first half's start -> the equations its second half moves
  for g in starts:
    found = _second_half_chain(eqns, g, producer)
    if found is not None:
      first_eqn = eqns[found[0]]
      groups.setdefault(id(first_eqn), (first_eqn, []))[1].extend(
          eqns[k] for k in found[1])
  for first_eqn, chain_eqns in groups.values():
    position = {id(e): k for k, e in enumerate(eqns)}
    first = position[id(first_eqn)]
    chain = sorted({position[id(e)] for e in chain_eqns})
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars
                if not isinstance(v, core.DropVar)}
    until = min(k for k in chain if eqns[k].primitive.name == "collective_done")
    down = _moved_down(eqns, first, until, chain)
    if down is not None:
      eqns = down
      continue
    m = _midpoint(eqns, first, until)
    if m >= until:
      continue
    chain = [k for k in chain if k >= m]   # (those before m stay: ready there)
    ready = all(producer.get(v, -1) < m or producer.get(v) in chain
                for k in chain for v in eqns[k].invars
                if isinstance(v, core.Var))
    if not ready:
      continue
    moved = [eqns[k] for k in chain]
    kept = [e for k, e in enumerate(eqns[m:], m) if k not in set(chain)]
    eqns = eqns[:m] + moved + kept
  return jaxpr.replace(eqns=eqns)


# An ordered block moves each second half up before it is fenced.
block_collectives.add_block_rewrite(advance_second_halves)
