"""One of two processes of multiprocess_test.py (not a test module itself).

  python multiprocess_worker.py PROCESS_ID PORT OUT.npz [PROGRAMS]

Joins a 2-process jax system on 127.0.0.1:PORT with 4 CPU devices here, runs
multiprocess_programs.PROGRAMS (default run_all, on 8-device meshes, its first
jax_overlap call made inside `jax.set_mesh`), and (process 0) writes the
results to OUT.npz.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


def main():
  process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  programs = sys.argv[4] if len(sys.argv) > 4 else "run_all"
  jax.config.update("jax_num_cpu_devices", 4)
  if hasattr(jax.config, "jax_cpu_collectives_implementation"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id,
                             initialization_timeout=120)
  import numpy as np  # noqa: PLC0415
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:0] = [here, os.path.join(os.path.dirname(here), "support")]
  import multiprocess_programs  # noqa: PLC0415
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  results = getattr(multiprocess_programs, programs)()
  if process_id == 0:
    np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
