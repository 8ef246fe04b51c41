"""ring_attention: values and gradients against dense attention, what the
backward pass saves, the rotations in the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap._src.patterns.attention.ring import ring_attention

from attention_reference import dense_attention, inputs, sharded, value_and_grads

# Every row runs on the newest jax; on older jax (CI runs all three side by
# side) a subset that still covers each layout, causal and not, segment ids,
# p = 2, 4 and 8, the lowering, the residuals, checkpoint and the key-block
# scan.
pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_equals_dense_attention_float32[p2-contiguous-causal-segments]",
    "test_equals_dense_attention_float32[p4-zigzag-causal-segments]",
    "test_equals_dense_attention_float32[p8-zigzag-full]",
    "test_rotations_are_futures_around_each_step",
    "test_zigzag_causal_computes_the_planned_blocks",
    "test_saves_no_remote_blocks",
    "test_jit_grad_checkpoint",
    "test_scale_and_key_blocks",
])


def _ring(p, layout, causal, scale=None):
  return sharded(p, lambda q, k, v, seg: ring_attention(
      q, k, v, axis="cp", causal=causal, layout=layout, scale=scale,
      segment_ids=seg), layout)


def _check(p, layout, causal, segments, dtype=jnp.float32, rtol=1e-5,
           atol=1e-5, **shape):
  q, k, v, seg = inputs(p, segments=segments, dtype=dtype, **shape)
  out, grads = value_and_grads(_ring(p, layout, causal), q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal,
                                           segment_ids=seg), q, k, v, seg)
  assert out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(ref.astype(dtype), np.float32),
                             rtol=rtol, atol=atol)
  for name, g, r in zip("qkv", grads, ref_grads):
    assert g.dtype == dtype, name
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(r.astype(dtype), np.float32),
                               rtol=rtol, atol=atol, err_msg=f"d{name}")


# Every layout and mask on p = 2, 4, 8; segment ids where causal (packed
# sequences are causal) and once without. Heads 8, kv_heads 2 (GQA).
CASES = [(p, layout, causal, causal or (p == 4 and layout == "zigzag"))
         for p in (2, 4, 8) for layout in ("contiguous", "zigzag")
         for causal in (False, True)]


@pytest.mark.parametrize("p,layout,causal,segments", CASES, ids=[
    f"p{p}-{layout}-{'causal' if c else 'full'}{'-segments' if s else ''}"
    for p, layout, c, s in CASES])
def test_equals_dense_attention_float32(p, layout, causal, segments):
  _check(p, layout, causal, segments)


@pytest.mark.parametrize("kv_heads", [1, 8], ids=["mqa", "mha"])
def test_mqa_and_mha(kv_heads):
  _check(4, "zigzag", True, False, kv_heads=kv_heads)


def test_bfloat16_inputs():
  # float32 inside: the output and gradients are within bfloat16's precision
  # of float32 dense attention on the same (rounded) inputs.
  _check(4, "zigzag", True, True, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


def test_scale_and_key_blocks(monkeypatch):
  # Key blocks longer than kernel.KEY_BLOCK are visited in a lax.scan.
  from jax_overlap._src.patterns.attention import kernel  # noqa: PLC0415
  monkeypatch.setattr(kernel, "KEY_BLOCK", 2)
  p, scale = 2, 0.3
  q, k, v, seg = inputs(p, seq_local=8, segments=True)
  out, grads = value_and_grads(_ring(p, "zigzag", True, scale), q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=True, scale=scale,
                                           segment_ids=seg), q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _equations(jaxpr, name):
  """Equations of primitive `name` in `jaxpr` and every jaxpr inside it."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in _sub_jaxprs(list(eqn.params.values())):
      count += _equations(sub, name)
  return count


def _sub_jaxprs(values):
  for v in values:
    if hasattr(v, "eqns"):
      yield v
    elif hasattr(getattr(v, "jaxpr", None), "eqns"):
      yield v.jaxpr
    elif isinstance(v, (tuple, list)):
      yield from _sub_jaxprs(v)


def test_rotations_are_futures_around_each_step():
  # p - 1 rotations of (k, v) forward; backward p - 1 of (k, v) and p - 1 of
  # the held block's (dk, dv). Each is a ppermute future of the library.
  p = 4
  q, k, v, _ = inputs(p)
  fwd = _ring(p, "zigzag", True)
  text = jax.jit(fwd).lower(q, k, v).as_text()
  grad = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).sum(),
                          argnums=(0, 1, 2)))
  grad_text = grad.lower(q, k, v).as_text()
  starts = lambda t: t.count("collective_permute") if "async_start" not in t \
      else t.count("async_start")
  from jax_overlap._src import _compat  # noqa: PLC0415
  if _compat.ASYNC_CUSTOM_CALLS:
    starts = lambda t: t.count('"collective-permute-start"')
  assert starts(text) == p - 1, text
  assert starts(grad_text) == (p - 1) + 2 * (p - 1), grad_text


def test_zigzag_causal_computes_the_planned_blocks():
  # Each computed (query chunk, key chunk) pair is two dot_generals (scores,
  # then probabilities @ v); with zigzag every step has one program for all
  # devices: 3 pairs at step 0, then 2 a step, 2p + 1 in all; not causal,
  # one (2 x 2 chunk) pair a step.
  p = 4
  q, k, v, _ = inputs(p)
  for causal, pairs in ((True, 2 * p + 1), (False, p)):
    jaxpr = jax.make_jaxpr(_ring(p, "zigzag", causal))(q, k, v).jaxpr
    assert _equations(jaxpr, "dot_general") == 2 * pairs, causal


def test_saves_no_remote_blocks():
  # The backward pass saves this device's q, k, v, output and row lse, and
  # nothing of another device's k, v (one block more would be 2 k / p more
  # elements): floats of 2 q + 2 k + lse elements. (The integers are
  # to_layout's gather indices.)
  from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415
  p = 8
  q, k, v, _ = inputs(p)
  fwd = _ring(p, "zigzag", True)
  saved = saved_residuals(lambda q, k, v: fwd(q, k, v).sum(), q, k, v)
  elements = sum(int(np.prod(aval.shape)) for aval, _ in saved
                 if jnp.issubdtype(aval.dtype, jnp.floating))
  lse = q.size // q.shape[-1]
  assert elements == 2 * q.size + 2 * k.size + lse, saved


def test_jit_grad_checkpoint():
  p = 2
  q, k, v, seg = inputs(p, segments=True)
  ring = _ring(p, "contiguous", True)
  loss = lambda q, k, v: (ring(q, k, v, seg) ** 2).sum()
  plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(plain, remat):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
