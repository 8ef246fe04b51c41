"""The dropless exchange: only the routed rows travel (a ragged all-to-all).

A chunk's buffer is `[axis_size, E_local, C_c, ...]`: block `(d, l)` holds
the slots of expert `d * E_local + l` (on device `d`), its filled slots
first (the layout fills an expert's slots in order). `ragged_blocks_start`
sends of each block only its first `send_sizes[e]` rows, by one
`jax.lax.ragged_all_to_all` with one chunk an expert (chunk `e`, at row
`e * C_c`, goes to device `e // E_local`), written where the padded
all-to-all would put it: block `(sender, l)` of the receiver's buffer. So
the receiver gets the padded exchange's `[axis_size, E_local, C_c, ...]`
(the static shapes `expert_fn` needs), zeros in the slots nothing was sent
to, and the links carry the routed rows only, not `E * C_c` rows a device.
The same call with the sizes swapped takes the replies back (the transpose).

The future is lowered per platform (`Comm.jaxpr_for`, at lowering, where
the target is known: an ahead-of-time compile for TPU/GPU from a CPU
process gets the TPU/GPU form):

* GPU and TPU: the real ragged all-to-all. It is synchronous: XLA has no
  async ragged all-to-all a program can place (xla/futures.py), so
  a dropless pass overlaps nothing, which a `CollectiveNotAsyncWarning`
  says once at compile time.
* CPU, which cannot run one: the dense all-to-all of the padded blocks (the
  rows past each block's size zeroed), the same value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax import lax
import jax.numpy as jnp

from jax_overlap._src.collectives.api import _start_future
from jax_overlap._src.collectives.ragged import by_real_op
from jax_overlap._src.patterns.moe.varying import vary_like

#: Said once per platform when a dropless pass compiles for GPU or TPU.
SYNC_NOTE = (
    "expert_parallel(capacity=None) on {platform}: the dropless dispatch and "
    "combine are ragged all-to-alls (only the routed rows travel), and XLA has "
    "no async ragged all-to-all a program can place, so they run synchronously "
    "and nothing overlaps the experts in a dropless pass (values unchanged). "
    "To overlap them, give a capacity (fixed-size buffers sent by async "
    "all-to-alls; what exceeds it is dropped and counted). Silence with "
    "warnings.filterwarnings('ignore', "
    "category=jax_overlap.CollectiveNotAsyncWarning).")


def received_sizes(sent, *, axis, experts_local: int):
  """`sent` (`[chunks, E]`: rows this device sends each expert in each
  chunk) -> `[chunks, E]`: rows each source device `s` sends this device's
  expert `l` in each chunk, at `s * E_local + l` (one small all-to-all)."""
  chunks, experts = sent.shape
  size = experts // experts_local
  sent = vary_like(sent.reshape(chunks, size, experts_local), axis=axis)
  got = lax.all_to_all(sent, axis, 1, 1, tiled=True)
  return got.reshape(chunks, experts)


class _Blocks(NamedTuple):
  future: Any
  shape: tuple

  def done(self):
    return self.future.done().reshape(self.shape)


def ragged_blocks_start(buffer, send_sizes, recv_sizes, *, axis):
  """Starts sending `buffer` (`[axis_size, E_local, C_c, ...]`) of which
  block `e` (flattened `(d, l)`) holds `send_sizes[e]` rows; `recv_sizes[e]`
  are the rows block `e` of the result receives. `done()` gives the
  `[axis_size, E_local, C_c, ...]` buffer received."""
  size, experts_local, per = buffer.shape[:3]
  rest = buffer.shape[3:]
  experts = size * experts_local
  operand = buffer.reshape(experts * per, *rest)
  output = vary_like(jnp.zeros_like(operand), operand)
  chunk = jnp.arange(experts, dtype=jnp.int32)
  me = lax.axis_index(axis).astype(jnp.int32)
  ints = (chunk * per, send_sizes.astype(jnp.int32),
          (me * experts_local + chunk % experts_local) * per,
          recv_sizes.astype(jnp.int32))
  ints = tuple(vary_like(a, operand, axis=axis) for a in ints)
  n_rows = operand.shape[0]
  stacked = jnp.concatenate([operand, output], axis=0)
  future = _start_future(
      "ragged_all_to_all", by_real_op(n_rows, axis, None), stacked, aux=ints,
      cpu_fn=_by_padded_all_to_all(n_rows, axis, per), sync_note=SYNC_NOTE)
  return _Blocks(future, buffer.shape)


def _by_padded_all_to_all(n_rows: int, axis, per: int):
  """stacked, *ints -> the ragged all-to-all's value for this module's fixed
  offsets (chunk e at row e * per, received at block (sender, e % E_local)),
  by one dense all-to-all of the padded blocks (XLA:CPU runs it)."""
  def fn(stacked, input_offsets, send_sizes, output_offsets, recv_sizes):
    del input_offsets, output_offsets     # fixed by the layout (above)
    operand, output = stacked[:n_rows], stacked[n_rows:]
    rest = operand.shape[1:]
    experts = n_rows // per
    row = jnp.arange(per)
    ones = (1,) * len(rest)

    def masked(blocks, sizes, other):
      keep = (row[None, :] < sizes[:, None]).reshape(experts, per, *ones)
      return jnp.where(keep, blocks.reshape(experts, per, *rest),
                       other.reshape(experts, per, *rest))

    sent = masked(operand, send_sizes, jnp.zeros_like(operand))
    got = lax.all_to_all(sent.reshape(n_rows, *rest), axis, 0, 0, tiled=True)
    return masked(got, recv_sizes, output).reshape(n_rows, *rest)
  return fn
