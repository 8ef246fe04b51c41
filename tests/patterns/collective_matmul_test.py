"""Collective matmul: values, gradients, the overlap in the program, errors."""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat

import lowered

SIZES = [1, 2, 4, 8]
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "collective_matmul.py"
README = ROOT / "README.md"


def _mesh(n):
  return jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _spec(dim):
  return P(*([None] * dim), "i")


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


# The two functions and their unfused references, as shard_maps. Each
# returns (ours, reference, args); `dim` may be negative, x is 3-D.

def all_gather_matmul_case(n, dim, bidirectional, dtype=jnp.float32, k=8,
                           check_vma=True):
  """x: (2, 3, k) blocks gathered along `dim`; w (k, 5) replicated. Every
  device's full result is returned, stacked."""
  d = dim % 3
  shape = [2, 3, k]
  shape[d] *= n
  spec = _spec(d)
  ours = lambda x, w: jo.all_gather_matmul(
      x, w, "i", gather_dimension=dim, bidirectional=bidirectional)[None]
  ref = lambda x, w: (jax.lax.all_gather(x, "i", axis=d, tiled=True) @ w)[None]
  smap = lambda f: jax.shard_map(f, mesh=_mesh(n), in_specs=(spec, P()),
                                 out_specs=P("i"), check_vma=check_vma)
  return smap(ours), smap(ref), (_normal(0, shape, dtype),
                                 _normal(1, (k, 5), dtype))


def matmul_reduce_scatter_case(n, dim, bidirectional, dtype=jnp.float32, k=8,
                               check_vma=True):
  """x: (2n, 3, k) on each device with the contracted dimension sharded,
  w (k, 5) sharded by rows; the sum is scattered along `dim`."""
  d = dim % 3
  shape = [3, 3, k * n]
  shape[d] = 2 * n
  ours = lambda x, w: jo.matmul_reduce_scatter(
      x, w, "i", scatter_dimension=dim, bidirectional=bidirectional)
  ref = lambda x, w: jax.lax.psum_scatter(x @ w, "i", scatter_dimension=d,
                                          tiled=True)
  smap = lambda f: jax.shard_map(f, mesh=_mesh(n),
                                 in_specs=(P(None, None, "i"), P("i")),
                                 out_specs=_spec(d), check_vma=check_vma)
  return smap(ours), smap(ref), (_normal(2, shape, dtype),
                                 _normal(3, (k * n, 5), dtype))


CASES = {"all_gather_matmul": all_gather_matmul_case,
         "matmul_reduce_scatter": matmul_reduce_scatter_case}


def _loss(f):
  return lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))


def _grad(f):
  return jax.grad(_loss(f), argnums=(0, 1))


def _assert_close(got, want, rtol=1e-5, atol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape,
                                                       a.dtype, b.dtype)
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=rtol, atol=atol)


# --- values and gradients ---------------------------------------------------------

#: The grid's older-jax subset (CI's budget): each size once per function,
#: with both directions and both dims among them.
GRID_ON_OLDER_JAX = [f"test_jit_values_and_grads_equal_unfused[{name}-{cell}]"
                     for name in sorted(CASES)
                     for cell in ("1-False-0", "2-True--2", "4-False--2", "8-True-0")]


@pytest.mark.newest_jax(older_jax=GRID_ON_OLDER_JAX)
@pytest.mark.parametrize("dim", [0, -2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_values_and_grads_equal_unfused(name, n, bidirectional, dim):
  ours, ref, args = CASES[name](n, dim, bidirectional)
  _assert_close(jax.jit(ours)(*args), jax.jit(ref)(*args))
  _assert_close(jax.jit(_grad(ours))(*args), jax.jit(_grad(ref))(*args),
                rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n, bidirectional", [(2, False), (4, True)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_values_and_grads_equal_unfused(name, n, bidirectional):
  # A shard_map not under jit runs its body one primitive at a time.
  ours, ref, args = CASES[name](n, 0, bidirectional)
  _assert_close(ours(*args), jax.jit(ref)(*args))
  _assert_close(_grad(ours)(*args), jax.jit(_grad(ref))(*args), rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16(name):
  # bfloat16 sums in another order differ by a few ulps of the largest
  # term, so the tolerance is scaled to each result's magnitude. A fixed
  # cotangent keeps the forward rounding out of the gradients.
  ours, ref, args = CASES[name](4, 0, True, dtype=jnp.bfloat16)
  got, pull_got = jax.vjp(jax.jit(ours), *args)
  want, pull_want = jax.vjp(jax.jit(ref), *args)
  dy = _normal(7, want.shape, jnp.bfloat16)
  for got, want in [(got, want), *zip(pull_got(dy), pull_want(dy))]:
    assert got.dtype == want.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    _assert_close(got, want, rtol=0, atol=2e-2 * scale)


def test_matrices_and_a_sharded_weight():
  # The everyday shapes: x (rows, k) gathered by rows, then the product
  # with a column block of w, scattered back by rows after a second matmul
  # over the sharded k. Both differentiate through each other.
  n = 8
  mesh = _mesh(n)

  def mlp(fused):
    def f(x, w1, w2):
      if fused:
        h = jo.all_gather_matmul(x, w1, "i", bidirectional=True)
        return jo.matmul_reduce_scatter(jnp.tanh(h), w2, "i")
      h = jax.lax.all_gather(x, "i", tiled=True) @ w1
      return jax.lax.psum_scatter(jnp.tanh(h) @ w2, "i", tiled=True)
    return jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P(None, "i"),
                                                 P("i")), out_specs=P("i"))
  args = (_normal(4, (2 * n, 6)), _normal(5, (6, 4 * n)),
          _normal(6, (4 * n, 6)))
  _assert_close(jax.jit(mlp(True))(*args), jax.jit(mlp(False))(*args))
  grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))
  _assert_close(jax.jit(grad(mlp(True)))(*args),
                jax.jit(grad(mlp(False)))(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_without_vma_checks(name):
  ours, ref, args = CASES[name](4, 0, True, check_vma=False)
  _assert_close(jax.jit(ours)(*args), jax.jit(ref)(*args))
  _assert_close(jax.jit(_grad(ours))(*args), jax.jit(_grad(ref))(*args),
                rtol=1e-4, atol=1e-5)


def test_forward_saves_only_the_local_blocks():
  # all_gather_matmul's backward gathers x again in a ring instead of
  # keeping the gathered x (n times larger) alive between the passes, as
  # the unfused version does. (Shapes are global: n blocks side by side.)
  from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415
  n = 8
  ours, ref, args = all_gather_matmul_case(n, 0, False)
  shapes = lambda f: [tuple(r[0].shape) for r in saved_residuals(
      _loss(f), *args)]
  gathered_on_every_device = (n * 2 * n, 3, 8)
  assert gathered_on_every_device in shapes(ref), shapes(ref)
  assert gathered_on_every_device not in shapes(ours), shapes(ours)
  assert args[0].shape in shapes(ours), shapes(ours)


# --- the overlap, in the traced program -------------------------------------------

def _max_in_flight(window_names):
  return 1 + max((w.count("collective_start") for w in window_names),
                 default=0)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_send_overlaps_a_matmul_in_the_traced_program(name,
                                                           bidirectional):
  n = 8
  ours, _, args = CASES[name](n, 0, bidirectional)
  windows = lowered.future_windows(ours, *args)
  # n - 1 hops in all, whichever the direction.
  assert len(windows) == n - 1
  assert all("dot_general" in w for w in windows), windows
  # Bidirectional: two sends in flight at once, so 4 steps instead of 7.
  assert _max_in_flight(windows) == (2 if bidirectional else 1)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_overlaps_too(name, bidirectional):
  n = 4
  ours, _, args = CASES[name](n, 0, bidirectional)
  windows = lowered.future_windows(_grad(ours), *args)
  # Forward ring, then all_gather_matmul's backward: a reduce-scatter ring
  # (dx) and a gather ring (dw); matmul_reduce_scatter's: one gather ring
  # that feeds both.
  rings = 3 if name == "all_gather_matmul" else 2
  assert len(windows) == rings * (n - 1)
  assert all("dot_general" in w for w in windows), windows


def test_axis_size_one_sends_nothing():
  for name, case in CASES.items():
    ours, _, args = case(1, 0, True)
    assert (lowered.future_windows(ours, *args) == []
            == lowered.future_windows(_grad(ours), *args)), name


# --- the overlap, in the program lowered for GPU -----------------------------------

_GPU_OPS = r'"collective-permute-(start|done)"|stablehlo\.(dot_general)'


def _gpu_order(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return [a or b for a, b in re.findall(_GPU_OPS, text)]


def _assert_dot_in_each_window(order, sends):
  # The rings start and finish their sends in the same order, so the k-th
  # done finishes the k-th start.
  starts = [i for i, op in enumerate(order) if op == "start"]
  dones = [i for i, op in enumerate(order) if op == "done"]
  assert len(starts) == len(dones) == sends, order
  for s, d in zip(starts, dones):
    assert "dot_general" in order[s:d], order


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax lowers async collectives as "
                    "stablehlo.async_start/async_done, not the GPU custom-call "
                    "pair that keeps start and done apart (jax >= 0.12)")
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_lowering_keeps_the_matmul_between_start_and_done(name,
                                                              bidirectional):
  n = 4
  ours, _, args = CASES[name](n, 0, bidirectional)
  _assert_dot_in_each_window(_gpu_order(ours, *args), n - 1)
  rings = 3 if name == "all_gather_matmul" else 2
  _assert_dot_in_each_window(_gpu_order(_grad(ours), *args), rings * (n - 1))


# --- errors at the call site --------------------------------------------------------

def _call(fn, x_shape, w_shape, in_specs=(P(), P()), n=2):
  f = jax.shard_map(lambda x, w: fn(x, w)[None], mesh=_mesh(n),
                    in_specs=in_specs, out_specs=P("i"))
  return jax.jit(f)(jnp.ones(x_shape), jnp.ones(w_shape))


AGM, MRS = jo.all_gather_matmul, jo.matmul_reduce_scatter

BAD = {
    "x_is_a_vector": (lambda x, w: AGM(x[0], w, "i"), ValueError,
                      r"all_gather_matmul: x must have at least two dimensions "
                      r"\(\.\.\., k\), got shape \(6,\)"),
    "w_is_not_a_matrix": (lambda x, w: MRS(x, w[None], "i"), ValueError,
                          r"matmul_reduce_scatter: w must be a matrix \(k, n\), "
                          r"got shape \(1, 6, 3\)"),
    "k_mismatch": (lambda x, w: AGM(x, w[:5], "i"), ValueError,
                   r"the last dimension of x \(shape \(4, 6\)\) must equal the "
                   r"first of w \(shape \(5, 3\)\)"),
    "gather_last_dimension": (
        lambda x, w: AGM(x, w, "i", gather_dimension=-1), ValueError,
        r"all_gather_matmul\(gather_dimension=-1\) names the last dimension of "
        r"x \(shape \(4, 6\)\), the one contracted with w; this pattern "
        r"splits a row or batch dimension only: gather_dimension must be 0 or "
        r"-2"),
    "gather_out_of_range": (
        lambda x, w: AGM(x, w, "i", gather_dimension=2), ValueError,
        r"all_gather_matmul\(gather_dimension=2\): x has shape \(4, 6\), so "
        r"gather_dimension must be 0 or -2, any dimension but the last"),
    "gather_not_an_int": (
        lambda x, w: AGM(x, w, "i", gather_dimension=0.0), TypeError,
        r"all_gather_matmul\(gather_dimension=0\.0\) must be an int"),
    "gather_a_bool": (
        lambda x, w: AGM(x, w, "i", gather_dimension=True), TypeError,
        r"all_gather_matmul\(gather_dimension=True\) must be an int"),
    "scatter_last_dimension": (
        lambda x, w: MRS(x, w, "i", scatter_dimension=1), ValueError,
        r"matmul_reduce_scatter\(scatter_dimension=1\) names the last "
        r"dimension of x @ w \(shape \(4, 3\)\), the columns of w; this "
        r"pattern splits a row or batch dimension only"),
    "scatter_out_of_range": (
        lambda x, w: MRS(x, w, "i", scatter_dimension=-3), ValueError,
        r"matmul_reduce_scatter\(scatter_dimension=-3\): x @ w has shape "
        r"\(4, 3\), so scatter_dimension must be 0 or -2"),
    "scatter_not_divisible": (
        lambda x, w: MRS(x[:3], w, "i"), ValueError,
        r"matmul_reduce_scatter\(scatter_dimension=0\): dimension 0 of x @ w "
        r"has size 3, which the 2 devices of axis 'i' cannot split evenly. "
        r"Make it a multiple of 2"),
    "unknown_axis": (lambda x, w: AGM(x, w, "j"), NameError,
                     r"all_gather_matmul\(axis='j'\): no mesh axis named 'j' "
                     r"is bound here. Call it inside jax.shard_map"),
    "several_axes": (lambda x, w: MRS(x, w, ("i",)), TypeError,
                     r"matmul_reduce_scatter\(axis=\('i',\)\): give one mesh "
                     r"axis name"),
    "bidirectional_not_a_bool": (
        lambda x, w: AGM(x, w, "i", bidirectional="yes"), TypeError,
        r"all_gather_matmul\(bidirectional='yes'\) must be True or False"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input_is_reported_at_the_call(bad):
  fn, error, message = BAD[bad]
  with pytest.raises(error, match=message) as info:
    _call(fn, (4, 6), (6, 3))
  # jax's filtered traceback ends at the user's call (our frames are hidden).
  assert info.traceback[-1].path == pathlib.Path(__file__), info.traceback


def test_outside_shard_map():
  with pytest.raises(NameError, match=r"matmul_reduce_scatter\(axis='i'\): no "
                     r"mesh axis named 'i' is bound here"):
    jo.matmul_reduce_scatter(jnp.ones((2, 2)), jnp.ones((2, 2)), "i")


# --- docs ---------------------------------------------------------------------------

def _run(*args):
  out = subprocess.run([sys.executable, *args], capture_output=True,
                       text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(ROOT / "src")})
  assert out.returncode == 0, out.stderr[-3000:]
  return out


@pytest.mark.subprocess
def test_readme_section_runs():
  section = README.read_text().split("\n## Collective matmul\n", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  out = _run("-c", code)
  assert out.stdout.split() == ["(64,", "16)", "(16,", "128)"], out.stdout


@pytest.mark.subprocess
def test_example_runs():
  out = _run(str(EXAMPLE))
  lines = out.stdout.splitlines()
  assert sum("match the unfused" in line for line in lines) == 2, out.stdout
  step = next(line for line in lines if line.startswith("one ring step:"))
  assert re.search(r"collective_start .*dot_general.* collective_done", step), \
      step
