"""XLA:CPU runs a collective that follows a while loop during the loop.

What it shows: `fsdp_scan` (attention + MLP block, d=64, 12 layers,
unroll=2, jitted `value_and_grad`, 8 CPU devices) as it was before the
workaround, i.e. with `lax.scan(..., unroll=2)` running the iteration that
does not fill a loop trip *after* the while loop (`--as-before`, the
default), and with the workaround (`--workaround`).

The mechanism (from XLA_FLAGS=--xla_dump_to and TF_CPP_VMODULE=
all_gather_thunk=3,collective_thunk=3): the remainder iteration's gathers
read only the params; `program_order`'s optimization barriers order them
after the loop in the HLO schedule, but XLA's CPU runtime drops barriers and
orders collectives only by a "scheduling" edge (start after the previous one
started); a while loop whose body runs concurrently counts as started at
once. So on some devices the remainder's gather runs while the loop's
gathers are still in flight. jax gives every collective channel id 1 and the
in-process rendezvous is keyed by (run, devices, channel id), so gathers of
the loop and of the remainder meet in one rendezvous: the process aborts
("rendezvous.h:314] Check failed: id < num_threads (9 vs. 8) ... all
gather ... op_id=1"), segfaults (gathers of different sizes mixed), or hangs
40 s and aborts ("Termination timeout for 'all gather ...'").

Seen with jax/jaxlib 0.12.0.1 and 0.11.0; 0.10.2 ran (its CPU pipeline drops
the barriers before scheduling, so the remainder is not held after the
loop). d=16 runs: XLA then runs every loop body sequentially. Giving our
collectives their own channel ids does not help: jax lowers the scan body
once and the copies keep its ids. A plain-jax emulation (scan + barriers +
lax.all_gather) did not abort in 30 steps in our tries, so this script uses
jax_overlap.

  timeout 300 python benchmarks/repro_cpu_loop_collectives.py              # aborts
  timeout 300 python benchmarks/repro_cpu_loop_collectives.py --workaround # runs

tests/fsdp_staying_up_test.py trains 24 layers x 30 steps through the fix.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_overlap import fsdp_scan  # noqa: E402
from jax_overlap._src.demo import model  # noqa: E402
from jax_overlap._src.patterns.fsdp import engine as fsdp_scan_module  # noqa: E402


def _remainder_last(body, carry, xs, unroll):
  """lax.scan as it is: the remainder iteration runs after the loop."""
  return lax.scan(body, carry, xs, unroll=unroll)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workaround", action="store_true")
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args()
  if not args.workaround:
    fsdp_scan_module._scan_remainder_first = _remainder_last
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  cfg = model.Config(vocab=16, d=64, heads=2, hidden=128, layers=args.layers,
                     seq=48)
  params = model.init(cfg, jax.random.PRNGKey(0))
  specs = model.specs(params, "d")
  run = lambda block, x, blocks: fsdp_scan(block, x, blocks, axis="d", unroll=2,
                                           params_first=True)

  @jax.shard_map(mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P())
  def loss(params, tokens, targets):
    return lax.pmean(model.cross_entropy(
        model.logits(cfg, params, tokens, run), targets), "d")

  @jax.jit
  def step(params, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads), value

  params = jax.device_put(
      params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  tokens = jnp.zeros((16, cfg.seq), jnp.int32)
  for i in range(args.steps):
    params, value = step(params, tokens, tokens)
    print(f"step {i}: loss {float(value):.5f}", flush=True)
  print("ran", args.steps, "steps without abort or hang")


if __name__ == "__main__":
  main()
