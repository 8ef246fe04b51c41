"""`pvary_start` on the real TPU v5e and H100 compilers, ahead of time: the
backward's sum of a replicated scale's gradient is an async pair with the
backward of the window's matmuls in flight (on the v5e `psum_start`'s
copies form, an all-to-all, whose buffer rides the forward's in-flight
slot: broadcast.py); nothing synchronous, nothing said."""

from __future__ import annotations

import warnings

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, compiled_text, target

import jax_overlap
from jax_overlap import program_order
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

#: target -> the async pair of the backward's sum
KIND = {"tpu_v5e": "all-to-all", "gpu_h100": "all-reduce"}


@pytest.mark.parametrize("name", sorted(KIND))
def test_the_gradients_sum_is_in_flight_beside_the_backward_matmuls(name):
  t = target(name)

  def loss(scale, x, w):
    @program_order(enforce=True)
    def body(scale, x, w):
      fut = jax_overlap.pvary_start(scale, "x")
      h = jnp.tanh(x @ w)
      h = jnp.tanh(h @ w)
      return h * fut.done()
    return jax.lax.psum(jnp.sum(body(scale, x, w) ** 2), "x")

  fn = jax.value_and_grad(jax.shard_map(
      loss, mesh=t.mesh, in_specs=(P(), P("x"), P()), out_specs=P()),
      argnums=(0, 1))   # (not w: its own implicit cast would be a psum in the block)
  not_async._warned.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = compiled_text(fn, arg(t, (16,)), arg(t, (64, 16), P("x")),
                         arg(t, (16, 16)))
  warned = [str(w.message) for w in caught
            if issubclass(w.category, jax_overlap.CollectiveNotAsyncWarning)]
  sums = [w for w in schedule.windows(text) if w.kind == KIND[name]]
  assert any(w.matmuls for w in sums), schedule.windows(text)
  assert not warned, warned
