"""Benchmark, on a chip: the 4-D model's streamed stages against the plain
blocks, with nothing to hide (a 1-device mesh).

  python benchmarks/chip_llama_stages.py --stage tp [--dtypes float32 bfloat16]
  python benchmarks/chip_llama_stages.py --stage ep [--dtypes float32 bfloat16]
  python benchmarks/chip_llama_stages.py --stage fb [--dtypes float32 bfloat16]
  python benchmarks/chip_llama_stages.py --stage tp --tiny   # a smoke run, any backend

examples/llama_4d.py's pipeline plans run a stage's blocks as a stream of
sequence chunks, so that each block's collectives have the other chunk's
compute beside them: `chunked_stream` (`--stage tp`, the psum plan's TP sums,
NVIDIA's Domino) and `moe_stream` (`--stage ep`, the expert plan's all-to-alls
through `expert_stream`). On one device the collectives move nothing, so each
variant's time against the plain block's is the stream's own compute cost.
`--stage fb` times a DualPipeV F&B cell of the expert blocks (one
microbatch's forward, another's backward, the backward recomputing its
forward as on TPU) as written against the same cell zipped at its
all-to-all futures (ordering/interleave.py, what `pipeline_loss` runs): the
zip's own compute cost.
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
SIZES["fb"] = SIZES["ep"]
TINY = {"tp": (64, 4, 2, 16, 128, 0, 2, 64, 2), "ep": (64, 4, 2, 16, 64, 4, 2, 64, 2)}
TINY["fb"] = TINY["ep"]


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


def fb_cell(layers):
  """`(w, x1, x2, dy) -> (y1, grads of x2's blocks)`: the forward of x1 and
  the backward of x2, in the executor's scopes."""
  from jax_overlap._src.patterns.varying import vary_over, varying
  stage = unrolled(expert_block(2), layers)

  def cell(w, x1, x2, dy):
    with jax.named_scope("pair_forward"):
      y1 = stage(w, x1)
    with jax.named_scope("pair_backward"):
      y2, pull = jax.vjp(stage, w, x2)
      grads = pull(vary_over(dy, tuple(varying(y2))))
    return y1, grads
  return cell


def _median_ms(step, *args, steps):
  jax.block_until_ready(step(*args))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def _exchanging_on_one_device():
  """On one device the MoE transport hands the buffers over without an
  all-to-all; made to start its all-to-all futures anyway (over the one
  device, moving nothing), the cell has the structure the zip works on."""
  from jax_overlap._src.patterns.moe import transport as T
  start = T.PaddedTransport._start
  if getattr(start, "exchanging", False):   # once a process
    return
  T.PaddedTransport._start = lambda self, *b: start(
      self._replace(size=-1) if self.size == 1 else self, *b)
  T.PaddedTransport._start.exchanging = True


def measure_fb(size, dtype, steps):
  """{variant: median ms}: the F&B cell as written, then zipped."""
  from jax_overlap._src.ordering.interleave import interleaved
  _exchanging_on_one_device()
  d, heads, kv, hd, hidden, experts, b, s, layers = size
  cfg = L.Config(vocab=64, d=d, heads=heads, kv_heads=kv, head_dim=hd, hidden=hidden,
                 layers=layers, experts=experts)
  w = jax.tree.map(lambda a: a.astype(dtype), L.init(cfg, jax.random.key(0))["blocks"])
  xs = [(jax.random.normal(jax.random.key(k), (b, s, d)) * 0.5).astype(dtype)
        for k in (1, 2, 3)]
  mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
  cell = fb_cell(layers)
  out = {}
  for name, fn in (("F&B as written", cell),
                   ("F&B zipped", interleaved(cell, ("pair_forward", "pair_backward")))):
    step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P("ep")))
    out[name] = _median_ms(step, w, *xs, steps=steps)
  return out


def measure(stage, size, dtype, steps):
  """{variant: median ms} of one size and dtype."""
  if stage == "fb":
    return measure_fb(size, dtype, steps)
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
    out[name] = _median_ms(step, w, x, steps=steps)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stage", choices=("tp", "ep", "fb"), required=True)
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
