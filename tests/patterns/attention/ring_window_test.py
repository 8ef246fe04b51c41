"""Sliding-window attention in ring_attention (`window=`): values and
gradients against dense attention, the plan's steps against a brute-force
mask, and the rotations the program takes."""

import re

import jax
import numpy as np
import pytest

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention import window as windows
from jax_overlap._src.patterns.attention.layout import device_chunks
from jax_overlap._src.patterns.attention.plan import (plan, relation,
                                                      ring_attention_work,
                                                      ring_steps)
from jax_overlap._src.patterns.attention.ring import ring_attention

from attention_reference import dense_attention, inputs, sharded, value_and_grads

# Older jax (CI runs all three side by side): each layout causal and not,
# a window inside a chunk, across chunks and 0, the plan and the rotations.
pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_the_reference_window_is_jaxs",
    "test_equals_dense_attention[p4-contiguous-causal-w3]",
    "test_equals_dense_attention[p4-zigzag-causal-w11]",
    "test_equals_dense_attention[p4-zigzag-full-w(2, 9)]",
    "test_equals_dense_attention[p8-contiguous-full-w0]",
    "test_the_plan_computes_every_needed_pair_and_no_step_more*",
    "test_rotations_only_to_the_blocks_the_window_reaches",
    "test_a_window_over_the_whole_sequence_is_the_plain_program",
])

SEQ_LOCAL = 8


def _ring(p, layout, causal, window):
  return sharded(p, lambda q, k, v, seg: ring_attention(
      q, k, v, axis="cp", causal=causal, layout=layout, segment_ids=seg,
      window=window), layout)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [0, 1, 5, (3, 0), (0, 4), (7, 2)])
def test_the_reference_window_is_jaxs(window, causal):
  # The window's meaning is jax.nn.dot_product_attention's local_window_size.
  q, k, v, _ = inputs(1, seq_local=12, kv_heads=8)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                      local_window_size=window)
  got = dense_attention(q, k, v, causal=causal, window=window)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# Windows on chunks of 8 (zigzag: 4): 0 (the diagonal alone), inside a
# chunk, across chunks, one-sided, and at least the whole sequence.
CASES = [
    (4, "contiguous", True, 3), (4, "contiguous", True, 11),
    (4, "contiguous", False, (2, 9)), (4, "contiguous", True, 0),
    (4, "zigzag", True, 3), (4, "zigzag", True, 11),
    (4, "zigzag", False, (2, 9)), (4, "zigzag", True, 31),
    (4, "zigzag", False, 0), (4, "contiguous", False, 100),
    (2, "zigzag", True, (5, 0)), (8, "contiguous", False, 0),
    (8, "zigzag", True, 20), (8, "contiguous", True, 9)]


@pytest.mark.parametrize("p,layout,causal,window", CASES, ids=[
    f"p{p}-{layout}-{'causal' if c else 'full'}-w{w}"
    for p, layout, c, w in CASES])
def test_equals_dense_attention(p, layout, causal, window):
  # Segment ids where causal (packed sequences): a window and the ids mask
  # together.
  q, k, v, seg = inputs(p, seq_local=SEQ_LOCAL, segments=causal)
  out, grads = value_and_grads(_ring(p, layout, causal, window), q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal,
                                           segment_ids=seg, window=window),
      q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_key_blocks_with_a_window(monkeypatch):
  # Key blocks longer than kernel.KEY_BLOCK are visited in a lax.scan; the
  # window's positions are split with them.
  from jax_overlap._src.patterns.attention import kernel  # noqa: PLC0415
  monkeypatch.setattr(kernel, "KEY_BLOCK", 2)
  p = 2
  q, k, v, seg = inputs(p, seq_local=8, segments=True)
  out, grads = value_and_grads(_ring(p, "zigzag", True, 5), q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=True, window=5,
                                           segment_ids=seg), q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


# --- the plan ----------------------------------------------------------------

def _needed(layout, p, chunk, causal, window, d, offset):
  """Brute force: device d's (local q chunk, local k chunk) pairs with a
  key some query sees, with the block of device d - offset."""
  q = device_chunks(layout, p, d)
  k = device_chunks(layout, p, (d - offset) % p)
  n = len(q)
  lo, hi = windows.reach(causal, window)
  seen = set()
  for i in range(n):
    for j in range(n):
      rel = (k[j] - q[i]) * chunk + np.arange(chunk)[None, :] \
          - np.arange(chunk)[:, None]
      ok = np.ones_like(rel, bool)
      if lo is not None:
        ok &= rel >= lo
      if hi is not None:
        ok &= rel <= hi
      if ok.any():
        seen.add((i, j))
  return seen


def _computed(pairs):
  return {(i, j) for pr in pairs
          for i in range(pr.q_first, pr.q_first + pr.q_count)
          for j in range(pr.k_first, pr.k_first + pr.k_count)}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_plan_computes_every_needed_pair_and_no_step_more_than_its_busiest_device(
    layout, causal, p):
  chunk = 4
  seq = p * chunk * (2 if layout == "zigzag" else 1)
  for window in [(0, 0), (1, 0), (3, 2), (4, 4), (9, 1), (0, 13),
                 (seq // 2, 3), (seq, seq)]:
    steps = ring_steps(layout, causal, p, chunk, window)
    assert steps[0].offset == 0
    taken = {s.offset for s in steps}
    for offset in range(p):
      need = [_needed(layout, p, chunk, causal, window, d, offset)
              for d in range(p)]
      if offset not in taken:   # a step is left out only if nothing needs it
        assert not any(need), (window, offset)
        continue
      step = next(s for s in steps if s.offset == offset)
      done = [_computed(step.pairs[relation(d, offset)]) for d in range(p)]
      for d in range(p):
        assert need[d] <= done[d], (window, offset, d)
      # One program for a relation's devices: never more pairs than the
      # device that needs the most at this step.
      assert max(map(len, done)) == max(map(len, need)), (window, offset)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_over_the_whole_sequence_plans_as_none(layout, causal):
  p, chunk = 4, 4
  seq = p * chunk * (2 if layout == "zigzag" else 1)
  table = plan(layout, causal)
  for window in [(seq - 1, seq - 1), (seq, 3 * seq)]:
    steps = ring_steps(layout, causal, p, chunk, window)
    assert [s.offset for s in steps] == list(range(p))
    for s in steps:
      for rel, pairs in s.pairs.items():
        assert pairs == table[rel], (window, s.offset, rel)


def test_zigzag_with_a_window_keeps_each_step_to_its_busiest_device():
  # With a window, work per device follows the band: the zigzag plan adds
  # nothing to any step beyond what its busiest device needs (above); here
  # the totals: within the no-window plan's, and the window's work never
  # above the plain causal ring's.
  p, chunk = 8, 8
  for w in (3, 20, 40):
    work = ring_attention_work("zigzag", p, causal=True, window=(w, 0),
                               chunk=chunk)
    assert max(work) <= 2 * p + 1
  assert ring_attention_work("zigzag", p, causal=True, window=(3, 0),
                             chunk=chunk) == (4,) + (5,) * (p - 2) + (4,)
  # Contiguous: a window inside one chunk is the diagonal and the chunk
  # before it, on every device but the first.
  assert ring_attention_work("contiguous", p, causal=True, window=(7, 0),
                             chunk=chunk) == (1,) + (2,) * (p - 1)


# --- the rotations in the program ---------------------------------------------

def _permute_starts(text):
  if _compat.ASYNC_CUSTOM_CALLS:
    return text.count('"collective-permute-start"')
  if "async_start" in text:
    return text.count("async_start")
  return text.count("collective_permute")


def _rotations(p, layout, causal, window, segments=False):
  q, k, v, seg = inputs(p, seq_local=SEQ_LOCAL, segments=segments)
  fwd = _ring(p, layout, causal, window)
  forward = jax.jit(fwd).lower(q, k, v, seg).as_text()
  grad = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v, seg).sum(),
                          argnums=(0, 1, 2))).lower(q, k, v).as_text()
  return _permute_starts(forward), _permute_starts(grad)


@pytest.mark.parametrize("layout,causal,window,taken", [
    # contiguous chunks of 8: a window inside a chunk reaches the chunk
    # before (causal) or both neighbours; 0 none.
    ("contiguous", True, (7, 0), 1),
    ("contiguous", True, (9, 0), 2),   # 9 back from a chunk's first query
    ("contiguous", False, 3, 2),
    ("contiguous", True, 0, 0),
    # zigzag chunks of 4: device d's first chunk needs device d - 1's
    # first, its second device d + 1's second: two rotations (+1, then -2).
    ("zigzag", True, (3, 0), 2),
    ("zigzag", False, (0, 0), 0),
    # at least the whole sequence: every step, as without a window.
    ("zigzag", True, 10_000, 3),
    ("contiguous", False, None, 3)])
def test_rotations_only_to_the_blocks_the_window_reaches(layout, causal,
                                                         window, taken):
  # Forward: one rotation of (k, v) a step taken after the first; the
  # gradient's program: the forward's, those again, and as many hops of
  # (dk, dv), the last one home.
  p = 4
  forward, gradient = _rotations(p, layout, causal, window)
  assert forward == taken, (forward, taken)
  assert gradient == 3 * taken, (gradient, taken)


def test_a_window_over_the_whole_sequence_is_the_plain_program():
  p = 4
  q, k, v, seg = inputs(p, seq_local=SEQ_LOCAL, segments=True)
  strip = lambda t: re.sub(r"loc\(.*?\)|#loc\d*", "", t)
  texts = [strip(jax.jit(_ring(p, "zigzag", True, w)).lower(
      q, k, v, seg).as_text()) for w in (None, p * SEQ_LOCAL - 1)]
  assert texts[0] == texts[1]


def test_a_shift_of_more_than_one_device_reaches_the_right_block():
  # zigzag, causal, window 3 on chunks of 4 (p = 4): offsets 0, 1 and 3, the
  # last reached by a shift of 2 (dk, dv home by a shift of 1).
  p = 4
  assert [s.offset for s in ring_steps("zigzag", True, p, 4, (3, 0))] == \
      [0, 1, 3]
  q, k, v, seg = inputs(p, seq_local=SEQ_LOCAL, segments=True)
  fwd = _ring(p, "zigzag", True, 3)
  shifts = lambda f, *a: [sorted((dst - src) % p for src, dst in perm)
                          for perm in _perms(jax.make_jaxpr(f)(*a).jaxpr)]
  assert shifts(fwd, q, k, v, seg) == [[1] * p, [2] * p]
  grad = jax.grad(lambda q, k, v: fwd(q, k, v, seg).sum(), argnums=(0, 1, 2))
  # The gradient's program: the forward's two; the backward's (k, v) +1 and
  # +2, and the (dk, dv) of offset 1's block on with the block (+2), then
  # home from offset 3 (+1).
  assert shifts(grad, q, k, v) == [[s] * p for s in (1, 2, 1, 2, 2, 1)]


def _perms(jaxpr):
  """The permutation of each ppermute future started in `jaxpr`."""
  from jax._src import core  # noqa: PLC0415
  from jax_overlap._src.collectives.primitives import (  # noqa: PLC0415
      collective_start_p)
  for eqn in jaxpr.eqns:
    if eqn.primitive is collective_start_p and eqn.params["comm"].name == "ppermute":
      inner = eqn.params["comm"].jaxpr
      inner = getattr(inner, "jaxpr", inner)
      yield from (e.params["perm"] for e in inner.eqns
                  if e.primitive.name == "ppermute")
    for sub in core.jaxprs_in_params(eqn.params):
      yield from _perms(sub)
