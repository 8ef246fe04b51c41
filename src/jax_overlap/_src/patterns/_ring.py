"""Rings of `ppermute_start` steps, each hidden behind the compute of one chunk.

Both collective matmuls are made of two rings over a mesh axis of `size`
devices, fenced with `program_order(enforce=True)` so that each step runs as
written: start the send, compute on what is already here, then `done()`.

* `gather_ring`: every device's chunk visits every device. Device `i` sees its
  own chunk first, then the one from `i + 1`, `i + 2`, ... (the "left" ring
  sends to `i - 1`); with `bidirectional=True` a second ring sends to `i + 1`
  at the same time, bringing `i - 1`, `i - 2`, ..., so each ring makes about
  half the hops.
* `reduce_scatter_ring`: an accumulator per output chunk travels towards the
  device that owns the chunk, and each device on the way adds its part. The
  accumulator for chunk `t` starts `hops` devices away from `t` on its ring.
* `gather_and_scatter_ring`: both in one ring of steps, for a transpose that
  needs both where the sends are plain collectives.

With `size` devices the left ring makes `size - 1` hops, or `size // 2` when
bidirectional (the right ring then makes `(size - 1) // 2`): the two cover the
`size - 1` other devices, and the whole takes `size // 2` steps instead of
`size - 1`. With `size == 1` there is nothing to send.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from jax_overlap._src.collectives.api import ppermute_start
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.leaf_scope import moving


class Ring(NamedTuple):
  """The static description of the rings over one mesh axis."""

  axis: Any
  size: int
  bidirectional: bool

  @property
  def hops(self) -> tuple[int, int]:
    """(hops of the left ring, hops of the right ring)."""
    if self.bidirectional:
      return self.size // 2, (self.size - 1) // 2
    return self.size - 1, 0

  def perm(self, shift: int) -> list[tuple[int, int]]:
    """Each device sends to the one `shift` places further along the axis."""
    return [(j, (j + shift) % self.size) for j in range(self.size)]


_LEFT, _RIGHT = -1, +1


def _send(chunk, ring: Ring, direction: int):
  """Starts sending `chunk` one device along the ring in `direction`, as a
  matrix: the TPU compiler may give a rank-3 or higher chunk's received
  copy another layout than the one sent (say a block of a (batch, sequence,
  width) array gathered along the sequence) and then refuses its own module:
  "Input and output buffer shapes have different layout"
  (tests/aot/real_compilers_test.py::
  test_data_and_tensor_parallel_block_compiles). The receiver reshapes it
  back."""
  if chunk.ndim > 2:
    chunk = chunk.reshape(-1, chunk.shape[-1])
  return ppermute_start(chunk, ring.axis, ring.perm(direction))


def _sources(ring: Ring, hops, index):
  """{(direction, step): the device whose chunk a gather ring brings here
  at that step}: the left ring brings index + step, the right index - step."""
  return {(d, step): (index - d * step) % ring.size
          for d in hops for step in range(1, hops[d] + 1)}


def _targets(ring: Ring, hops, index):
  """{(direction, local): the device whose output chunk the accumulator
  here after `local` hops is for}: it travels `hops` devices in its ring's
  direction to its owner, and is that many devices short of it."""
  return {(d, local): (index + d * (hops[d] - local)) % ring.size
          for d in hops for local in range(hops[d])}


def gather_ring(ring: Ring, chunk, operands, state,
                consume: Callable[[Any, Any, Any, Any], Any]):
  """Folds every device's `chunk` into `state`, each as it arrives.

  Calls `state = consume(operands, state, held, source)` once per device of
  the axis, with `held` the chunk of device `source` (a traced index), the
  own chunk first; while it runs, the held chunk is already on its way to
  the next device. `operands` and `state` are pytrees of arrays.
  """
  left_hops, right_hops = ring.hops
  hops = {_LEFT: left_hops, _RIGHT: right_hops}
  # Device index arithmetic stays outside the ordered block, which then
  # holds only the sends, the compute and the dones. The left ring brings
  # the chunk of index + step, the right one that of index - step.
  index = jax.lax.axis_index(ring.axis)
  sources = _sources(ring, hops, index)

  @program_order(enforce=True)
  def run(chunk, operands, state, index, sources):
    held = {_LEFT: chunk, _RIGHT: chunk}
    for step in range(left_hops + 1):
      sending = [d for d in held if step < hops[d]]
      futures = {d: _send(held[d], ring, d) for d in sending}
      state = _fold(consume, operands, state, held, index, sources, step)
      for d in sending:
        held[d] = futures[d].done().reshape(chunk.shape)
    return state

  return run(chunk, operands, state, index, sources)


def _fold(consume, operands, state, held, index, sources, step: int):
  """A gather step's compute: the own chunk at step 0, then each ring's
  chunk held at that step (from device `sources[direction, step]`)."""
  if step == 0:
    return consume(operands, state, held[_LEFT], index)
  for d in held:
    if (d, step) in sources:
      state = consume(operands, state, held[d], sources[d, step])
  return state


def reduce_scatter_ring(ring: Ring, operands,
                        part: Callable[[Any, Any], Any], *, paced: bool):
  """Sums `part(operands, index)` over the devices, for this device's index.

  `part(operands, t)` is this device's contribution to the output chunk of
  device `t` (a traced index); the result is, on device `i`, the sum over
  all devices of their `part(..., i)`. Each accumulator is sent on while
  the next part is computed; `paced`: each step's parts wait until the
  accumulators it sends are complete (see below where that helps).
  """
  left_hops, right_hops = ring.hops
  hops = {_LEFT: left_hops, _RIGHT: right_hops}
  # Both rings end on the last step: the shorter one starts later.
  first_step = {d: left_hops - h for d, h in hops.items()}

  index = jax.lax.axis_index(ring.axis)
  targets = _targets(ring, hops, index)

  @program_order(enforce=True)
  def run(operands, index, targets):
    acc = {}
    received = {}
    for step in range(left_hops + 1):
      local = {d: step - first_step[d] for d in hops}
      sending = [d for d in hops if 1 <= local[d] <= hops[d]]
      futures = {d: _send(acc[d], ring, d) for d in sending}
      if sending and paced:
        # This step's parts read the operands only once what is being sent
        # is complete, as a gather ring's compute reads the chunk it sends.
        # A part reads nothing that travels, and without this tie the TPU
        # compiler (v5e) computes every part of a ring alone in the first
        # send's window, leaving the later sends nothing to hide behind; a
        # tie to the arrival instead (the done) makes v5p run each part after
        # its send has finished (tests/aot/real_compilers_test.py::
        # test_collective_matmul_sends_behind_block_matmuls).
        operands, _ = jax.lax.optimization_barrier(
            (operands, [acc[d] for d in sending]))
      parts = {d: part(operands, targets[d, local[d]])
               for d in hops if 0 <= local[d] < hops[d]}
      if step == left_hops:
        own = part(operands, index)
      _arrive(futures, received, acc, parts, local)
    return _summed(own, received)

  return run(operands, index, targets)


def _arrive(futures, received, acc, parts, local):
  """Receives each sent accumulator, and adds this step's parts to it."""
  for d, future in futures.items():
    received[d] = future.done().reshape(acc[d].shape)
  for d in parts:
    acc[d] = parts[d] if local[d] == 0 else received[d] + parts[d]


def _summed(own, received):
  for d in sorted(received):
    own = own + received[d]
  return own


def gather_and_scatter_ring(ring: Ring, chunk, operands, state,
                            consume: Callable[[Any, Any, Any, Any], Any],
                            part: Callable[[Any, Any], Any], *,
                            names: tuple[str, str]):
  """`gather_ring` and a paced `reduce_scatter_ring` in one ring of steps.

  Returns `(the summed parts, state)`, each as the two rings would. Each
  step is two halves: the chunk's send while `consume` runs on the chunk
  held, then the accumulators' send while this step's parts run; and the
  step's compute reads the operands only once the accumulators it sends
  are complete. Where the sends are plain collectives
  (`not _compat.ASYNC_CUSTOM_CALLS`), the TPU compiler interleaves the
  sends of two rings side by side and leaves some with no compute behind
  them; without the tie it moves a step's matmul into the window before
  (tests/aot/real_compilers_test.py::
  test_collective_matmul_sends_behind_block_matmuls, older aot venvs).
  `names`: what the chunk's and the accumulators' sends carry (`moving`).
  """
  left_hops, right_hops = ring.hops
  hops = {_LEFT: left_hops, _RIGHT: right_hops}
  first_step = {d: left_hops - h for d, h in hops.items()}
  index = jax.lax.axis_index(ring.axis)
  sources = _sources(ring, hops, index)
  targets = _targets(ring, hops, index)

  def send(name, chunks, directions):
    with moving(name):
      return {d: _send(chunks[d], ring, d) for d in directions}

  @program_order(enforce=True)
  def run(chunk, operands, state, index, sources, targets):
    held = {_LEFT: chunk, _RIGHT: chunk}
    acc, received = {}, {}
    for step in range(left_hops + 1):
      local = {d: step - first_step[d] for d in hops}
      summing = [d for d in hops if 1 <= local[d] <= hops[d]]
      sending = [d for d in hops if step < hops[d]]
      futures = send(names[0], held, sending)
      if summing:
        operands, _ = jax.lax.optimization_barrier(
            (operands, [acc[d] for d in summing]))
      state = _fold(consume, operands, state, held, index, sources, step)
      for d in sending:
        held[d] = futures[d].done().reshape(chunk.shape)
      futures = send(names[1], acc, summing)
      parts = {d: part(operands, targets[d, local[d]])
               for d in hops if 0 <= local[d] < hops[d]}
      if step == left_hops:
        own = part(operands, index)
      _arrive(futures, received, acc, parts, local)
    return _summed(own, received), state

  return run(chunk, operands, state, index, sources, targets)
