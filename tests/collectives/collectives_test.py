"""Async collectives: values, lowering, program_order, autodiff, vmap, misuse."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap._src.collectives.misuse import FutureNotFinishedError

from lowered import stablehlo

PERM = [(0, 1), (1, 0)]

# name -> (start, sync, in_spec, out_spec, StableHLO async name)
CASES = {
    "all_gather": (lambda v: jo.all_gather_start(v, "i", tiled=True),
                   lambda v: jax.lax.all_gather(v, "i", tiled=True),
                   P("i"), P("i"), "all-gather"),
    "all_gather_untiled": (lambda v: jo.all_gather_start(v, "i", axis=1),
                           lambda v: jax.lax.all_gather(v, "i", axis=1),
                           P("i"), P("i"), "all-gather"),
    # gathered along a minor axis as moveaxis + a gather along axis 0
    # (collectives/major_dim.py): the real compilers refuse the plain one
    "all_gather_axis1": (lambda v: jo.all_gather_start(v, "i", axis=1, tiled=True),
                         lambda v: jax.lax.all_gather(v, "i", axis=1, tiled=True),
                         P("i"), P("i"), "all-gather"),
    "psum_scatter_dim1": (
        lambda v: jo.psum_scatter_start(v, "i", scatter_dimension=1, tiled=True),
        lambda v: jax.lax.psum_scatter(v, "i", scatter_dimension=1, tiled=True),
        P("i"), P("i"), "reduce-scatter"),
    "all_to_all_split1": (
        lambda v: jo.all_to_all_start(v, "i", 1, 0, tiled=True),
        lambda v: jax.lax.all_to_all(v, "i", 1, 0, tiled=True),
        P("i"), P("i"), "all-to-all"),
    "all_to_all_split1_concat1": (
        lambda v: jo.all_to_all_start(v, "i", 1, 1, tiled=True),
        lambda v: jax.lax.all_to_all(v, "i", 1, 1, tiled=True),
        P("i"), P("i"), "all-to-all"),
    "psum": (lambda v: jo.psum_start(v, "i"),
             lambda v: jax.lax.psum(v, "i"), P("i"), P(), "all-reduce"),
    "psum_scatter": (lambda v: jo.psum_scatter_start(v, "i", tiled=True),
                     lambda v: jax.lax.psum_scatter(v, "i", tiled=True),
                     P("i"), P("i"), "reduce-scatter"),
    "all_to_all": (lambda v: jo.all_to_all_start(v, "i", 0, 1, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "i", 0, 1, tiled=True),
                   P("i"), P("i"), "all-to-all"),
    "ppermute": (lambda v: jo.ppermute_start(v, "i", PERM),
                 lambda v: jax.lax.ppermute(v, "i", PERM),
                 P("i"), P("i"), "collective-permute"),
}
NAMES = list(CASES)


def _smap(mesh, f, in_spec, out_spec):
  return jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec)


def _x(shape=(8, 4)):
  return jnp.arange(float(np.prod(shape))).reshape(shape) / 7


def _with_compute(start, enforce):
  """start; some unrelated compute; done - optionally in an ordered block."""
  def f(x):
    def body(x):
      fut = start(x)
      y = jnp.sin(x)
      return fut.done(), y
    if enforce:
      body = jo.program_order(enforce=True)(body)
    return body(x)[0]
  return f


# --- values --------------------------------------------------------------------

@pytest.mark.parametrize("enforce", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_done_equals_sync_bit_for_bit(mesh2, name, enforce):
  start, sync, si, so, _ = CASES[name]
  x = _x()
  got = jax.jit(_smap(mesh2, _with_compute(start, enforce), si, so))(x)
  want = jax.jit(_smap(mesh2, sync, si, so))(x)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("case", [
    ("all_gather", dict(axis=2, tiled=True)), ("all_gather", dict(axis=1)),
    ("all_gather", dict(axis=-1)),
    ("psum_scatter", dict(scatter_dimension=2, tiled=True)),
    ("psum_scatter", dict(scatter_dimension=1)),
    ("all_to_all", dict(split_axis=2, concat_axis=1, tiled=True)),
    ("all_to_all", dict(split_axis=1, concat_axis=2, tiled=True)),
    ("all_to_all", dict(split_axis=2, concat_axis=0, tiled=True))],
    ids=lambda c: f"{c[0]}-" + "-".join(f"{k}{v}" for k, v in c[1].items()))
def test_minor_axis_futures_values_and_gradients(mesh2, case):
  # Moved along axis 0 and put back at done() (collectives/major_dim.py):
  # exactly jax.lax's values and gradients, rank 3.
  name, kw = case
  ours = getattr(jo, f"{name}_start")
  ref = getattr(jax.lax, name)
  x = _x((4, 2, 4))
  f = lambda start: jax.jit(_smap(mesh2, start, P("i"), P("i")))
  got = f(lambda v: ours(v, "i", **kw).done())(x)
  want = f(lambda v: ref(v, "i", **kw))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  loss = lambda fn: jax.grad(lambda v: jnp.sum(jnp.sin(f(fn)(v))))
  np.testing.assert_allclose(
      np.asarray(loss(lambda v: ours(v, "i", **kw).done())(x)),
      np.asarray(loss(lambda v: ref(v, "i", **kw))(x)), rtol=1e-6)


def test_untiled_psum_scatter_and_all_to_all(mesh2):
  x = _x((2, 2, 4))
  for start, sync in [
      (lambda v: jo.psum_scatter_start(v, "i", scatter_dimension=1),
       lambda v: jax.lax.psum_scatter(v, "i", scatter_dimension=1)),
      (lambda v: jo.all_to_all_start(v, "i", 1, 2),
       lambda v: jax.lax.all_to_all(v, "i", 1, 2)),
  ]:
    got = jax.jit(_smap(mesh2, lambda v: start(v).done(), P("i"), P("i")))(x)
    want = jax.jit(_smap(mesh2, sync, P("i"), P("i")))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_two_futures_in_flight_stay_separate(mesh2):
  def f(x):
    a = jo.all_gather_start(x, "i", tiled=True)
    b = jo.all_gather_start(2 * x, "i", tiled=True)
    return a.done() + 10 * b.done()
  g = _smap(mesh2, f, P("i"), P("i"))
  x = jnp.arange(32.0).reshape(8, 4)  # whole numbers: a + 10 * 2a is 21a exactly
  want = jax.jit(_smap(mesh2, lambda v: 21 * jax.lax.all_gather(v, "i", tiled=True),
                       P("i"), P("i")))(x)
  np.testing.assert_array_equal(np.asarray(jax.jit(g)(x)), np.asarray(want))
  text = stablehlo(g, x)
  if _compat.ASYNC_CUSTOM_CALLS:
    assert text.count('"all-gather-start"') == 2
  else:
    assert text.count("stablehlo.async_start") == 2


def test_future_crosses_shard_maps(mesh2):
  start = _smap(mesh2, lambda v: jo.all_gather_start(v, "i", tiled=True),
                P("i"), P("i"))
  finish = _smap(mesh2, lambda fut: fut.done(), P("i"), P("i"))
  sync = _smap(mesh2, lambda v: jax.lax.all_gather(v, "i", tiled=True),
               P("i"), P("i"))
  x = _x()
  f = lambda v: finish(start(v))
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)),
                                np.asarray(jax.jit(sync)(x)))
  loss = lambda g: lambda v: jnp.sum(jnp.sin(g(v)))
  np.testing.assert_allclose(jax.jit(jax.grad(loss(f)))(x),
                             jax.jit(jax.grad(loss(sync)))(x), rtol=1e-6)


def test_future_is_a_pytree_with_one_leaf(mesh2):
  seen = []

  def f(x):
    fut = jo.psum_start(x, "i")
    seen.append(len(jax.tree_util.tree_leaves(fut)))
    assert isinstance(fut, jo.Future) and fut.collective == "psum"
    return fut.done()
  jax.jit(_smap(mesh2, f, P("i"), P()))(_x())
  assert seen == [1]


# --- lowering ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_lowers_to_an_async_pair(mesh2, name):
  start, _, si, so, hlo_name = CASES[name]
  text = stablehlo(_smap(mesh2, lambda v: start(v).done(), si, so), _x())
  if _compat.ASYNC_CUSTOM_CALLS:
    assert "stablehlo.custom_call" in text
    assert f'"{hlo_name}-start"' in text and f'"{hlo_name}-done"' in text
  elif name == "all_to_all":
    # Old XLA cannot hold this all_to_all (split 0, concat 1) in an async
    # region; it stays synchronous there. split == concat is async.
    assert "stablehlo.async_start" not in text
    same = stablehlo(_smap(mesh2, lambda v: jo.all_to_all_start(
        v, "i", 0, 0, tiled=True).done(), si, so), _x())
    assert "stablehlo.async_start" in same and "stablehlo.async_done" in same
  else:
    assert "stablehlo.async_start" in text and "stablehlo.async_done" in text


def _order(text, hlo_name):
  pattern = (rf'"({hlo_name}-start|{hlo_name}-done)"|'
             r"stablehlo\.(dot_general|async_start|async_done)")
  return [a or b for a, b in re.findall(pattern, text)]


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax has no custom-call async form to split")
@pytest.mark.parametrize("name", ["all_gather", "psum", "psum_scatter",
                                  "all_to_all", "ppermute"])
def test_gpu_lowering_keeps_written_order(mesh2, name):
  start, _, si, so, hlo_name = CASES[name]

  def f(x, a):
    @jo.program_order(enforce=True)
    def body():
      fut = start(x)
      b = a @ a
      return fut.done(), b
    return body()
  g = jax.jit(_smap(mesh2, f, (si, P("i")), (so, P("i"))))
  x, a = _x(), jnp.ones((8, 4))
  # Lowered for GPU: the two halves, with the compute between them.
  text = g.trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
  assert _order(text, hlo_name) == [f"{hlo_name}-start", "dot_general",
                                    f"{hlo_name}-done"]
  # On CPU the pair stays whole, ahead of the compute.
  cpu = g.trace(x, a).lower(lowering_platforms=("cpu",)).as_text()
  assert _order(cpu, hlo_name) == [f"{hlo_name}-start", f"{hlo_name}-done",
                                   "dot_general"]


# --- autodiff ---------------------------------------------------------------------

@pytest.mark.parametrize("enforce", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_grad_equals_sync_grad(mesh2, name, enforce):
  start, sync, si, so, _ = CASES[name]

  def loss(f):
    return lambda x: jnp.sum(_smap(mesh2, f, si, so)(x) ** 2)
  # A polynomial, not a transcendental: XLA:CPU evaluates cos/sin with other
  # approximations inside and outside a fusion, and the fences move fusion
  # boundaries (3e-7 apart on this machine's CPU), which is no gradient error.
  post = lambda r: r * (1.0 + 0.5 * r)
  fa = lambda x: post(_with_compute(start, enforce)(x))
  fs = lambda x: post(_with_compute(lambda v: _Done(sync(v)), enforce)(x))
  x = _x()
  np.testing.assert_allclose(jax.jit(jax.grad(loss(fa)))(x),
                             jax.jit(jax.grad(loss(fs)))(x), rtol=1e-6)


class _Done:
  """A finished value that looks like a future, to share `_with_compute`."""

  def __init__(self, value):
    self.value = value

  def done(self):
    return self.value


def test_jvp_equals_sync_jvp(mesh2):
  start, sync, si, so, _ = CASES["all_gather"]
  x, t = _x(), jnp.ones((8, 4))
  fa = _smap(mesh2, lambda v: start(v).done(), si, so)
  fs = _smap(mesh2, sync, si, so)
  pa, ta = jax.jit(lambda x, t: jax.jvp(fa, (x,), (t,)))(x, t)
  ps, ts = jax.jit(lambda x, t: jax.jvp(fs, (x,), (t,)))(x, t)
  np.testing.assert_array_equal(np.asarray(pa), np.asarray(ps))
  np.testing.assert_array_equal(np.asarray(ta), np.asarray(ts))


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax has no custom-call async form to split")
def test_backward_starts_the_transposed_collective_where_forward_finished(mesh2):
  def f(x, a):
    @jo.program_order(enforce=True)
    def body():
      fut = jo.all_gather_start(x, "i", tiled=True)
      b = a @ a
      return fut.done(), b
    return body()

  def loss(x, a):
    y, b = _smap(mesh2, f, (P("i"), P()), (P("i"), P()))(x, a)
    return jnp.sum(y * y) + jnp.sum(b)
  g = jax.jit(jax.grad(loss, argnums=(0, 1)))
  x, a = jnp.arange(8.0), jnp.ones((4, 4))
  text = g.trace(x, a).lower(lowering_platforms=("cuda",)).as_text()
  order = [m for m in re.findall(
      r'"((?:all-gather|reduce-scatter)-(?:start|done))"|stablehlo\.dot_general',
      text)]
  order = [m or "dot" for m in order]
  # (The forward a @ a is dead under grad and removed.) Backward: the
  # gather's transpose, a reduce-scatter, starts where the gather finished
  # and is in flight across the two transposed matmuls.
  assert order == ["all-gather-start", "all-gather-done",
                   "reduce-scatter-start", "dot", "dot",
                   "reduce-scatter-done"], order
  grads = g(x, a)
  sync = lambda x, a: (jax.lax.all_gather(x, "i", tiled=True), a @ a)

  def sync_loss(x, a):
    y, b = _smap(mesh2, sync, (P("i"), P()), (P("i"), P()))(x, a)
    return jnp.sum(y * y) + jnp.sum(b)
  want = jax.jit(jax.grad(sync_loss, argnums=(0, 1)))(x, a)
  for got, exp in zip(grads, want):
    np.testing.assert_allclose(got, exp, rtol=1e-6)


# --- vmap -------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_vmap_inside_shard_map(mesh2, name):
  start, sync, si, so, _ = CASES[name]
  vm = lambda f: lambda x: jax.vmap(f, in_axes=1, out_axes=1)(x)
  x = _x((8, 3, 4))
  got = jax.jit(_smap(mesh2, vm(lambda v: start(v).done()), si, so))(x)
  want = jax.jit(_smap(mesh2, vm(sync), si, so))(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vmap_over_the_collective_axis():
  x = jnp.arange(6.0).reshape(3, 2)
  for start, sync in [
      (lambda v: jo.psum_start(v, "b"), lambda v: jax.lax.psum(v, "b")),
      (lambda v: jo.all_gather_start(v, "b"), lambda v: jax.lax.all_gather(v, "b")),
  ]:
    got = jax.vmap(lambda v: start(v).done(), axis_name="b")(x)
    want = jax.vmap(sync, axis_name="b")(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    got = jax.jit(jax.vmap(lambda v: start(v).done(), axis_name="b"))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- misuse -----------------------------------------------------------------------

def test_done_twice(mesh2):
  def f(x):
    fut = jo.psum_start(x, "i")
    fut.done()
    return fut.done()
  with pytest.raises(RuntimeError, match=r"done\(\) was called twice on the "
                     r"future from psum_start started at .*collectives_test"):
    jax.jit(_smap(mesh2, f, P("i"), P()))(_x())


def test_never_finished(mesh2):
  def f(x):
    jo.all_gather_start(x, "i", tiled=True)
    return x
  with pytest.raises(FutureNotFinishedError,
                     match=r"all_gather_start started at .*collectives_test"
                     r".*never finished"):
    jax.jit(_smap(mesh2, f, P("i"), P("i")))(_x())


def test_returned_from_jit(mesh2):
  f = _smap(mesh2, lambda v: jo.ppermute_start(v, "i", PERM), P("i"), P("i"))
  with pytest.raises(FutureNotFinishedError, match=r"ppermute_start started "
                     r"at .*never finished.*returned from the jit"):
    jax.jit(f)(_x())


@pytest.mark.parametrize("use", [jnp.sin, lambda f: f + 1, jnp.asarray])
def test_future_is_not_an_array(mesh2, use):
  f = _smap(mesh2, lambda v: use(jo.psum_start(v, "i")), P("i"), P())
  with pytest.raises(TypeError, match=r"future from psum_start .* is not an "
                     r"array. Call .done\(\)"):
    jax.jit(f)(_x())


def test_unknown_axis_name(mesh2):
  f = _smap(mesh2, lambda v: jo.psum_start(v, "j").done(), P("i"), P())
  with pytest.raises(NameError, match=r"psum_start\(axis_name='j'\): unknown "
                     r"axis name 'j'; the axis names in scope here are \['i'\]"):
    jax.jit(f)(_x())


@pytest.mark.parametrize("perm, problem", [
    ([(0, 1), (1, 1)], "a destination appears twice"),
    ([(0, 1), (0, 0)], "a source appears twice"),
    ([(0, 2)], "an index is outside 0..1"),
])
def test_perm_not_a_permutation(mesh2, perm, problem):
  f = _smap(mesh2, lambda v: jo.ppermute_start(v, "i", perm).done(),
            P("i"), P("i"))
  with pytest.raises(ValueError, match=r"ppermute_start\(perm=.*\) is not a "
                     rf"permutation: {re.escape(problem)}"):
    jax.jit(f)(_x())
