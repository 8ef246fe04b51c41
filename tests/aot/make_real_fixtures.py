"""Regenerates tests/fixtures/hlo/real/{gpu,tpu}_*: scheduled modules from the
real compilers, for the inspector's tests.

For each program (fsdp_scan forward and value_and_grad, all_gather_matmul
and matmul_reduce_scatter forward) and target (GPU H100, TPU v5e 2x4), one
process compiles it with XLA's dump on and writes two files:
`<target>_<program>.as_text.txt` (`compile().as_text()`) and
`<target>_<program>.after_optimizations.txt` (the dump file users bring from
their clusters), plus `versions.txt`. Run in .venv-aot:

    .venv-aot/bin/python tests/aot/make_real_fixtures.py
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).parent
OUT = HERE.parent / "fixtures" / "hlo" / "real"
PROGRAMS = {  # name -> (PROGRAMS key, extra args)
    "fsdp_scan_forward": ("fsdp", (False,)),
    "fsdp_scan_value_and_grad": ("fsdp", (True,)),
    "all_gather_matmul": ("collective_matmul", ("all_gather_matmul", False)),
    "matmul_reduce_scatter": ("collective_matmul", ("matmul_reduce_scatter", False)),
}
TARGETS = {"gpu": "gpu_h100", "tpu": "tpu_v5e"}
if len(sys.argv) > 1:
  TARGETS = {k: v for k, v in TARGETS.items() if k in sys.argv[1:]}

_CHILD = """
import sys
sys.path[:0] = [{aot!r}, {tests!r}]
import real_compilers_test as rt
t = rt.target({target!r})
fn, args = rt.PROGRAMS[{key!r}](t, *{extra!r})
open({out!r}, "w").write(rt.compiled_text(fn, *args))
"""


def main() -> int:
  OUT.mkdir(parents=True, exist_ok=True)
  for prefix, target in TARGETS.items():
    for name, (key, extra) in PROGRAMS.items():
      stem = OUT / f"{prefix}_{name}"
      with tempfile.TemporaryDirectory() as dump:
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
        env["XLA_FLAGS"] = flags  # libtpu refuses --xla_dump_to in LIBTPU_INIT_ARGS
        code = _CHILD.format(aot=str(HERE), tests=str(HERE.parent), target=target,
                             key=key, extra=extra, out=f"{stem}.as_text.txt")
        run = subprocess.run([sys.executable, "-c", code], env=env,
                             capture_output=True, text=True, timeout=600)
        if run.returncode:
          print(f"{stem.name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
          return 1
        dumps = sorted(glob.glob(f"{dump}/*after_optimizations.txt"),
                       key=os.path.getsize)
        if dumps:
          shutil.copy(dumps[-1], f"{stem}.after_optimizations.txt")
        print(stem.name, "as_text", "+ dump" if dumps else "(no dump file)")
  versions = subprocess.run(
      [sys.executable, "-c",
       "import importlib.metadata as m; print('\\n'.join(f'{p} {m.version(p)}' for p in "
       "('jax', 'jaxlib', 'libtpu', 'jax-cuda12-plugin', 'jax-cuda12-pjrt', "
       "'nvidia-cuda-nvcc-cu12')))"], capture_output=True, text=True)
  (OUT / "versions.txt").write_text(
      "# made by tests/aot/make_real_fixtures.py with:\n" + versions.stdout)
  return 0


if __name__ == "__main__":
  sys.exit(main())
