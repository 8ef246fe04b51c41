import sys, time, os
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import chip_programs as cp
jax.config.update("jax_enable_compilation_cache", False)
for rnd in range(2):
  for dt in (jnp.float32, jnp.bfloat16):
    for v in ("shard_map, lax.scan", "fsdp_scan"):
      jitted, args = cp.train_step(v, dt)
      t0 = time.perf_counter(); c0 = time.process_time()
      low = jitted.lower(*args)
      t1 = time.perf_counter(); c1 = time.process_time()
      low.compile()
      t2 = time.perf_counter(); c2 = time.process_time()
      print(f"round {rnd} {jnp.dtype(dt).name} {v}: lower {t1-t0:.2f} s wall {c1-c0:.2f} cpu; compile {t2-t1:.2f} s wall {c2-c1:.2f} cpu", flush=True)
