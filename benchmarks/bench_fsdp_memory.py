"""Memory of a gradient step through `fsdp_scan`, against plain scans.

For an MLP stack whose weights dominate (per device: 2 x 64 x 512 floats per
layer, a batch of 16), prints the compiled gradient step's
`memory_analysis().temp_size_in_bytes` on 8 CPU devices, for:

  (a) a plain `lax.scan` whose body all-gathers its layer's weights
      (autodiff saves every gathered weight);
  (b) the same with `jax.checkpoint` around the gather alone (the layer's
      matmul still saves its input, the gathered weight: no saving);
  (c) the same with the layer checkpointed under a policy that saves
      everything but the gather (weights rematerialized, activations saved);
  (d) the same with the layer checkpointed, nothing saved but its input;
  and fsdp_scan with its default (`unroll=None`: one layer a loop iteration)
  and unroll=2, and the default with `remat_policy`.

  python benchmarks/bench_fsdp_memory.py [--layers 8 16]

With `--target gpu_h100` (or another of tests/aot/compilers.py's targets;
run it with the real compilers' venv, .venv-aot) it prints instead the temp
bytes of fsdp_scan's memory knobs (`reshard_after_forward`, `prefetch`)
compiled ahead of time for that target: a 6-layer stack of two 256 x 256
float32 weights a layer, in units of one gathered layer (512 KiB).

  JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/bench_fsdp_memory.py \
      --target gpu_h100
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax_overlap import fsdp_scan  # noqa: E402

AXIS = "d"


def mlp_layer(w, x):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def _gather(shard):
  return jax.tree.map(lambda a: lax.all_gather(a, AXIS, axis=0, tiled=True),
                      shard)


def _not_the_gather(prim, *_, **__):
  return prim.name != "all_gather"


def setup(n_layers=8, d=64, h=512, batch=16):
  """(mesh, x, params, specs) for an MLP stack of `n_layers`."""
  mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (n_layers, d, h)) * 0.05,
            "w2": jax.random.normal(k2, (n_layers, h, d)) * 0.05}
  x = jax.random.normal(k3, (batch * 8, d))
  specs = jax.tree.map(lambda p: P(None, AXIS, None), params)
  return mesh, x, params, specs


def losses(mesh, specs):
  """name -> loss(x, params) for every variant in the module docstring."""
  def shard_mapped(per_device):
    @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), specs), out_specs=P())
    def loss(x, params):
      return lax.psum(jnp.sum(per_device(x, params) ** 2), AXIS)
    return loss

  def plain(step):
    return shard_mapped(lambda x, params: lax.scan(
        lambda x, shard: (step(x, shard), None), x, params)[0])

  gathered = lambda x, shard: mlp_layer(_gather(shard), x)
  remat_gather = jax.checkpoint(_gather)
  nothing = jax.checkpoint_policies.nothing_saveable
  ours = lambda **kw: shard_mapped(
      lambda x, params: fsdp_scan(mlp_layer, x, params, axis=AXIS,
                                  params_first=True, **kw))
  return {
      "(a) plain scan, gather saved": plain(gathered),
      "(b) plain scan, checkpoint(gather)": plain(
          lambda x, s: mlp_layer(remat_gather(s), x)),
      "(c) plain scan, layer checkpointed, all but the gather saved": plain(
          jax.checkpoint(gathered, policy=_not_the_gather)),
      "(d) plain scan, layer checkpointed, nothing saved": plain(
          jax.checkpoint(gathered, policy=nothing)),
      "fsdp_scan, unroll=None (default: 1 layer an iteration)": ours(),
      "fsdp_scan, unroll=2": ours(unroll=2),
      "fsdp_scan, unroll=None, remat_policy=nothing_saveable": ours(
          remat_policy=nothing),
  }


def temp_bytes(loss, x, params) -> int:
  compiled = jax.jit(jax.grad(loss, argnums=1)).lower(x, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def figures(n_layers: int) -> dict[str, int]:
  mesh, x, params, specs = setup(n_layers)
  return {name: temp_bytes(loss, x, params)
          for name, loss in losses(mesh, specs).items()}


KNOBS = {   # setting: fsdp_scan keyword arguments
    "reshard_after_forward=1, prefetch=1 (default)": {},
    "reshard_after_forward=True": dict(reshard_after_forward=True),
    "reshard_after_forward=2": dict(reshard_after_forward=2),
    "reshard_after_forward=False": dict(reshard_after_forward=False),
    "reshard_after_forward=True, prefetch=2":
        dict(reshard_after_forward=True, prefetch=2),
    "reshard_after_forward=True, prefetch=3":
        dict(reshard_after_forward=True, prefetch=3),
    "prefetch=2 (reshard_after_forward=1)": dict(prefetch=2),
}


def knob_figures(target_name: str, n_layers: int = 6, width: int = 256):
  """setting -> temp bytes of the value_and_grad step compiled for
  `target_name` by its own compiler (tests/aot/compilers.py)."""
  import pathlib  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "aot"))
  import compilers  # noqa: PLC0415
  t = compilers.target(target_name)

  def layer(p, x):
    return jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])
  spec = {"a": P(None, "x"), "b": P(None, "x")}
  w = compilers.arg(t, (n_layers, width, width), P(None, "x"))
  args = (compilers.arg(t, (8 * t.n, width), P("x")), {"a": w, "b": w})
  out = {}
  for name, kw in KNOBS.items():
    def loss(x, ps, kw=kw):
      return fsdp_scan(layer, x, ps, axis="x", params_first=True,
                       **kw).sum()[None]
    fwd = jax.shard_map(loss, mesh=t.mesh, in_specs=(P("x"), spec),
                        out_specs=P("x"))
    step = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
    compiled = jax.jit(step).lower(*args).compile()
    out[name] = compiled.memory_analysis().temp_size_in_bytes
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[8, 16])
  parser.add_argument("--target", default=None,
                      help="a real compiler's target (e.g. gpu_h100): the "
                      "memory knobs' temp bytes there")
  parsed = parser.parse_args()
  if parsed.target:
    layer_bytes = 2 * 256 * 256 * 4
    figures_ = knob_figures(parsed.target)
    print(f"jax {jax.__version__}, {parsed.target}: temp bytes of the "
          "gradient step, 6 layers (one gathered layer: 512 KiB)\n")
    print("| setting | temp bytes | in gathered layers |")
    print("|---|---|---|")
    for name, temp in figures_.items():
      print(f"| {name} | {temp / 2**20:.2f} MiB | {temp / layer_bytes:.2f} |")
    return
  layers = parsed.layers
  table = {n: figures(n) for n in layers}
  weight = 2 * 64 * 512 * 4
  print(f"jax {jax.__version__}; temp bytes of the gradient step per device "
        f"(one layer's gathered weights: {weight // 1024} KiB)\n")
  print("| variant | " + " | ".join(f"{n} layers" for n in layers) + " |")
  print("|---|" + "---|" * len(layers))
  for name in table[layers[0]]:
    cells = " | ".join(f"{table[n][name] / 2**20:.2f} MiB" for n in layers)
    print(f"| {name} | {cells} |")


if __name__ == "__main__":
  main()
