"""The chunked schedule: one exchange in flight beside the experts each step.

`exchange_pipeline` runs, for chunks `0 .. m-1`, a dispatch (`send(c)` to
the expert devices), the experts' work on what arrived (`compute(c,
arrived)`) and a combine of its reply back. Each step's one all-to-all
carries chunk c+1's dispatch and chunk c-1's combine together
(`transport.start(dispatch=..., combine=...)`), so one exchange is in
flight at a time (TPU v5e takes no more) while the experts compute chunk c. One
`program_order(enforce=True)` block keeps this written order:

    arrived_0 = exchange(send 0)                     (nothing to hide it)
    for c in 0 .. m-1:
      start exchange(send c+1, reply_{c-1})          (what exists of them)
      reply_c = compute(c, arrived_c)                <- the exchange in flight
      arrived_{c+1}, returned_{c-1} = its done()
    returned_{m-1} = exchange(reply_{m-1})           (nothing to hide it)

so a pass has m + 2 all-to-alls (2 when m = 1), each but the first and last
beside the experts. (Dropless, each leg is a ragged exchange of its own, 2m
a pass, synchronous on GPU and TPU: transport.py.) The forward pass sends tokens and receives expert
outputs; the backward pass sends output cotangents and receives token
cotangents, the experts' backward in between: the same schedule. The pieces
of compute (building a buffer, the experts) are free blocks
(`program_order(enforce=False)`): XLA may fuse inside each, not across the
fences.
"""

from __future__ import annotations

from typing import Any, Callable

from jax_overlap._src.ordering.decorator import program_order


def exchange_pipeline(transport, chunks: int, *,
                      send: Callable[[int], Any],
                      compute: Callable[[int, Any], tuple[Any, Any]]):
  """Runs the schedule above; returns `([returned_c], [extra_c])` with
  `compute(c, arrived) -> (reply_c, extra_c)`."""

  def free(fn, *args):
    return program_order(enforce=False)(lambda: fn(*args))()

  @program_order(enforce=True)
  def ordered():
    returned, extras = [None] * chunks, [None] * chunks
    arrived, _ = transport.start(dispatch=(0, free(send, 0))).done()
    reply = None
    for c in range(chunks):
      dispatch = (c + 1, free(send, c + 1)) if c + 1 < chunks else None
      combine = (c - 1, reply) if reply is not None else None
      exchange = None
      if dispatch is not None or combine is not None:
        exchange = transport.start(dispatch=dispatch, combine=combine)
      new_reply, extras[c] = free(compute, c, arrived)
      if exchange is not None:
        got_arrived, got_returned = exchange.done()
        if dispatch is not None:
          arrived = got_arrived
        if combine is not None:
          returned[c - 1] = got_returned
      reply = new_reply
    _, returned[chunks - 1] = transport.start(
        combine=(chunks - 1, reply)).done()
    return returned, extras

  return ordered()
