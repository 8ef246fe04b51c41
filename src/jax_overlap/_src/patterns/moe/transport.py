"""How a chunk's slots travel between the devices: the seam of the pattern.

A transport's `start(dispatch=(c, buffer), combine=(c, buffer))` sends chunk
`c`'s dispatch (each buffer `[axis_size, E_local, C_c, ...]`, block `d` to
device `d`: the slots of its experts) and chunk `c`'s combine (the experts'
replies, block `s` back to source device `s`), either of them None;
`done()` gives `(arrived, returned)`, each the buffer received (block `s`
from device `s`) or None. Two transports:

* `PaddedTransport` (a capacity): the fixed-size buffers, padded with
  zeros where no token was routed, by `all_to_all_start`. The exchange is
  its own inverse and its own transpose, so the combine and the backward
  pass use it too. Both legs go in *one* all-to-all (each flattened per
  destination and concatenated), so that the pipeline keeps one exchange
  in flight at a time: the TPU compiler takes one async all-to-all at a
  time (quirks.py, "tpu-forms-in-flight"), and a second one started while
  the first is in flight would run synchronously
  (tests/aot/moe_compiled_test.py::
  test_all_to_alls_are_in_flight_across_the_expert_matmuls).
* `RaggedTransport` (dropless, `capacity=None`): each leg a ragged
  all-to-all of the same buffers that sends only the routed rows
  (`ragged_exchange.py`): the real `ragged-all-to-all` on GPU and TPU
  (synchronous there), the padded all-to-all on CPU, which cannot run one,
  chosen when the program is lowered. Dropless buffers are sized for the
  worst case, `T * k` slots an expert over all chunks, so on GPU and TPU
  this moves the routed rows where the padded buffers would move `E * T * k`
  rows a device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.collectives.api import all_to_all_start
from jax_overlap._src.patterns.moe.ragged_exchange import ragged_blocks_start
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


class _Legs(NamedTuple):
  """An exchange of what was given of (dispatch, combine)."""

  exchange: Any      # done() -> the given legs' buffers, in that order
  legs: tuple        # (dispatch given, combine given)

  def done(self):
    got = list(self.exchange.done())
    return tuple(got.pop(0) if given else None for given in self.legs)


class _Each(NamedTuple):
  """Several exchanges, finished in the order they started."""

  exchanges: tuple

  def done(self):
    return tuple(e.done() for e in self.exchanges)


def _given(dispatch, combine):
  legs = tuple(leg for leg in (dispatch, combine) if leg is not None)
  return legs, (dispatch is not None, combine is not None)


class PaddedTransport(NamedTuple):
  """Fixed-size `[axis_size, ...]` buffers over mesh axis `axis`."""

  axis: Any
  size: int

  def start(self, dispatch=None, combine=None):
    """`dispatch` and `combine`, `(chunk, buffer)` or None, in one
    all-to-all."""
    legs, given = _given(dispatch, combine)
    return _Legs(self._start(*(buffer for _, buffer in legs)), given)

  def _start(self, *buffers):
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


class RaggedTransport(NamedTuple):
  """Only the routed rows of each buffer, by a ragged all-to-all a leg."""

  axis: Any
  size: int
  sent: Any        # [chunks, E]: rows this device sends each expert
  received: Any    # [chunks, E]: rows each (source, local expert) receives

  def start(self, dispatch=None, combine=None):
    """`dispatch` and `combine`, `(chunk, buffer)` or None: one ragged
    all-to-all each (synchronous on GPU and TPU: nothing to keep to one in
    flight)."""
    legs, given = _given(dispatch, combine)
    if self.size == 1:
      return _Legs(_Here(tuple(buffer for _, buffer in legs)), given)
    exchanges = []
    if dispatch is not None:
      c, buffer = dispatch
      exchanges.append(ragged_blocks_start(buffer, self.sent[c],
                                           self.received[c], axis=self.axis))
    if combine is not None:
      c, buffer = combine
      exchanges.append(ragged_blocks_start(buffer, self.received[c],
                                           self.sent[c], axis=self.axis))
    return _Legs(_Each(tuple(exchanges)), given)


def choose_transport(axis, size: int, sizes=None):
  """Ragged for a dropless call (`sizes`: `(sent, received)`, each
  `[chunks, E]`), else padded."""
  if sizes is None:
    return PaddedTransport(axis, size)
  return RaggedTransport(axis, size, *sizes)
