"""An all-reduce that autodiff inserted gets autodiff's hint, not "use
jax_overlap.psum_start", also where XLA combined it with the loss's `pmean`
(analysis._from_autodiff; the real compilers: tests/aot/report_hints_compiled_test.py).

tests/fixtures/hlo/tpu_combined_autodiff_all_reduce.txt is `compile().as_text()`
of `jax.jit(jax.value_and_grad(loss))` for TPU v5e 2x4 (jax 0.12.0.1, libtpu
0.0.52), where `loss(w, x)` is a shard_map (in_specs `P()` for w, `P("d")` for
x) returning `pmean(sum(tanh(x @ w)), "d")`: XLA combined the loss's pmean and
w's gradient sum into one all-reduce named after the pmean."""

from __future__ import annotations

import pathlib

from jax_overlap import OverlapReport
from jax_overlap._src.inspection.report import analysis

FIXTURE = (pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
           / "tpu_combined_autodiff_all_reduce.txt")


def test_a_combined_all_reduce_holding_a_gradient_is_autodiffs():
  text = FIXTURE.read_text()
  # The combined collective carries the forward pass's name...
  assert 'op_name="jit(loss)/jvp()/shard_map/psum_invariant"' in text
  report = OverlapReport.from_hlo(FIXTURE, hardware="v5e")
  (c,) = report.collectives
  assert c.kind == "all-reduce" and not c.is_async
  # ...and its gradient element says where it came from.
  assert analysis.FROM_AUTODIFF in c.flags
  hints = " ".join(str(report).split("What to change:")[1:])
  assert "autodiff inserted" in hints
  assert "use jax_overlap.psum_start" not in hints


def test_a_combined_all_reduce_of_forward_sums_keeps_the_future_hint():
  # The same collective with the gradient element renamed to the forward
  # pass: nothing autodiff wrote is in it, so psum_start is the advice.
  text = FIXTURE.read_text().replace(
      'op_name="jit(loss)/transpose(jvp())/shard_map/psum_invariant"',
      'op_name="jit(loss)/jvp()/shard_map/psum_invariant"')
  assert "transpose(" not in text.split("%all-reduce = ")[1].split("ROOT")[0]
  report = OverlapReport.from_hlo(text, hardware="v5e")
  (c,) = report.collectives
  assert analysis.FROM_AUTODIFF not in c.flags
  assert "use jax_overlap.psum_start" in str(report)
