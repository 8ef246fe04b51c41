"""`psum_start(..., to="varying")`: a sum typed varying over its axis whose
gradient's sum is a future too.

Values and gradients equal `jax.lax.psum` followed by
`jax.lax.pcast(..., to="varying")`, inside and outside an ordered block, with
the TPU forms forced on CPU (the ring of a reduce-scatter and an all-gather,
and the copies form of a small buffer); on the GPU lowering the backward's
sum is a start/done pair around the backward's matmuls; a bad `to` is
refused at the call.
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
from jax_overlap._src.collectives import permute_forms, ring_psum, tpu_forms

AXIS = "i"


def _x(shape, seed=0):
  rng = np.random.RandomState(seed)
  return jnp.asarray(rng.randint(-4, 5, shape).astype(np.float32))


def _sum(ours):
  if ours:
    return lambda y: jo.psum_start(y, AXIS, to="varying")
  return lambda y: _Done(jax.lax.pcast(jax.lax.psum(y, AXIS), AXIS, to="varying"))


class _Done:
  def __init__(self, value):
    self.value = value

  def done(self):
    return self.value


def _loss(mesh, ours, enforce):
  """A row-parallel matmul whose varying sum meets a varying residual, with
  a matmul written while the sum is in flight; the loss summed over the
  axis inside, as a pipeline stage's."""
  start = _sum(ours)

  def body(x, w, a):
    y = x @ w
    fut = start(y)
    b = jnp.tanh(a.T @ a)          # in the sum's window
    s = fut.done()
    return s + x[:, :s.shape[1]] * 0.5, b   # meets a varying value

  if enforce:
    body = jo.program_order(enforce=True)(body)

  def per_device(x, w, a):
    s, b = body(x, w, a)
    return jax.lax.psum(jnp.sum(s * s * 0.25) + jnp.sum(b * b), AXIS)

  f = jax.shard_map(per_device, mesh=mesh,
                    in_specs=(P(None, AXIS), P(AXIS), P(AXIS)), out_specs=P())
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


def _args(n, rows=4):
  return _x((rows, 4 * n)), _x((4 * n, 4), 1) / 4, _x((2 * n, 3), 2) / 8


@pytest.mark.parametrize("enforce", [False, True])
def test_values_and_gradients_equal_psum_then_cast(mesh2, enforce):
  args = _args(2)
  got, want = _loss(mesh2, True, enforce)(*args), _loss(mesh2, False, False)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.fixture(params=["v5e", "every_form", "v5p"])
def forced(request, monkeypatch):
  """The TPU forms on CPU: as on the v5e (a plain all-gather), every form
  (the all-gather an all-to-all of copies too), or as on the v5p (the
  ring's halves as permutes)."""
  if request.param == "v5e":
    monkeypatch.setattr(tpu_forms, "wanted",
                        lambda name: name in tpu_forms.EVERY_TPU)
  if request.param == "v5p":
    monkeypatch.setattr(permute_forms, "wanted",
                        lambda name: name in permute_forms.COLLECTIVES)
  with tpu_forms.forced():
    yield request.param


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


#: (collective, with a TPU form) of the starts of the value and gradient,
#: forward then backward: the ring's reduce-scatter and all-gather (each an
#: all-to-all), then the cotangent's reduce-scatter, in its TPU form, and
#: all-gather (plain: the transpose of the forward reduce-scatter); over 2
#: devices the copies form, both ways.
RING = [("psum_scatter", True), ("all_gather", True),
        ("psum_scatter", True), ("all_gather", False)]
COPIES = [("psum", True), ("psum", True)]
#: as permutes (v5p): N - 1 a half, each way
PERMUTES = [("ppermute", False)] * (4 * 7)


@pytest.mark.parametrize("devices", [8, 2])
def test_tpu_forms_values_and_gradients(request, forced, devices):
  mesh = request.getfixturevalue(f"mesh{devices}")
  args = _args(devices)
  program = _loss(mesh, True, True)
  starts = _starts(program.trace(*args).jaxpr.jaxpr)
  want = COPIES if devices == 2 else PERMUTES if forced == "v5p" else RING
  assert starts == want, starts
  got = program(*args)
  want = _loss(mesh, False, False)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-6)


def test_result_is_typed_varying(mesh2):
  def per_device(x):
    y = jo.psum_start(x, AXIS, to="varying").done()
    assert AXIS in _compat.varying_axes(y)
    z = jo.psum_start(x, AXIS).done()
    assert AXIS not in _compat.varying_axes(z)
    return y
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P(AXIS))
  np.testing.assert_array_equal(jax.jit(f)(jnp.arange(4.0)),
                                [2.0, 4.0, 2.0, 4.0])


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="this jax has no custom-call async form to read")
def test_backward_sum_is_in_flight_across_the_backward_matmul(mesh2):
  # The forward sum starts after x @ w and ends after the window's matmul;
  # the backward's sum of the cotangent starts where the forward ended and
  # ends after the two transposed matmuls of the window (a.T @ a's), before
  # the transposes of x @ w. Without to="varying", jax's transpose of the
  # cast would be a synchronous all-reduce there.
  text = _loss(mesh2, True, True).trace(*_args(2)).lower(
      lowering_platforms=("cuda",)).as_text()
  order = [m or "dot" for m in re.findall(
      r'"(all-reduce-(?:start|done))"|stablehlo\.dot_general', text)]
  assert order[:8] == ["dot", "all-reduce-start", "dot", "all-reduce-done",
                       "all-reduce-start", "dot", "dot", "all-reduce-done"], order
  assert len(re.findall(r"stablehlo\.all_reduce|all-reduce-start", text)) == 3
  # (the third: the loss's own psum)


@pytest.mark.parametrize("to", ["varied", None, "invariant"])
def test_bad_to_is_refused(mesh2, to):
  def per_device(x):
    return jo.psum_start(x, AXIS, to=to).done()
  f = jax.shard_map(per_device, mesh=mesh2, in_specs=P(AXIS), out_specs=P())
  with pytest.raises(ValueError, match=r"psum_start\(to="):
    jax.jit(f)(jnp.arange(4.0))


def _blocks(jaxpr):
  """The ordered blocks' jaxprs inside `jaxpr`, in order."""
  found = []
  for e in jaxpr.eqns:
    subs = list(jax_core.jaxprs_in_params(e.params))
    if e.primitive.name == "program_order":
      found += subs
    for sub in subs:
      found += _blocks(sub)
  return found


def _placement(jaxpr):
  """The collective starts and dones and matmuls of `jaxpr`, in order."""
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name in ("collective_start", "collective_done"):
      comm = e.params["comm"]
      out.append(f"{comm.name}-{e.primitive.name.split('_')[1]}")
    elif e.primitive.name == "dot_general":
      out.append("dot")
  return out


def test_backward_ring_halves_are_placed_beside_the_backward_matmuls(mesh8, forced):
  # The ordered block's rewrite (ring_psum.advance_second_halves, applied
  # when a block is fenced): forward, the all-gather half moves up after the
  # first of the window's two matmuls; backward, where the cotangent's
  # reduce-scatter starts and ends at the forward's done(), its all-gather
  # half moves down after half of the window's backward matmuls.
  if forced == "v5p":
    pytest.skip("as permutes: the same moves, 7 parts a half")

  def per_device(x, w, a):
    @jo.program_order(enforce=True)
    def body(x, w, a):
      fut = jo.psum_start(x @ w, AXIS, to="varying")
      b = jnp.tanh(a @ a.T)
      b = jnp.tanh(b @ a)
      return fut.done(), b
    s, b = body(x, w, a)
    return jax.lax.psum(jnp.sum(s * s) + jnp.sum(b), AXIS)

  f = jax.shard_map(per_device, mesh=mesh8,
                    in_specs=(P(None, AXIS), P(AXIS), P(AXIS)), out_specs=P())
  args = _args(8)
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(*args).jaxpr
  forward, backward = [_placement(ring_psum.advance_second_halves(b))
                       for b in _blocks(jaxpr)]
  assert forward == ["dot", "psum_scatter-start", "dot", "psum_scatter-done",
                     "all_gather-start", "dot", "all_gather-done"], forward
  # backward: a @ a.T and b @ a each transpose to two matmuls
  assert backward[:2] == ["psum_scatter-start", "dot"], backward
  i = backward.index("all_gather-start")
  assert backward[i - 1] == "psum_scatter-done" and "dot" in backward[i:], backward
  assert backward.index("psum_scatter-done") > backward.index("dot"), backward
