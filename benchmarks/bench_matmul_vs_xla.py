"""Benchmark: collective matmul against XLA's own sharded matmul, on the real compilers.

A tensor-parallel MLP, `tanh(all_gather(x) @ w1) @ w2` reduce-scattered back
to the rows (sequence parallelism, as Megatron-LM writes it), on 8 devices:
`x` (8 * tokens, width) sharded by rows, `w1` (width, hidden) by columns,
`w2` (hidden, width) by rows, bf16. Compiled ahead of time, with no
accelerator, by the real TPU compiler (libtpu, a v5e 2x4 slice) and the real
GPU compiler (the CUDA plugin, 8 H100s of one host), forward and
`value_and_grad` (of the sum of squares, for x, w1 and w2), in these versions:

  XLA sharding          `jit` over global arrays laid out by `NamedSharding`, the
                        hidden activation constrained to the column sharding and the
                        output to the rows; XLA's partitioner inserts the all-gather
                        and the reduce-scatter; XLA's defaults.
  XLA sharding + windowed einsum
                        the same with each compiler's windowed-einsum options: GPU
                        `WINDOWED_GPU` (compile options); TPU `WINDOWED_TPU`
                        (LIBTPU_INIT_ARGS: the windowed-einsum flags, libtpu's
                        "collective matmul V1").
  XLA sharding + collective matmul
                        TPU only: libtpu's collective matmul V2 (`CM_TPU`, the
                        `post_spmd` modes its own log message recommends).
  collective matmul     `jax_overlap.all_gather_matmul` then
                        `jax_overlap.matmul_reduce_scatter` inside `jax.shard_map`.
  collective matmul, bidirectional
                        the same with `bidirectional=True` (two rings, half the steps).

Each compiled module (`compile().as_text()`) is read by the library's own
inspector (`jax_overlap.OverlapReport.from_hlo`, what `jax-overlap inspect FILE`
runs) on the matching profile (tpu-v5e, h100): the modelled step, the modelled
exposed communication and the collectives in flight (async, with compute
beside them; a loop's once an iteration). Every figure but compile time is
modelled, not measured.

  .venv-aot/bin/python benchmarks/bench_matmul_vs_xla.py [--widths 1024 4096]
      [--targets tpu_v5e gpu_h100] [--modes forward value_and_grad] [--jobs 2]
  .venv-aot/bin/python benchmarks/bench_matmul_vs_xla.py --check-flags

Writes benchmarks/results/bench-matmul-vs-xla.{md,json}. `--check-flags`
gives each windowed-einsum option name alone to the installed compilers (on a
small sharded matmul) and prints which they accept. `--reinspect JSON` reads
again the modules a run with `--keep-hlo` kept (after the inspector changed).
The library read, and compiled, is this checkout's (src/ first on the path).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "src"))  # this checkout's library, not an installed one
sys.path.insert(0, str(HERE))

import bench_vs_xla  # noqa: E402 - its targets and mesh

#: target -> (platform, topology, GPU target config, hardware profile, label)
TARGETS = bench_vs_xla.TARGETS
XLA = "XLA sharding"
XLA_WINDOWED = "XLA sharding + windowed einsum"
XLA_CM = "XLA sharding + collective matmul"
OURS = "collective matmul"
OURS_BI = "collective matmul, bidirectional"
VARIANTS = (XLA, XLA_WINDOWED, XLA_CM, OURS, OURS_BI)
XLA_ROWS = (XLA, XLA_WINDOWED, XLA_CM)
OUR_ROWS = (OURS, OURS_BI)
MODES = ("forward", "value_and_grad")

#: GPU windowed einsum (compile options): loop every sharded matmul whatever
#: its size, the loop's matmuls on streams of their own.
WINDOWED_GPU = {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                "xla_gpu_multi_streamed_windowed_einsum": True}
#: TPU windowed einsum (LIBTPU_INIT_ARGS, read once a process): for all-gathers
#: and reduce-scatters, at any size, both ways round the ring.
WINDOWED_TPU = ("--xla_tpu_enable_windowed_einsum_for_all_gather=true "
                "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=true "
                "--xla_jf_spmd_threshold_for_windowed_einsum_mib=0 "
                "--xla_tpu_spmd_bidirectional_windowed_einsum=true")
#: TPU collective matmul V2 (libtpu: "You can enable V2 by setting
#: xla_tpu_all_gather_collective_matmul_mode=post_spmd and ...").
CM_TPU = ("--xla_tpu_all_gather_collective_matmul_mode=post_spmd "
          "--xla_tpu_reduce_scatter_collective_matmul_mode=post_spmd")

#: Option names tried by --check-flags, with the value given.
CANDIDATES = {
    "cuda": {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
             "xla_gpu_multi_streamed_windowed_einsum": True,
             "xla_gpu_operand_bytes_threshold_for_windowed_einsum": 0,
             "xla_gpu_experimental_enable_alltoall_windowed_einsum": True,
             "xla_gpu_enable_windowed_einsum_for_all_gather": True,
             "xla_gpu_enable_windowed_einsum_for_reduce_scatter": True},
    "tpu": {"xla_tpu_enable_windowed_einsum_for_all_gather": "true",
            "xla_tpu_enable_windowed_einsum_for_reduce_scatter": "true",
            "xla_jf_spmd_threshold_for_windowed_einsum_mib": "0",
            "xla_tpu_spmd_bidirectional_windowed_einsum": "true",
            "xla_tpu_spmd_unroll_windowed_einsum": "true",
            "xla_tpu_all_gather_collective_matmul_mode": "post_spmd",
            "xla_tpu_reduce_scatter_collective_matmul_mode": "post_spmd",
            "xla_tpu_threshold_for_windowed_einsum_mib": "0",
            "xla_threshold_for_windowed_einsum_mib": "0",
            "xla_tpu_enable_windowed_einsum": "true"},
}

TOKENS = 2048  # a device
DEVICES = 8
AXIS = bench_vs_xla.AXIS


# --- the programs ------------------------------------------------------------------

def mesh_of(target: str):
  """All of `target`'s devices along axis "d" (bench_vs_xla's mesh)."""
  return bench_vs_xla._mesh(target)


def mlp(variant: str, mesh):
  """`x, w1, w2 -> y`: the MLP block as `variant` writes it."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  if variant in XLA_ROWS:
    def block(x, w1, w2):
      h = lax.with_sharding_constraint(jnp.tanh(x @ w1),
                                       NamedSharding(mesh, P(None, AXIS)))
      return lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P(AXIS)))
    return block
  import jax_overlap  # noqa: PLC0415
  both = variant == OURS_BI

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P(None, AXIS), P(AXIS)),
                 out_specs=P(AXIS))
  def block(x, w1, w2):
    h = jnp.tanh(jax_overlap.all_gather_matmul(x, w1, AXIS, bidirectional=both))
    return jax_overlap.matmul_reduce_scatter(h, w2, AXIS, bidirectional=both)
  return block


def program(variant: str, mode: str, mesh, width: int, hidden: int,
            tokens: int = TOKENS, dtype=None):
  """(fn, abstract args) of one row: the block, or value_and_grad of the sum
  of its squares for (x, w1, w2)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  dtype = dtype or jnp.bfloat16
  arg = lambda shape, spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec))
  n = mesh.devices.size
  args = (arg((n * tokens, width), P(AXIS)), arg((width, hidden), P(None, AXIS)),
          arg((hidden, width), P(AXIS)))
  block = mlp(variant, mesh)
  if mode == "forward":
    return block, args
  loss = lambda x, w1, w2: jnp.sum(block(x, w1, w2).astype(jnp.float32) ** 2)
  return jax.value_and_grad(loss, argnums=(0, 1, 2)), args


def compile_options(target: str, variant: str):
  """The GPU compile options of `variant` (TPU's go in LIBTPU_INIT_ARGS)."""
  if TARGETS[target][0] == "cuda" and variant == XLA_WINDOWED:
    return WINDOWED_GPU
  return None


def libtpu_args(variant: str) -> str:
  return {XLA_WINDOWED: WINDOWED_TPU, XLA_CM: CM_TPU}.get(variant, "")


def applies(target: str, variant: str) -> bool:
  """Collective matmul V2 is a libtpu option: no GPU row."""
  return not (variant == XLA_CM and TARGETS[target][0] != "tpu")


def child(target: str, variant: str, widths: list[int], modes: list[str],
          out_dir: str) -> None:
  import jax  # noqa: PLC0415
  mesh = mesh_of(target)
  for width in widths:
    for mode in modes:
      rec = {"target": target, "variant": variant, "width": width,
             "hidden": 4 * width, "mode": mode}
      try:
        fn, args = program(variant, mode, mesh, width, 4 * width)
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile(
            compiler_options=compile_options(target, variant))
        rec["compile_s"] = time.perf_counter() - t0
        path = pathlib.Path(out_dir) / (
            f"{target}-{variant.replace(' ', '_').replace(',', '')}-{width}-{mode}.txt")
        path.write_text(compiled.as_text())
        rec["hlo"] = str(path)
      except Exception as e:  # noqa: BLE001 - a failed compile is a result
        rec["error"] = f"{type(e).__name__}: {_first_lines(str(e))}"
      print("RESULT " + json.dumps(rec), flush=True)


def _first_lines(text: str) -> str:
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  return " ".join(lines[:3])[:600]


# --- the parent: a process a (target, variant), then the inspector -----------------

def child_env(target: str, variant: str) -> dict:
  # ALLOW_MULTIPLE_LIBTPU_LOAD: without it a second libtpu process at once
  # fails on /tmp/libtpu_lockfile (there are no chips here to share).
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  flags = libtpu_args(variant)
  if TARGETS[target][0] == "tpu" and flags:
    env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " " + flags).strip()
  return env


def compile_variant(target: str, variant: str, widths, modes, out_dir: str,
                    timeout: float) -> list[dict]:
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", target,
         variant, ",".join(map(str, widths)), ",".join(modes), out_dir]
  try:
    run = subprocess.run(cmd, env=child_env(target, variant), capture_output=True,
                         text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return [{"target": target, "variant": variant, "width": w, "hidden": 4 * w,
             "mode": m, "error": f"did not finish in {timeout:.0f} s"}
            for w in widths for m in modes]
  got = [json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines()
         if line.startswith("RESULT ")]
  done = {(r["width"], r["mode"]) for r in got}
  why = _first_lines("\n".join(l for l in run.stderr.splitlines()
                               if "rror" in l or "Check failed" in l)
                     or run.stderr[-600:])
  got += [{"target": target, "variant": variant, "width": w, "hidden": 4 * w,
           "mode": m, "error": f"the compiler process died (exit {run.returncode}): {why}"}
          for w in widths for m in modes if (w, m) not in done]
  return got


def inspect(rec: dict) -> None:
  """Adds the inspector's modelled figures to `rec`."""
  import jax_overlap  # noqa: PLC0415
  if "hlo" not in rec:
    return
  report = jax_overlap.OverlapReport.from_hlo(
      pathlib.Path(rec["hlo"]).read_text(), hardware=TARGETS[rec["target"]][3])
  t = report.totals
  # Counted once a run: a loop body's collective once an iteration (XLA's
  # windowed einsum is a loop; the library's rings are unrolled).
  runs = lambda c: c.trip_count or 1
  rec.update(step_s=report.step_s, exposed_s=t["exposed_s"], comm_s=t["comm_s"],
             bound_exposed_s=t["bound_exposed_s"], compute_s=report.compute_s,
             collectives=sum(map(runs, report.collectives)),
             in_flight=sum(runs(c) for c in report.collectives
                           if c.is_async and c.overlapped))


# --- flags: which names the installed compilers take --------------------------------

_TINY = """
import sys, json
sys.path.insert(0, {bench!r})
import bench_matmul_vs_xla as b
import jax, jax.numpy as jnp
mesh = b.mesh_of({target!r})
fn, args = b.program(b.XLA, "forward", mesh, 256, 1024, tokens=64)
try:
  jax.jit(fn).lower(*args).compile(compiler_options={options!r})
  print("ACCEPTED")
except Exception as e:
  print("REFUSED " + json.dumps(b._first_lines(str(e))))
"""


def check_flag(target: str, name: str, value) -> tuple[bool, str]:
  """Whether the compiler of `target` accepts option `name` (alone)."""
  tpu = TARGETS[target][0] == "tpu"
  env = child_env(target, XLA)
  if tpu:
    env["LIBTPU_INIT_ARGS"] = f"--{name}={value}"
  source = _TINY.format(bench=str(HERE), target=target,
                        options=None if tpu else {name: value})
  run = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                       text=True, timeout=300)
  if "ACCEPTED" in run.stdout:
    return True, ""
  unknown = [l.strip() for l in run.stderr.splitlines() if "Unknown command line flag" in l]
  refused = [l[len("REFUSED "):] for l in run.stdout.splitlines() if l.startswith("REFUSED")]
  return False, (unknown or refused or [run.stderr.strip()[-300:]])[0]


def check_flags() -> int:
  for target, (plat, *_rest) in TARGETS.items():
    for name, value in CANDIDATES[plat].items():
      ok, why = check_flag(target, name, value)
      print(f"{TARGETS[target][4]}: {name}={value}: "
            + ("accepted" if ok else f"REFUSED ({why})"), flush=True)
  return 0


# --- the tables ------------------------------------------------------------------------

def _us(v) -> str:
  return "-" if v is None else f"{v * 1e6:,.0f}"


def targets_checked(records: list[dict]) -> list[dict]:
  """Issue 31's target for collective matmul: our modelled step and exposed
  communication each at most the best XLA row's, per target, width, mode."""
  rows = []
  keys = sorted({(r["target"], r["width"], r["mode"]) for r in records},
                key=lambda k: (list(TARGETS).index(k[0]), k[1], MODES.index(k[2])))
  for target, width, mode in keys:
    group = [r for r in records if (r["target"], r["width"], r["mode"]) ==
             (target, width, mode) and "step_s" in r]
    xla = [r for r in group if r["variant"] in XLA_ROWS]
    ours = [r for r in group if r["variant"] in OUR_ROWS]
    if not xla or not ours:
      continue
    for key, what in (("step_s", "step"), ("exposed_s", "exposed")):
      best = min(xla, key=lambda r: r[key])
      mine = min(ours, key=lambda r: r[key])
      rows.append({"target": target, "width": width, "mode": mode, "what": what,
                   "ours": mine[key], "ours_variant": mine["variant"],
                   "xla": best[key], "xla_variant": best["variant"],
                   "holds": mine[key] <= best[key] * (1 + 1e-9)})
  return rows


def markdown(meta: dict, records: list[dict], checks: list[dict]) -> str:
  out = ["# Collective matmul against XLA's own sharded matmul (modelled)", "",
         f"Made by `{meta['command']}` on {meta['date']} ({meta['wall_s']:.0f} s wall"
         + (f"; modules read again on {meta['reinspected']}" if meta.get("reinspected")
            else "") + "); "
         + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".", "",
         "All times but compile are **modelled** by jax_overlap's inspector "
         "(`OverlapReport.from_hlo` on `compile().as_text()`), not measured. Model: "
         f"`tanh(all_gather(x) @ w1) @ w2`, reduce-scattered; {TOKENS} tokens a device "
         f"on {DEVICES} devices, hidden = 4 x width, bf16.", ""]
  for target in TARGETS:
    for width in sorted({r["width"] for r in records if r["target"] == target}):
      for mode in MODES:
        rs = [r for r in records if (r["target"], r["width"], r["mode"]) ==
              (target, width, mode)]
        if not rs:
          continue
        out += [f"### {TARGETS[target][4]}, width {width}, {mode} (modelled)", "",
                "| version | step (us) | exposed (us) | communication (us) | compute (us) "
                "| in flight / collectives | compile (s) |",
                "|---|---|---|---|---|---|---|"]
        for r in sorted(rs, key=lambda r: VARIANTS.index(r["variant"])):
          if "step_s" in r:
            cells = [_us(r["step_s"]), _us(r["exposed_s"]), _us(r["comm_s"]),
                     _us(r["compute_s"]), f"{r['in_flight']} / {r['collectives']}",
                     f"{r['compile_s']:.1f}"]
          else:
            cells = ["-"] * 5 + ["**failed**: " + r["error"].replace("|", "\\|")]
          out.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        out.append("")
  out += ["Targets (issue 31): our modelled step and exposed communication each at "
          "most the best XLA row's (ours: the better of the two ring variants).", "",
          "| target | width | mode | what | ours (us) | best XLA (us) | holds |",
          "|---|---|---|---|---|---|---|"]
  for c in checks:
    out.append(f"| {TARGETS[c['target']][4]} | {c['width']} | {c['mode']} | {c['what']} "
               f"| {_us(c['ours'])} ({c['ours_variant']}) | {_us(c['xla'])} "
               f"({c['xla_variant']}) | {'yes' if c['holds'] else 'NO'} |")
  return "\n".join(out) + "\n"


def versions() -> dict:
  import importlib.metadata  # noqa: PLC0415
  out = {}
  for dist in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = None
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--widths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
  parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
  parser.add_argument("--jobs", type=int, default=1, help="compiler processes at once")
  parser.add_argument("--timeout", type=float, default=1200)
  parser.add_argument("--keep-hlo", metavar="DIR", help="keep the compiled modules in DIR")
  parser.add_argument("--out", default=str(RESULTS))
  parser.add_argument("--check-flags", action="store_true",
                      help="only say which windowed-einsum option names the compilers take")
  parser.add_argument("--reinspect", metavar="JSON",
                      help="compile nothing: read again the modules of a --keep-hlo run")
  opts = parser.parse_args()
  if opts.check_flags:
    return check_flags()
  if opts.reinspect:
    data = json.loads(pathlib.Path(opts.reinspect).read_text())
    records = data["records"]
    for r in records:
      for key in ("step_s", "exposed_s", "comm_s", "bound_exposed_s", "compute_s",
                  "collectives", "in_flight"):
        r.pop(key, None)
      inspect(r)
    data["meta"]["reinspected"] = datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return write(pathlib.Path(opts.out), data["meta"], records, keep_hlo=True)
  started = time.perf_counter()
  hlo_dir = opts.keep_hlo or tempfile.mkdtemp(prefix="bench-matmul-vs-xla-")
  pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
  jobs = [(t, v) for t in opts.targets for v in opts.variants if applies(t, v)]

  def one(job):
    got = compile_variant(*job, opts.widths, opts.modes, hlo_dir, opts.timeout)
    for r in got:
      inspect(r)
      state = (f"step {_us(r['step_s'])} us, exposed {_us(r['exposed_s'])} us, "
               f"{r['in_flight']}/{r['collectives']} in flight" if "step_s" in r
               else f"FAILED: {r['error'][:200]}")
      print(f"  {TARGETS[r['target']][4]}, width {r['width']}, {r['mode']}, "
            f"{r['variant']}: {state}", flush=True)
    return got

  with concurrent.futures.ThreadPoolExecutor(max(1, opts.jobs)) as pool:
    records = [r for got in pool.map(one, jobs) for r in got]
  meta = {"command": "python benchmarks/bench_matmul_vs_xla.py " + shlex.join(sys.argv[1:]),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "wall_s": time.perf_counter() - started, "versions": versions(),
          "windowed_gpu": WINDOWED_GPU, "windowed_tpu": WINDOWED_TPU, "cm_tpu": CM_TPU}
  return write(pathlib.Path(opts.out), meta, records, keep_hlo=bool(opts.keep_hlo))


def write(out: pathlib.Path, meta: dict, records: list[dict], keep_hlo: bool) -> int:
  checks = targets_checked(records)
  text = markdown(meta, records, checks)
  print("\n" + text)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench-matmul-vs-xla.md").write_text(text)
  kept = records if keep_hlo else [{k: v for k, v in r.items() if k != "hlo"}
                                     for r in records]
  (out / "bench-matmul-vs-xla.json").write_text(json.dumps(
      {"meta": meta, "records": kept, "targets": checks}, indent=2) + "\n")
  print(f"wrote {out / 'bench-matmul-vs-xla.md'}", flush=True)
  return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
  child(sys.argv[2], sys.argv[3], [int(w) for w in sys.argv[4].split(",")],
        sys.argv[5].split(","), sys.argv[6])
  sys.exit(0)


if __name__ == "__main__":
  sys.exit(main())
