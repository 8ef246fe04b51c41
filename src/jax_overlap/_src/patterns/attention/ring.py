"""`ring_attention`: the keys and values go round the ring while each block
of attention runs.

Each of the p - 1 rotations of (k, v) (one array, `kv`) is a
`ppermute_start` started before a step's blocks and finished after them,
under `program_order(enforce=True)` so the compiler keeps it in flight
there. The backward pass (a `jax.custom_vjp`) rotates `kv` the same way and,
one step behind, the gradient (dk, dv) of the block each device holds: it
starts at the device after the block's owner and reaches the owner after
p - 1 hops, adding each device's part on the way. Part of the device's own
block is computed behind the first rotation of (k, v), the rest behind the
last hop of (dk, dv) home, so that every rotation has block matmuls in flight
(tests/aot/attention_compiled_test.py). Saved for the backward:
this device's q, k, v, output and row log-sum-exp; no other device's block
(tests/patterns/attention/ring_attention_test.py::test_saves_no_remote_blocks).

With a sliding window the ring takes only the steps whose blocks some query
sees (plan.ring_steps): the held block moves by the gap between two steps'
offsets in one rotation, its gradient travels with it and goes home from the
last step in one hop (tests/patterns/attention/ring_window_test.py counts
and checks the shifts).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.collectives.api import ppermute_start
from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.attention import checks
from jax_overlap._src.patterns.attention import dispatch
from jax_overlap._src.patterns.attention import kernel
from jax_overlap._src.patterns.attention.layout import (
    check_layout, chunks_per_device, device_chunks)
from jax_overlap._src.patterns.attention.local import local_attention
from jax_overlap._src.patterns.attention.plan import (AFTER, BEFORE, SELF,
                                                      ring_steps)
from jax_overlap._src.patterns.attention.window import check_window
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.varying import vary_over, varying


class Config(NamedTuple):
  axis: object
  size: int
  layout: str
  causal: bool
  scale: float
  window: tuple[int, int] | None = None   # (left, right), window.py
  implementation: str | None = None   # dispatch.py


def ring_attention(q, k, v, *, axis, causal: bool = False,
                   layout: str = "contiguous", scale=None, segment_ids=None,
                   window=None, implementation=None):
  """Attention over a sequence sharded over `axis`, keys and values passed
  round a ring of devices one block at a time.

  Call it inside `jax.shard_map` with the sequence dimension sharded over
  `axis` (p devices), laid out as `layout` says (`to_layout`). Each step
  attends this device's queries to the block of keys it holds (an online
  softmax in float32) while that block is already on its way to the next
  device; blocks fully masked (causal, or outside a sliding window) are not
  computed, and a step whose blocks all are is not taken: with a window the
  ring visits only the devices whose keys some query sees, moving the
  blocks between them in one rotation each. Differentiable
  (`jax.grad`, `jax.checkpoint`): the backward pass is a ring too, and
  saves no other device's block.

  Args:
    q: (batch, seq_local, heads, head_dim).
    k, v: (batch, seq_local, kv_heads, head_dim); kv_heads divides heads
      (GQA, MQA).
    axis: the mesh axis name the sequence is sharded over.
    causal: mask each query to the keys at or before its global position.
    layout: "contiguous" (device d holds chunk d of p) or "zigzag" (chunks d
      and 2p - 1 - d of 2p: with `causal`, equal work on every device).
    scale: multiplies q @ k; default 1 / sqrt(head_dim).
    segment_ids: (batch, seq_local) integers laid out as q; a query sees
      only keys of its own id (packed sequences).
    window: sliding-window attention, as `jax.nn.dot_product_attention`'s
      `local_window_size`: `(left, right)` lets the query at global
      position i see the keys at i - left .. i + right (with `causal`, at
      most i); an int w is `(w, w)`. Mistral's and Gemma's
      `sliding_window=W` is `causal=True, window=(W - 1, 0)`. None: every
      key. With a window shorter than the sequence, "contiguous" takes the
      fewest rotations (about window / seq_local of them).
    implementation: what computes each block: None (a Pallas flash kernel
      on TPU, XLA's operations elsewhere), "xla" or "pallas" (the kernel;
      on CPU in Pallas's interpreter, for tests).

  Returns:
    (batch, seq_local, heads, head_dim) in q's dtype: this device's queries'
    attention over the whole sequence.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('cp',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P(None, 'cp'), out_specs=P(None, 'cp'))
    ... def attend(q, k, v):
    ...   return jax_overlap.ring_attention(q, k, v, axis='cp', causal=True)
    >>> attend(q, k, v).shape
    (1, 8, 2, 4)
  """
  name = "ring_attention"
  q, k, v = checks.qkv(name, q, k, v)
  layout = check_layout(name, layout)
  size = checks.axis_size(name, axis)
  if q.shape[1] % chunks_per_device(layout):
    raise ValueError(
        f"ring_attention(layout={layout!r}): each device holds "
        f"{chunks_per_device(layout)} chunks of the sequence, but seq_local "
        f"is {q.shape[1]} (q shape {tuple(q.shape)}); lay the global sequence "
        "out with to_layout and make its length a multiple of "
        f"{chunks_per_device(layout) * size}.")
  segment_ids = checks.segment_ids(name, segment_ids, q)
  if not isinstance(causal, bool):
    raise TypeError(f"ring_attention(causal={causal!r}) must be True or False.")
  window = check_window(name, window)
  if window is not None and causal:
    window = (window[0], 0)   # the keys after a query are masked anyway
  if window is not None and window[0] >= q.shape[1] * size - 1 and (
      causal or window[1] >= q.shape[1] * size - 1):
    window = None   # every key: the same program as without
  cfg = Config(axis, size, layout, causal,
               checks.scale(name, scale, q.shape[-1]), window,
               dispatch.check(name, implementation))
  if size == 1:
    # Nothing to rotate: this device's attention over its own sequence, one
    # kernel call a pass (no stacked k and v, no blocks to merge).
    return local_attention(q, k, v, causal=causal, scale=cfg.scale,
                           segment_ids=segment_ids, window=window,
                           implementation=cfg.implementation)
  every = sorted(frozenset({axis}).union(*map(varying, (q, k, v))), key=str)
  q, k, v = (vary_over(a, every) for a in (q, k, v))
  if segment_ids is not None:
    segment_ids = vary_over(segment_ids, every)
  return _ring_attention(cfg, q, k, v, segment_ids)


# --- one step's blocks --------------------------------------------------------

def _take(a, first, count: int, chunk: int):
  """Local chunks [first, first + count) of `a` along axis 1."""
  if isinstance(first, int):
    return jax.lax.slice_in_dim(a, first * chunk, (first + count) * chunk,
                                axis=1)
  return jax.lax.dynamic_slice_in_dim(a, first * chunk, count * chunk, axis=1)


def _put(a, part, first, chunk: int):
  return jax.lax.dynamic_update_slice_in_dim(a, part, first * chunk, axis=1)


def _choices(table):
  """The steps after the first as a list of (pair if before, pair if
  after): entries of one shape are computed by one program, indexed by
  `before` (a traced bool)."""
  return list(itertools.zip_longest(table[BEFORE], table[AFTER]))


def _pick(pair_b, pair_a, before):
  """One pair whose chunk offsets depend on `before`, or None where the two
  differ in shape (then a `lax.cond` chooses)."""
  if pair_b == pair_a:
    return pair_b, pair_b.q_first, pair_b.k_first
  if (pair_b is not None and pair_a is not None
      and pair_b._replace(q_first=0, k_first=0)
      == pair_a._replace(q_first=0, k_first=0)):
    pick = lambda x, y: x if x == y else jnp.where(before, x, y)
    return (pair_b, pick(pair_b.q_first, pair_a.q_first),
            pick(pair_b.k_first, pair_a.k_first))
  return None


def _each_pair(table, step: int, before, run, state):
  """`state = run(state, pair, q_first, k_first)` for each pair of this
  step; `before` says which of the plan's lists applies after step 0."""
  if step == 0:
    for pair in table[SELF]:
      state = run(state, pair, pair.q_first, pair.k_first)
    return state
  for pair_b, pair_a in _choices(table):
    picked = _pick(pair_b, pair_a, before)
    if picked is not None:
      state = run(state, *picked)
      continue
    branch = lambda pair: (
        (lambda s: s) if pair is None
        else (lambda s: run(s, pair, pair.q_first, pair.k_first)))
    state = jax.lax.cond(before, branch(pair_b), branch(pair_a), state)
  return state


def _free(fn, state):
  """`fn(state)` as one free block (`program_order(enforce=False)`): the
  forward's blocks of one step are a unit between the rotation's start and
  done, fenced as a whole rather than operation by operation (far fewer
  barriers to lower and compile; the window is what must hold,
  tests/aot/attention_compiled_test.py). The backward keeps every operation
  fenced: free blocks there let the TPU compiler hold more scores at once,
  above the all-gather form's temp bytes (docs/attention.md gives the
  figures, benchmarks/bench_attention.py measures them)."""
  return program_order(enforce=False)(fn)(state)


def _send(x, cfg: Config, shift: int = 1):
  """Starts sending `x` to the device `shift` places on, as a matrix (the TPU
  compiler may lay out a higher-rank received copy differently from the sent
  one and refuse its own module; see patterns/_ring.py)."""
  perm = [(j, (j + shift) % cfg.size) for j in range(cfg.size)]
  return ppermute_start(x.reshape(-1, x.shape[-1]), cfg.axis, perm)


def _steps(cfg: Config, q):
  """The ring's steps (plan.ring_steps) and the chunk length."""
  chunk = q.shape[1] // chunks_per_device(cfg.layout)
  return ring_steps(cfg.layout, cfg.causal, cfg.size, chunk, cfg.window), chunk


def _shifts(cfg: Config, steps):
  """How far the held block moves after each step but the last, and how far
  the gradient of the last step's block then goes home."""
  offsets = [s.offset for s in steps]
  return [b - a for a, b in zip(offsets, offsets[1:])], -offsets[-1] % cfg.size


def _ring_indices(cfg: Config, segment_ids, steps):
  """Per step: whether the held block comes from a device before this one,
  and its segment ids (all devices' ids are gathered once: integers, a
  small fraction of a block of k)."""
  index = jax.lax.axis_index(cfg.axis)
  before = [jnp.asarray(s.offset) <= index for s in steps]
  if segment_ids is None:
    return before, [None] * len(steps)
  every = jax.lax.all_gather(segment_ids, cfg.axis)
  return before, [every[(index - s.offset) % cfg.size] for s in steps]


def _positions(cfg: Config, chunk: int, offset: int, qf, kf):
  """Global positions of local query chunk `qf` and of local key chunk `kf`
  of the block held at `offset` (for a pair masked by the window)."""
  order = jnp.asarray(np.array([device_chunks(cfg.layout, cfg.size, d)
                                for d in range(cfg.size)]))
  index = jax.lax.axis_index(cfg.axis)
  at = lambda device, first: order[device, first] * chunk + jnp.arange(chunk)
  return at(index, qf), at((index - offset) % cfg.size, kf)


def _mask_args(cfg: Config, chunk: int, offset: int, pair, qf, kf) -> dict:
  """How the kernel masks `pair`: by the aligned causal mask (a diagonal
  pair), by global positions (a pair the window cuts), or not at all."""
  if pair.window:
    return dict(causal=cfg.causal, window=cfg.window,
                positions=_positions(cfg, chunk, offset, qf, kf))
  return dict(causal=pair.diagonal)


# --- forward ------------------------------------------------------------------

def _forward(cfg: Config, q, k, v, segment_ids):
  """(output in q's dtype, lse), q grouped by kv head."""
  steps, chunk = _steps(cfg, q)
  shifts, _ = _shifts(cfg, steps)
  before, k_segs = _ring_indices(cfg, segment_ids, steps)

  @program_order(enforce=True)
  def run(q, kv, q_seg, before, k_segs):
    stats = kernel.empty_stats(q)
    held = kv
    for step, planned in enumerate(steps):
      sending = step < len(steps) - 1
      if sending:
        with moving("k, v"):
          future = _send(held, cfg, shifts[step])

      def block(stats, pair, qf, kf, held=held, step=step,
                offset=planned.offset):
        part = kernel.Stats(*(_take(x, qf, pair.q_count, chunk) for x in stats))
        seg = lambda a, f, n: None if a is None else _take(a, f, n, chunk)
        part = dispatch.block_forward(
            cfg.implementation, part, _take(q, qf, pair.q_count, chunk),
            _take(held[0], kf, pair.k_count, chunk),
            _take(held[1], kf, pair.k_count, chunk), scale=cfg.scale,
            q_seg=seg(q_seg, qf, pair.q_count),
            k_seg=seg(k_segs[step], kf, pair.k_count),
            **_mask_args(cfg, chunk, offset, pair, qf, kf))
        return kernel.Stats(*(_put(x, y, qf, chunk) for x, y in zip(stats, part)))
      stats = _free(lambda stats, step=step, planned=planned: _each_pair(
          planned.pairs, planned.offset, before[step], block, stats), stats)
      if sending:
        held = future.done().reshape(kv.shape)
    return kernel.finish(stats)

  kv = jnp.stack([k, v])
  out, lse = run(q, kv, segment_ids, before, k_segs)
  return out.astype(q.dtype), lse


# --- backward -----------------------------------------------------------------

def _self_parts(pairs, chunk: int):
  """The step-0 (own block) pairs as (pair, first key, end key) parts, keys
  counted within the pair, in two lists: the parts computed while the first
  (k, v) rotation is in flight, and those left for the window of the last
  (dk, dv) hop home. Both lists hold work unless the block has one key.
  The own block's gradients are needed only at the end, so any split is
  exact; one pair is split by keys (a diagonal half then takes an explicit
  causal mask), at a multiple of the TPU kernel's 128-key tile where the
  halves are longer than one (flash_tpu.fits_tpu)."""
  whole = [(pair, 0, pair.k_count * chunk) for pair in pairs]
  if len(whole) > 1:
    half = (len(whole) + 1) // 2
    return whole[:half], whole[half:]
  (pair, _, n), = whole
  if n < 2:
    return whole, []
  cut = n // 2
  if cut > 128:
    cut -= cut % 128
  return [(pair, 0, cut)], [(pair, cut, n)]


def _backward(cfg: Config, q, k, v, segment_ids, out, lse, dout):
  steps, chunk = _steps(cfg, q)
  shifts, home = _shifts(cfg, steps)
  before, k_segs = _ring_indices(cfg, segment_ids, steps)
  delta = kernel.row_delta(out, dout)
  early, late = _self_parts(steps[0].pairs[SELF], chunk)

  @program_order(enforce=True)
  def run(q, kv, dout, lse, delta, q_seg, before, k_segs):
    def block(state, pair, qf, kf, lo=0, hi=None, *, held, step):
      """`state` (dq, dkv) plus the pair's part (keys lo..hi of the pair's
      keys) of the gradient, with the block `held` at `step`."""
      dq, dkv = state
      hi = pair.k_count * chunk if hi is None else hi
      rows = lambda a: _take(a, qf, pair.q_count, chunk)
      keys = lambda a: jax.lax.slice_in_dim(
          _take(a, kf, pair.k_count, chunk), lo, hi, axis=1)
      seg = lambda a, f, n: None if a is None else _take(a, f, n, chunk)
      k_seg = seg(k_segs[step], kf, pair.k_count)
      masking = _mask_args(cfg, chunk, steps[step].offset, pair, qf, kf)
      k_offset = lo   # a diagonal pair's keys lo..hi: causal from key lo on
      if pair.window:
        q_pos, k_pos = masking["positions"]
        masking["positions"] = (q_pos, k_pos[lo:hi])
        k_offset = 0
      dq_part, dk_part, dv_part = dispatch.block_backward(
          cfg.implementation, rows(q), keys(held[0]), keys(held[1]),
          rows(dout), rows(lse), rows(delta), scale=cfg.scale,
          q_seg=seg(q_seg, qf, pair.q_count),
          k_seg=None if k_seg is None else k_seg[:, lo:hi], k_offset=k_offset,
          **masking)
      dq = _put(dq, rows(dq) + dq_part, qf, chunk)
      dkv_part = jnp.stack([dk_part, dv_part])
      start = kf * chunk + lo
      dkv = jax.lax.dynamic_update_slice_in_dim(
          dkv, jax.lax.dynamic_slice_in_dim(dkv, start, hi - lo, axis=2)
          + dkv_part, start, axis=2)
      return dq, dkv

    def parts(state, listed, held, step):
      for pair, lo, hi in listed:
        state = block(state, pair, pair.q_first, pair.k_first, lo, hi,
                      held=held, step=step)
      return state

    dq = kernel.zeros_like_varying(q.shape, q)
    held = kv
    grads = None
    own = kernel.zeros_like_varying(kv.shape, q)
    for step, planned in enumerate(steps):
      sending = step < len(steps) - 1
      if sending:
        with moving("k, v"):
          future = _send(held, cfg, shifts[step])
      if step == 0:
        # Part of the own block now, the rest behind the last hop home.
        dq, own = parts((dq, own), early, held, 0)
      else:
        dkv = kernel.zeros_like_varying(kv.shape, q)
        dq, dkv = _each_pair(
            planned.pairs, planned.offset, before[step],
            lambda s, *a, held=held, step=step: block(s, *a, held=held,
                                                       step=step), (dq, dkv))
        # The gradient of the held block: this device's part, added to
        # what the devices before it sent (step >= 2), sent on with the
        # block, and home from the last step.
        if grads is not None:
          dkv = grads.done().reshape(kv.shape) + dkv
        with moving("dk, dv"):
          grads = _send(dkv, cfg, shifts[step] if sending else home)
      if sending:
        held = future.done().reshape(kv.shape)
    dq, own = parts((dq, own), late, kv, 0)
    if grads is not None:
      own = own + grads.done().reshape(kv.shape)
    return dq, own

  kv = jnp.stack([k, v])
  dq, dkv = run(q, kv, dout, lse, delta, segment_ids, before, k_segs)
  return dq, dkv[0], dkv[1]


# --- the custom_vjp -----------------------------------------------------------

def _attention(cfg: Config, q, k, v, segment_ids):
  grouped = kernel.group_heads(q, k.shape[2])
  out, _ = _forward(cfg, grouped, k, v, segment_ids)
  return kernel.ungroup_heads(out)


def _attention_fwd(cfg: Config, q, k, v, segment_ids):
  grouped = kernel.group_heads(q, k.shape[2])
  out, lse = _forward(cfg, grouped, k, v, segment_ids)
  return kernel.ungroup_heads(out), (q, k, v, segment_ids, out, lse)


def _attention_bwd(cfg: Config, residuals, dout):
  q, k, v, segment_ids, out, lse = residuals
  grouped = kernel.group_heads(q, k.shape[2])
  dq, dk, dv = _backward(cfg, grouped, k, v, segment_ids, out, lse,
                         kernel.group_heads(dout, k.shape[2]))
  return (kernel.ungroup_heads(dq).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype), None)


_ring_attention = jax.custom_vjp(_attention, nondiff_argnums=(0,))
_ring_attention.defvjp(_attention_fwd, _attention_bwd)
