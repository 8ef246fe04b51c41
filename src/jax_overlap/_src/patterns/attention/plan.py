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

Pinned by tests/patterns/attention/attention_layout_test.py: the plan
against a brute-force mask of every pair, and equal work per device.
"""

from __future__ import annotations

from typing import NamedTuple

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


def ring_attention_work(layout: str, axis_size: int, *,
                        causal: bool) -> tuple[int, ...]:
  """The number of (query chunk, key chunk) pairs `ring_attention` computes
  on each device of a ring of `axis_size` (chunks as `layout` cuts the
  sequence: p of them, or 2p for "zigzag"), fully masked pairs skipped.

  Example:
    >>> from jax_overlap._src.patterns.attention.plan import ring_attention_work
    >>> ring_attention_work("zigzag", 4, causal=True)
    (9, 9, 9, 9)
    >>> ring_attention_work("contiguous", 4, causal=True)
    (1, 2, 3, 4)
  """
  table = plan(layout, causal)
  return tuple(
      sum(pair.blocks for step in range(axis_size)
          for pair in table[relation(d, step)])
      for d in range(axis_size))
