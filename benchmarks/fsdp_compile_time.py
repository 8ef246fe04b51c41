"""Benchmark, ahead of time: how long the TPU v5e compiler takes over
fsdp_scan's train step, against the same layers as a plain `lax.scan` in
`shard_map` (issue 45's target: at most 1.5x), on one chip.

  python benchmarks/fsdp_compile_time.py [--rounds 3] [--dtypes float32 bfloat16]
      [--variants 'fsdp_scan' 'shard_map, lax.scan' ...] [--chips 1|8]

The train step is the chip benchmarks' (`chip_programs.train_loss`: the demo
transformer, 8 layers, width 1024, hidden 4096, 16x128 tokens,
`value_and_grad` plus an SGD update), on a 1-device mesh of a described
one-chip v5e topology ('v5e:1x1', one chip a host), its arguments abstract
(nothing runs). Each round lowers every variant anew (a lowered program
keeps its executable) and compiles it, the order reversed every other
round; one line a compile (wall and CPU seconds: the compiler's threads
summed, the steadier figure on a shared machine), then each variant's
median CPU and wall ratio to 'shard_map, lax.scan'. 'shard_map, lax.scan,
layer 0 peeled' is the plain scan with layer 0 run before the loop (in
both passes, as autodiff gives it): what one copy of the layer outside the
loops costs. `--chips 8`: the same on a v5e 2x4 slice (the batch over its
8 chips), where fsdp_scan's gathers move and layer 0 is split by use
order (docs/fsdp.md).

Run it with the compiler the chip has: the chip of docs/fsdp.md ran jax
0.10.2 with libtpu 0.0.42.1, as .venv-aot-jax0.10.2 here:

  PYTHONPATH=src .venv-aot-jax0.10.2/bin/python benchmarks/fsdp_compile_time.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BASE = "shard_map, lax.scan"
PEELED = "shard_map, lax.scan, layer 0 peeled"
VARIANTS = ("fsdp_scan", BASE, "fsdp_scan bucket=False", "jit, lax.scan",
            PEELED)


def v5e_mesh(chips: int = 1):
  """A mesh (axis 'd') over a described v5e slice of `chips` (1 or 8)."""
  import jax  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  if chips == 1:
    topo = topologies.get_topology_desc(topology_name="v5e:1x1",
                                        platform="tpu",
                                        chips_per_host_bounds=(1, 1, 1))
  else:
    topo = topologies.get_topology_desc(topology_name="v5e:2x4",
                                        platform="tpu")
  return jax.sharding.Mesh(list(topo.devices), (cp.AXIS,))


def peeled_loss(mesh, specs):
  """'shard_map, lax.scan' with layer 0 run before the loop."""
  import jax  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  from jax_overlap._src.demo import model  # noqa: PLC0415
  cfg = cp.train_config()
  gather = lambda shard: jax.tree.map(
      lambda a: lax.all_gather(a, cp.AXIS, axis=0, tiled=True), shard)

  def peeled(block, x, blocks):
    x = block(x, gather(jax.tree.map(lambda a: a[0], blocks)))
    return lax.scan(lambda x, shard: (block(x, gather(shard)), None), x,
                    jax.tree.map(lambda a: a[1:], blocks))[0]

  @jax.shard_map(mesh=mesh, in_specs=(specs, P(cp.AXIS), P(cp.AXIS)),
                 out_specs=P())
  def loss(params, tokens, targets):
    return lax.pmean(model.cross_entropy(
        model.logits(cfg, params, tokens, peeled), targets), cp.AXIS)
  return loss


def train_step(variant: str, dtype, mesh):
  """(train step, abstract args) of `variant` on `mesh`, params in `dtype`."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  from jax_overlap._src.demo import training  # noqa: PLC0415
  cfg = cp.train_config()
  specs, params = training.abstract_params(cfg, mesh)
  params = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding)
      if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
  tokens = jax.ShapeDtypeStruct((cp.TRAIN["batch"], cfg.seq), jnp.int32,
                                sharding=NamedSharding(mesh, P(cp.AXIS)))
  loss = peeled_loss(mesh, specs) if variant == PEELED else \
      cp.train_loss(variant, mesh, specs)

  def step(params, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value
  return jax.jit(step), (params, tokens, tokens)


def measure(variants, dtypes, rounds: int, chips: int):
  import jax.numpy as jnp  # noqa: PLC0415
  mesh = v5e_mesh(chips)
  times = {}
  for r in range(rounds):
    for dtype in dtypes:
      for variant in (variants if r % 2 == 0 else variants[::-1]):
        fn, args = train_step(variant, jnp.dtype(dtype), mesh)
        lowered = fn.lower(*args)
        t0, c0 = time.perf_counter(), time.process_time()
        lowered.compile()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        times.setdefault((dtype, variant), []).append((wall, cpu))
        print(f"round {r}, {dtype}, {variant}: compile {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU (load {os.getloadavg()[0]:.1f})", flush=True)
  return times


def table(times, variants, dtypes) -> str:
  lines = ["| dtype | variant | compile, CPU (s) | / plain scan | compile, wall (s) "
           "| / plain scan |", "|---|---|---|---|---|---|"]
  for dtype in dtypes:
    med = {v: (statistics.median(w for w, _ in times[dtype, v]),
               statistics.median(c for _, c in times[dtype, v]))
           for v in variants}
    base = med.get(BASE)
    for v in variants:
      wall, cpu = med[v]
      ratio = lambda k: f"{med[v][k] / base[k]:.2f}x" if base else "-"
      lines.append(f"| {dtype} | {v} | {cpu:.1f} | {ratio(1)} | {wall:.1f} | "
                   f"{ratio(0)} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--variants", nargs="+", default=["fsdp_scan", BASE],
                      choices=VARIANTS)
  parser.add_argument("--chips", type=int, default=1, choices=(1, 8))
  opts = parser.parse_args()
  import jax  # noqa: PLC0415
  import libtpu  # noqa: F401, PLC0415 - the compiler this measures
  times = measure(opts.variants, opts.dtypes, opts.rounds, opts.chips)
  try:
    import importlib.metadata as md  # noqa: PLC0415
    libtpu_version = md.version("libtpu")
  except Exception:  # noqa: BLE001
    libtpu_version = "unknown"
  where = "one chip" if opts.chips == 1 else "2x4, 8 chips"
  print(f"\nTPU v5e ({where}, ahead of time), jax {jax.__version__}, libtpu "
        f"{libtpu_version}, medians of {opts.rounds} rounds:")
  print(table(times, opts.variants, opts.dtypes))


if __name__ == "__main__":
  main()
