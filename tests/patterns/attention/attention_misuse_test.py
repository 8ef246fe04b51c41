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


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention])
@pytest.mark.parametrize("window, error, match", [
    ("4", TypeError, r"window='4'\) must be an int or a \(left, right\) pair"),
    ((1, 2, 3), TypeError, r"must be an int or a \(left, right\) pair"),
    (2.0, TypeError, r"must be an int or a \(left, right\) pair"),
    (True, TypeError, r"must be an int or a \(left, right\) pair"),
    (-1, ValueError, r"window=-1\): left and right must be >= 0"),
    ((3, -1), ValueError, r"left and right must be >= 0.*window=\(W - 1, 0\)")])
def test_window_not_a_window(fn, window, error, match):
  if match.startswith("window"):   # the message starts with the call
    match = fn.__name__ + r"\(" + match
  with pytest.raises(error, match=match):
    _call(fn, *_arrays(), window=window)


@pytest.mark.parametrize("kw", [dict(segment_ids=jnp.zeros((1, 4), jnp.int32)),
                                dict(window=3)])
def test_ulysses_mask_with_an_attention_fn(kw):
  name = next(iter(kw))
  with pytest.raises(ValueError, match=f"{name}= applies to the default kernel only"):
    _call(ulysses_attention, *_arrays(), attention_fn=lambda q, k, v: q, **kw)


def _call2(q, k, v, **kw):
  mesh2 = jax.make_mesh((2, 2), ("ring", "cp"), devices=jax.devices()[:4],
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  f = jax.shard_map(
      lambda q, k, v: ulysses_attention(q, k, v, axis="cp", **kw),
      mesh=mesh2, in_specs=P(None, ("ring", "cp")),
      out_specs=P(None, ("ring", "cp")))
  return jax.eval_shape(f, q, k, v)


def test_ulysses_ring_axis_misuse():
  q, k, v = _arrays()
  with pytest.raises(ValueError, match=r"ring_axis='cp'\) must be another mesh axis"):
    _call2(q, k, v, ring_axis="cp")
  with pytest.raises(NameError, match=r"ulysses_attention\(ring_axis='sp'\): no mesh axis"):
    _call2(q, k, v, ring_axis="sp")
  with pytest.raises(TypeError, match=r"ulysses_attention\(ring_axis=\('ring', 'x'\)\): give one"):
    _call2(q, k, v, ring_axis=("ring", "x"))
  with pytest.raises(ValueError, match="ring_axis= runs ring_attention"):
    _call2(q, k, v, ring_axis="ring", attention_fn=lambda q, k, v: q)
  with pytest.raises(ValueError, match=r"layout='zigzag'\): the layout is the ring's; give ring_axis"):
    _call2(q, k, v, layout="zigzag")
  with pytest.raises(ValueError, match="unknown layout"):
    _call2(q, k, v, ring_axis="ring", layout="striped")
  # heads not a multiple of the Ulysses axis: the message names ring_axis.
  with pytest.raises(ValueError, match=r"heads \(6.*\(ring_axis=\)"):
    _call(ulysses_attention, *_arrays(heads=6, kv_heads=2), p=4)
