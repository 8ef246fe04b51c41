"""The dispatch layout: which (token, choice) goes to which slot, and in
which chunk.

Slots are claimed over all of this device's tokens, as one unchunked
exchange would: a (token, choice) pair `(t, j)` with expert
`e = expert_ids[t, j]` takes slot `q` of expert `e`, where `q` is how many
earlier pairs (token order, then choice order) chose `e`. It is kept when
`q < capacity` (dropless: always), so which pairs are dropped does not
depend on `chunks`. Expert `e` has `C = min(capacity, T * k)` slots (dropless
`T * k`: the choices of one token may repeat an expert, so `T` is not enough
in general).

The chunks split the slots, not the tokens: chunk `c` sends slots
`[c * C_c, (c + 1) * C_c)` of every expert, `C_c = ceil(C / chunks)`, so
the chunks together send what one exchange sends (`chunks * C_c < C +
chunks` slots an expert), and the experts see each kept pair once.

An id outside `[0, E)` (which only a traced `expert_ids` can carry past the
checks) is treated as dropped: it contributes 0 and, with a capacity, is
counted in `dropped`. Indices one past the end mean "nothing": gathers read
them as 0 (`mode="fill"`) and scatters write nowhere (`mode="drop"`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Layout(NamedTuple):
  """Where each (token, choice) goes; arrays, traced."""

  # [chunks, E * C_c] int32: the pair (t * k + j) in each slot of each
  # chunk's buffer, T * k where the slot is empty.
  pair_in_slot: jax.Array
  # [T * k] int32: each pair's row in the chunks' buffers stacked
  # ([chunks * E * C_c]), chunks * E * C_c if dropped.
  slot_of_pair: jax.Array
  dropped: jax.Array  # [] int32: this device's dropped (token, choice) pairs
  # [chunks, E] int32: the kept pairs each chunk sends each expert, the
  # filled slots at the front of its C_c (what a ragged exchange sends).
  sent: jax.Array


def slots_per_expert(tokens: int, k: int, capacity, chunks: int) -> int:
  """`C_c`: the slots each chunk's buffer has for each expert."""
  total = tokens * k if capacity is None else min(int(capacity), tokens * k)
  return -(-total // chunks)


def dispatch_layout(expert_ids, *, experts: int, chunks: int, capacity,
                    per_expert: int) -> Layout:
  """The layout of `expert_ids` ([T, k]); `per_expert` is `C_c`."""
  tokens, k = expert_ids.shape
  pairs = tokens * k
  ids = expert_ids.astype(jnp.int32).reshape(pairs)
  valid = (ids >= 0) & (ids < experts)
  own = jnp.where(valid, ids, 0)
  # q: earlier pairs (all tokens) that chose the same expert: the pair's
  # rank in one stable sort by expert (memory and work grow with T*k, not
  # with T*k*E as a one-hot's running count would). Invalid ids sort last.
  key = jnp.where(valid, own, experts)
  order = jnp.argsort(key, stable=True)
  counts = jnp.zeros((experts + 1,), jnp.int32).at[key].add(1)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(pairs, dtype=jnp.int32) - starts[key[order]]
  q = jnp.zeros((pairs,), jnp.int32).at[order].set(rank)
  kept = valid if capacity is None else valid & (q < capacity)
  chunk, in_chunk = q // per_expert, q % per_expert
  rows = chunks * experts * per_expert
  slot = (chunk * experts + own) * per_expert + in_chunk
  slot = jnp.where(kept, slot, rows).astype(jnp.int32)
  # Kept pairs have distinct slots; dropped ones are written nowhere.
  pair_in_slot = jnp.full((rows,), pairs, jnp.int32).at[slot].set(
      jnp.arange(pairs, dtype=jnp.int32), mode="drop")
  dropped = jnp.sum(~kept, dtype=jnp.int32)
  per_expert_kept = counts[:experts]
  if capacity is not None:
    per_expert_kept = jnp.minimum(per_expert_kept, capacity)
  before = jnp.arange(chunks, dtype=jnp.int32)[:, None] * per_expert
  sent = jnp.clip(per_expert_kept[None, :] - before, 0, per_expert)
  return Layout(pair_in_slot.reshape(chunks, experts * per_expert), slot,
                dropped, sent.astype(jnp.int32))


def gather_rows(rows, index):
  """`rows[index]` along the first axis, 0 where `index` is out of range."""
  return rows.at[index].get(mode="fill", fill_value=0)
