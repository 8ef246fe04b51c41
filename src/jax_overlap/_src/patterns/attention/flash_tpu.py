"""A flash attention kernel for TPU (Pallas): one block of queries against
one block of keys, the forward pass returning each row's log-sum-exp, the
backward pass taking a given one.

The same contract as kernel.py's blocks, so that the ring can combine the
blocks it meets in any order: `forward` gives the block's normalised output
and `lse`; `backward` gives the block's part of (dq, dk, dv) from the whole
attention's `lse` and `delta = sum(do * out)`, never this block's own.

Why not jax's `pallas.ops.tpu.flash_attention`: it wants (batch, heads,
seq, head_dim) arrays (transposes of q, k, v, out, do and the three
gradients around every call), as many key/value heads as query heads (GQA
repeated), rounds each block's output to q's dtype before the ring combines
them, has no causal offset (the ring computes the halves of its own block
apart) and its lse and backward are reachable only through private
functions. Here q, k and v are read where they lie, (batch, seq, heads *
head_dim), a query head's kv head found by the index map; the row statistics
travel lane-dense, (batch, heads, 1, seq) in float32; and the key/value
gradient kernel works on the transposed scores (keys by queries), so that
the row statistics broadcast along sublanes and no block is transposed.

Three kernels:
* forward: grid (batch, heads, query blocks, key blocks), an online softmax
  over the key blocks in VMEM scratch;
* dq: the same grid, dq accumulated over the key blocks;
* dk, dv: grid (batch, kv heads, key blocks, group, query blocks), each
  key block's gradient accumulated over the query heads of its group and
  the query blocks.
Blocks of keys entirely after a causal block's queries are skipped and not
fetched; the mask is computed only on blocks that need one.

On CPU the kernels run in Pallas's interpreter (tests). Pinned by
tests/patterns/attention/flash_tpu_test.py (values and gradients against
dense attention, in the interpreter) and tests/aot/flash_compiled_test.py
(the TPU compiler takes them, ahead of time).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention.kernel import _MASKED as MASKED
from jax_overlap._src.patterns.varying import vary_over, varying

#: Lanes of a TPU vector register: row statistics live in (rows, LANES)
#: scratch, each row's value in every lane.
LANES = 128
#: q @ k.T without a transpose: contract both operands' last dimension.
_NT = (((1,), (1,)), ((), ()))


class Mask(NamedTuple):
  """Which keys a block's queries see. Query i of the block sits at
  position i, key j at `k_offset + j`; `causal`: key position <= query
  position. Segment ids, where given, must also match."""
  causal: bool
  k_offset: int = 0


class Blocks(NamedTuple):
  """Kernel tile sizes: rows of queries and of keys a grid step holds."""
  q: int
  k: int


def block_sizes(sq: int, sk: int, head_dim: int) -> Blocks:
  """The tiles for sq queries against sk keys: 512 where it divides (the
  chip's figures are in docs/attention.md), else the largest power of two
  multiple of 128 that does, else the whole length (short blocks: tests in
  the interpreter). Head dims above 256 take half, to stay inside VMEM."""
  top = 512 if head_dim <= 256 else 256
  return Blocks(_tile(sq, top), _tile(sk, top))


def _tile(n: int, top: int) -> int:
  size = top
  while size >= LANES:
    if n % size == 0:
      return size
    size //= 2
  return n


def fits_tpu(sq: int, sk: int, head_dim: int, dtype) -> bool:
  """Whether the TPU compiler takes these shapes: head_dim and both
  lengths multiples of 128 (a block's minor dimension fills lanes), and a
  float dtype the matrix unit reads."""
  return (head_dim % LANES == 0 and sq % LANES == 0 and sk % LANES == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                   jnp.dtype(jnp.float32)))


# --- in-kernel helpers ------------------------------------------------------------

def _lanes(col, n: int):
  """(rows, LANES) with one value a row -> (rows, n)."""
  if n % LANES == 0:
    return jnp.tile(col, (1, n // LANES))
  return jnp.broadcast_to(col[:, :1], (col.shape[0], n))


def _col_to_row(col):
  """(rows, LANES) with one value a row -> (1, rows), lane-dense."""
  return jnp.transpose(col)[:1, :]


def _row_to_col(row):
  """(1, rows) -> (rows, LANES), one value a row."""
  return jnp.transpose(jnp.broadcast_to(row, (LANES, row.shape[1])))


def _runs(mask: Mask, q_start, k_start, bq: int, bk: int):
  """(whether some key of the block is seen, whether every one is), as
  traced bools; for a causal block, by position alone."""
  if not mask.causal:
    return True, True
  k_first = mask.k_offset + k_start
  return (k_first <= q_start + bq - 1), (k_first + bk - 1 <= q_start)


def _seen(mask: Mask, q_start, k_start, shape, q_axis: int, q_seg, k_seg):
  """Where queries see keys in a score tile of `shape` whose axis `q_axis`
  runs over queries: `q_seg` and `k_seg` the segment ids broadcast along
  the tile's other axis (or None)."""
  out = None
  if mask.causal:
    q_pos = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = (mask.k_offset + k_start
             + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis))
    out = k_pos <= q_pos
  if q_seg is not None:
    same = q_seg == k_seg
    out = same if out is None else out & same
  return out


def _scores(a, b, scale: float, masked: bool, mask: Mask, i, j, q_axis: int,
            q_seg_ref, k_seg_ref):
  """`a @ b.T * scale` in float32 for query block `i` and key block `j`, the
  keys `mask` hides set to MASKED where `masked`: queries along axis `q_axis`
  of the scores (0: (queries, keys), the forward and dq kernels; 1: (keys,
  queries), the dk/dv kernel), the segment ids broadcast along the lanes of
  their side. The three kernels' scores are this one function (their Mosaic
  text is what it was when each wrote its own: flash_tpu_test's values)."""
  s = jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32) * scale
  if not masked:
    return s
  if q_seg_ref is None:
    seg = (None, None)
  elif q_axis == 0:
    seg = (_lanes(q_seg_ref[...], s.shape[1]), k_seg_ref[...])
  else:
    seg = (q_seg_ref[...], _lanes(k_seg_ref[...], s.shape[1]))
  q_start, k_start = i * s.shape[q_axis], j * s.shape[1 - q_axis]
  return jnp.where(_seen(mask, q_start, k_start, s.shape, q_axis, *seg), s, MASKED)


def _step(mask: Mask, q_start, k_start, bq: int, bk: int, segmented: bool,
          body):
  """Runs `body(masked)` for a block that has keys to see: with the mask
  where some key is hidden, without it where none is."""
  runs, whole = _runs(mask, q_start, k_start, bq, bk)
  if segmented:
    _when(runs, lambda: body(True))
  elif not mask.causal:
    body(False)
  else:
    _when(runs & jnp.logical_not(whole), lambda: body(True))
    _when(whole, lambda: body(False))


def _when(cond, fn):
  """`fn()` where `cond` holds (a traced bool, or True)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415 - Pallas is costly
  if cond is True:
    fn()
    return
  pl.when(cond)(fn)


# --- the forward kernel ---------------------------------------------------------

def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref,
                    m_scr, l_scr, acc_scr, *, mask: Mask, scale: float,
                    n_k: int):
  from jax.experimental import pallas as pl  # noqa: PLC0415
  i, j = pl.program_id(2), pl.program_id(3)
  bq, d = q_ref.shape
  bk = k_ref.shape[0]

  @pl.when(j == 0)
  def _():
    m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def body(masked: bool):
    s = _scores(q_ref[...], k_ref[...], scale, masked, mask, i, j, 0,
                q_seg_ref, k_seg_ref)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - _lanes(m_next, bk))
    fade = jnp.exp(m_prev - m_next)
    l_scr[...] = fade * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = m_next
    v = v_ref[...]
    acc_scr[...] = acc_scr[...] * _lanes(fade, d) + jax.lax.dot(
        p.astype(v.dtype), v, preferred_element_type=jnp.float32)

  _step(mask, i * bq, j * bk, bq, bk, q_seg_ref is not None, body)

  @pl.when(j == n_k - 1)
  def _():
    # A row that saw no key keeps m == MASKED exactly: output 0, lse MASKED.
    m, l = m_scr[...], l_scr[...]
    seen = m > MASKED / 2
    l = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc_scr[...] * _lanes(jnp.where(seen, 1.0 / l, 0.0), d)
                  ).astype(o_ref.dtype)
    lse_ref[...] = _col_to_row(jnp.where(seen, m + jnp.log(l), MASKED))


# --- the backward kernels --------------------------------------------------------

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
               k_seg_ref, dq_ref, acc_scr, lse_scr, delta_scr, *, mask: Mask,
               scale: float, n_k: int):
  from jax.experimental import pallas as pl  # noqa: PLC0415
  i, j = pl.program_id(2), pl.program_id(3)
  bq = q_ref.shape[0]
  bk = k_ref.shape[0]

  @pl.when(j == 0)
  def _():
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    lse_scr[...] = _row_to_col(lse_ref[...])
    delta_scr[...] = _row_to_col(delta_ref[...])

  def body(masked: bool):
    s = _scores(q_ref[...], k_ref[...], scale, masked, mask, i, j, 0,
                q_seg_ref, k_seg_ref)
    p = jnp.exp(s - _lanes(lse_scr[...], bk))
    dp = jax.lax.dot_general(do_ref[...], v_ref[...], _NT,
                             preferred_element_type=jnp.float32)
    ds = p * (dp - _lanes(delta_scr[...], bk))
    k = k_ref[...]
    acc_scr[...] += jax.lax.dot(ds.astype(k.dtype), k,
                                preferred_element_type=jnp.float32)

  _step(mask, i * bq, j * bk, bq, bk, q_seg_ref is not None, body)

  @pl.when(j == n_k - 1)
  def _():
    dq_ref[...] = (acc_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref,
                k_seg_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, mask: Mask,
                scale: float, n_q: int, group: int):
  """Scores transposed, (keys, queries): the rows' lse and delta are
  (1, queries) and broadcast along sublanes; dv and dk are plain products."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  j, h, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  bk = k_ref.shape[0]
  bq = q_ref.shape[0]

  @pl.when((h == 0) & (i == 0))
  def _():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  def body(masked: bool):
    q = q_ref[...]
    s = _scores(k_ref[...], q, scale, masked, mask, i, j, 1,
                q_seg_ref, k_seg_ref)
    p = jnp.exp(s - lse_ref[...])
    do = do_ref[...]
    dv_scr[...] += jax.lax.dot(p.astype(do.dtype), do,
                               preferred_element_type=jnp.float32)
    dp = jax.lax.dot_general(v_ref[...], do, _NT,
                             preferred_element_type=jnp.float32)
    ds = p * (dp - delta_ref[...])
    dk_scr[...] += jax.lax.dot(ds.astype(q.dtype), q,
                               preferred_element_type=jnp.float32)

  _step(mask, i * bq, j * bk, bq, bk, q_seg_ref is not None, body)

  @pl.when((h == group - 1) & (i == n_q - 1))
  def _():
    dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


# --- calling them -----------------------------------------------------------------

class _Shape(NamedTuple):
  batch: int
  sq: int
  sk: int
  kv_heads: int
  group: int
  head_dim: int

  @property
  def heads(self) -> int:
    return self.kv_heads * self.group


def _shape(q, k) -> _Shape:
  b, sq, kv_heads, group, d = q.shape
  return _Shape(b, sq, k.shape[1], kv_heads, group, d)


def _flat(x):
  """(b, s, ...heads..., d) -> (b, s, heads * d): a free reshape; a head's
  block is the lane range [head * d, (head + 1) * d)."""
  return x.reshape(x.shape[0], x.shape[1], -1)


def _rows(x, sh: _Shape):
  """Row statistics (b, sq, kv_heads, group) -> (b, heads, 1, sq)."""
  return jnp.transpose(x.reshape(sh.batch, sh.sq, sh.heads), (0, 2, 1))[:, :, None]


def _unrows(x, sh: _Shape):
  return jnp.transpose(x[:, :, 0], (0, 2, 1)).reshape(
      sh.batch, sh.sq, sh.kv_heads, sh.group)


def _segments(q_seg, k_seg):
  """Query ids as (b, sq, LANES) columns and key ids as (b, 1, sk) rows
  (the forward and dq kernels' forms), and the other way round (dk, dv's)."""
  if q_seg is None:
    return (None, None), (None, None)
  col = lambda s: jnp.broadcast_to(s[:, :, None].astype(jnp.int32),
                                   (*s.shape, LANES))
  row = lambda s: s[:, None, :].astype(jnp.int32)
  return (col(q_seg), row(k_seg)), (row(q_seg), col(k_seg))


def _same_varying(*arrays):
  """The arrays, each cast to vary over the mesh axes any of them varies
  over (a kernel's outputs are typed as varying like its inputs)."""
  every = sorted(frozenset().union(*(varying(a) for a in arrays
                                     if a is not None)), key=str)
  return [None if a is None else vary_over(a, every) for a in arrays]


def _call(kernel, out_shapes, like, *, grid, in_specs, out_specs, scratch,
          semantics, interpret, cost):
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  return pl.pallas_call(
      kernel,
      out_shape=[_compat.struct_like(shape, dtype, like)
                 for shape, dtype in out_shapes],
      grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      interpret=_compat.PALLAS_INTERPRET if interpret else False,
      cost_estimate=cost)


def _cost(sh: _Shape, mask: Mask, matmuls: int, *arrays):
  from jax.experimental import pallas as pl  # noqa: PLC0415
  seen = 0.5 if mask.causal else 1.0
  pairs = sh.batch * sh.heads * sh.sq * sh.sk * seen
  return pl.CostEstimate(
      flops=int(2 * matmuls * pairs * sh.head_dim),
      transcendentals=int(pairs),
      bytes_accessed=int(sum(math.prod(a.shape) * a.dtype.itemsize
                             for a in arrays if a is not None)))


def forward(q, k, v, *, mask: Mask, scale: float, q_seg=None, k_seg=None,
            blocks: Blocks | None = None, out_dtype=jnp.float32,
            interpret: bool = False):
  """(out, lse) of queries q (b, sq, kv_heads, group, d) against keys and
  values k, v (b, sk, kv_heads, d): out normalised over this block's keys,
  in `out_dtype`, (b, sq, kv_heads, group, d); lse (b, sq, kv_heads, group)
  float32, MASKED (and out 0) for a row that sees no key of the block."""
  sh = _shape(q, k)
  out, lse = _forward(_flat(q), _flat(k), _flat(v), sh, mask=mask,
                      scale=scale, q_seg=q_seg, k_seg=k_seg, blocks=blocks,
                      out_dtype=out_dtype, interpret=interpret)
  return out.reshape(q.shape[:-1] + (sh.head_dim,)), _unrows(lse, sh)


def backward(q, k, v, do, lse, delta, *, mask: Mask, scale: float, q_seg=None,
             k_seg=None, blocks: Blocks | None = None, out_dtype=jnp.float32,
             interpret: bool = False):
  """(dq, dk, dv) in `out_dtype` of this block's part of an attention whose
  rows have log-sum-exp `lse` and `delta = sum(do * out)` (b, sq, kv_heads,
  group) over all its keys; shapes as `forward`'s, do like q."""
  sh = _shape(q, k)
  dq, dk, dv = _backward(
      _flat(q), _flat(k), _flat(v), _flat(do), _rows(lse, sh),
      _rows(delta, sh), sh, mask=mask, scale=scale, q_seg=q_seg, k_seg=k_seg,
      blocks=blocks, out_dtype=out_dtype, interpret=interpret)
  return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# --- the whole attention on one device ------------------------------------------

def attention(q, k, v, *, causal: bool, scale: float, segment_ids=None,
              interpret: bool = False):
  """Softmax attention of q (b, s, heads, d) over k, v (b, s, kv_heads, d)
  on this device, differentiable: out, dq, dk and dv in the inputs' dtypes
  straight from the kernels (float32 inside), the rows' lse and delta kept
  in the kernels' own form, (b, heads, 1, s), from the forward pass to the
  backward. What `ulysses_attention` runs, and `ring_attention` on a ring of
  one device."""
  return _attention(Mask(causal), float(scale), bool(interpret), q, k, v,
                    segment_ids)


def _attention_shape(q, k) -> _Shape:
  b, s, heads, d = q.shape
  return _Shape(b, s, k.shape[1], k.shape[2], heads // k.shape[2], d)


def _attention_fwd(mask, scale, interpret, q, k, v, segment_ids):
  sh = _attention_shape(q, k)
  out, lse = _forward(_flat(q), _flat(k), _flat(v), sh, mask=mask,
                      scale=scale, q_seg=segment_ids, k_seg=segment_ids,
                      out_dtype=q.dtype, interpret=interpret)
  out = out.reshape(q.shape)
  # A row that saw no key: lse +huge, so that its backward terms are 0.
  lse = jnp.where(lse > MASKED / 2, lse, -MASKED)
  return out, (q, k, v, segment_ids, out, lse)


def _attention_plain(mask, scale, interpret, q, k, v, segment_ids):
  return _attention_fwd(mask, scale, interpret, q, k, v, segment_ids)[0]


def _attention_bwd(mask, scale, interpret, residuals, dout):
  q, k, v, segment_ids, out, lse = residuals
  sh = _attention_shape(q, k)
  delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32),
                     dout.astype(jnp.float32))[:, :, None]
  dq, dk, dv = _backward(
      _flat(q), _flat(k), _flat(v), _flat(dout), lse, delta, sh, mask=mask,
      scale=scale, q_seg=segment_ids, k_seg=segment_ids, out_dtype=q.dtype,
      interpret=interpret)
  return (dq.reshape(q.shape), dk.reshape(k.shape).astype(k.dtype),
          dv.reshape(v.shape).astype(v.dtype), None)


_attention = jax.custom_vjp(_attention_plain, nondiff_argnums=(0, 1, 2))
_attention.defvjp(_attention_fwd, _attention_bwd)


# --- the pallas_calls, on (b, s, heads * d) arrays -------------------------------

def _forward(qf, kf, vf, sh: _Shape, *, mask: Mask, scale: float, q_seg,
             k_seg, blocks: Blocks | None = None, out_dtype, interpret: bool):
  """(out (b, sq, heads * d), lse (b, heads, 1, sq))."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  blocks = blocks or block_sizes(sh.sq, sh.sk, sh.head_dim)
  n_q, n_k = sh.sq // blocks.q, sh.sk // blocks.k
  (q_col, k_row), _ = _segments(q_seg, k_seg)
  qf, kf, vf, q_col, k_row = _same_varying(qf, kf, vf, q_col, k_row)
  sq_ = _compat.squeezed()

  def kv_block(b, h, i, j):
    runs, _ = _runs(mask, i * blocks.q, j * blocks.k, blocks.q, blocks.k)
    # A skipped block fetches what the next row of blocks starts with.
    return j if runs is True else jnp.where(runs, j, 0)

  seg_specs = [None, None] if q_col is None else [
      pl.BlockSpec((sq_, blocks.q, LANES), lambda b, h, i, j: (b, i, 0)),
      pl.BlockSpec((sq_, 1, blocks.k),
                   lambda b, h, i, j: (b, 0, kv_block(b, h, i, j)))]
  kernel = functools.partial(_forward_kernel, mask=mask, scale=scale, n_k=n_k)
  out, lse = _call(
      kernel,
      [((sh.batch, sh.sq, sh.heads * sh.head_dim), out_dtype),
       ((sh.batch, sh.heads, 1, sh.sq), jnp.float32)],
      qf,
      grid=(sh.batch, sh.heads, n_q, n_k),
      in_specs=[
          pl.BlockSpec((sq_, blocks.q, sh.head_dim), lambda b, h, i, j: (b, i, h)),
          pl.BlockSpec((sq_, blocks.k, sh.head_dim),
                       lambda b, h, i, j: (b, kv_block(b, h, i, j), h // sh.group)),
          pl.BlockSpec((sq_, blocks.k, sh.head_dim),
                       lambda b, h, i, j: (b, kv_block(b, h, i, j), h // sh.group)),
          *seg_specs],
      out_specs=[
          pl.BlockSpec((sq_, blocks.q, sh.head_dim), lambda b, h, i, j: (b, i, h)),
          pl.BlockSpec((sq_, sq_, 1, blocks.q), lambda b, h, i, j: (b, h, 0, i))],
      scratch=[(blocks.q, LANES), (blocks.q, LANES), (blocks.q, sh.head_dim)],
      semantics=("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      cost=_cost(sh, mask, 2, qf, kf, vf))(qf, kf, vf, q_col, k_row)
  return out, lse


def _backward(qf, kf, vf, dof, lse, delta, sh: _Shape, *, mask: Mask,
              scale: float, q_seg, k_seg, blocks: Blocks | None = None,
              out_dtype, interpret: bool):
  """(dq (b, sq, heads * d), dk, dv (b, sk, kv_heads * d)) from the rows'
  lse and delta (b, heads, 1, sq)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  blocks = blocks or block_sizes(sh.sq, sh.sk, sh.head_dim)
  n_q, n_k = sh.sq // blocks.q, sh.sk // blocks.k
  (q_col, k_row), (q_row, k_col) = _segments(q_seg, k_seg)
  qf, kf, vf, dof, lse_r, delta_r, q_col, k_row, q_row, k_col = _same_varying(
      qf, kf, vf, dof, lse, delta, q_col, k_row, q_row, k_col)
  sq_ = _compat.squeezed()
  bq, bk, d, g = blocks.q, blocks.k, sh.head_dim, sh.group

  def kv_block(b, h, i, j):
    runs, _ = _runs(mask, i * bq, j * bk, bq, bk)
    return j if runs is True else jnp.where(runs, j, 0)

  dq_specs = [
      pl.BlockSpec((sq_, bq, d), lambda b, h, i, j: (b, i, h)),
      pl.BlockSpec((sq_, bk, d), lambda b, h, i, j: (b, kv_block(b, h, i, j), h // g)),
      pl.BlockSpec((sq_, bk, d), lambda b, h, i, j: (b, kv_block(b, h, i, j), h // g)),
      pl.BlockSpec((sq_, bq, d), lambda b, h, i, j: (b, i, h)),
      pl.BlockSpec((sq_, sq_, 1, bq), lambda b, h, i, j: (b, h, 0, i)),
      pl.BlockSpec((sq_, sq_, 1, bq), lambda b, h, i, j: (b, h, 0, i)),
      *([None, None] if q_col is None else [
          pl.BlockSpec((sq_, bq, LANES), lambda b, h, i, j: (b, i, 0)),
          pl.BlockSpec((sq_, 1, bk), lambda b, h, i, j: (b, 0, kv_block(b, h, i, j)))])]
  dq, = _call(
      functools.partial(_dq_kernel, mask=mask, scale=scale, n_k=n_k),
      [((sh.batch, sh.sq, sh.heads * d), out_dtype)], qf,
      grid=(sh.batch, sh.heads, n_q, n_k), in_specs=dq_specs,
      out_specs=[pl.BlockSpec((sq_, bq, d), lambda b, h, i, j: (b, i, h))],
      scratch=[(bq, d), (bq, LANES), (bq, LANES)],
      semantics=("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      cost=_cost(sh, mask, 3, qf, kf, vf, dof))(
          qf, kf, vf, dof, lse_r, delta_r, q_col, k_row)

  def q_block(b, kh, j, h, i):
    runs, _ = _runs(mask, i * bq, j * bk, bq, bk)
    if runs is True:
      return i
    # A skipped block fetches the first block of queries that sees these
    # keys (k_offset >= 0: the skipped ones come first).
    first = jnp.minimum((mask.k_offset + j * bk) // bq, n_q - 1)
    return jnp.where(runs, i, first)

  head = lambda kh, h: kh * g + h
  dkv_specs = [
      pl.BlockSpec((sq_, bq, d), lambda b, kh, j, h, i: (b, q_block(b, kh, j, h, i), head(kh, h))),
      pl.BlockSpec((sq_, bk, d), lambda b, kh, j, h, i: (b, j, kh)),
      pl.BlockSpec((sq_, bk, d), lambda b, kh, j, h, i: (b, j, kh)),
      pl.BlockSpec((sq_, bq, d), lambda b, kh, j, h, i: (b, q_block(b, kh, j, h, i), head(kh, h))),
      pl.BlockSpec((sq_, sq_, 1, bq), lambda b, kh, j, h, i: (b, head(kh, h), 0, q_block(b, kh, j, h, i))),
      pl.BlockSpec((sq_, sq_, 1, bq), lambda b, kh, j, h, i: (b, head(kh, h), 0, q_block(b, kh, j, h, i))),
      *([None, None] if q_row is None else [
          pl.BlockSpec((sq_, 1, bq), lambda b, kh, j, h, i: (b, 0, q_block(b, kh, j, h, i))),
          pl.BlockSpec((sq_, bk, LANES), lambda b, kh, j, h, i: (b, j, 0))])]
  kv_out = pl.BlockSpec((sq_, bk, d), lambda b, kh, j, h, i: (b, j, kh))
  dk, dv = _call(
      functools.partial(_dkv_kernel, mask=mask, scale=scale, n_q=n_q, group=g),
      [((sh.batch, sh.sk, sh.kv_heads * d), out_dtype)] * 2, qf,
      grid=(sh.batch, sh.kv_heads, n_k, g, n_q), in_specs=dkv_specs,
      out_specs=[kv_out, kv_out],
      scratch=[(bk, d), (bk, d)],
      semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
      interpret=interpret,
      cost=_cost(sh, mask, 4, qf, kf, vf, dof))(
          qf, kf, vf, dof, lse_r, delta_r, q_row, k_col)
  return dq, dk, dv
