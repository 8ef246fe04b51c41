"""Eager `jax.shard_map` (no enclosing jit), as users call it on public model code.

jax compiles every primitive of an eager shard_map body, and every value
crossing its boundary, anew at each call. These tests count compiles (never
time) on a second call: `fsdp_scan` and `program_order` blocks must add
nothing there beyond what the same model written with a plain `lax.scan`
compiles, and eager values and gradients must equal jit's and the plain
model's. docs/real-clients.md has the measured times.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import eager_shard_map

N_DEV, AXIS = 8, "d"
B, D, H = 8, 8, 16
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _mesh():
  return jax.make_mesh((N_DEV,), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))


@contextlib.contextmanager
def _counting_compiles():
  """Counts XLA compiles (jax's backend-compile event) inside the block."""
  from jax._src import monitoring  # noqa: PLC0415
  count = [0]

  def listener(name, secs, **kwargs):
    del secs, kwargs
    if name == _COMPILE_EVENT:
      count[0] += 1
  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield count
  finally:
    monitoring.unregister_event_duration_listener(listener)


def _second_call_compiles(fn, *args) -> int:
  jax.block_until_ready(fn(*args))
  with _counting_compiles() as count:
    jax.block_until_ready(fn(*args))
  return count[0]


# --- a tiny stack, with fsdp_scan and with a plain lax.scan -------------------------

def _layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def _inputs(n_layers=3):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (B, D))
  params = {"w1": jax.random.normal(k2, (n_layers, D, H)) * 0.3,
            "w2": jax.random.normal(k3, (n_layers, H, D)) * 0.3}
  return x, params


def _fsdp_loss(x, params):
  y = jo.fsdp_scan(_layer, x, params, axis=AXIS)
  return lax.pmean(jnp.mean(y ** 2), AXIS)


def _plain_loss(x, params):
  full = jax.tree.map(lambda w: lax.all_gather(w, AXIS, axis=1, tiled=True),
                      params)
  y, _ = lax.scan(lambda x, w: (_layer(x, w), None), x, full)
  return lax.pmean(jnp.mean(y ** 2), AXIS)


def _smap(loss):
  return jax.shard_map(loss, mesh=_mesh(), in_specs=(P(AXIS), P(None, AXIS)),
                       out_specs=P())


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_second_eager_fsdp_call_compiles_no_more_than_plain_scan(grad):
  x, params = _inputs()
  wrap = (lambda f: jax.value_and_grad(f, argnums=(0, 1))) if grad else \
      (lambda f: f)
  plain = _second_call_compiles(wrap(_smap(_plain_loss)), x, params)
  fsdp = _second_call_compiles(wrap(_smap(_fsdp_loss)), x, params)
  assert fsdp <= plain, (fsdp, plain)


def test_eager_values_and_gradients_equal_jit_and_plain():
  x, params = _inputs()
  vg = lambda loss: jax.value_and_grad(_smap(loss), argnums=(0, 1))
  eager = vg(_fsdp_loss)(x, params)
  eager_again = vg(_fsdp_loss)(x, params)       # from the cached programs
  jitted = jax.jit(vg(_fsdp_loss))(x, params)
  plain = jax.jit(vg(_plain_loss))(x, params)
  for got in (eager, eager_again, jitted):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
  # The forward alone, and grad taken inside the eager shard_map.
  np.testing.assert_allclose(_smap(_fsdp_loss)(x, params), plain[0], rtol=2e-5)
  inside = jax.shard_map(
      lambda x, p: jax.grad(_fsdp_loss, argnums=1)(x, p), mesh=_mesh(),
      in_specs=(P(AXIS), P(None, AXIS)), out_specs=P(None, AXIS))(x, params)
  for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(plain[1][1])):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


# --- program_order blocks ---------------------------------------------------------

def _block_program(decorate):
  """An ordered block that starts a gather and hands the future out of it."""
  @decorate
  def block(x, w):
    h = jnp.tanh(x * 2.0) + 1.0
    fut = jo.all_gather_start(w, AXIS, tiled=True)
    return jnp.sin(h) * jnp.cos(h), fut

  def body(x, w):
    y, fut = block(x, w)
    return y * jnp.sum(fut.done())

  return jax.shard_map(body, mesh=_mesh(), in_specs=(P(AXIS), P(AXIS)),
                       out_specs=P(AXIS))


def test_second_eager_block_call_compiles_nothing_for_the_block():
  x, w = jnp.arange(16.0) / 16, jnp.arange(8.0)
  ordered = _block_program(jo.program_order(enforce=True))
  undecorated = _block_program(lambda f: f)
  np.testing.assert_allclose(ordered(x, w), jax.jit(undecorated)(x, w),
                             rtol=1e-6)
  with_block = _second_call_compiles(ordered, x, w)
  without = _second_call_compiles(undecorated, x, w)
  # The block's 6 primitives are one cached program: nothing compiles for
  # them, where compiling them one by one at every call would cost 6.
  assert with_block < without, (with_block, without)


def test_blocks_differing_in_a_constant_are_not_confused():
  x = jnp.arange(16.0)
  big = np.arange(eager_shard_map._SMALL_ARRAY + 8, dtype=np.float32)

  def run(scale, table):
    @jo.program_order(enforce=True)
    def block(x):
      return jnp.sin(x) * scale + table[-1]
    return jax.shard_map(block, mesh=_mesh(), in_specs=P(AXIS),
                         out_specs=P(AXIS))(x)

  for scale in (2.0, 3.0):
    for table in (big, big + 1.0):
      np.testing.assert_allclose(run(scale, table),
                                 np.sin(x) * scale + table[-1], rtol=1e-6)
