"""The arguments of `ring_attention` and `ulysses_attention`, checked where
the user passes them (tests/patterns/attention/attention_misuse_test.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.patterns.bound_axis import one_axis_size


def as_array(x):
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def qkv(name: str, q, k, v):
  """q (b, s, heads, d), k and v (b, s, kv_heads, d), kv_heads | heads."""
  q, k, v = map(as_array, (q, k, v))
  for what, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(
          f"{name}: {what} must be (batch, seq_local, heads, head_dim), got "
          f"shape {tuple(a.shape)}.")
  if k.shape != v.shape:
    raise ValueError(
        f"{name}: k and v must have one shape (batch, seq_local, kv_heads, "
        f"head_dim), got {tuple(k.shape)} and {tuple(v.shape)}.")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
        f"{name}: q's sequence length ({q.shape[1]}, shape {tuple(q.shape)}) "
        f"differs from k's and v's ({k.shape[1]}, shape {tuple(k.shape)}); "
        "each device must hold the same stretch of the sequence in all "
        "three.")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(
        f"{name}: q (shape {tuple(q.shape)}) and k, v (shape "
        f"{tuple(k.shape)}) must agree in batch and head_dim.")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"{name}: kv_heads ({k.shape[2]}) must divide heads ({q.shape[2]}): "
        "query head i uses key/value head i // (heads / kv_heads).")
  return q, k, v


def segment_ids(name: str, segment_ids, q):
  if segment_ids is None:
    return None
  segment_ids = as_array(segment_ids)
  if segment_ids.shape != q.shape[:2]:
    raise ValueError(
        f"{name}: segment_ids must be (batch, seq_local) = {tuple(q.shape[:2])} "
        f"like q's first two dimensions, got shape {tuple(segment_ids.shape)}.")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(
        f"{name}: segment_ids must be integers, got {segment_ids.dtype}.")
  return segment_ids


def axis_size(name: str, axis, arg: str = "axis") -> int:
  return one_axis_size(name, axis,
                       several="a ring over several axes is not supported.",
                       bound_hint=", with the sequence sharded over it",
                       arg=arg)


def scale(name: str, scale, head_dim: int) -> float:
  if scale is None:
    return float(1.0 / np.sqrt(head_dim))
  try:
    return float(scale)
  except (TypeError, ValueError):
    raise TypeError(
        f"{name}(scale={scale!r}) must be a Python number (the scores are "
        "q @ k * scale).") from None
