"""ulysses_attention: values and gradients against dense attention, the
all-to-all futures, a user's attention_fn."""

import functools

import jax
import numpy as np
import pytest

from jax_overlap._src.patterns.attention.ulysses import ulysses_attention

from attention_reference import dense_attention, inputs, sharded, value_and_grads


def _ulysses(p, causal, attention_fn=None):
  return sharded(p, lambda q, k, v, seg: ulysses_attention(
      q, k, v, axis="cp", causal=causal, attention_fn=attention_fn))


# kv_heads 2 on p = 4 and 8: the kv heads are repeated to a multiple of p.
@pytest.mark.parametrize("p,causal", [(2, False), (4, True), (8, True)])
def test_equals_dense_attention(p, causal):
  q, k, v, _ = inputs(p)
  out, grads = value_and_grads(_ulysses(p, causal), q, k, v, None)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal),
      q, k, v, None)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


def test_default_kernel_scans_key_blocks(monkeypatch):
  from jax_overlap._src.patterns.attention import kernel  # noqa: PLC0415
  monkeypatch.setattr(kernel, "KEY_BLOCK", 4)
  p = 2
  q, k, v, _ = inputs(p, seq_local=8)
  out, grads = value_and_grads(_ulysses(p, True), q, k, v, None)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=True), q, k, v, None)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_a_users_attention_fn():
  p = 2
  q, k, v, _ = inputs(p, kv_heads=8)
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=True)
  out = jax.jit(_ulysses(p, False, fn))(q, k, v)
  np.testing.assert_allclose(out, dense_attention(q, k, v, causal=True),
                             rtol=1e-5, atol=1e-5)


def test_three_all_to_all_futures_kv_started_first():
  # (k, v) as one array, q, and the output back: three all-to-all futures;
  # the (k, v) one started first and finished after q's.
  p = 4
  q, k, v, _ = inputs(p)
  text = str(jax.make_jaxpr(_ulysses(p, True))(q, k, v))
  lines = [ln.strip() for ln in text.splitlines()
           if "= collective_start[" in ln or "= collective_done[" in ln]
  kinds = ["start" if "collective_start[" in ln else "done" for ln in lines]
  assert kinds == ["start", "start", "done", "done", "start", "done"], lines
  assert all("all_to_all" in ln for ln in lines if "done" in ln), lines
  started = lambda ln: [t.split(":")[0] for t in ln.split(" = ")[0].split()]
  finished = lambda ln: ln.rsplit("]", 1)[1].split()
  assert finished(lines[2]) == started(lines[1])   # q first
  assert finished(lines[3]) == started(lines[0])   # then (k, v)


def _ulysses_masked(p, causal, window):
  return sharded(p, lambda q, k, v, seg: ulysses_attention(
      q, k, v, axis="cp", causal=causal, segment_ids=seg, window=window))


# Segment ids (3 packed sequences a row) and sliding windows (window.py):
# 0, inside a device's stretch, across stretches, one-sided, and longer
# than the sequence.
@pytest.mark.parametrize("p,causal,segments,window", [
    (4, True, True, None), (2, False, True, None), (4, True, True, 3),
    (4, False, False, (2, 9)), (8, True, False, 0), (2, True, True, 100)])
def test_segment_ids_and_window_equal_dense_attention(p, causal, segments,
                                                      window):
  q, k, v, seg = inputs(p, seq_local=8, segments=segments)
  out, grads = value_and_grads(_ulysses_masked(p, causal, window), q, k, v,
                               seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal,
                                           segment_ids=seg, window=window),
      q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
