"""How a chunk's slots travel between the devices: the seam of the pattern.

`PaddedTransport` sends fixed-size buffers of `E = E_local * axis_size`
experts x `C_c` slots, padded with zeros where no token was routed, with
`all_to_all_start`: device `i` sends expert block
`[d * E_local, (d + 1) * E_local)` to device `d` and receives, from each
source device, the slots of its own `E_local` experts. The same exchange
takes the experts' outputs back (it is its own inverse), and it is its own
transpose, so the backward pass uses it too.

`start(a, b, ...)` sends several buffers in *one* all-to-all (each
flattened per destination and concatenated), so that the pipeline keeps
one exchange in flight at a time: TPU v5e (libtpu 0.0.52) takes one async
all-to-all at a time, and a second one started while the first is in
flight would run synchronously.

Every backend gets the padded transport today: dropless (`capacity=None`)
sizes the slots for the worst case, `T * k` an expert over all chunks. A
ragged all-to-all (`jax.lax.ragged_all_to_all`, which XLA:CPU cannot run)
would send only the routed rows; it would replace this class (and the
layout's slot assignment with per-destination offsets) on the backends that
compile it, behind the same `start(...).done()` interface.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import all_to_all_start
from jax_overlap._src.patterns.moe.varying import vary_like


class _Here(NamedTuple):
  """An exchange over one device: nothing travels."""

  values: tuple

  def done(self):
    return self.values


class _Together(NamedTuple):
  """One all-to-all carrying several buffers; `done()` splits them again."""

  future: Any
  shapes: tuple      # each buffer's shape
  dtypes: tuple      # each buffer's dtype
  widths: tuple      # each buffer's elements (of the sent dtype) per device
  as_bytes: bool     # sent as uint8 (the buffers' dtypes differ)

  def done(self):
    got = self.future.done()
    bounds = np.cumsum((0,) + self.widths)
    out = []
    for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
      part = got[:, bounds[i]:bounds[i + 1]]
      if self.as_bytes:
        part = jax.lax.bitcast_convert_type(
            part.reshape(shape[0], -1, np.dtype(dtype).itemsize), dtype)
      out.append(part.reshape(shape))
    return tuple(out)


def _flat(buffer, as_bytes: bool):
  """[axis_size, ...] -> [axis_size, W], as bytes if `as_bytes`."""
  if as_bytes:
    buffer = jax.lax.bitcast_convert_type(buffer, jnp.uint8)
  return buffer.reshape(buffer.shape[0], -1)


class PaddedTransport(NamedTuple):
  """Fixed-size `[axis_size, ...]` buffers over mesh axis `axis`."""

  axis: Any
  size: int

  def start(self, *buffers):
    """Starts sending `buffers` (each `[axis_size, ...]`, block `d` to device
    `d`) in one all-to-all; `done()` gives them back, block `s` of each from
    device `s`."""
    if self.size == 1:
      return _Here(buffers)
    if len(buffers) == 1:
      return _One(all_to_all_start(buffers[0], self.axis, 0, 0, tiled=True))
    buffers = tuple(vary_like(b, buffers, axis=self.axis) for b in buffers)
    as_bytes = len({b.dtype for b in buffers}) > 1
    flat = [_flat(b, as_bytes) for b in buffers]
    future = all_to_all_start(jnp.concatenate(flat, axis=1), self.axis, 0, 0,
                              tiled=True)
    return _Together(future, tuple(b.shape for b in buffers),
                     tuple(b.dtype for b in buffers),
                     tuple(f.shape[1] for f in flat), as_bytes)


class _One(NamedTuple):
  """One buffer in one all-to-all."""

  future: Any

  def done(self):
    return (self.future.done(),)


def choose_transport(axis, size: int) -> PaddedTransport:
  """The transport for this call: padded on every backend, for now."""
  return PaddedTransport(axis, size)
