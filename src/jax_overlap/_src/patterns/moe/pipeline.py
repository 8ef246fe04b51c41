"""The chunked schedule: each chunk's exchanges in flight beside the experts.

`exchange_pipeline` runs, for chunks `0 .. m-1`, a dispatch exchange
(`send(c)` to the expert devices), the experts' work on what arrived
(`compute(c, arrived)`), and a combine exchange of its reply back
(`receive(c, returned)`). One `program_order(enforce=True)` block keeps this
written order:

    start dispatch 0
    for c in 0 .. m-1:
      arrived_c = dispatch c .done()
      start dispatch c+1                      (its buffer built first)
      reply_c = compute(c, arrived_c)         <- dispatch c+1 and combine c-1
      receive(c-1, combine c-1 .done())          are in flight here
      start combine c (reply_c)
    receive(m-1, combine m-1 .done())

so at most two exchanges are in flight at once, both while the experts
compute. The forward pass sends tokens and receives expert outputs; the
backward pass sends output cotangents and receives token cotangents, the
experts' backward in between: the same schedule. The pieces of compute
(building a buffer, the experts, unpacking) are free blocks
(`program_order(enforce=False)`): XLA may fuse inside each, not across the
fences.
"""

from __future__ import annotations

from typing import Any, Callable

from jax_overlap import program_order


def exchange_pipeline(transport, chunks: int, *,
                      send: Callable[[int], Any],
                      compute: Callable[[int, Any], tuple[Any, Any]],
                      receive: Callable[[int, Any], Any]):
  """Runs the schedule above; returns `([receive(c, ...)], [extra_c])` with
  `compute(c, arrived) -> (reply_c, extra_c)`."""

  def free(fn, *args):
    return program_order(enforce=False)(lambda: fn(*args))()

  @program_order(enforce=True)
  def ordered():
    results, extras = [None] * chunks, [None] * chunks
    dispatch = transport.start(free(send, 0))
    combine = None
    for c in range(chunks):
      arrived = dispatch.done()
      if c + 1 < chunks:
        dispatch = transport.start(free(send, c + 1))
      reply, extras[c] = free(compute, c, arrived)
      if combine is not None:
        results[c - 1] = free(receive, c - 1, combine.done())
      combine = transport.start(reply)
    results[chunks - 1] = free(receive, chunks - 1, combine.done())
    return results, extras

  return ordered()
