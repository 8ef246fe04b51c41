"""The pipelined demo's model (`demo.pipeline`) under the schedules that run
two chunks a device: its stages laid out for the schedule, the pipelined
value and gradient equal the model without a pipeline (the check
`jax-overlap demo --pipeline` prints). 1F1B's path is demo_test.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap._src.demo import model, pipeline

pytestmark = pytest.mark.newest_jax

STAGES, FSDP = 4, 2


#: DualPipeV lays its stages out as ZB-V does (the same V) and runs through
#: the same demo code; its m >= 2p would double this test's compile time.
@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_two_chunk_schedules_equal_the_model(schedule):
  cfg = model.Config(vocab=8, d=16, heads=2, hidden=32, layers=8, seq=8)
  m = 4
  mesh = pipeline.mesh_of(STAGES, FSDP)
  params = pipeline.init(cfg, STAGES, jax.random.key(0), schedule)
  assert jax.tree.leaves(params["blocks"])[0].shape[:2] == (8, 1)
  tokens = jax.random.randint(jax.random.key(1), (m * FSDP, cfg.seq), 0, cfg.vocab)
  targets = jnp.roll(tokens, -1, axis=1)
  # the stages' weights gathered once (a plain stage: a quarter of the
  # fsdp_scan stage's compile time; the fsdp_scan stage is demo_test.py's)
  loss = pipeline.pipelined_loss(cfg, mesh, pipeline.specs(params), m, schedule,
                                 gather_once=True)
  got = jax.jit(jax.value_and_grad(loss))(params, tokens, targets)
  want = jax.jit(jax.value_and_grad(pipeline.sequential_loss(cfg, STAGES, schedule)))(
      params, tokens, targets)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))


def test_the_layout_is_the_schedules():
  """ZB-V's V: device 0 holds stages 0 and 7 (blocks 0 and 7)."""
  cfg = model.Config(vocab=8, d=16, heads=2, hidden=32, layers=8, seq=8)
  plain = pipeline.init(cfg, STAGES, jax.random.key(0))
  v = pipeline.init(cfg, STAGES, jax.random.key(0), "zb-v")
  a, b = (jax.tree.leaves(p["blocks"])[0] for p in (plain, v))
  np.testing.assert_array_equal(b[1, 0], a[3, 1])    # entry 1 = stage 7 = block 7
  np.testing.assert_array_equal(b[0, 0], a[0, 0])
