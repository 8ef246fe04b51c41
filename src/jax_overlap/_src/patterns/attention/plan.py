"""Which (query chunk, key chunk) pairs a ring step computes.

At step s device d holds the keys and values of device (d - s) mod p: its
own at step 0 ("self"), then a device before it ("before", while s <= d)
or after it ("after"). For each relation the plan lists the pairs to
compute as `Pair`s of chunk ranges (layout.py's chunks); a causal pair
whose keys all lie after its queries is left out, so it costs nothing.

For both layouts and every (d, s) the relation alone decides which pairs
are unmasked, so the same program (SPMD) serves every device, choosing
between "before" and "after" by index arithmetic, not by branching, where
both have a pair of the same shape. With zigzag each device then computes
2p + 1 chunk pairs of the (2p)^2 / 2 + p unmasked ones in all.

With a sliding window (window.py) the relation no longer decides alone:
`ring_steps` lists, for each step the ring takes, the pairs some device of
each relation needs, marked `window` where the mask depends on where the
chunks lie (computed from global positions then, so a device that needs
none of the pair adds nothing). A step where no device needs a pair is not
taken: the ring visits only the offsets it needs, and moves the blocks
between them in one rotation each.

Pinned by tests/patterns/attention/attention_layout_test.py: the plan
against a brute-force mask of every pair, and equal work per device; the
windowed steps by tests/patterns/attention/ring_window_test.py.
"""

from __future__ import annotations

from typing import NamedTuple

from jax_overlap._src.patterns.attention import window as windows
from jax_overlap._src.patterns.attention.layout import (
    chunks_per_device, device_chunks)

SELF, BEFORE, AFTER = "self", "before", "after"


class Pair(NamedTuple):
  """Queries in local chunks [q_first, q_first + q_count) against keys in
  [k_first, k_first + k_count); `diagonal`: the two are the same global
  chunk, and a causal mask applies inside it."""
  q_first: int
  q_count: int
  k_first: int
  k_count: int
  diagonal: bool
  window: bool = False   # masked by global positions (window.py)

  @property
  def blocks(self) -> int:
    return self.q_count * self.k_count


def relation(device: int, step: int) -> str:
  if step == 0:
    return SELF
  return BEFORE if step <= device else AFTER


def _pairs(layout: str, causal: bool, rel: str) -> tuple[Pair, ...]:
  n = chunks_per_device(layout)
  if not causal:
    return (Pair(0, n, 0, n, False),)
  # Representative devices of a ring of 2: any other size gives the same
  # relation between global chunks (attention_layout_test checks p <= 8).
  p = 2
  d, src = {SELF: (0, 0), BEFORE: (1, 0), AFTER: (0, 1)}[rel]
  q_chunks = device_chunks(layout, p, d)
  k_chunks = device_chunks(layout, p, src)
  pairs = []
  # The queries of the last local chunk first: with zigzag it is the pair
  # both "before" and "after" compute, kept at the same place in both.
  for i in reversed(range(n)):
    for j in range(n):
      if k_chunks[j] < q_chunks[i]:
        pairs.append(Pair(i, 1, j, 1, False))
      elif k_chunks[j] == q_chunks[i]:
        pairs.append(Pair(i, 1, j, 1, True))
  return tuple(pairs)


def plan(layout: str, causal: bool) -> dict[str, tuple[Pair, ...]]:
  """relation -> the pairs a step of that relation computes."""
  return {rel: _pairs(layout, causal, rel) for rel in (SELF, BEFORE, AFTER)}


class Step(NamedTuple):
  """One step of the ring: the block held is device (d - offset)'s, and
  `pairs[relation]` are the pairs computed with it (SELF at offset 0)."""
  offset: int
  pairs: dict


def ring_steps(layout: str, causal: bool, size: int, chunk: int,
               window=None) -> tuple[Step, ...]:
  """The steps of a ring of `size` devices over chunks of `chunk`
  positions, in the order taken: every offset without a window (`plan`'s
  pairs), else only the offsets some device needs, ascending."""
  if window is None:
    table = plan(layout, causal)
    return tuple(Step(o, table) for o in range(size))
  steps = []
  for offset in range(size):
    rels = (SELF,) if offset == 0 else (BEFORE, AFTER)
    pairs = {rel: _window_pairs(layout, causal, size, chunk, window, offset,
                                [d for d in range(size)
                                 if relation(d, offset) == rel])
             for rel in rels}
    if any(pairs.values()):
      steps.append(Step(offset, pairs))
  return tuple(steps)


def _window_pairs(layout, causal, size, chunk, window, offset, devices):
  """The pairs the `devices` (one relation at `offset`) compute: each chunk
  pair some of them need, one kind for all of them (else "window", whose
  mask is exact on each); the whole block in one pair where every chunk
  pair is "full" for all, as `plan` has it without a mask."""
  if not devices:
    return ()
  n = chunks_per_device(layout)
  kinds = {}
  for i in reversed(range(n)):
    for j in range(n):
      seen = {windows.chunk_pair(device_chunks(layout, size, d)[i],
                                 device_chunks(layout, size,
                                               (d - offset) % size)[j],
                                 chunk, causal, window) for d in devices}
      if seen != {windows.SKIP}:
        kinds[i, j] = seen.pop() if len(seen) == 1 else windows.WINDOW
  if not causal and len(kinds) == n * n and set(kinds.values()) == {
      windows.FULL}:
    return (Pair(0, n, 0, n, False),)
  return tuple(Pair(i, 1, j, 1, kind == windows.DIAGONAL,
                    kind == windows.WINDOW) for (i, j), kind in kinds.items())


def ring_attention_work(layout: str, axis_size: int, *, causal: bool,
                        window=None, chunk: int = 1) -> tuple[int, ...]:
  """The number of (query chunk, key chunk) pairs `ring_attention` computes
  on each device of a ring of `axis_size` (chunks as `layout` cuts the
  sequence: p of them, or 2p for "zigzag", each `chunk` positions long),
  fully masked pairs skipped (with `window`, `(left, right)`: the pairs no
  device of a step's relation needs).

  Example:
    >>> from jax_overlap._src.patterns.attention.plan import ring_attention_work
    >>> ring_attention_work("zigzag", 4, causal=True)
    (9, 9, 9, 9)
    >>> ring_attention_work("contiguous", 4, causal=True)
    (1, 2, 3, 4)
    >>> ring_attention_work("contiguous", 4, causal=True, window=(8, 0), chunk=8)
    (1, 2, 2, 2)
  """
  steps = ring_steps(layout, causal, axis_size, chunk, window)
  return tuple(
      sum(pair.blocks for step in steps
          for pair in step.pairs[relation(d, step.offset)])
      for d in range(axis_size))
