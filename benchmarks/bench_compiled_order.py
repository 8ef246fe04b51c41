"""Benchmark: what keeping the order in the compiled CPU program costs per call.

On jaxlibs whose CPU compiler drops barriers before scheduling (jax 0.10.2,
0.11.0), jax_overlap compiles ordered modules with XLA's barrier expander
disabled, and, where the module has a loop, small-while-loop hoisting too.
This prints, per call, as ratios measured in one run:
  * an unordered module with a small loop, compiled as is and with hoisting
    disabled (what the loop rule alone costs);
  * the same loop with an ordered body, against unordered (ordering itself:
    no fusion across steps, plus the above where it applies);
  * a loop-free ordered body with independent branches against unordered
    (kept barriers also keep XLA's CPU runtime from running independent
    kernels at the same time);
  * 64 dependent steps, ordered against unordered (nothing to reorder: what
    a kept barrier itself costs).

  python benchmarks/bench_compiled_order.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jax_overlap import program_order  # noqa: E402
from jax_overlap._src import _compat  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 64)
W = jnp.linspace(0.5, 1.5, 64)
M = jnp.ones((64, 64)) / 64


def loop(ordered: bool):
  def f(x, w):
    def step(i, c):
      return jnp.sin(c) * w + i.astype(c.dtype) * 0.1
    if ordered:
      step = program_order(step, enforce=True)
    return lax.fori_loop(0, 100, step, x)
  return f


def straight(ordered: bool):
  def f(x, w):
    a = jnp.tanh(M @ M)
    return a.sum() + jnp.sin(x) * w, jnp.exp(w)
  return program_order(f, enforce=True) if ordered else f


def chain(ordered: bool, n: int = 64):
  """`n` dependent steps: each needs the one before, as in a layer stack."""
  def f(x, w):
    for i in range(n):
      x = jnp.sin(x) * w if i % 2 else x + w
    return x, w
  return program_order(f, enforce=True) if ordered else f


def per_call(compiled: dict, calls: int, rounds: int = 7) -> dict:
  """Best time per call of each executable, measured in turns so that the
  machine's noise falls on all of them alike."""
  best = {k: float("inf") for k in compiled}
  for fn in compiled.values():
    jax.block_until_ready(fn(X, W))
  for _ in range(rounds):
    for name, fn in compiled.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        out = fn(X, W)
      jax.block_until_ready(out)
      best[name] = min(best[name], (time.perf_counter() - t0) / calls)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=2000)
  calls = parser.parse_args().calls
  early = _compat.cpu_expands_barriers_before_scheduling()
  print(f"jax {jax.__version__}: CPU compiler drops barriers before "
        f"scheduling: {early}; per call, best of 7 turns x {calls} calls\n")
  no_hoist = {"xla_disable_hlo_passes": _compat.LOOP_HOISTING_PASS}
  plain = jax.jit(loop(False)).lower(X, W)
  t = per_call({
      "loop": plain.compile(),
      "loop_no_hoist": plain.compile(compiler_options=no_hoist),
      "loop_ordered": jax.jit(loop(True)).lower(X, W).compile(),
      "straight": jax.jit(straight(False)).lower(X, W).compile(),
      "straight_ordered": jax.jit(straight(True)).lower(X, W).compile(),
      "chain": jax.jit(chain(False)).lower(X, W).compile(),
      "chain_ordered": jax.jit(chain(True)).lower(X, W).compile(),
  }, calls)
  rows = [
      ("100-step loop, unordered, hoisting disabled / as is",
       t["loop_no_hoist"], t["loop"]),
      ("100-step loop, ordered body / unordered", t["loop_ordered"], t["loop"]),
      ("loop-free body with independent branches, ordered / unordered",
       t["straight_ordered"], t["straight"]),
      ("64 dependent steps, ordered / unordered", t["chain_ordered"],
       t["chain"]),
  ]
  print("| what | us per call | us per call | ratio |")
  print("|---|---|---|---|")
  for name, a, b in rows:
    print(f"| {name} | {a * 1e6:.1f} | {b * 1e6:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
  main()
