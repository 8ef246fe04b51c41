"""matmul_psum: values, gradients, the overlap in the program, errors."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat

import lowered


def _mesh(n):
  return jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def case(n, chunks=2, dim=0, to="invarying", check_vma=True, dtype=jnp.float32,
         rows=(6, 5)):
  """x: (6, 5, 8n) with the contracted dimension over 'i', w: (8n, 3) by
  rows. Each side is a loss inside the shard_map, so that `to="varying"`
  is checked where it belongs: the sum added to a residual that varies over
  'i' (a pipeline stage's activation), the loss pmean'ed over 'i'."""
  def body(sum_of):
    def f(x, w, r):
      y = sum_of(x, w)
      if to == "varying":
        y = r + y
      loss = jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(3.0))
      return jax.lax.pmean(loss, "i") if to == "varying" else loss
    return jax.shard_map(f, mesh=_mesh(n),
                         in_specs=(P(None, None, "i"), P("i"), P("i")),
                         out_specs=P(), check_vma=check_vma)

  def ref(x, w):
    y = jax.lax.psum(x @ w, "i")
    # the cast jax makes where a psum meets a varying value
    return jax.lax.pcast(y, "i", to="varying") if to == "varying" and check_vma \
        else y
  ours = body(lambda x, w: jo.matmul_psum(x, w, "i", chunks=chunks,
                                          dimension=dim, to=to))
  # the residual: varying over 'i' (each device its own)
  args = (_normal(0, (*rows, 8 * n), dtype), _normal(1, (8 * n, 3), dtype),
          _normal(2, (n * rows[0], rows[1], 3), dtype))
  return ours, body(ref), args


def _assert_close(got, want, rtol=1e-5, atol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape,
                                                       a.dtype, b.dtype)
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=rtol, atol=atol)


def _value_and_grad(f):
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


# --- values and gradients ---------------------------------------------------------

@pytest.mark.parametrize("to", ["invarying", "varying"])
@pytest.mark.parametrize("n, chunks, dim", [
    (1, 2, 0), (2, 1, 0), (2, 2, 0), (4, 2, 1), (4, 3, -2), (2, 5, 1),
    (8, 6, 0)])
def test_values_and_grads_equal_psum_of_the_matmul(n, chunks, dim, to):
  ours, ref, args = case(n, chunks, dim, to)
  with jax.default_matmul_precision("highest"):
    _assert_close(_value_and_grad(ours)(*args), _value_and_grad(ref)(*args))


@pytest.mark.parametrize("to", ["invarying", "varying"])
def test_without_vma_checks(to):
  # jax then transposes a psum to a psum: the cotangent is summed whatever
  # `to` says, as the plain psum's is.
  ours, ref, args = case(4, 2, 0, to, check_vma=False)
  with jax.default_matmul_precision("highest"):
    _assert_close(_value_and_grad(ours)(*args), _value_and_grad(ref)(*args))


def test_eager_shard_map():
  ours, ref, args = case(2, 2, 1, "varying")
  with jax.default_matmul_precision("highest"):
    _assert_close(jax.value_and_grad(ours, (0, 1, 2))(*args),
                  _value_and_grad(ref)(*args))


def test_bfloat16():
  # Sums in bfloat16 keep their dtype; the products are the plain ones, so
  # the tolerance is a few bfloat16 ulps of each result.
  ours, ref, args = case(4, 2, 0, "varying", dtype=jnp.bfloat16)
  for got, want in zip(jax.tree.leaves(_value_and_grad(ours)(*args)),
                       jax.tree.leaves(_value_and_grad(ref)(*args))):
    assert got.dtype == want.dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    _assert_close(got, want, rtol=0, atol=3e-2 * scale)


def test_result_types():
  # "invarying" is typed as psum's result, "varying" varies over the axis.
  seen = {}

  def f(x, w):
    for to in ("invarying", "varying"):
      seen[to] = _compat.varying_axes(jo.matmul_psum(x, w, "i", to=to))
    return x
  jax.jit(jax.shard_map(f, mesh=_mesh(2), in_specs=(P(None, "i"), P("i")),
                        out_specs=P(None, "i")))(jnp.ones((4, 4)), jnp.ones((4, 2)))
  if seen["invarying"] is None:
    pytest.skip(f"jax {jax.__version__} does not track varying axes here")
  assert seen == {"invarying": frozenset(), "varying": frozenset({"i"})}, seen


# --- the overlap, in the traced program -------------------------------------------

def _sum_windows(fn, *args):
  """The windows of the psum futures (the primitive names in each)."""
  return lowered.future_windows(fn, *args)


@pytest.mark.parametrize("chunks", [2, 3])
def test_each_sum_but_the_last_is_in_flight_over_the_next_matmul(chunks):
  ours, _, args = case(4, chunks, 0)
  windows = _sum_windows(ours, *args)
  assert len(windows) == chunks, windows
  assert all("dot_general" in w for w in windows[:-1]), windows
  assert "dot_general" not in windows[-1], windows
  # one sum in flight at a time (TPU's forms allow one)
  assert not any("collective_start" in w for w in windows), windows


def test_backward_sums_in_flight_over_the_previous_chunks_matmuls():
  chunks = 3
  ours, _, args = case(4, chunks, 0, "varying")
  windows = _sum_windows(jax.grad(ours, argnums=(0, 1)), *args)
  backward = windows[chunks:]
  assert len(backward) == chunks, windows
  # the first cotangent chunk's sum has none of this call's matmuls beside
  # it; each later one has the previous chunk's dx and dw
  assert "dot_general" not in backward[0], backward
  assert all(w.count("dot_general") >= 2 for w in backward[1:]), backward


def test_invarying_backward_has_no_collective():
  ours, _, args = case(4, 2, 0, "invarying")
  assert len(_sum_windows(jax.grad(ours, argnums=(0, 1)), *args)) == 2


# --- the overlap, in the program lowered for GPU -----------------------------------

_GPU_OPS = r'"all-reduce-(start|done)"|stablehlo\.(dot_general)'


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax lowers async collectives as "
                    "stablehlo.async_start/async_done, not the GPU custom-call "
                    "pair that keeps start and done apart (jax >= 0.12)")
def test_gpu_lowering_keeps_the_next_matmul_between_start_and_done():
  ours, _, args = case(4, 2, 0, "varying")
  text = jax.jit(jax.grad(ours, argnums=(0, 1))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  order = [a or b for a, b in re.findall(_GPU_OPS, text)]
  starts = [i for i, op in enumerate(order) if op == "start"]
  dones = [i for i, op in enumerate(order) if op == "done"]
  assert len(starts) == len(dones) == 4, order
  # forward: the first sum over the second chunk's matmul; backward: the
  # second sum over the first chunk's dx and dw
  assert [order[s:d].count("dot_general") for s, d in zip(starts, dones)] \
      == [1, 0, 0, 2], order


# --- errors at the call site --------------------------------------------------------

def _call(fn, x_shape=(4, 6), w_shape=(6, 3), n=2):
  f = jax.shard_map(lambda x, w: fn(x, w)[None], mesh=_mesh(n),
                    in_specs=(P(), P()), out_specs=P("i"))
  return jax.jit(f)(jnp.ones(x_shape), jnp.ones(w_shape))


MP = jo.matmul_psum

BAD = {
    "x_is_a_vector": (lambda x, w: MP(x[0], w, "i"), ValueError,
                      r"matmul_psum: x must have at least two dimensions"),
    "k_mismatch": (lambda x, w: MP(x, w[:5], "i"), ValueError,
                   r"matmul_psum: the last dimension of x \(shape \(4, 6\)\) "
                   r"must equal the first of w \(shape \(5, 3\)\)"),
    "last_dimension": (
        lambda x, w: MP(x, w, "i", dimension=-1), ValueError,
        r"matmul_psum\(dimension=-1\) names the last dimension of x \(shape "
        r"\(4, 6\)\), the one contracted with w"),
    "dimension_not_an_int": (lambda x, w: MP(x, w, "i", dimension=0.0),
                             TypeError, r"matmul_psum\(dimension=0\.0\) must be an int"),
    "no_chunks": (lambda x, w: MP(x, w, "i", chunks=0), ValueError,
                  r"matmul_psum\(chunks=0\): dimension 0 of x \(shape \(4, 6\)\) "
                  r"has 4 rows to cut, so chunks must be in 1 \.\. 4"),
    "more_chunks_than_rows": (lambda x, w: MP(x, w, "i", chunks=5), ValueError,
                              r"matmul_psum\(chunks=5\).*chunks must be in 1 \.\. 4"),
    "chunks_not_an_int": (lambda x, w: MP(x, w, "i", chunks=2.0), TypeError,
                          r"matmul_psum\(chunks=2\.0\) must be an int"),
    "to": (lambda x, w: MP(x, w, "i", to="invariant"), ValueError,
           r"matmul_psum\(to='invariant'\): 'invarying' \(typed as psum's "
           r"result\) or 'varying'"),
    "unknown_axis": (lambda x, w: MP(x, w, "j"), NameError,
                     r"matmul_psum\(axis='j'\): no mesh axis named 'j' is bound "
                     r"here. Call it inside jax.shard_map"),
    "several_axes": (lambda x, w: MP(x, w, ("i",)), TypeError,
                     r"matmul_psum\(axis=\('i',\)\): give one mesh axis name"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input_is_reported_at_the_call(bad):
  fn, error, message = BAD[bad]
  with pytest.raises(error, match=message) as info:
    _call(fn)
  # jax's filtered traceback ends at the user's call (our frames are hidden).
  assert info.traceback[-1].path == pathlib.Path(__file__), info.traceback


def test_outside_shard_map():
  with pytest.raises(NameError, match=r"matmul_psum\(axis='i'\): no mesh axis "
                     r"named 'i' is bound here"):
    jo.matmul_psum(jnp.ones((2, 2)), jnp.ones((2, 2)), "i")
