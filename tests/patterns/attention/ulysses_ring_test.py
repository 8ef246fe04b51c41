"""Ulysses x ring on a 2-D context mesh (`ulysses_attention(...,
ring_axis=...)`): heads exchanged over one axis, the ring over the other,
the sequence sharded over both (the ring's axis major). Values and
gradients against dense attention on 2x4 and 4x2 meshes of the 8 CPU
devices, causal with segment ids, both ring layouts, with a window; the
collectives in the program."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.attention.layout import from_layout, to_layout
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention

from attention_reference import dense_attention, inputs, value_and_grads
import meshes

pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_equals_dense_attention[2x4-zigzag-causal-segments]",
    "test_equals_dense_attention[4x2-contiguous-causal-segments]",
    "test_equals_dense_attention[4x2-zigzag-full]",
    "test_equals_dense_attention[2x4-contiguous-causal-segments-w5]",
    "test_more_devices_than_kv_heads_without_repeating_them_eightfold",
])


def two_d(ring, heads, layout="contiguous", **kw):
  """`ulysses_attention(axis="u", ring_axis="ring")` on global arrays in
  their global order: laid out for the ring, sharded over ("ring", "u")."""
  mesh = meshes.make((ring, heads), ("ring", "u"))
  spec = P(None, ("ring", "u"))

  @jax.shard_map(mesh=mesh, in_specs=spec, out_specs=spec)
  def local(q, k, v, seg):
    return ulysses_attention(q, k, v, axis="u", ring_axis="ring",
                             layout=layout, segment_ids=seg, **kw)

  def run(q, k, v, seg=None):
    lay = lambda x: None if x is None else to_layout(x, layout, ring)
    return from_layout(local(lay(q), lay(k), lay(v), lay(seg)), layout, ring)
  return run


CASES = [((ring, heads), layout, causal, causal, None)
         for ring, heads in ((2, 4), (4, 2))
         for layout in ("contiguous", "zigzag") for causal in (True, False)]
CASES += [((2, 4), "contiguous", True, True, 5), ((4, 2), "zigzag", True, True, 9)]


@pytest.mark.parametrize("shape,layout,causal,segments,window", CASES, ids=[
    f"{r}x{h}-{layout}-{'causal' if c else 'full'}"
    f"{'-segments' if s else ''}{f'-w{w}' if w is not None else ''}"
    for (r, h), layout, c, s, w in CASES])
def test_equals_dense_attention(shape, layout, causal, segments, window):
  q, k, v, seg = inputs(8, seq_local=4, heads=8, kv_heads=2,
                        segments=segments)
  out, grads = value_and_grads(
      two_d(*shape, layout, causal=causal, window=window), q, k, v, seg)
  ref, ref_grads = value_and_grads(
      lambda q, k, v, seg: dense_attention(q, k, v, causal=causal,
                                           segment_ids=seg, window=window),
      q, k, v, seg)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def _starts(jaxpr):
  """(collective, operand shape) of each future started in `jaxpr`."""
  from jax._src import core  # noqa: PLC0415
  from jax_overlap._src.collectives.primitives import (  # noqa: PLC0415
      collective_start_p)
  for eqn in jaxpr.eqns:
    if eqn.primitive is collective_start_p:
      yield eqn.params["comm"].name, tuple(eqn.invars[0].aval.shape)
    for sub in core.jaxprs_in_params(eqn.params):
      yield from _starts(sub)


def test_more_devices_than_kv_heads_without_repeating_them_eightfold():
  # 8 devices, 2 kv heads, 4 query heads: Ulysses alone over 8 cannot split
  # 4 heads; over 2 ("u") with a ring of 4 it attends 2 heads a device and
  # holds one kv head, the (k, v) going round the ring.
  q, k, v, seg = inputs(8, seq_local=4, heads=4, kv_heads=2, segments=True)
  f = two_d(4, 2, "zigzag", causal=True)
  out = jax.jit(f)(q, k, v, seg)
  np.testing.assert_allclose(
      out, dense_attention(q, k, v, causal=True, segment_ids=seg),
      rtol=1e-5, atol=1e-5)
  starts = list(_starts(jax.make_jaxpr(f)(q, k, v, seg).jaxpr))
  # (k, v) and q over "u" and the output back; 3 rotations of (k, v) over
  # the ring, each one kv head: (2 for k and v, batch, 8 positions, 1 head,
  # head_dim 8) as a matrix.
  assert sorted(name for name, _ in starts) == ["all_to_all"] * 3 + [
      "ppermute"] * 3, starts
  assert {shape for name, shape in starts if name == "ppermute"} == {
      (2 * 1 * 8 * 1, 8)}, starts
