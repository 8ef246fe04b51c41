"""Attention on one device, by kernel.py's blocks: the default kernel of
`ulysses_attention`, over the whole sequence and a slice of the heads.

A `jax.custom_vjp` saves the inputs, the output and the row log-sum-exp,
never the (seq x seq) probabilities: the backward pass recomputes them a key
block at a time (tests/patterns/attention/ulysses_attention_test.py). Without
`positions`, `implementation` may choose the Pallas TPU flash kernel instead
(dispatch.py, flash_tpu.attention).
"""

from __future__ import annotations

import functools

import jax

from jax_overlap._src.patterns.attention import dispatch
from jax_overlap._src.patterns.attention import flash_tpu
from jax_overlap._src.patterns.attention import kernel


def local_attention(q, k, v, *, causal: bool, scale: float, segment_ids=None,
                    positions=None, window=None, implementation=None):
  """Softmax attention of q (b, sq, heads, d) over k, v (b, sk, kv_heads,
  d), all on this device; float32 inside, q's dtype out. Causal: keys at or
  before each query, by index (sq == sk) or by `positions`, a pair of
  integer arrays (sq,), (sk,) of global positions. `window`: (left, right)
  keys either side of each query (window.py). With `positions` or a
  `window`, XLA's operations; else as `implementation` says (dispatch.py)."""
  xla = lambda q, k, v, seg: _local(causal, scale, window, q, k, v, seg,
                                    positions)
  if positions is not None or window is not None:
    return xla(q, k, v, segment_ids)

  def pallas(interpret):
    return lambda q, k, v, seg: flash_tpu.attention(
        q, k, v, causal=causal, scale=scale, segment_ids=seg,
        interpret=interpret)
  return dispatch.choose(implementation, q, k, v, pallas, xla,
                         q, k, v, segment_ids)


def _forward(causal, scale, window, q, k, v, segment_ids, positions):
  grouped = kernel.group_heads(q, k.shape[2])
  stats = kernel.block_forward(kernel.empty_stats(grouped), grouped, k, v,
                               causal=causal, scale=scale, q_seg=segment_ids,
                               k_seg=segment_ids, positions=positions,
                               window=window)
  out, lse = kernel.finish(stats)
  return kernel.ungroup_heads(out).astype(q.dtype), lse


def _plain(causal, scale, window, q, k, v, segment_ids, positions):
  return _forward(causal, scale, window, q, k, v, segment_ids, positions)[0]


def _fwd(causal, scale, window, q, k, v, segment_ids, positions):
  out, lse = _forward(causal, scale, window, q, k, v, segment_ids, positions)
  return out, (q, k, v, segment_ids, positions, out, lse)


def _bwd(causal, scale, window, residuals, dout):
  q, k, v, segment_ids, positions, out, lse = residuals
  group = functools.partial(kernel.group_heads, kv_heads=k.shape[2])
  gq, gout, gdout = group(q), group(out), group(dout)
  dq, dk, dv = kernel.block_backward(
      gq, k, v, gdout, lse, kernel.row_delta(gout, gdout), causal=causal,
      scale=scale, q_seg=segment_ids, k_seg=segment_ids, positions=positions,
      window=window)
  return (kernel.ungroup_heads(dq).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype), None, None)


_local = jax.custom_vjp(_plain, nondiff_argnums=(0, 1, 2))
_local.defvjp(_fwd, _bwd)
