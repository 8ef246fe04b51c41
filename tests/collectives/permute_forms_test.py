"""`all_gather_start` / `psum_scatter_start` as collective-permutes
(collectives/permute_forms.py: their form on TPU v5p), checked on CPU.

The forms are forced on CPU (`permute_forms.forced()`) and compared with
`jax.lax` over `shard_map` on 8 devices: values (exact: small integers, so
every order of the sum gives the same value) and gradients, inside and
outside `program_order`, a future that crosses an ordered block's boundary,
under vmap, and the misuses a future reports (finished twice, never
finished). One compile each (tiny shapes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives import permute_forms
from jax_overlap._src.collectives.composed import ComposedFuture

N = 8
AXIS = "i"


@pytest.fixture
def forced():
  with permute_forms.forced():
    yield


# name -> (future, jax.lax reference, global shape of x)
CASES = {
    "all_gather_tiled_0": (
        lambda v: jo.all_gather_start(v, AXIS, tiled=True),
        lambda v: jax.lax.all_gather(v, AXIS, tiled=True), (N * 2, 3)),
    "all_gather_tiled_1": (
        lambda v: jo.all_gather_start(v, AXIS, axis=1, tiled=True),
        lambda v: jax.lax.all_gather(v, AXIS, axis=1, tiled=True), (N * 2, 3)),
    "all_gather_stacked": (
        lambda v: jo.all_gather_start(v, AXIS, axis=2),
        lambda v: jax.lax.all_gather(v, AXIS, axis=2), (N * 2, 3)),
    "all_gather_1d": (
        lambda v: jo.all_gather_start(v, AXIS, tiled=True),
        lambda v: jax.lax.all_gather(v, AXIS, tiled=True), (N * 5,)),
    "psum_scatter_d0": (
        lambda v: jo.psum_scatter_start(v, AXIS, tiled=True),
        lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True), (N * 16, 3)),
    "psum_scatter_d1": (
        lambda v: jo.psum_scatter_start(v, AXIS, scatter_dimension=1, tiled=True),
        lambda v: jax.lax.psum_scatter(v, AXIS, scatter_dimension=1, tiled=True),
        (N * 2, 16, 3)),
    "psum_scatter_untiled": (
        lambda v: jo.psum_scatter_start(v, AXIS, scatter_dimension=1),
        lambda v: jax.lax.psum_scatter(v, AXIS, scatter_dimension=1),
        (N * 2, N, 3)),
    "psum_scatter_1d": (
        lambda v: jo.psum_scatter_start(v, AXIS, tiled=True),
        lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True), (N * N * 2,)),
}


def _x(shape):
  rng = np.random.RandomState(0)
  return jnp.asarray(rng.randint(-4, 5, shape).astype(np.float32))


def _program(mesh, fn, enforce):
  def body(v):
    if enforce:
      return jo.program_order(enforce=True)(lambda v: (fn(v), jnp.sin(v)))(v)[0]
    return fn(v)
  per_device = lambda v: body(v)[None]   # one slot per device: no replication check
  return jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))


def _permute_starts(closed) -> int:
  """How many ppermute future starts `closed` holds (nested jaxprs too)."""
  from jax._src import core  # noqa: PLC0415
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "collective_start":
        found.append(eqn.params["comm"].name)
      for sub in core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(closed.jaxpr)
  assert set(found) <= {"ppermute"}, found
  return len(found)


def _check(mesh, start, reference, shape, enforce):
  x = _x(shape)
  ours = _program(mesh, lambda v: start(v).done(), enforce=enforce)
  ref = _program(mesh, reference, enforce=False)
  assert _permute_starts(jax.make_jaxpr(ours)(x)) == N - 1
  np.testing.assert_array_equal(jax.jit(ours)(x), jax.jit(ref)(x))
  cot = _x(jax.eval_shape(ref, x).shape) + 0.5
  loss = lambda f: lambda v: jnp.sum(f(v) * cot)
  np.testing.assert_array_equal(jax.jit(jax.grad(loss(ours)))(x),
                                jax.jit(jax.grad(loss(ref)))(x))


@pytest.mark.parametrize("case", sorted(CASES))
def test_permute_form_gives_jax_lax_values_and_gradients(mesh8, forced, case):
  _check(mesh8, *CASES[case], enforce=True)


@pytest.mark.parametrize("case", ["all_gather_tiled_1", "psum_scatter_d1"])
def test_permute_form_outside_program_order(mesh8, forced, case):
  _check(mesh8, *CASES[case], enforce=False)


def test_the_future_is_one_future_of_the_collective(mesh8, forced):
  seen = []

  def f(v):
    fut = jo.all_gather_start(v, AXIS, tiled=True)
    seen.append((type(fut), fut.collective, fut.shape))
    return fut.done()[None]
  jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS)))(
      _x((N * 2, 3)))
  assert seen == [(ComposedFuture, "all_gather", (N * 2, 3))]


def test_the_future_crosses_ordered_blocks(mesh8, forced):
  # Started in one block, finished in the next, with work between.
  x = _x((N * 2, 16, 3))

  def ours(v):
    fut, w = jo.program_order(enforce=True)(
        lambda v: (jo.psum_scatter_start(v, AXIS, scatter_dimension=1,
                                         tiled=True), jnp.sin(v)))(v)
    done, _ = jo.program_order(enforce=True)(lambda f, w: (f.done(), w * 2))(fut, w)
    return done[None]
  ref = lambda v: jax.lax.psum_scatter(v, AXIS, scatter_dimension=1, tiled=True)[None]
  smap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P(AXIS),
                                         out_specs=P(AXIS)))
  np.testing.assert_array_equal(smap(ours)(x), smap(ref)(x))


def test_permute_form_under_vmap(mesh8, forced):
  x = _x((N * 2, 16, 3))
  ours = _program(mesh8, jax.vmap(
      lambda v: jo.psum_scatter_start(v, AXIS, tiled=True).done()), False)
  ref = _program(mesh8, jax.vmap(
      lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True)), False)
  np.testing.assert_array_equal(jax.jit(ours)(x), jax.jit(ref)(x))


def test_done_twice_raises(mesh8, forced):
  def f(v):
    fut = jo.all_gather_start(v, AXIS, tiled=True)
    fut.done()
    return fut.done()[None]
  with pytest.raises(RuntimeError, match="done\\(\\) was called twice on the "
                     "future from all_gather_start"):
    jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS)))(
        _x((N * 2, 3)))


def test_never_finished_is_said_as_the_collective(mesh8, forced):
  def f(v):
    jo.psum_scatter_start(v, AXIS, tiled=True)
    return v
  with pytest.raises(jo.FutureNotFinishedError,
                     match="the future from psum_scatter_start"):
    jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS)))(
        _x((N * 16, 3)))


def test_no_permute_form_off_tpu(mesh8):
  # Not forced, a CPU trace takes the plain collective.
  start, _, shape = CASES["all_gather_tiled_0"]
  closed = jax.make_jaxpr(_program(mesh8, lambda v: start(v).done(), True))(
      _x(shape))
  assert "ppermute" not in str(closed) and "all_gather" in str(closed)
