"""Regenerates tests/fixtures/hlo/real/{gpu,tpu}_*-jax<V>.*: scheduled modules
from the real compilers, for the inspector's tests.

For each program and target (GPU H100 x8, TPU v5e 2x4), one process compiles
it with XLA's dump on and writes two files,
`<target>_<program>-jax<V>.as_text.txt` (`compile().as_text()`) and
`<target>_<program>-jax<V>.after_optimizations.txt` (the dump file users
bring from their clusters), and the jax version's section of `versions.txt`
(jaxlib, libtpu, CUDA plugin; and each program that does not compile there,
with the compiler's first line). Programs (real_compilers_test.PROGRAMS):

- fsdp_scan_forward, fsdp_scan_value_and_grad: 4 layers, 2 weights a layer,
  inside shard_map over 8 devices; fsdp_scan_explicit_forward: the same on
  an Explicit mesh (jax.set_mesh, no shard_map: no futures, so it compiles
  on the older jax too);
- all_gather_matmul, matmul_reduce_scatter: the forward;
- dp_tp_mlp: a data + tensor parallel training step, a Megatron-style MLP
  with sequence parallelism on a (data, model) = (2, 4) mesh, plain jax
  collectives; dp_tp_mlp_overlapped: the same with the library's
  all_gather_matmul / matmul_reduce_scatter.

Run it in each aot venv (the older jax's make only what compiles there):

    for v in .venv-aot .venv-aot-jax0.11.0 .venv-aot-jax0.10.2; do
      PYTHONPATH=$PWD/src $v/bin/python tests/aot/make_real_fixtures.py
    done

`make_real_fixtures.py gpu` (or `tpu`) makes one target's files only, and
`--program NAME` (repeatable; a key of PROGRAMS) those programs only: the
other programs' files and their "not made" lines in versions.txt stay.
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).parent
# What the child imports from beside tests/aot: lowered.py, schedule_test.py.
TEST_PATHS = [str(HERE.parent / d) for d in ("support", "ordering")]
OUT = HERE.parent / "fixtures" / "hlo" / "real"
PROGRAMS = {  # name -> (PROGRAMS key, extra args)
    "fsdp_scan_forward": ("fsdp", (False,)),
    "fsdp_scan_value_and_grad": ("fsdp", (True,)),
    "fsdp_scan_explicit_forward": ("fsdp_explicit", (False,)),
    "all_gather_matmul": ("collective_matmul", ("all_gather_matmul", False)),
    "matmul_reduce_scatter": ("collective_matmul", ("matmul_reduce_scatter", False)),
    "dp_tp_mlp": ("dp_tp", (False,)),
    "dp_tp_mlp_overlapped": ("dp_tp", (True,)),
}
TARGETS = {"gpu": "gpu_h100", "tpu": "tpu_v5e"}
PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt",
            "nvidia-cuda-nvcc-cu12")

_CHILD = """
import sys
sys.path[:0] = [{aot!r}, *{tests!r}]
import real_compilers_test as rt
import contextlib
t = rt.target({target!r}, explicit={key!r} in rt.EXPLICIT_PROGRAMS)
fn, args, *context = rt.PROGRAMS[{key!r}](t, *{extra!r})
with context[0] if context else contextlib.nullcontext():
  open({out!r}, "w").write(rt.compiled_text(fn, *args))
"""


def _section(version: str, lines: list[str], made=None) -> None:
  """Replaces jax `version`'s section of versions.txt (the others stay).
  `made`: the "<target>_<program>" stems made this run, when not all were:
  the old section's "not made" lines of the others are kept."""
  path = OUT / "versions.txt"
  text = path.read_text() if path.exists() else ""
  sections = re.split(r"(?m)^(?=## jax )", text)
  head = sections[0] if not sections[0].startswith("## jax ") else ""
  kept = [s for s in sections if s.startswith("## jax ") and
          not s.startswith(f"## jax {version}\n")]
  if made is not None:
    old = next((s for s in sections if s.startswith(f"## jax {version}\n")), "")
    lines = lines + [
        line for line in old.splitlines()
        if line.startswith("not made: ") and
        line[len("not made: "):].split(":", 1)[0] not in made]
  mine = f"## jax {version}\n" + "".join(f"{line}\n" for line in lines)
  kept.append(mine)
  kept.sort(key=lambda s: [int(p) for p in s.split()[2].split(".")])
  if not head.strip():
    head = ("# made by tests/aot/make_real_fixtures.py; files are named\n"
            "# <target>_<program>-jax<V>.{as_text,after_optimizations}.txt\n\n")
  path.write_text(head + "\n".join(k.rstrip("\n") + "\n" for k in kept))


def compile_with_dump(code: str, stem: pathlib.Path) -> subprocess.CompletedProcess:
  """Runs `code` (which writes `<stem>.as_text.txt`) in a child process with
  XLA's dump on, and copies the dump file it made to
  `<stem>.after_optimizations.txt`; the child's result."""
  with tempfile.TemporaryDirectory() as dump:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    # libtpu refuses --xla_dump_to in LIBTPU_INIT_ARGS; XLA_FLAGS works.
    env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    run = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 0:
      dumps = sorted(glob.glob(f"{dump}/*after_optimizations.txt"),
                     key=os.path.getsize)
      if dumps:
        shutil.copy(dumps[-1], f"{stem}.after_optimizations.txt")
      print(stem.name, "as_text", "+ dump" if dumps else "(no dump file)")
  return run


def main(argv=None) -> int:
  import argparse  # noqa: PLC0415
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("targets", nargs="*", help="gpu and/or tpu (default: both)")
  ap.add_argument("--program", action="append", choices=sorted(PROGRAMS),
                  help="make only this program (repeatable)")
  args = ap.parse_args(argv)
  if set(args.targets) - set(TARGETS):
    ap.error(f"targets are {sorted(TARGETS)}, got {args.targets}")
  targets = {k: v for k, v in TARGETS.items()
             if not args.targets or k in args.targets}
  programs = {k: v for k, v in PROGRAMS.items()
              if not args.program or k in args.program}
  OUT.mkdir(parents=True, exist_ok=True)
  version = md.version("jax")
  notes = []
  for p in PACKAGES:
    try:
      notes.append(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
      notes.append(f"{p} (not installed)")
  for prefix, target in targets.items():
    for name, (key, extra) in programs.items():
      stem = OUT / f"{prefix}_{name}-jax{version}"
      code = _CHILD.format(aot=str(HERE), tests=TEST_PATHS, target=target,
                           key=key, extra=extra, out=f"{stem}.as_text.txt")
      run = compile_with_dump(code, stem)
      if run.returncode:
        pathlib.Path(f"{stem}.as_text.txt").unlink(missing_ok=True)
        lines = run.stderr.splitlines()
        errors = ([line for line in lines if "failed to legalize" in line] or
                  [line for line in lines if "Error" in line or "error:" in line] or
                  [f"exit {run.returncode}"])
        why = re.sub(r"\s+", " ", errors[-1].strip())
        why = why[why.find("failed to legalize"):] if "failed to legalize" in why else why
        why = why[:240]
        notes.append(f"not made: {prefix}_{name}: {why}")
        print(f"{stem.name}: does not compile: {why}", file=sys.stderr)
  every = len(targets) == len(TARGETS) and len(programs) == len(PROGRAMS)
  _section(version, notes, None if every else
           {f"{p}_{n}" for p in targets for n in programs})
  return 0


if __name__ == "__main__":
  sys.exit(main())
