"""What ring_attention, ulysses_attention and the layout helpers say when
they are misused."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.attention.layout import from_layout, to_layout
from jax_overlap._src.patterns.attention.ring import ring_attention
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention

from attention_reference import mesh


def _call(fn, q, k, v, p=2, **kw):
  f = jax.shard_map(lambda q, k, v: fn(q, k, v, axis="cp", **kw),
                    mesh=mesh(p), in_specs=P(None, "cp"),
                    out_specs=P(None, "cp"))
  return jax.eval_shape(f, q, k, v)


def _arrays(s_q=8, s_k=8, heads=8, kv_heads=2):
  q = jax.ShapeDtypeStruct((1, s_q, heads, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((1, s_k, kv_heads, 8), jnp.float32)
  return q, k, k


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention])
def test_sequence_lengths_that_differ(fn):
  with pytest.raises(ValueError, match="sequence length .* differs"):
    _call(fn, *_arrays(s_q=8, s_k=4))


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention])
def test_kv_heads_not_dividing_heads(fn):
  with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide heads"):
    _call(fn, *_arrays(heads=8, kv_heads=3))


def test_ulysses_heads_not_divisible():
  with pytest.raises(ValueError, match=r"heads \(6.*multiple of the 4 devices"):
    _call(ulysses_attention, *_arrays(heads=6, kv_heads=2), p=4)


def test_ulysses_causal_with_an_attention_fn():
  with pytest.raises(ValueError, match="masks itself"):
    _call(ulysses_attention, *_arrays(), attention_fn=lambda q, k, v: q,
          causal=True)


def test_unknown_layout():
  with pytest.raises(ValueError, match="unknown layout; give one of 'contiguous', 'zigzag'"):
    _call(ring_attention, *_arrays(), layout="striped")
  with pytest.raises(ValueError, match="unknown layout"):
    to_layout(jnp.zeros((1, 8)), "Zigzag", 2)


def test_layout_mismatch():
  # What of a mismatch can be seen from shapes (which chunks a device holds
  # cannot): zigzag needs two chunks a device, an odd local sequence is not
  # two; a global sequence that 2p chunks cannot split, both ways.
  with pytest.raises(ValueError, match="each device holds 2 chunks"):
    _call(ring_attention, *_arrays(s_q=6, s_k=6), layout="zigzag")
  with pytest.raises(ValueError, match="to_layout: .* cannot split into 8 equal chunks"):
    to_layout(jnp.zeros((1, 12)), "zigzag", 4)
  with pytest.raises(ValueError, match="from_layout: .* cannot split into 8 equal chunks"):
    from_layout(jnp.zeros((1, 12)), "zigzag", 4)
  with pytest.raises(ValueError, match=r"axis_size=0\) must be a positive int"):
    to_layout(jnp.zeros((1, 12)), "zigzag", 0)


def test_segment_ids_of_another_shape():
  q, k, v = _arrays()
  seg = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match=r"segment_ids must be \(batch, seq_local\)"):
    _call(lambda q, k, v, axis: ring_attention(q, k, v, axis=axis,
                                               segment_ids=seg), q, k, v)


def test_axis_not_bound():
  q, k, v = _arrays()
  with pytest.raises(NameError, match="no mesh axis named 'sp'"):
    _call(lambda q, k, v, axis: ring_attention(q, k, v, axis="sp"), q, k, v)


@pytest.mark.parametrize("scale", ["auto", [0.5]])
def test_scale_not_a_number(scale):
  # A string that float() refuses raised float()'s own ValueError before.
  with pytest.raises(TypeError, match=r"ring_attention\(scale=.*must be a Python number"):
    _call(ring_attention, *_arrays(), scale=scale)
