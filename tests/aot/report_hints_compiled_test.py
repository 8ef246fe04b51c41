"""What the report says about programs the real compilers compiled, ahead of
time: the gradient of a `P()` weight beside a `pmean`ed loss gets autodiff's
hint, not "use jax_overlap.psum_start", also where XLA combines the two sums
into one all-reduce named after the pmean (TPU v5e does;
report/analysis.py `_from_autodiff`); `pipeline_loss`'s sum of xs's gradient
is named the pipeline's, not told to shard xs (report/summary.py
`_pipeline_sums`)."""

from __future__ import annotations

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest
from compilers import P, arg, compiled_text, target

from jax_overlap import OverlapReport
from jax_overlap._src.inspection.report import analysis
from jax_overlap._src.patterns.pipeline import tick_names

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


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_the_pipelines_sum_of_xs_gradient_is_not_told_to_shard_xs(name):
  # pipeline_loss sums xs's gradient parts over its axis (xs replicated
  # there, as it requires): the report names the sum the pipeline's and says
  # it is needed, not to shard xs (tests/patterns/pipeline/pipeline_sum_hint_test.py
  # on CPU; here what the real compilers made of it, combined or not).
  from jax_overlap import pipeline_loss  # noqa: PLC0415
  t = target(name)
  p, m, width = t.n, t.n, 256

  def loss(w, xs, ts):
    @jax.shard_map(mesh=t.mesh, in_specs=(P("x"), P(), P()), out_specs=P())
    def f(w, xs, ts):
      return pipeline_loss(lambda w, x: jnp.tanh(x @ w[0]),
                           lambda y, t: jnp.mean((y - t) ** 2), w, xs, ts,
                           axis="x")
    return f(w, xs, ts)
  text = compiled_text(jax.value_and_grad(loss, argnums=(0, 1)),
                       arg(t, (p, 1, width, width), P("x")),
                       arg(t, (m, 64, width)), arg(t, (m, 64, width)))
  report = OverlapReport.from_hlo(text)
  sums = [c for c in report.collectives if tick_names.summed(c.leaf)]
  # (TPU v5e combines it with the loss's sum: the leaf names both)
  assert any("the gradient of xs" in tick_names.summed(c.leaf) for c in sums), \
      [(c.kind, c.start, c.leaf) for c in report.collectives]
  assert all(analysis.FROM_AUTODIFF not in c.flags for c in sums), sums
  text = str(report)
  assert "shard those weights" not in text, text
  if any(c.exposed_s > 0 for c in sums):
    assert "pipeline_loss refuses xs and targets sharded over that axis" in text
