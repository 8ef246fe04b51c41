"""Sliding-window attention: which keys a query may see, and which chunk
pairs of the ring that leaves.

`window` has `jax.nn.dot_product_attention`'s `local_window_size` meaning:
`(left, right)` lets the query at position i see the keys at positions
i - left .. i + right; an int w is `(w, w)`. With `causal` the keys after
i are masked as well, so `right` no longer matters. Mistral's and Gemma's
`sliding_window=W` (each query sees W keys, itself included, none after it)
is `causal=True, window=(W - 1, 0)` (or `window=W - 1`).

A pair of sequence chunks (each `chunk` positions long, global chunk
indices a for the queries and b for the keys) is, for one device:
"skip" (no query sees a key), "full" (every query sees every key),
"diagonal" (the same chunk under a causal mask the window does not cut),
or "window" (the mask depends on positions: computed from them).
"""

from __future__ import annotations

import operator

SKIP, FULL, DIAGONAL, WINDOW = "skip", "full", "diagonal", "window"


def check_window(name: str, window):
  """`window` as `(left, right)` ints >= 0, or None (every key)."""
  if window is None:
    return None
  pair = (window, window) if _is_int(window) else window
  if (not isinstance(pair, (tuple, list)) or len(pair) != 2
      or not all(_is_int(w) for w in pair)):
    raise TypeError(
        f"{name}(window={window!r}) must be an int or a (left, right) pair "
        "of ints, as jax.nn.dot_product_attention's local_window_size: the "
        "query at position i sees the keys at i - left .. i + right.")
  left, right = (operator.index(w) for w in pair)
  if left < 0 or right < 0:
    raise ValueError(
        f"{name}(window={window!r}): left and right must be >= 0 (each "
        "query sees at least itself); give window=(W - 1, 0) with "
        "causal=True for a sliding window of W keys.")
  return left, right


def _is_int(w) -> bool:
  return not isinstance(w, bool) and hasattr(w, "__index__")


def reach(causal: bool, window):
  """(lowest, highest) key position minus query position a query sees;
  None for no bound."""
  left, right = window if window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  return (None if left is None else -left), right


def chunk_pair(a: int, b: int, chunk: int, causal: bool, window) -> str:
  """What queries of global chunk `a` see of keys of global chunk `b`."""
  low, high = reach(causal, window)
  # key - query over the pair: from (b - a) * chunk - (chunk - 1) to
  # (b - a) * chunk + (chunk - 1).
  first = (b - a) * chunk - (chunk - 1)
  last = (b - a) * chunk + (chunk - 1)
  if (low is not None and last < low) or (high is not None and first > high):
    return SKIP
  if (low is None or first >= low) and (high is None or last <= high):
    return FULL
  if a == b and causal and (low is None or -(chunk - 1) >= low):
    return DIAGONAL
  return WINDOW

