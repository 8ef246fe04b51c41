"""How a chunk's slots travel between the devices: the seam of the pattern.

`PaddedTransport` sends every chunk as one fixed-size buffer of
`E = E_local * axis_size` experts x `C` slots, padded with zeros where no
token was routed, with `all_to_all_start`: device `i` sends expert block
`[d * E_local, (d + 1) * E_local)` to device `d` and receives, from each
source device, the slots of its own `E_local` experts. The same exchange
takes the experts' outputs back (it is its own inverse), and it is its own
transpose, so the backward pass uses it too.

Every backend gets the padded transport today: dropless (`capacity=None`)
sizes `C` for the worst case, `T_chunk * k` slots per expert. A ragged
all-to-all (`jax.lax.ragged_all_to_all`, which XLA:CPU cannot run) would
send only the routed rows; it would replace this class (and the layout's
slot assignment with per-destination offsets) on the backends that compile
it, behind the same `start(buffer).done()` interface.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax_overlap import all_to_all_start


class _Here(NamedTuple):
  """An exchange over one device: nothing travels."""

  value: Any

  def done(self):
    return self.value


class PaddedTransport(NamedTuple):
  """Fixed-size `[axis_size, E_local, C, D]` buffers over mesh axis `axis`."""

  axis: Any
  size: int

  def start(self, buffer):
    """Starts sending `buffer` ([axis_size, ...], block `d` to device `d`);
    `done()` gives `[axis_size, ...]` with block `s` from device `s`."""
    if self.size == 1:
      return _Here(buffer)
    return all_to_all_start(buffer, self.axis, 0, 0, tiled=True)


def choose_transport(axis, size: int) -> PaddedTransport:
  """The transport for this call: padded on every backend, for now."""
  return PaddedTransport(axis, size)
