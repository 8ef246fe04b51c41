"""fsdp_scan on an explicit mesh: which moves the real compilers overlap, with
and without the GPU step ties (src/jax_overlap/_src/xla/gpu_ties.py).

A diagnostic, not part of `make bench`: it compiles (ahead of time, nothing
runs) fsdp_scan's forward and value_and_grad on an Explicit mesh (4 layers of
2 weights, width W) for each target, once with the ties where the library
puts them (GPU) and once with them forced on every platform or off
(`--ties gpu|all|none`), and prints per kind: async pairs with a matmul in
flight / async pairs (each as many times as it runs: a loop body's once a
layer) / synchronous ones. On TPU with jax 0.12 the moves are futures
(patterns/fsdp/explicit_futures.py): v5e's gathers are all-gather pairs and
its reduce-scatters all-to-all forms, v5p's both N-1 collective-permutes.
TPU's own async collectives (the `async-collective-start` fusions of its
collective fusion pass) are paired by name here, as tests/aot/schedule.py
does not pair them.

    PYTHONPATH=$PWD/src JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 \\
      .venv-aot/bin/python benchmarks/explicit_mesh_windows.py --width 16 128 \\
      --ties gpu none all --targets gpu_h100 gpu_a100 tpu_v5e tpu_v5p

The counts measured are in docs/compilers.md (`fsdp_scan` on an explicit mesh).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "aot")]

import compilers  # noqa: E402,F401 - first: JAX_PLATFORMS=cpu before jax starts
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import schedule  # noqa: E402
from compilers import arg, compiled_text, target  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap._src.xla import gpu_ties as explicit_ties  # noqa: E402

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
         "collective-permute")


def program(t, grad, width, layers=4):
  def layer(p, x):
    return jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])

  def loss(x, ps):
    return jax_overlap.fsdp_scan(layer, x, ps, axis="x", params_first=True).sum()
  f = jax.value_and_grad(loss, argnums=1) if grad else loss
  w = arg(t, (layers, width, width), P(None, "x"))
  return f, (arg(t, (4 * width, width), P("x")), {"a": w, "b": w})


def _tpu_pairs(text):
  comps = schedule.computations(text)
  out = []
  for instrs in schedule.scheduled(text).values():
    index = {i.name: k for k, i in enumerate(instrs)}
    for k, i in enumerate(instrs):
      m = re.match(r"async-collective-start(\.\d+)?$", i.name)
      done = index.get("async-collective-done" + (m.group(1) or "")) if m else None
      if done is None:
        continue
      body = "\n".join(x.line for c in re.findall(r"calls=%([\w.\-]+)", i.line)
                       for x in comps.get(c, []))
      kind = next((kd for kd in KINDS if f"{kd}(" in body), "other")
      matmuls = sum("convolution" in x.line or x.is_matmul
                    for x in instrs[k + 1:done])
      out.append((kind, matmuls))
  return out


def counts(text):
  out = {}
  for kind in KINDS:
    # Each window as many times as it runs (a loop body's once a layer).
    windows = schedule.runs(text, [w for w in schedule.windows(text)
                                   if w.kind == kind])
    sync = sum(i.opcode == kind for comp in schedule.scheduled(text).values()
               for i in comp)
    out[kind] = [sum(w.matmuls >= 1 for w in windows), len(windows), sync]
  for kind, matmuls in _tpu_pairs(text):
    out[kind][0] += matmuls >= 1
    out[kind][1] += 1
  return {k: "/".join(map(str, v)) for k, v in out.items() if any(v)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--targets", nargs="+", default=["gpu_h100", "tpu_v5e"])
  ap.add_argument("--width", nargs="+", type=int, default=[16])
  ap.add_argument("--ties", nargs="+", default=["gpu", "none"],
                  choices=["gpu", "all", "none"])
  args = ap.parse_args()
  platforms = {"gpu": explicit_ties._GPU, "none": (), "all": ("cuda", "rocm", "tpu")}
  import pytest  # noqa: PLC0415 - compilers.target skips through pytest
  for name in args.targets:
    try:
      t = target(name, explicit=True)
    except BaseException as e:  # noqa: BLE001 - pytest's skip
      print(f"{name}: no compiler ({e})")
      continue
    for ties in args.ties:
      explicit_ties._GPU = platforms[ties]
      for width in args.width:
        for grad in (False, True):
          f, xs = program(t, grad, width)
          try:
            with jax.set_mesh(t.mesh):
              text = compiled_text(f, *xs)
            said = counts(text)
          except Exception as e:  # noqa: BLE001
            said = f"failed: {type(e).__name__}: {str(e)[:160]}"
          print(f"{name} ties={ties} width={width} "
                f"{'value_and_grad' if grad else 'forward'}: {said}", flush=True)
  del pytest


if __name__ == "__main__":
  main()
