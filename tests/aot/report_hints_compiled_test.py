"""What the report says about programs the real compilers compiled, ahead of
time: the gradient of a `P()` weight beside a `pmean`ed loss gets autodiff's
hint, not "use jax_overlap.psum_start", also where XLA combines the two sums
into one all-reduce named after the pmean (TPU v5e does;
report/analysis.py `_from_autodiff`)."""

from __future__ import annotations

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest
from compilers import P, arg, compiled_text, target

from jax_overlap import OverlapReport
from jax_overlap._src.inspection.report import analysis

pytestmark = pytest.mark.newest_jax(older_jax=["*"])


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_the_gradient_of_a_replicated_weight_gets_autodiffs_hint(name):
  t = target(name)

  def loss(w, x):
    @jax.shard_map(mesh=t.mesh, in_specs=(P(), P("x")), out_specs=P())
    def f(w, x):
      return jax.lax.pmean(jnp.sum(jnp.tanh(x @ w)), "x")
    return f(w, x)
  text = compiled_text(jax.value_and_grad(loss), arg(t, (1024, 1024)),
                       arg(t, (4096, 1024), P("x")))
  report = OverlapReport.from_hlo(text)
  reduces = [c for c in report.collectives if c.kind == "all-reduce"]
  assert reduces, report.table()
  # The gradient's sum (4 MiB; the loss is a scalar) is flagged...
  big = max(reduces, key=lambda c: c.bytes)
  assert big.bytes >= 1024 * 1024 * 4
  if not big.is_async:
    assert analysis.FROM_AUTODIFF in big.flags, big
  # ...and nothing says to make it a psum_start.
  assert "use jax_overlap.psum_start" not in str(report), str(report)
