"""`pvary_start`: an invariant value cast to vary over an axis, whose
gradient's sum over the axis is a future.

Values and gradients equal jax's cast (`jax.lax.pcast(..., to="varying")`,
and the implicit one of a replicated value meeting a varying one), inside
and outside an ordered block, with the TPU form forced on CPU (the
cotangent's sum as the copies all-to-all, carried in the forward's in-flight
slot); on the GPU lowering the backward's sum is a start/done pair around
the backward's matmuls; bad calls are refused where they are written.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core as jax_core
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap._src.collectives import tpu_forms

AXIS = "i"


def _x(shape, seed=0):
  rng = np.random.RandomState(seed)
  return jnp.asarray(rng.randint(-4, 5, shape).astype(np.float32))


def _loss(mesh, ours, enforce, implicit=False):
  """A replicated scale `s` (invariant over the axis) on a varying
  activation, with matmuls written between the cast's start and its use;
  the loss summed over the axis, as a stage's."""
  def body(s, x, a):
    fut = jo.pvary_start(s, AXIS) if ours else None
    b = jnp.tanh(a.T @ a)                 # in the window
    y = jnp.tanh(x @ b)
    if ours:
      scale = fut.done()
    elif implicit:
      scale = s                            # jax casts it at the multiply
    else:
      scale = jax.lax.pcast(s, AXIS, to="varying")
    return y * scale

  if enforce:
    body = jo.program_order(enforce=True)(body)

  def per_device(s, x, a):
    return jax.lax.psum(jnp.sum(body(s, x, a) ** 2), AXIS)

  f = jax.shard_map(per_device, mesh=mesh,
                    in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


def _args(n):
  return _x((2, 4), 3) / 4, _x((2 * n, 4)) / 4, _x((2 * n, 4), 1) / 8


def _check(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("enforce", [False, True])
@pytest.mark.parametrize("implicit", [False, True])
def test_values_and_gradients_equal_the_cast(mesh2, enforce, implicit):
  args = _args(2)
  _check(_loss(mesh2, True, enforce)(*args),
         _loss(mesh2, False, False, implicit)(*args))


def _starts(jaxpr):
  """(collective, whether it has a TPU form) of each start, in order."""
  found = []
  for e in jaxpr.eqns:
    if e.primitive.name == "collective_start":
      comm = e.params["comm"]
      found.append((comm.name, comm.tpu_form is not None))
    for sub in jax_core.jaxprs_in_params(e.params):
      found += _starts(sub)
  return found


@pytest.mark.parametrize("devices", [2, 8])
@pytest.mark.parametrize("enforce", [False, True])
def test_tpu_form_values_and_gradients(request, devices, enforce):
  # The forward's in-flight value is N copies of s (made locally); the
  # cotangent's sum is psum's copies form, an all-to-all of that buffer.
  mesh = request.getfixturevalue(f"mesh{devices}")
  args = _args(devices)
  with tpu_forms.forced():
    program = _loss(mesh, True, enforce)
    assert _starts(program.trace(*args).jaxpr.jaxpr) == [
        ("pvary", True), ("psum", True)]
    got = program(*args)
  _check(got, _loss(mesh, False, False)(*args))


def test_over_two_axes(mesh8):
  # several axes: no TPU form (the backward sum is the plain psum)
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=mesh8.devices.flat[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def loss(ours):
    def per_device(s, x):
      scale = jo.pvary_start(s, ("a", "b")).done() if ours else s
      return jax.lax.psum(jnp.sum(jnp.tanh(x) * scale), ("a", "b"))
    return jax.jit(jax.value_and_grad(jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(("a", "b"))), out_specs=P()),
        argnums=(0, 1)))
  args = (_x((4,)), _x((16, 4), 1) / 4)
  with tpu_forms.forced():
    _check(loss(True)(*args), loss(False)(*args))


def test_result_is_typed_varying(mesh2):
  def per_device(s):
    assert AXIS not in _compat.varying_axes(s)
    y = jo.pvary_start(s, AXIS).done()
    assert AXIS in _compat.varying_axes(y)
    return y
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(), out_specs=P(AXIS))
  np.testing.assert_array_equal(jax.jit(f)(jnp.arange(2.0)), [0., 1., 0., 1.])


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax has no custom-call async form to read")
def test_backward_sum_is_in_flight_across_the_backward_matmuls(mesh2):
  # Forward: the window's matmuls, no collective but the loss's psum. The
  # cotangent's sum starts where the forward done() was (after the backward
  # of y * scale) and ends where the start was: the transposed matmuls of
  # the window (x @ b's and a.T @ a's) run while it is in flight. Without
  # the future jax's transpose of the cast is a synchronous all-reduce.
  text = _loss(mesh2, True, True).trace(*_args(2)).lower(
      lowering_platforms=("cuda",)).as_text()
  order = [m or "dot" for m in re.findall(
      r'"(all-reduce-(?:start|done))"|stablehlo\.dot_general', text)]
  start, done = order.index("all-reduce-start"), order.index("all-reduce-done")
  assert order[:2] == ["dot", "dot"], order            # the forward window
  assert order[start + 1:done].count("dot") >= 2, order   # the backward's


@pytest.mark.parametrize("x, kind, match", [
    ("text", TypeError, "pvary_start: x must be an array"),
    (None, TypeError, "pvary_start"),
])
def test_non_arrays_are_refused(mesh2, x, kind, match):
  def per_device(v):
    return v + jo.pvary_start(x, AXIS).done()
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  with pytest.raises(kind, match=match):
    jax.jit(f)(jnp.arange(4.0))


def test_a_future_is_refused(mesh2):
  def per_device(v):
    fut = jo.psum_start(v, AXIS)
    return jo.pvary_start(fut, AXIS).done()
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  with pytest.raises(TypeError, match="is a Future; call .done"):
    jax.jit(f)(jnp.arange(4.0))


def test_unbound_axis_is_refused(mesh2):
  def per_device(v):
    return jo.pvary_start(jnp.ones(2), "nope").done() + v
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  with pytest.raises(NameError, match=r"pvary_start\(axis_name='nope'\): unknown axis"):
    jax.jit(f)(jnp.arange(4.0))


def test_already_varying_is_refused(mesh2):
  def per_device(v):
    return jo.pvary_start(v, AXIS).done()
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  with pytest.raises(ValueError, match=r"pvary_start\(axis_name='i'\): x already varies over 'i'"):
    jax.jit(f)(jnp.arange(4.0))


def test_over_two_axes_on_tpu_is_one_future_an_axis(mesh8):
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=mesh8.devices.flat[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def per_device(s, x):
    fut = jo.pvary_start(s, ("a", "b"))
    return jax.lax.psum(jnp.sum(jnp.tanh(x) * fut.done()), ("a", "b"))
  f = jax.value_and_grad(jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P(("a", "b"))), out_specs=P()),
      argnums=(0, 1))
  args = (_x((4,)), _x((16, 4), 1) / 4)
  with tpu_forms.forced():
    starts = _starts(jax.jit(f).trace(*args).jaxpr.jaxpr)
  assert starts == [("pvary", True), ("pvary", True), ("psum", True),
                    ("psum", True)], starts


def test_no_axis_is_refused(mesh2):
  def per_device(v):
    return jo.pvary_start(jnp.ones(2), ()).done() + v
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  with pytest.raises(ValueError, match=r"pvary_start\(axis_name=\(\)\): name at least one"):
    jax.jit(f)(jnp.arange(4.0))
