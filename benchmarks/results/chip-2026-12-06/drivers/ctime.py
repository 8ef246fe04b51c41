"""Lowering and compile times of the train step, `fsdp_scan` against the plain
scan in `shard_map`, on the chip's host (2 rounds, persistent cache off):
`PYTHONPATH=src:benchmarks python drivers/ctime.py` (run 2026-12-06 04:05 UTC)."""

import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import chip_programs as cp  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)
for rnd in range(2):
  for dt in (jnp.float32, jnp.bfloat16):
    for v in ("shard_map, lax.scan", "fsdp_scan"):
      jitted, args = cp.train_step(v, dt)
      t0, c0 = time.perf_counter(), time.process_time()
      low = jitted.lower(*args)
      t1, c1 = time.perf_counter(), time.process_time()
      low.compile()
      t2, c2 = time.perf_counter(), time.process_time()
      print(f"round {rnd} {jnp.dtype(dt).name} {v}: lower {t1 - t0:.2f} s wall "
            f"{c1 - c0:.2f} cpu; compile {t2 - t1:.2f} s wall {c2 - c1:.2f} cpu",
            flush=True)
