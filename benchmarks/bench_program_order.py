"""Benchmark: what program_order costs at trace+lower time and per call.

Prints, for bodies of 10, 100 and 1,000 equations, on the jax this runs on:
  * trace+lower time of plain jit, of jax_overlap's program_order and of
    jax's own (jax >= 0.12), and their ratios; on jax >= 0.12 also the lojax
    stage alone, where both make their barriers;
  * per-call time of a jitted decorated function against the same function
    undecorated (enforce=True and enforce=False), and the ratios.

Each time is the best of several repetitions; ratios come from one run, since
the machines are noisy. Run on every supported jax with `make bench`, or:

  python benchmarks/bench_program_order.py [--reps N]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_overlap import program_order  # noqa: E402

try:
  from jax.experimental.overlap import program_order as jax_program_order
except ImportError:
  jax_program_order = None


def make_body(n_eqns: int):
  """A fresh function (so no trace cache is hit) of `n_eqns` equations."""
  def body(x, y):
    for i in range(n_eqns // 2):
      x = jnp.sin(x) if i % 2 else x * y
      y = y + x
    return x, y
  return body


def best_of(reps: int, fn) -> float:
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def lower_time(wrap, n_eqns, reps, args):
  def once():
    jax.jit(wrap(make_body(n_eqns))).lower(*args)
  once()  # warm the caches that every variant shares
  return best_of(reps, once)


def lojax_time(wrap, n_eqns, reps, args):
  """Time of the lojax stage alone (jax >= 0.12), where barriers are made."""
  best = float("inf")
  for _ in range(reps):
    traced = jax.jit(wrap(make_body(n_eqns))).trace(*args)
    t0 = time.perf_counter()
    traced.lojax  # noqa: B018 - computing it is the point
    best = min(best, time.perf_counter() - t0)
  return best


def call_time(wrap, n_eqns, calls, args):
  f = jax.jit(wrap(make_body(n_eqns)))
  jax.block_until_ready(f(*args))

  def many():
    out = None
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
  return best_of(5, many) / calls


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=5)
  opts = parser.parse_args()
  args = (jnp.ones(128), jnp.full(128, 0.5))
  plain = lambda f: f
  ours = lambda f: program_order(f, enforce=True)
  ours_free = lambda f: program_order(f, enforce=False)
  theirs = (lambda f: jax_program_order(f, enforce=True)) if jax_program_order else None

  print(f"jax {jax.__version__}, Python {platform.python_version()}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cores")
  print()
  print("trace+lower (best of %d)" % opts.reps)
  print(f"{'eqns':>6} {'plain ms':>9} {'ours ms':>9} {'jax ms':>9} "
        f"{'ours/plain':>11} {'ours/jax':>9}")
  for n in (10, 100, 1000):
    t_plain = lower_time(plain, n, opts.reps, args)
    t_ours = lower_time(ours, n, opts.reps, args)
    t_jax = lower_time(theirs, n, opts.reps, args) if theirs else None
    jax_ms = f"{t_jax * 1e3:9.1f}" if t_jax else f"{'-':>9}"
    ratio_jax = f"{t_ours / t_jax:9.2f}" if t_jax else f"{'-':>9}"
    print(f"{n:>6} {t_plain * 1e3:9.1f} {t_ours * 1e3:9.1f} {jax_ms} "
          f"{t_ours / t_plain:11.2f} {ratio_jax}")

  if theirs:
    print()
    print("lojax stage alone, where the barriers are made (best of %d)" % opts.reps)
    print(f"{'eqns':>6} {'ours ms':>9} {'jax ms':>9} {'ours/jax':>9}")
    for n in (100, 1000):
      t_ours = lojax_time(ours, n, opts.reps, args)
      t_jax = lojax_time(theirs, n, opts.reps, args)
      print(f"{n:>6} {t_ours * 1e3:9.1f} {t_jax * 1e3:9.1f} {t_ours / t_jax:9.2f}")

  print()
  print("per call of a jitted function, 128 floats (best of 5 batches)")
  print(f"{'eqns':>6} {'plain us':>9} {'ordered':>9} {'free':>9} "
        f"{'ord/plain':>10} {'free/plain':>11}")
  for n in (10, 100, 1000):
    calls = 2000 if n <= 100 else 300
    t_plain = call_time(plain, n, calls, args)
    t_ord = call_time(ours, n, calls, args)
    t_free = call_time(ours_free, n, calls, args)
    print(f"{n:>6} {t_plain * 1e6:9.1f} {t_ord * 1e6:9.1f} {t_free * 1e6:9.1f} "
          f"{t_ord / t_plain:10.2f} {t_free / t_plain:11.2f}")
  print()
  print("'ordered' fences every equation, so XLA may not fuse across them: its "
        "per-call cost grows with the body; 'free' isolates dispatch overhead.")


if __name__ == "__main__":
  main()
