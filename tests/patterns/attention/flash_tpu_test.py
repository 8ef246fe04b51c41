"""The Pallas TPU flash kernel (flash_tpu.py) in Pallas's interpreter on CPU:
values and gradients against dense attention, alone, inside the ring on 2, 4
and 8 devices and inside Ulysses; what `implementation` chooses (dispatch.py).

The interpreter is slow (a grid step at a time), so the shapes are small and
the cases few; they run on every supported jax. The same kernels on the real
TPU compiler: tests/aot/flash_compiled_test.py.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention import dispatch, flash_tpu, kernel
from jax_overlap._src.patterns.attention.layout import from_layout, to_layout
from jax_overlap._src.patterns.attention.local import local_attention
from jax_overlap._src.patterns.attention.ring import ring_attention
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention

from attention_reference import dense_attention, inputs, mesh, value_and_grads

# Every test on the newest jax; on older jax (CI runs all three side by side)
# the kernel alone, the ring on 1 and 2 devices (its split own block, segment
# ids), Ulysses and the choice.
pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_kernel_equals_dense", "test_causal_offset_halves_add_up",
    "test_a_row_that_sees_no_key",
    "test_ring_with_the_kernel_equals_dense[p2-contiguous-causal-segments]",
    "test_ring_on_one_device_is_the_local_kernel[contiguous]",
    "test_ulysses_with_the_kernel_equals_dense", "test_off_tpu_the_default_is_xla",
    "test_without_a_mesh_the_lowering_chooses",
    "test_a_jax_without_the_kernel_api_warns_once_and_runs_xla",
    "test_a_block_masked_by_traced_positions_runs_xla", "test_the_tile_sizes",
])


def _grouped(q, kv_heads):
  return kernel.group_heads(q, kv_heads)


# --- the kernel alone ---------------------------------------------------------

def _dense_lse(q, k, causal, seg, scale):
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, 2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  n = q.shape[1]
  keep = jnp.ones((1, 1, n, n), bool)
  if causal:
    keep = keep & jnp.tril(jnp.ones((n, n), bool))
  if seg is not None:
    keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
  lse = jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf), -1)
  return jnp.transpose(lse, (0, 2, 1))   # (b, s, heads)


@pytest.mark.parametrize("causal,segments", [(True, False), (False, True),
                                             (True, True)],
                         ids=["causal", "full-segments", "causal-segments"])
def test_kernel_equals_dense(causal, segments):
  # 32 queries and keys in tiles of 8: the online softmax across key tiles,
  # causal tiles skipped and unmasked ones computed without a mask. GQA:
  # 4 heads over 2 kv heads. The backward pass is given the dense lse.
  q, k, v, seg = inputs(1, seq_local=32, heads=4, kv_heads=2, segments=segments)
  scale, tiles = 0.3, flash_tpu.Blocks(8, 8)
  mask = flash_tpu.Mask(causal)
  g = lambda a: _grouped(a, 2)
  out, lse = jax.jit(lambda q, k, v, s: flash_tpu.forward(
      g(q), k, v, mask=mask, scale=scale, q_seg=s, k_seg=s, blocks=tiles,
      interpret=True))(q, k, v, seg)
  ref = dense_attention(q, k, v, causal=causal, segment_ids=seg, scale=scale)
  np.testing.assert_allclose(kernel.ungroup_heads(out), ref, rtol=1e-5,
                             atol=1e-5)
  ref_lse = _dense_lse(q, k, causal, seg, scale)
  np.testing.assert_allclose(lse.reshape(ref_lse.shape), ref_lse, rtol=1e-5,
                             atol=1e-5)

  do = jax.random.normal(jax.random.key(3), q.shape)
  delta = kernel.row_delta(g(ref), g(do))
  grads = jax.jit(lambda q, k, v, do, lse, delta, s: flash_tpu.backward(
      g(q), k, v, g(do), lse, delta, mask=mask, scale=scale, q_seg=s,
      k_seg=s, blocks=tiles, interpret=True))(
          q, k, v, do, ref_lse.reshape(lse.shape), delta, seg)
  _, vjp = jax.vjp(lambda q, k, v: dense_attention(
      q, k, v, causal=causal, segment_ids=seg, scale=scale), q, k, v)
  for name, got, want in zip("qkv", grads, vjp(do)):
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4,
                               atol=1e-5, err_msg=f"d{name}")


def test_causal_offset_halves_add_up():
  # The ring's own block split by keys (ring._self_parts): keys [16, 32) of
  # a causal block are at offset 16. The two halves' outputs merged equal
  # the whole, and their gradients add up to the whole's.
  q, k, v, _ = inputs(1, seq_local=32, heads=2, kv_heads=2)
  q = _grouped(q, 2)
  tiles, scale = flash_tpu.Blocks(8, 8), 0.3
  run = lambda lo, hi: flash_tpu.forward(
      q, k[:, lo:hi], v[:, lo:hi], mask=flash_tpu.Mask(True, lo), scale=scale,
      blocks=tiles, interpret=True)
  stats = kernel.empty_stats(q)
  for lo, hi in ((0, 16), (16, 32)):
    stats = dispatch.merge(stats, *run(lo, hi))
  out, lse = kernel.finish(stats)
  whole, whole_lse = run(0, 32)
  np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, whole_lse, rtol=1e-5, atol=1e-5)

  do = jax.random.normal(jax.random.key(3), q.shape)
  delta = kernel.row_delta(whole, do)
  back = lambda lo, hi: flash_tpu.backward(
      q, k[:, lo:hi], v[:, lo:hi], do, whole_lse, delta,
      mask=flash_tpu.Mask(True, lo), scale=scale, blocks=tiles, interpret=True)
  dq0, dk0, dv0 = back(0, 16)
  dq1, dk1, dv1 = back(16, 32)
  dq, dk, dv = back(0, 32)
  np.testing.assert_allclose(dq0 + dq1, dq, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate([dk0, dk1], 1), dk, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(jnp.concatenate([dv0, dv1], 1), dv, rtol=1e-5,
                             atol=1e-5)


def test_a_row_that_sees_no_key():
  # Segment ids that hide every key of the block from some rows: output 0
  # and lse MASKED there (the ring's merge then leaves the row as it was).
  q, k, v, _ = inputs(1, seq_local=8, heads=2, kv_heads=2)
  q = _grouped(q, 2)
  q_seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]])
  k_seg = jnp.zeros((1, 8), jnp.int32)
  out, lse = flash_tpu.forward(q, k, v, mask=flash_tpu.Mask(False), scale=0.3,
                               q_seg=q_seg, k_seg=k_seg, interpret=True)
  assert np.all(np.asarray(out)[:, 4:] == 0)
  assert np.all(np.asarray(lse)[:, 4:] == kernel._MASKED)
  assert np.all(np.asarray(lse)[:, :4] > -100)


# --- inside the ring and Ulysses ------------------------------------------------

def _sharded(p, attend, layout="contiguous"):
  """As attention_reference.sharded, under check_vma=False: Pallas's
  interpreter fails inside a shard_map that checks varying axes
  (_compat.PALLAS_INTERPRET)."""
  smap = jax.shard_map(attend, mesh=mesh(p), in_specs=P(None, "cp"),
                       out_specs=P(None, "cp"), check_vma=False)

  def run(q, k, v, seg=None):
    lay = lambda x: None if x is None else to_layout(x, layout, p)
    return from_layout(smap(lay(q), lay(k), lay(v), lay(seg)), layout, p)
  return run


def _check(fn, q, k, v, seg, causal, rtol=1e-5, atol=1e-5):
  """fn's output and gradients against dense attention's; returns them."""
  out, grads = value_and_grads(fn, q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal,
                                           segment_ids=seg), q, k, v, seg)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(ref, np.float32), rtol=rtol, atol=atol)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(r, np.float32), rtol=rtol, atol=atol,
                               err_msg=f"d{name}")
  return out, grads


RING = [(2, "contiguous", True, True), (4, "contiguous", False, False),
        pytest.param(8, "zigzag", True, True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("p,layout,causal,segments", RING, ids=[
    "p2-contiguous-causal-segments", "p4-contiguous-full",
    "p8-zigzag-causal-segments"])
def test_ring_with_the_kernel_equals_dense(p, layout, causal, segments):
  # p = 2 contiguous splits the own block's keys in the backward pass (a
  # causal offset); zigzag runs the diagonal and full pairs of every step.
  q, k, v, seg = inputs(p, segments=segments)
  _check(_sharded(p, lambda q, k, v, s: ring_attention(
      q, k, v, axis="cp", causal=causal, layout=layout, segment_ids=s,
      implementation="pallas"), layout), q, k, v, seg, causal)


def test_ring_with_the_kernel_bfloat16():
  # bfloat16 in and out, float32 inside: within bfloat16's precision of
  # float32 dense attention on the same (rounded) inputs.
  q, k, v, seg = inputs(2, segments=True, dtype=jnp.bfloat16)
  ring = _sharded(2, lambda q, k, v, s: ring_attention(
      q, k, v, axis="cp", causal=True, segment_ids=s, implementation="pallas"))
  out, grads = _check(ring, q, k, v, seg, True, rtol=2e-2, atol=2e-2)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_on_one_device_is_the_local_kernel(layout):
  # Nothing to rotate: one kernel call a pass (the whole sequence, in its
  # order under both layouts), its gradients straight in the inputs' dtype.
  q, k, v, seg = inputs(1, seq_local=16, segments=True)
  ring = _sharded(1, lambda q, k, v, s: ring_attention(
      q, k, v, axis="cp", causal=True, layout=layout, segment_ids=s,
      implementation="pallas"), layout)
  _check(ring, q, k, v, seg, True)
  text = str(jax.make_jaxpr(lambda *a: value_and_grads(ring, *a, seg))(q, k, v))
  assert text.count("pallas_call") == 3 and "ppermute" not in text


def test_ulysses_with_the_kernel_equals_dense():
  q, k, v, _ = inputs(4, heads=8, kv_heads=2)
  _check(_sharded(4, lambda q, k, v, s: ulysses_attention(
      q, k, v, axis="cp", causal=True, implementation="pallas")),
         q, k, v, None, True)


# --- the choice -------------------------------------------------------------------

def _primitives(implementation, fn=ring_attention, check_vma=False):
  q, k, v, _ = inputs(2)
  smap = jax.shard_map(
      lambda q, k, v: fn(q, k, v, axis="cp", causal=True,
                         implementation=implementation),
      mesh=mesh(2), in_specs=P(None, "cp"), out_specs=P(None, "cp"),
      check_vma=check_vma)
  grad = jax.grad(lambda q, k, v: smap(q, k, v).sum(), argnums=(0, 1, 2))
  text = str(jax.make_jaxpr(grad)(q, k, v))
  return text.count("pallas_call"), text.count("platform_index")


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention],
                         ids=["ring", "ulysses"])
def test_off_tpu_the_default_is_xla(fn):
  # A CPU mesh: XLA's operations, no kernel traced and nothing left to the
  # lowering. Forced, the kernel: the ring's forward and backward pass.
  assert _primitives(None, fn) == (0, 0)
  assert _primitives("xla", fn) == (0, 0)
  kernels, choices = _primitives("pallas", fn)
  assert kernels >= 3 and choices == 0


def test_without_a_mesh_the_lowering_chooses():
  # No shard_map (the platform unknown while tracing): both codes are
  # traced and jax.lax.platform_dependent keeps the TPU one for TPU.
  q, k, v, _ = inputs(1, seq_local=128, heads=2, kv_heads=2, head_dim=128)
  attend = lambda q, k, v: local_attention(q, k, v, causal=True, scale=0.1)
  text = str(jax.make_jaxpr(attend)(q, k, v))
  assert "platform_index" in text and "pallas_call" in text
  np.testing.assert_allclose(
      jax.jit(attend)(q, k, v),
      dense_attention(q, k, v, causal=True, scale=0.1), rtol=1e-5, atol=1e-5)
  # A block the TPU kernel does not take (head_dim 8): XLA's alone.
  q, k, v, _ = inputs(1, seq_local=128, heads=2, kv_heads=2)
  assert "pallas_call" not in str(jax.make_jaxpr(attend)(q, k, v))


def test_a_jax_without_the_kernel_api_warns_once_and_runs_xla(monkeypatch):
  monkeypatch.setattr(_compat, "pallas_tpu_missing", lambda: "pl.Squeezed")
  monkeypatch.setattr(dispatch, "_warned", set())
  with pytest.warns(UserWarning, match="lacks pl.Squeezed") as caught:
    assert _primitives("pallas") == (0, 0)
    assert _primitives("pallas", ulysses_attention) == (0, 0)
  assert len([w for w in caught if "lacks" in str(w.message)]) == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _primitives(None) == (0, 0)   # off TPU nothing is lost: silent


def test_a_block_masked_by_traced_positions_runs_xla():
  # The kernel's masks are static (causal from an offset); a block masked
  # by traced positions (a pair a sliding window cuts) runs XLA's operations
  # whatever `implementation` says.
  q, k, v, _ = inputs(1, seq_local=16, heads=2, kv_heads=2)
  q = _grouped(q, 2)
  positions = (jnp.arange(16), jnp.arange(16))

  def both(q, k, v):
    stats = dispatch.block_forward("pallas", kernel.empty_stats(q), q, k, v,
                                   causal=True, scale=0.3, positions=positions)
    out, lse = kernel.finish(stats)
    grads = dispatch.block_backward("pallas", q, k, v, q, lse,
                                    jnp.zeros_like(lse), causal=True,
                                    scale=0.3, positions=positions)
    return out, grads
  assert "pallas_call" not in str(jax.make_jaxpr(both)(q, k, v))
  want = kernel.finish(kernel.block_forward(
      kernel.empty_stats(q), q, k, v, causal=True, scale=0.3))[0]
  np.testing.assert_allclose(both(q, k, v)[0], want, rtol=1e-6, atol=1e-6)


def test_the_tile_sizes():
  assert flash_tpu.block_sizes(8192, 8192, 128) == flash_tpu.Blocks(512, 512)
  assert flash_tpu.block_sizes(384, 1024, 128) == flash_tpu.Blocks(128, 512)
  assert flash_tpu.block_sizes(4096, 4096, 512) == flash_tpu.Blocks(256, 256)
  assert flash_tpu.block_sizes(24, 16, 8) == flash_tpu.Blocks(24, 16)
  assert flash_tpu.fits_tpu(256, 512, 128, jnp.bfloat16)
  assert not flash_tpu.fits_tpu(256, 512, 64, jnp.bfloat16)
  assert not flash_tpu.fits_tpu(200, 512, 128, jnp.float32)
  assert not flash_tpu.fits_tpu(256, 256, 128, jnp.float16)
