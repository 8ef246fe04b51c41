"""The chunked schedule: each exchange in flight beside half of the experts.

`exchange_pipeline` runs, for chunks `0 .. m-1`, a dispatch exchange
(`send(c)` to the expert devices), the experts' work on what arrived, in
two halves (`first(c, arrived)` then `second(c, half)`, which returns the
reply), and a combine exchange of the reply back (`receive(c, returned)`).
One `program_order(enforce=True)` block keeps this written order:

    start dispatch 0; finish it
    for c in 0 .. m-1:
      start dispatch c+1                      (its buffer built first)
      first half of the experts on chunk c    <- dispatch c+1 in flight
      finish dispatch c+1
      start combine c-1
      second half of the experts on chunk c   <- combine c-1 in flight
      finish combine c-1; receive it
    start combine m-1; finish it; receive it

Every exchange but the first and the last has expert compute in flight, and
only one exchange is in flight at a time: the TPU compiler runs a second
concurrent all-to-all synchronously, and XLA's GPU scheduler limits
concurrent collectives (one by default). The forward pass sends tokens and
receives expert outputs; the backward pass sends output cotangents and
receives token cotangents, the experts' backward in between: the same
schedule. The pieces of compute (building a buffer, each half, unpacking)
are free blocks (`program_order(enforce=False)`): XLA may fuse inside each,
not across the fences.
"""

from __future__ import annotations

from typing import Any, Callable

from jax_overlap import program_order


def exchange_pipeline(transport, chunks: int, *,
                      send: Callable[[int], Any],
                      first: Callable[[int, Any], Any],
                      second: Callable[[int, Any], tuple[Any, Any]],
                      receive: Callable[[int, Any], Any]):
  """Runs the schedule above; returns `([receive(c, ...)], [extra_c])` with
  `second(c, first(c, arrived)) -> (reply_c, extra_c)`."""

  def free(fn, *args):
    return program_order(enforce=False)(lambda: fn(*args))()

  @program_order(enforce=True)
  def ordered():
    results, extras = [None] * chunks, [None] * chunks
    arrived = transport.start(free(send, 0)).done()
    reply = None                      # chunk c-1's, not yet sent back
    for c in range(chunks):
      if c + 1 < chunks:
        dispatch = transport.start(free(send, c + 1))
      half = free(first, c, arrived)
      if c + 1 < chunks:
        arrived = dispatch.done()
      if reply is not None:
        combine = transport.start(reply)
      reply_c, extras[c] = free(second, c, half)
      if reply is not None:
        results[c - 1] = free(receive, c - 1, combine.done())
      reply = reply_c
    results[chunks - 1] = free(receive, chunks - 1,
                               transport.start(reply).done())
    return results, extras

  return ordered()
