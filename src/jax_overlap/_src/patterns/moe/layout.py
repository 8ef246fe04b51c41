"""The dispatch layout: which (token, choice) goes to which slot.

Each device sends, per chunk of its tokens, one buffer of `E` experts x `C`
slots (`E = E_local * axis_size`, `C` the chunk's slots per expert). A
(token, choice) pair `(t, j)` with expert `e = expert_ids[t, j]` goes to slot
`q` of expert `e`, where `q` is how many earlier pairs of the same chunk
(in token order, then choice order) chose `e`.

The capacity rule is the whole call's, not a chunk's, so that which pairs
are dropped does not depend on `chunks`: a pair is kept when the number of
earlier pairs of *this device* (all chunks) that chose `e` is below
`capacity`. A chunk therefore needs at most `min(capacity, T_chunk * k)`
slots per expert (every kept pair of a chunk may choose one expert), and
dropless needs `T_chunk * k` (the choices of one token may repeat an expert,
so `T_chunk` is not enough in general).

An id outside `[0, E)` (which only a traced `expert_ids` can carry past the
checks) is treated as dropped: it contributes 0 and, with a capacity, is
counted in `dropped`. A kept pair's flat slot index is `e * C + q`; a
dropped pair's is `E * C`, one past the end, which scatters write nowhere
(`mode="drop"`) and gathers read as 0 (`mode="fill"`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap._src.patterns.moe.varying import vary_like


class Layout(NamedTuple):
  """Where each (token, choice) of each chunk goes; arrays, traced."""

  slots: jax.Array    # [chunks, T_chunk * k] int32 flat slot, E * C if dropped
  dropped: jax.Array  # [] int32: this device's dropped (token, choice) pairs


def slots_per_expert(tokens_per_chunk: int, k: int, capacity) -> int:
  """`C`: the slots each chunk's buffer has for each expert."""
  worst = tokens_per_chunk * k
  return worst if capacity is None else min(int(capacity), worst)


def dispatch_layout(expert_ids, *, experts: int, chunks: int, capacity,
                    per_expert: int) -> Layout:
  """The layout of `expert_ids` ([T, k]) split into `chunks` in token order."""
  tokens, k = expert_ids.shape
  ids = expert_ids.astype(jnp.int32).reshape(chunks, (tokens // chunks) * k)
  valid = (ids >= 0) & (ids < experts)
  own = jnp.where(valid, ids, 0)
  chose = (own[..., None] == jnp.arange(experts, dtype=jnp.int32)) \
      & valid[..., None]                                  # [chunks, Tc*k, E]
  chose = chose.astype(jnp.int32)
  # q: earlier pairs of the same chunk that chose the same expert.
  earlier_in_chunk = jnp.cumsum(chose, axis=1) - chose
  q = jnp.take_along_axis(earlier_in_chunk, own[..., None], axis=2)[..., 0]
  kept = valid
  if capacity is not None:
    per_chunk = chose.sum(axis=1)                        # [chunks, E]
    before = jnp.cumsum(per_chunk, axis=0) - per_chunk   # earlier chunks
    earlier = jnp.take_along_axis(before, own, axis=1) + q
    kept = kept & (earlier < capacity)
  flat = jnp.where(kept, own * per_expert + q, experts * per_expert)
  flat = flat.astype(jnp.int32)
  dropped = jnp.sum(~kept, dtype=jnp.int32)
  return Layout(flat, dropped)


def pack(rows, slots_of_chunk, *, experts: int, per_expert: int, like):
  """The send buffer [E * C, D] of one chunk: `rows` ([T_chunk * k, D], one
  row per (token, choice)) put in their slots; empty slots are 0."""
  buffer = jnp.zeros((experts * per_expert, rows.shape[-1]), rows.dtype)
  buffer = vary_like(buffer, like)
  # Dropped pairs share the one-past-the-end index, so the indices are not
  # promised unique.
  return buffer.at[slots_of_chunk].set(rows, mode="drop")


def unpack(buffer, slots_of_chunk):
  """Each (token, choice)'s row of a returned buffer [E * C, D]; 0 for a
  dropped pair."""
  return buffer.at[slots_of_chunk].get(mode="fill", fill_value=0)
