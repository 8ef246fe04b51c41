"""The pipeline's tick gate (xla/tick_gate.py): a barrier lowered for TPU only,
where its quirks row says so (jax >= 0.12); nothing, and no lookup, for any
other platform or older jax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap._src import _compat, quirks
from jax_overlap._src.xla import tick_gate as gate


def _lowered(platform, f=None):
  f = f or (lambda w, s: gate.tick_gate([w * 2.0, s]))
  return jax.jit(f).trace(jnp.ones((4, 3)), jnp.float32(1.0)).lower(
      lowering_platforms=(platform,)).as_text()


def test_lowered_for_tpu_it_is_one_barrier_over_the_values(monkeypatch):
  asked = []
  monkeypatch.setattr(quirks, "applies",
                      lambda name, platform, kind=None: asked.append(
                          (name, platform)) or True)
  text = _lowered("tpu")
  if _compat.ASYNC_CUSTOM_CALLS:
    assert text.count("stablehlo.optimization_barrier") == 1, text
    assert asked == [(gate.QUIRK, "tpu")]
  else:   # plain-future gathers stay in their tick: no gate, no lookup
    assert "optimization_barrier" not in text and not asked


def test_where_the_row_does_not_apply_tpu_gets_no_barrier(monkeypatch):
  monkeypatch.setattr(quirks, "applies", lambda *a, **k: False)
  assert "optimization_barrier" not in _lowered("tpu")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_other_platforms_get_no_barrier_and_never_ask(monkeypatch, platform):
  def asked(*a, **k):
    raise AssertionError("quirks asked off TPU")
  monkeypatch.setattr(quirks, "applies", asked)
  assert "optimization_barrier" not in _lowered(platform)


def test_values_and_derivatives_pass_unchanged():
  f = lambda w, s: sum(jnp.sum(v ** 2) for v in gate.tick_gate([w, s]))
  w, s = jnp.arange(6.0).reshape(2, 3), jnp.float32(3.0)
  gw, gs = jax.jit(jax.grad(f, argnums=(0, 1)))(w, s)
  np.testing.assert_allclose(gw, 2 * w)
  np.testing.assert_allclose(gs, 2 * s)
  out = jax.vmap(lambda a: gate.tick_gate([a])[0])(w)
  np.testing.assert_allclose(out, w)
