"""Staying up: `fsdp_scan` trains 24 layers x 30 steps on 8 CPU devices.

The training runs in a fresh subprocess under a timeout, so that an abort
(XLA's "Check failed: id < num_threads" in a collective's rendezvous, or a
segfault) or a hang ("Termination timeout for 'all gather ...'") is a clear
test failure with the tail of its stderr, not a dead pytest process.

What it guards: XLA's CPU runtime starts a collective that follows a while
loop while the loop still runs, when the collective's operands do not come
from the loop, and jax keys every collective's rendezvous alike (channel id
1). `lax.scan(..., unroll=2)` over an odd number of layers runs its last
iteration after the loop, and that iteration's gathers read only the
params: the process aborted within a few steps. `fsdp_scan` now runs those
iterations before the loop. 24 layers: 23 forward iterations and 22
backward ones, one of each parity regime. The standalone reproduction is
benchmarks/repro_cpu_loop_collectives.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("optax", reason="needs optax (a test-only dependency)")

LAYERS, STEPS = 24, 30

PROGRAM = textwrap.dedent(f"""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np, optax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_overlap import fsdp_scan
    from jax_overlap._src.demo import model

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = model.Config(vocab=16, d=64, heads=2, hidden=128, layers={LAYERS},
                       seq=48)
    params = model.init(cfg, jax.random.PRNGKey(0))
    specs = model.specs(params, "d")
    run = lambda block, x, blocks: fsdp_scan(block, x, blocks, axis="d",
                                             unroll=2, params_first=True)

    @jax.shard_map(mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P())
    def loss(params, tokens, targets):
      out = model.logits(cfg, params, tokens, run)
      return lax.pmean(model.cross_entropy(out, targets), "d")

    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, tokens, targets):
      value, grads = jax.value_and_grad(loss)(params, tokens, targets)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    params = jax.device_put(
        params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    # The step count on the mesh, where the step returns it: one compile
    # (optax makes it on one device; the second step compiled again, 6 CPU-s).
    opt_state = jax.tree.map(
        lambda a: a if isinstance(a.sharding, NamedSharding)
        else jax.device_put(a, NamedSharding(mesh, P())), optimizer.init(params))
    rng = np.random.default_rng(0)
    for i in range({STEPS}):
      tokens = jnp.asarray(rng.integers(0, 16, (16, 49)), jnp.int32)
      params, opt_state, value = step(params, opt_state, tokens[:, :-1],
                                      tokens[:, 1:])
      value = float(value)
      assert np.isfinite(value), (i, value)
    print("trained", {STEPS}, "steps, last loss", value)
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_fsdp_scan_trains_24_layers_30_steps_without_abort_or_hang():
  env = dict(os.environ)
  src = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "src")
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.abspath(src)] + [p for p in [env.get("PYTHONPATH")] if p])
  env.pop("XLA_FLAGS", None)
  try:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env,
                          capture_output=True, text=True, timeout=420)
  except subprocess.TimeoutExpired as e:
    tail = (e.stderr or b"")[-3000:]
    tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    pytest.fail(f"training hung (no result after {e.timeout} s); stderr "
                f"tail:\n{tail}")
  how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
         else f"exit status {proc.returncode}")
  assert proc.returncode == 0, (
      f"training {LAYERS} layers x {STEPS} steps died ({how}); stderr "
      f"tail:\n{proc.stderr[-3000:]}")
  assert f"trained {STEPS} steps" in proc.stdout, proc.stdout
