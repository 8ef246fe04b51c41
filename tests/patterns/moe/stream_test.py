"""expert_stream: each group's values, drops and gradients equal
expert_parallel's (chunks=1, itself pinned to a dense NumPy reference in
moe_test.py), every exchange is in flight beside the experts or the caller's
work, forward and backward, one at a time; the argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax._src.ad_checkpoint import saved_residuals

import lowered

T, D = 8, 8          # tokens per device, model width
K = 2


def _mesh(n):
  return jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def expert(p, tokens):
  return jnp.tanh(tokens @ p["w"]) + p["b"]


def _inputs(n, experts_local, seed=0):
  E = n * experts_local
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * T, D)).astype(np.float32)
  # Half the choices go to experts 0 and 1, so a tight capacity drops.
  ids = np.where(rng.uniform(size=(n * T, K)) < 0.5,
                 rng.integers(0, min(2, E), (n * T, K)),
                 rng.integers(0, E, (n * T, K))).astype(np.int32)
  weights = rng.uniform(size=(n * T, K)).astype(np.float32)
  params = {"w": (rng.normal(size=(E, D, D)) / np.sqrt(D)).astype(np.float32),
            "b": rng.normal(size=(E, D)).astype(np.float32)}
  return x, ids, weights, params


def _bounds(groups):
  return [T * g // groups for g in range(groups + 1)]


def streamed(n, groups, capacity, between=lambda x: x, recompute=False):
  """Each device's tokens in `groups` groups through one stream, `between`
  of the next group's tokens written between sends (the caller's work)."""
  bounds = _bounds(groups)

  @jo.program_order(enforce=True)
  def local(x, ids, weights, params):
    stream = jo.expert_stream(expert, params, axis="i", capacity=capacity,
                              recompute=recompute)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
      stream.send(between(x[lo:hi]), ids[lo:hi], weights[lo:hi])
    outs = [out.done() for out in stream.close()]
    ys, dropped = zip(*outs)
    return jnp.concatenate(ys), jnp.stack(dropped)[None]
  return jax.shard_map(local, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                       out_specs=(P("i"), P("i")))


def per_group(n, groups, capacity, between=lambda x: x):
  """The same groups, each through its own expert_parallel(chunks=1)."""
  bounds = _bounds(groups)

  def local(x, ids, weights, params):
    outs = [jo.expert_parallel(expert, between(x[lo:hi]), ids[lo:hi],
                               weights[lo:hi], params, axis="i",
                               capacity=capacity, chunks=1)
            for lo, hi in zip(bounds[:-1], bounds[1:])]
    ys, dropped = zip(*outs)
    return jnp.concatenate(ys), jnp.stack(dropped)[None]
  return jax.shard_map(local, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                       out_specs=(P("i"), P("i")))


def _value_and_grads(f, x, ids, weights, params):
  def loss(x, w, p):
    y, dropped = f(x, ids, w, p)
    return jnp.sum(jnp.sin(y)), dropped
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
      x, weights, params)


# (axis size, E_local, groups, capacity, recompute)
CASES = [(2, 1, 2, T * K, False), (2, 2, 3, 2, False), (4, 1, 1, 3, False),
         (8, 1, 4, T * K, False), (2, 2, 3, 2, True), (4, 1, 2, T * K, True)]


@pytest.mark.parametrize("n, experts_local, groups, capacity, recompute", CASES,
                         ids=[f"n{n}-el{e}-g{g}-cap{c}" + ("-recompute" if r else "")
                              for n, e, g, c, r in CASES])
def test_each_group_equals_expert_parallel_in_values_drops_and_grads(
    n, experts_local, groups, capacity, recompute):
  args = _inputs(n, experts_local)
  between = lambda x: x * 1.5          # the caller's work, differentiated too
  (value, dropped), grads = _value_and_grads(
      streamed(n, groups, capacity, between, recompute), *args)
  (want_value, want_dropped), want_grads = _value_and_grads(
      per_group(n, groups, capacity, between), *args)
  np.testing.assert_array_equal(np.asarray(dropped), np.asarray(want_dropped))
  if capacity == 2:
    assert int(np.sum(dropped)) > 0      # the tight case drops
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads),
                  strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5)


def test_every_exchange_is_in_flight_beside_compute_forward_and_backward():
  # 2 groups: d(0) beside the caller's work on group 1 (cos), d(1) beside
  # group 0's experts (tanh), c(0) beside group 1's experts, c(1) beside the
  # caller's work written before the last done() (exp). The backward: each
  # exchange's transpose, in reverse, beside the backward of the same work.
  n = 2
  x, ids, weights, params = _inputs(n, 1)

  @jo.program_order(enforce=True)
  def local(x, ids, weights, params):
    stream = jo.expert_stream(expert, params, axis="i", capacity=T * K)
    stream.send(x[:T // 2], ids[:T // 2], weights[:T // 2])
    other = jnp.cos(x[T // 2:])
    stream.send(other, ids[T // 2:], weights[T // 2:])
    first, last = stream.close()
    y0, _ = first.done()
    after = jnp.exp(y0)                 # beside the last combine
    y1, _ = last.done()
    return jnp.concatenate([after, y1])
  f = jax.shard_map(local, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                    out_specs=P("i"))
  fwd = lambda x, w, p: f(x, ids, w, p)
  windows = lowered.future_windows(fwd, x, weights, params)
  assert len(windows) == 4, windows
  beside = [("cos" in w, "tanh" in w, "exp" in w) for w in windows]
  assert beside == [(True, False, False), (False, True, False),
                    (False, True, False), (False, False, True)], windows
  grad = jax.grad(lambda x, w, p: jnp.sum(jnp.sin(fwd(x, w, p))), (0, 1, 2))
  windows = lowered.future_windows(grad, x, weights, params)
  assert len(windows) == 8, windows
  compute = {"cos", "sin", "tanh", "exp", "dot_general", "mul"}
  for w in windows:
    assert compute & set(w), windows
    # One exchange in flight at a time (TPU v5e takes no more).
    assert "collective_start" not in w, windows


def test_recompute_saves_only_what_arrived_at_the_experts():
  """With `recompute=True` the experts' activations (the tanh of each
  expert's tokens) are not saved for the backward: fewer residual bytes,
  at least one [E_local, sources * capacity, D] activation a group fewer."""
  n, groups, capacity = 2, 2, T * K
  x, ids, weights, params = _inputs(n, 1)

  def saved(recompute):
    f = streamed(n, groups, capacity, recompute=recompute)
    loss = lambda x, w, p: jnp.sum(jnp.sin(f(x, ids, w, p)[0]))
    return sum(a.size * a.dtype.itemsize
               for a, _ in saved_residuals(loss, x, weights, params))
  # one group's at a device's expert: its n sources' capacity rows, f32
  activation = n * capacity * D * 4
  # (at least: jax < 0.12 saves the matmul's output beside its tanh)
  assert saved(False) - saved(True) >= groups * activation


def test_argument_errors_name_the_call():
  n = 2
  x, ids, weights, params = _inputs(n, 1)
  mesh = _mesh(n)

  def run(body):
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("i"),) * 4,
                      out_specs=P("i"))
    return jax.jit(f).trace(x, ids, weights, params)

  with pytest.raises(ValueError, match=r"expert_stream\(capacity=None\)"):
    run(lambda x, i, w, p: jo.expert_stream(expert, p, axis="i",
                                            capacity=None))
  with pytest.raises(TypeError, match=r"expert_stream\(recompute=\.\.\.\)"):
    run(lambda x, i, w, p: jo.expert_stream(expert, p, axis="i", capacity=2,
                                            recompute="yes"))
  with pytest.raises(TypeError, match=r"expert_stream\(expert_fn=\.\.\.\)"):
    run(lambda x, i, w, p: jo.expert_stream(None, p, axis="i", capacity=2))

  def flat_x(x, i, w, p):
    jo.expert_stream(expert, p, axis="i", capacity=2).send(x[None], i, w)
  with pytest.raises(ValueError, match=r"expert_stream\(\.\.\.\)\.send\(x=\.\.\.\)"):
    run(flat_x)

  def twice(x, i, w, p):
    s = jo.expert_stream(expert, p, axis="i", capacity=2)
    s.send(x, i, w)
    s.close()
    s.send(x, i, w)
  with pytest.raises(ValueError, match="send\\(\\) after close\\(\\)"):
    run(twice)

  def empty(x, i, w, p):
    jo.expert_stream(expert, p, axis="i", capacity=2).close()
  with pytest.raises(ValueError, match="close\\(\\) before any send\\(\\)"):
    run(empty)
