"""A switch tick's row buffers (the kept stage inputs, cotangents and
residuals) start unfilled, and a branch's row writes are made after its
`conditional` (executor.py `_unset_rows`, row_writes.py): filled with NaN
instead, every schedule still gives the sequential model's values and
gradients, so no row is read before the device that reads it wrote it.
What the compiled program gains: tests/aot/pipeline_compiled_test.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap._src.patterns.pipeline import executor
from pipeline_model import SCHEDULES, TOL, model, pipelined_loss, sequential_loss


def _nan_rows(a, n):
  return jnp.full((n,) + jnp.shape(a), jnp.nan, a.dtype)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute"])
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_no_row_is_read_before_it_is_written(schedule, v, recompute, monkeypatch):
  monkeypatch.setattr(executor, "_unset_rows", _nan_rows)
  p, m = 2, 4
  params, xs, ts = model(p * v, m)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, xs, ts)
  want = grad(sequential_loss)
  got = grad(pipelined_loss(p, schedule=schedule, virtual_stages=v,
                            dispatch="switch", recompute=recompute))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, **TOL)


def test_the_nan_rows_are_used():
  """The test above is not vacuous: the switch program starts its row
  buffers from `_unset_rows` (a NaN row read would make a value NaN)."""
  called = []

  def spy(a, n):
    called.append(n)
    return _nan_rows(a, n)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(executor, "_unset_rows", spy)
    params, xs, ts = model(2, 4)
    jax.jit(jax.value_and_grad(pipelined_loss(2, schedule="1f1b", dispatch="switch",
                                              recompute=False)))(params, xs, ts)
  assert called
