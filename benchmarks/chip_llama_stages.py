"""Benchmark, on a chip: the 4-D model's streamed stages against the plain
blocks, with nothing to hide (a 1-device mesh).

  python benchmarks/chip_llama_stages.py --stage tp [--dtypes float32 bfloat16]
  python benchmarks/chip_llama_stages.py --stage ep [--dtypes float32 bfloat16]
  python benchmarks/chip_llama_stages.py --stage tp --tiny   # a smoke run, any backend

examples/llama_4d.py's pipeline plans run a stage's blocks as a stream of
sequence chunks, so that each block's collectives have the other chunk's
compute beside them: `chunked_stream` (`--stage tp`, the psum plan's TP sums,
NVIDIA's Domino) and `moe_stream` (`--stage ep`, the expert plan's all-to-alls
through `expert_stream`). On one device the collectives move nothing, so each
variant's time against the plain block's is the stream's own compute cost.
Prints the median wall time of `value_and_grad(sum(stage(x)))` over warm
steps (each to `block_until_ready`) for every variant, its ratio to the
first (the plain block), and a JSON line of them all. The measured figures
are in docs/pipeline.md ("The four plans on the real compilers").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import llama_4d as L  # noqa: E402

import jax_overlap  # noqa: E402

# (d, heads, kv_heads, head_dim, hidden, experts, batch, sequence, layers)
SIZES = {
    "tp": [(2048, 16, 8, 128, 5632, 0, 2, 2048, 2), (1024, 8, 4, 128, 2816, 0, 4, 1024, 2)],
    "ep": [(1024, 8, 4, 128, 1408, 8, 2, 1024, 2), (2048, 16, 8, 128, 1408, 8, 2, 1024, 2)],
}
TINY = {"tp": (64, 4, 2, 16, 128, 0, 2, 64, 2), "ep": (64, 4, 2, 16, 64, 4, 2, 64, 2)}


def unrolled(step, layers):
  """The layers one after the other: `step(w_layer, x) -> x`."""
  def run(w, x):
    for i in range(layers):
      x = step(jax.tree.map(lambda a: a[i], w), x).astype(x.dtype)
    return x
  return run


def expert_block(chunks):
  """A block whose MoE is one `expert_parallel` call (the plans without a
  pipeline): capacity the tokens, so none drops."""
  def moe(h, w):
    ids, weights = L.route(h, w["router"])
    experts = {k: w[k] for k in ("w_gate", "w_up", "w_down")}
    y, _ = jax_overlap.expert_parallel(L.expert, h, ids, weights, experts, axis="ep",
                                       capacity=h.shape[0], chunks=chunks)
    return y
  return lambda wl, x: L.block(x, wl, L.Parallel(moe=moe))


def variants(stage: str, layers: int) -> dict:
  """name -> `stage(w [layers, ...], x) -> x`, the plain block first."""
  if stage == "tp":
    return {
        "block unrolled": unrolled(lambda wl, x: L.block(x, wl), layers),
        "block lax.scan": lambda w, x: jax.lax.scan(
            lambda x, wl: (L.block(x, wl).astype(x.dtype), None), x, w)[0],
        "chunked_stream chunks=1": lambda w, x: L.chunked_stream(x, w, "tp", chunks=1),
        "chunked_stream chunks=2": lambda w, x: L.chunked_stream(x, w, "tp", chunks=2),
    }
  return {
      "block expert_parallel chunks=1": unrolled(expert_block(1), layers),
      "block expert_parallel chunks=2": unrolled(expert_block(2), layers),
      "moe_stream chunks=1": unrolled(lambda wl, x: L.moe_stream(x, wl, "ep", chunks=1), layers),
      "moe_stream chunks=2": unrolled(lambda wl, x: L.moe_stream(x, wl, "ep", chunks=2), layers),
  }


def measure(stage, size, dtype, steps):
  """{variant: median ms} of one size and dtype."""
  d, heads, kv, hd, hidden, experts, b, s, layers = size
  cfg = L.Config(vocab=64, d=d, heads=heads, kv_heads=kv, head_dim=hd, hidden=hidden,
                 layers=layers, experts=experts)
  w = jax.tree.map(lambda a: a.astype(dtype), L.init(cfg, jax.random.key(0))["blocks"])
  x = (jax.random.normal(jax.random.key(1), (b, s, d)) * 0.5).astype(dtype)
  mesh = jax.make_mesh((1,), (stage,), axis_types=(jax.sharding.AxisType.Auto,))
  out = {}
  for name, run in variants(stage, layers).items():
    def loss(w, x, run=run):
      f = jax.shard_map(lambda w, x: jnp.sum(run(w, x).astype(jnp.float32))[None],
                        mesh=mesh, in_specs=(P(), P()), out_specs=P(stage))
      return f(w, x).sum()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(w, x))
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      jax.block_until_ready(step(w, x))
      times.append(time.perf_counter() - t0)
    out[name] = statistics.median(times) * 1e3
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stage", choices=("tp", "ep"), required=True)
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--steps", type=int, default=15)
  ap.add_argument("--tiny", action="store_true", help="one small size, 2 steps")
  args = ap.parse_args(argv)
  sizes = [TINY[args.stage]] if args.tiny else SIZES[args.stage]
  steps = 2 if args.tiny else args.steps
  results = {}
  for dtype in args.dtypes:
    for size in sizes:
      ms = measure(args.stage, size, jnp.dtype(dtype), steps)
      base = next(iter(ms.values()))
      for name, t in ms.items():
        key = f"d{size[0]} {size[6]}x{size[7]} tokens {dtype} {name}"
        results[key] = t
        print(f"{key}: {t:.3f} ms ({t / base:.2f}x)", flush=True)
  print(json.dumps(results))


if __name__ == "__main__":
  main()
