"""Benchmark: what `expert_parallel`'s chunks hide of one MoE block's all-to-alls.

One mixture-of-experts feed-forward block on 8 devices (each device's tokens
routed top-2 to 16 experts, 2 a device; each expert a two-layer GELU MLP), in
four versions:

  synchronous dispatch   the textbook block: one `jax.lax.all_to_all` sends
                         every device's tokens to their experts (capacity
                         slots, as expert_parallel's), the experts run, one
                         `jax.lax.all_to_all` brings the results back; no
                         futures, no chunks, XLA's own schedule.
  chunks=1, 2, 4         `jax_overlap.expert_parallel(..., chunks=c)`: each
                         expert's capacity slots in c chunks, one all-to-all
                         carrying chunk c+1's dispatch and chunk c-1's
                         combine in flight while the experts compute chunk c.

each as the forward alone and as `value_and_grad` (of x, the combine weights
and the expert weights). Each program is compiled ahead of time by the real
GPU compiler (the CUDA plugin, 8 H100s of one host: .venv-aot, no GPU
needed), one compile a process, and its scheduled module
(`compile().as_text()`) read by the library's inspector
(`jax_overlap.OverlapReport.from_hlo`, what `jax-overlap inspect FILE` runs)
on the h100 profile: modelled communication, modelled exposed communication
and the report's dependency-aware bound. Where the CUDA plugin is absent (or
with --cpu) the programs are traced for 8 CPU devices instead (whose
compiler makes every collective blocking, so its compiled schedule hides
nothing) and the report is of the schedule as written
(`jax_overlap.inspect(..., schedule="written")`), on the same profile; the
output says which. Every time is modelled, not measured.

  .venv-aot/bin/python benchmarks/bench_moe.py [--targets gpu_h100 tpu_v5e] [--cpu]

(`make bench-moe`; `make bench` calls it.) Writes
benchmarks/results/bench-moe.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

#: The block: tokens a device, width, expert hidden width, experts a device,
#: choices a token, and capacity (tokens each expert takes from each device:
#: 1.25 x the average 2048 x 2 / 16 = 256). f32.
SHAPES = dict(devices=8, tokens=2048, d=1024, hidden=4096, experts_per_device=2,
              k=2, capacity=320)
VARIANTS = ("synchronous dispatch", "chunks=1", "chunks=2", "chunks=4")
PASSES = ("forward", "value_and_grad")
AXIS = "d"
PROFILE = {"gpu_h100": "h100", "tpu_v5e": "tpu-v5e", "cpu": "h100"}


# --- the programs -------------------------------------------------------------------

def expert(params, tokens):
  """One expert on the tokens routed to it: [C, D] -> [C, D]."""
  import jax  # noqa: PLC0415
  return jax.nn.gelu(tokens @ params["w_in"]) @ params["w_out"]


def synchronous_dispatch(expert_fn, x, expert_ids, weights, expert_params, *, axis,
                         capacity):
  """The unchunked block with plain `jax.lax.all_to_all`s, no futures.

  The same slots as expert_parallel: (token, choice) pairs claim an
  expert's `capacity` slots for this device in token order, then choice
  order; the rest are dropped. Returns (y, dropped)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  n = lax.axis_size(axis)
  tokens, width = x.shape
  k = expert_ids.shape[1]
  local = jax.tree.leaves(expert_params)[0].shape[0]
  experts = local * n
  ids = expert_ids.reshape(-1)                           # token order, then choice
  onehot = jax.nn.one_hot(ids, experts, dtype=jnp.int32)
  slot = (jnp.cumsum(onehot, 0) * onehot).sum(-1) - 1    # this pair's slot at its expert
  kept = slot < capacity
  token = jnp.repeat(jnp.arange(tokens), k)
  send = jnp.zeros((experts, capacity, width), x.dtype).at[
      ids, jnp.where(kept, slot, capacity)].set(x[token], mode="drop")
  got = lax.all_to_all(send.reshape(n, local, capacity, width), axis, 0, 0, tiled=True)
  got = got.transpose(1, 0, 2, 3).reshape(local, n * capacity, width)
  out = jax.vmap(expert_fn)(expert_params, got)
  out = out.reshape(local, n, capacity, width).transpose(1, 0, 2, 3)
  back = lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(experts, capacity, width)
  picked = back[ids, jnp.minimum(slot, capacity - 1)]
  y = (picked * (kept * weights.reshape(-1))[:, None]).reshape(tokens, k, width).sum(1)
  return y, jnp.sum(~kept).astype(jnp.int32)


def program(variant: str, pass_: str, mesh):
  """(fn, abstract args) of one version of the block on `mesh` (axis "d")."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  import jax_overlap  # noqa: PLC0415
  s = SHAPES
  n, experts = s["devices"], s["devices"] * s["experts_per_device"]

  def block(x, ids, weights, params):
    if variant == "synchronous dispatch":
      y, dropped = synchronous_dispatch(expert, x, ids, weights, params, axis=AXIS,
                                        capacity=s["capacity"])
    else:
      chunks = int(variant.split("=")[1])
      y, dropped = jax_overlap.expert_parallel(expert, x, ids, weights, params,
                                               axis=AXIS, capacity=s["capacity"],
                                               chunks=chunks)
    return y, dropped[None]

  moe = jax.shard_map(block, mesh=mesh, in_specs=(P(AXIS),) * 4,
                      out_specs=(P(AXIS), P(AXIS)))
  fn = moe
  if pass_ == "value_and_grad":
    def loss(x, ids, weights, params):
      return jnp.sum(moe(x, ids, weights, params)[0] ** 2)
    fn = jax.value_and_grad(loss, argnums=(0, 2, 3))

  def arg(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(AXIS)))
  t = n * s["tokens"]
  args = (arg((t, s["d"])), arg((t, s["k"]), jnp.int32), arg((t, s["k"])),
          {"w_in": arg((experts, s["d"], s["hidden"])),
           "w_out": arg((experts, s["hidden"], s["d"]))})
  return fn, args


# --- the child: one compile a process -------------------------------------------------

def _mesh(target: str):
  import jax  # noqa: PLC0415
  if target == "cpu":
    return jax.make_mesh((SHAPES["devices"],), (AXIS,),
                         axis_types=(jax.sharding.AxisType.Auto,))
  from bench_vs_xla import _mesh as real_mesh  # noqa: PLC0415 - its axis is "d" too
  return real_mesh(target)


def child(target: str, variant: str, pass_: str, out_dir: str) -> None:
  import jax  # noqa: PLC0415
  if target == "cpu":
    jax.config.update("jax_num_cpu_devices", SHAPES["devices"])
  import jax_overlap  # noqa: PLC0415
  rec = {"target": target, "variant": variant, "pass": pass_}
  try:
    fn, args = program(variant, pass_, _mesh(target))
    t0 = time.perf_counter()
    if target == "cpu":
      report = jax_overlap.overlap_report(fn, hardware=PROFILE[target],
                                          schedule="written")(*args)
      rec["schedule"] = "as written (traced for 8 CPU devices)"
    else:
      text = jax.jit(fn).lower(*args).compile().as_text()
      path = pathlib.Path(out_dir) / f"{target}-{variant.replace(' ', '_')}-{pass_}.txt"
      path.write_text(text)
      report = jax_overlap.OverlapReport.from_hlo(text, hardware=PROFILE[target])
      rec["schedule"] = f"compiled ({target}, ahead of time)"
      rec["hlo"] = str(path)
    rec["compile_s"] = time.perf_counter() - t0
    t = report.totals
    rec.update(comm_s=t["comm_s"], exposed_s=t["exposed_s"],
               bound_exposed_s=t["bound_exposed_s"], compute_s=report.compute_s,
               all_to_alls=sum(c.kind == "all-to-all" for c in report.collectives),
               collectives=len(report.collectives),
               read_async=sum(bool(c.is_async) for c in report.collectives))
  except Exception as e:  # noqa: BLE001 - a failed compile is a result
    rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
  print("RESULT " + json.dumps(rec), flush=True)


# --- the parent ------------------------------------------------------------------------

def _env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def compile_one(target, variant, pass_, out_dir, timeout) -> dict:
  from bench_vs_xla import _crash_line  # noqa: PLC0415
  rec = {"target": target, "variant": variant, "pass": pass_}
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", target,
         variant, pass_, out_dir]
  try:
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired:
    rec["error"] = f"the compile did not finish in {timeout:.0f} s"
    return rec
  for line in run.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  how = f"signal {-run.returncode}" if run.returncode < 0 else f"exit {run.returncode}"
  rec["error"] = f"the compiler process died ({how}): {_crash_line(run.stderr)}"
  return rec


def has_compiler(target: str) -> bool:
  if target.startswith("gpu"):
    return _find("jax_plugins.xla_cuda12") and _find("nvidia.cuda_nvcc")
  return _find("libtpu")


def _find(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def _us(v) -> str:
  return "-" if v is None else f"{v * 1e6:,.0f}"


def _base(records, r):
  for b in records:
    if (b["target"], b["pass"], b["variant"]) == (r["target"], r["pass"],
                                                  "synchronous dispatch"):
      return b
  return None


def markdown(meta: dict, records: list[dict]) -> str:
  s = SHAPES
  out = ["# expert_parallel: modelled exposed all-to-all of one MoE block", "",
         f"Made by `{meta['command']}` on {meta['date']} ({meta['wall_s']:.0f} s wall). "
         "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
         + ".", "",
         f"The block: {s['devices']} devices, {s['tokens']} tokens a device of width "
         f"{s['d']}, {s['devices'] * s['experts_per_device']} experts "
         f"({s['experts_per_device']} a device; each `gelu(x @ w_in) @ w_out`, hidden "
         f"{s['hidden']}), top-{s['k']}, capacity {s['capacity']} tokens per expert per "
         "source device, f32. Times are **modelled** by jax_overlap's inspector on the "
         "h100 profile (tpu-v5e for TPU), not measured; 'vs sync' is exposed time over "
         "the synchronous dispatch's for the same target and pass.", "",
         "| target | schedule | pass | version | all-to-alls | communication (us) | "
         "exposed (us) | bound (us) | exposed / comm | exposed vs sync | compute (us) |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    head = f"| {r['target']} | {r.get('schedule', '-')} | {r['pass']} | {r['variant']} |"
    if "error" in r:
      err = r["error"].replace("|", "\\|").replace("\n", " ")[:400]
      out.append(head + " - | - | - | - | - | - | **failed**: " + err + " |")
      continue
    b = _base(records, r)
    vs = ("-" if b is None or "exposed_s" not in b or not b["exposed_s"]
          else f"{r['exposed_s'] / b['exposed_s']:.2f}")
    share = f"{r['exposed_s'] / r['comm_s']:.1%}" if r["comm_s"] else "-"
    out.append(head + f" {r['all_to_alls']} | {_us(r['comm_s'])} | "
               f"{_us(r['exposed_s'])} | {_us(r['bound_exposed_s'])} | {share} | {vs} | "
               f"{_us(r['compute_s'])} |")
  return "\n".join(out)


def versions() -> dict:
  import importlib.metadata  # noqa: PLC0415
  out = {"python": platform.python_version()}
  for dist in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = None
  git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True).stdout.strip()
  out["jax_overlap"] = f"git {git or '?'}"
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="+", choices=("gpu_h100", "tpu_v5e"),
                      default=["gpu_h100"])
  parser.add_argument("--cpu", action="store_true",
                      help="the CPU compile and the written schedule, not the real "
                      "compilers")
  parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
  parser.add_argument("--timeout", type=float, default=600)
  parser.add_argument("--keep-hlo", metavar="DIR")
  parser.add_argument("--out", default=str(RESULTS))
  opts = parser.parse_args()
  started = time.perf_counter()
  targets = ["cpu"] if opts.cpu else [t for t in opts.targets if has_compiler(t)]
  if not targets:
    print(f"no compiler for {opts.targets} here (make bench-moe runs this in "
          ".venv-aot): the CPU compile and the written schedule instead", flush=True)
    targets = ["cpu"]
  hlo_dir = opts.keep_hlo or tempfile.mkdtemp(prefix="bench-moe-")
  pathlib.Path(hlo_dir).mkdir(parents=True, exist_ok=True)
  records = []
  for target in targets:
    for pass_ in opts.passes:
      for variant in VARIANTS:
        rec = compile_one(target, variant, pass_, hlo_dir, opts.timeout)
        records.append(rec)
        b = _base(records, rec)
        state = (f"FAILED: {rec['error'][:300]}" if "error" in rec else
                 f"exposed {_us(rec['exposed_s'])} of {_us(rec['comm_s'])} us"
                 + (f" ({rec['exposed_s'] / b['exposed_s']:.2f}x the synchronous "
                    "dispatch's)" if b is not rec and b and b.get("exposed_s") else ""))
        print(f"  {target}, {pass_}, {variant}: {state}", flush=True)
  command = "python benchmarks/bench_moe.py " + " ".join(sys.argv[1:])
  meta = {"command": command.strip(), "shapes": SHAPES, "versions": versions(),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime(
              "%Y-%m-%d %H:%M UTC"), "wall_s": time.perf_counter() - started}
  text = markdown(meta, records)
  print("\n" + text)
  out = pathlib.Path(opts.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench-moe.md").write_text(text + "\n")
  kept = records if opts.keep_hlo else [{k: v for k, v in r.items() if k != "hlo"}
                                          for r in records]
  (out / "bench-moe.json").write_text(json.dumps({"meta": meta, "records": kept},
                                                 indent=2) + "\n")
  print(f"wrote {out / 'bench-moe.md'} and bench-moe.json", flush=True)
  return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  child(*sys.argv[2:6])
  sys.exit(0)


if __name__ == "__main__":
  sys.exit(main())
