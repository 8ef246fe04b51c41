"""The TPU forms of the futures (collectives/tpu_forms.py), checked on CPU.

On TPU, `psum_scatter_start`, `psum_start`, `all_to_all_start` (and on v5p
`all_gather_start`) are built from a rank-3 all-to-all, with a sum or a
reshape at `done()`, because that is what libtpu makes async. Here the forms
are forced on CPU (`tpu_forms.forced()`) and compared with `jax.lax` over
`shard_map` on 8 devices: values (exact: the inputs are small integers, so
every order of the sum gives the same value), gradients, inside and outside
`program_order`, under vmap, and the synchronous stand-in that a second future
gets while one form is in flight (`Form.sync`). One compile each (tiny shapes).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives import permute_forms, tpu_forms

N = 8
AXIS = "i"


@pytest.fixture
def forced():
  with tpu_forms.forced():
    yield


#: psum_start's ring where all_gather_start is permutes
#: (collectives/permute_forms.py): on v5p its reduce-scatter half too; on v5e
#: with jax < 0.12 only its all-gather half.
PERMUTE_GATHERS = {"v5p": lambda name: True,
                   "v5e_older": lambda name: name == "all_gather"}


@pytest.fixture(params=sorted(PERMUTE_GATHERS))
def forced_permutes(request, monkeypatch):
  wanted = PERMUTE_GATHERS[request.param]
  monkeypatch.setattr(permute_forms, "wanted",
                      lambda name: name in permute_forms.COLLECTIVES and wanted(name))
  with tpu_forms.forced():
    yield request.param


# name -> (future, jax.lax reference, global shape of x)
CASES = {
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
    "psum": (lambda v: jo.psum_start(v, AXIS), lambda v: jax.lax.psum(v, AXIS),
             (N * 2, 5)),
    "psum_1d": (lambda v: jo.psum_start(v, AXIS), lambda v: jax.lax.psum(v, AXIS),
                (N * 3,)),
    "psum_two": (lambda v: jo.psum_start(v, AXIS), lambda v: jax.lax.psum(v, AXIS),
                 (N * 2,)),
    "psum_padded": (lambda v: jo.psum_start(v, AXIS),
                    lambda v: jax.lax.psum(v, AXIS), (N * 3, 5)),
    "psum_3d": (lambda v: jo.psum_start(v, AXIS), lambda v: jax.lax.psum(v, AXIS),
                (N, 8, 2)),
    "all_gather_tiled": (
        lambda v: jo.all_gather_start(v, AXIS, axis=1, tiled=True),
        lambda v: jax.lax.all_gather(v, AXIS, axis=1, tiled=True), (N * 2, 3)),
    "all_gather_stacked": (
        lambda v: jo.all_gather_start(v, AXIS, axis=2),
        lambda v: jax.lax.all_gather(v, AXIS, axis=2), (N * 2, 3)),
    "all_to_all_2d": (
        lambda v: jo.all_to_all_start(v, AXIS, 0, 0, tiled=True),
        lambda v: jax.lax.all_to_all(v, AXIS, 0, 0, tiled=True), (N * 16, 4)),
    "all_to_all_split1_concat0": (
        lambda v: jo.all_to_all_start(v, AXIS, 1, 0, tiled=True),
        lambda v: jax.lax.all_to_all(v, AXIS, 1, 0, tiled=True), (N * 2, 16)),
    "all_to_all_untiled": (
        lambda v: jo.all_to_all_start(v, AXIS, 0, 2, tiled=False),
        lambda v: jax.lax.all_to_all(v, AXIS, 0, 2, tiled=False), (N * N, 2, 3)),
}


#: Cases whose future is psum_start's ring form (collectives/ring_psum.py):
#: a reduce-scatter future (its TPU form) and, at done(), an all-gather
#: future (none), the shard padded to a multiple of N (15 -> 16 in
#: psum_padded, 3 -> 8 in psum_1d). A shard the padded ring would not send in
#: fewer bytes keeps the form of N copies (psum_two: 2 elements).
RING_PSUM = {"psum", "psum_1d", "psum_padded", "psum_3d"}

#: jax's own gradient of these fails ("Expected cotangent type
#: float32[8,2,3,1] but got float32[8,1,2,3]", untiled all_to_all with the
#: split and concat axes apart): values only.
NO_GRAD = {"all_to_all_untiled"}


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


@pytest.mark.parametrize("case", sorted(CASES))
def test_tpu_form_gives_jax_lax_values_and_gradients(mesh8, forced, case):
  # Inside an ordered block, where a future's halves lower apart.
  start, reference, shape = CASES[case]
  x = _x(shape)
  ours = _program(mesh8, lambda v: start(v).done(), enforce=True)
  ref = _program(mesh8, reference, enforce=False)
  assert _forms_taken(jax.make_jaxpr(ours)(x)) == (
      [True, False] if case in RING_PSUM else [True])
  np.testing.assert_array_equal(jax.jit(ours)(x), jax.jit(ref)(x))
  if case in NO_GRAD:
    return
  cot = _x(jax.eval_shape(ref, x).shape) + 0.5
  loss = lambda f: lambda v: jnp.sum(f(v) * cot)
  np.testing.assert_array_equal(jax.jit(jax.grad(loss(ours)))(x),
                                jax.jit(jax.grad(loss(ref)))(x))


SYNC_CASES = {
    "psum_scatter": (dict(axis_name=AXIS, scatter_dimension=1, tiled=True),
                     (N * 2, 16, 3)),
    "psum": (dict(axis_name=AXIS), (N * 2, 5)),
    "all_gather": (dict(axis_name=AXIS, axis=0, tiled=True), (N * 2, 3)),
    "all_to_all": (dict(axis_name=AXIS, split_axis=1, concat_axis=0, tiled=True),
                   (N * 2, 16)),
}


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_sync_stand_in_gives_the_forms_buffer(mesh8, forced, name):
  # What a second future gets on TPU while another's all-to-all is in
  # flight: the same buffer, by an all-gather.
  params, shape = SYNC_CASES[name]

  def both(v):
    form = tpu_forms.trace_form(name, params, v)
    (a,) = _run(form.start, v)
    (b,) = _run(form.sync, v)
    return jnp.stack([a, b])[None]
  fn = jax.shard_map(both, mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS))
  out = jax.jit(fn)(_x(shape))
  np.testing.assert_array_equal(out[:, 0], out[:, 1])


def _forms_taken(closed) -> list[bool]:
  """For each future start in `closed` (nested jaxprs too): has it a form?"""
  from jax._src import core  # noqa: PLC0415
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "collective_start":
        found.append(eqn.params["comm"].tpu_form is not None)
      for sub in core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(closed.jaxpr)
  return found


def _run(closed, *args):
  from jax._src import core  # noqa: PLC0415
  return core.jaxpr_as_fun(closed)(*args)


def test_tpu_form_under_vmap(mesh8, forced):
  x = _x((N * 2, 16, 3))
  ours = _program(mesh8, jax.vmap(
      lambda v: jo.psum_scatter_start(v, AXIS, tiled=True).done()), False)
  ref = _program(mesh8, jax.vmap(
      lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True)), False)
  np.testing.assert_array_equal(jax.jit(ours)(x), jax.jit(ref)(x))


def test_no_form_off_tpu(mesh8):
  # Not forced, a CPU trace takes the plain collective.
  start, _, shape = CASES["psum_scatter_d0"]
  closed = jax.make_jaxpr(_program(mesh8, lambda v: start(v).done(), True))(
      _x(shape))
  assert _forms_taken(closed) == [False]


def test_ring_psum_with_work_in_its_window(mesh8, forced):
  # Work written between psum_start and done(): the ordered block lowers the
  # all-gather half after the first matmul (ring_psum.advance_second_halves);
  # values and gradients are jax.lax's, and the block's lowered text has the
  # all-gather between the two matmuls.
  w = _x((5, 5))

  def ours(v):
    def body(v):
      fut = jo.psum_start(v, AXIS)
      a = jnp.sin(v @ w)
      a = jnp.cos(a @ w)
      return fut.done() + a
    return jo.program_order(enforce=True)(body)(v)[None]

  def ref(v):
    return (jax.lax.psum(v, AXIS) + jnp.cos(jnp.sin(v @ w) @ w))[None]
  smap = lambda f: jax.shard_map(f, mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS))
  x = _x((N * 2, 5))
  np.testing.assert_allclose(jax.jit(smap(ours))(x), jax.jit(smap(ref))(x),
                             rtol=1e-6)
  loss = lambda f: lambda v: jnp.sum(smap(f)(v) ** 2)
  np.testing.assert_allclose(jax.jit(jax.grad(loss(ours)))(x),
                             jax.jit(jax.grad(loss(ref)))(x), rtol=1e-5)
  text = jax.jit(smap(ours)).lower(x).as_text()
  order = [m.group(0) for m in re.finditer(r"all_to_all|all_gather|dot_general",
                                           text)]
  first_gather = order.index("all_gather")
  assert order[:first_gather].count("dot_general") == 1, order


@pytest.mark.parametrize("case", sorted(RING_PSUM))
def test_ring_psum_gathers_by_permutes(mesh8, forced_permutes, case):
  # Where all_gather_start is N-1 permutes, so is the ring's all-gather
  # half; its result stays invariant over the axis, as psum's (out_specs
  # P(): refused if it varied), with psum's values and gradients.
  start, reference, shape = CASES[case]
  x = _x(shape)

  def program(fn, enforce):
    def body(v):
      if enforce:
        return jo.program_order(enforce=True)(lambda v: (fn(v), jnp.sin(v)))(v)[0]
      return fn(v)
    return jax.shard_map(body, mesh=mesh8, in_specs=P(AXIS), out_specs=P())
  ours = program(lambda v: start(v).done(), True)
  ref = program(reference, False)
  starts = _starts(jax.make_jaxpr(ours)(x))
  halves = [c.second_half for c in starts if c.name == "ppermute"]
  assert halves.count(True) == N - 1, starts
  assert halves.count(False) == (N - 1 if forced_permutes == "v5p" else 0)
  np.testing.assert_array_equal(jax.jit(ours)(x), jax.jit(ref)(x))
  cot = _x(jax.eval_shape(ref, x).shape) + 0.5
  loss = lambda f: lambda v: jnp.sum(f(v) * cot)
  np.testing.assert_array_equal(jax.jit(jax.grad(loss(ours)))(x),
                                jax.jit(jax.grad(loss(ref)))(x))
  under_vmap = lambda f: jax.shard_map(jax.vmap(f), mesh=mesh8,
                                       in_specs=P(None, AXIS), out_specs=P())
  xs = jnp.stack([x, x + 1])
  np.testing.assert_array_equal(
      jax.jit(under_vmap(lambda v: start(v).done()))(xs),
      jax.jit(under_vmap(reference))(xs))


def test_ring_psum_permute_gather_moves_into_the_window(mesh8, forced_permutes):
  # The all-gather half's N-1 permute starts move up together, after the
  # first of the two matmuls written in the window (on v5p after the
  # reduce-scatter half's N-1 permutes).
  w = _x((5, 5))

  def body(v):
    fut = jo.psum_start(v, AXIS)
    a = jnp.sin(v @ w)
    a = jnp.cos(a @ w)
    return fut.done() + a
  ours = jax.shard_map(lambda v: jo.program_order(enforce=True)(body)(v)[None],
                       mesh=mesh8, in_specs=P(AXIS), out_specs=P(AXIS))
  text = jax.jit(ours).lower(_x((N * 2, 5))).as_text()
  # (The op, or on jax 0.12 its async start: xla/futures.py.)
  order = [m.group(1).replace("-", "_").removesuffix("_start") for m in re.finditer(
      r"(all_to_all|all-to-all-start|dot_general|collective_permute|"
      r"collective-permute-start)", text)]
  scatter = ["collective_permute"] * (N - 1) if forced_permutes == "v5p" \
      else ["all_to_all"]
  assert order == (scatter + ["dot_general"] + ["collective_permute"] * (N - 1)
                   + ["dot_general"]), order


def _starts(closed) -> list:
  """The Comm of each future start in `closed` (nested jaxprs too)."""
  from jax._src import core  # noqa: PLC0415
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "collective_start":
        found.append(eqn.params["comm"])
      for sub in core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(closed.jaxpr)
  return found
