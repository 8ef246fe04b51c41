"""Benchmark: pipeline_loss's schedules against MaxText's approach, on the
real H100 and TPU v5e compilers, ahead of time.

The demo's transformer (`jax_overlap._src.demo.pipeline`: width 1024,
hidden 4096, 8 heads, sequence 512, 8 blocks) over 4 pipeline stages x 2
FSDP devices, each stage an `fsdp_scan` over its 2 blocks, 8 microbatches
of 2 sequences (one a device), f32, the training loss's `value_and_grad`:

  gpipe / 1f1b / zb-h1   `jax_overlap.pipeline_loss(..., schedule=...)`: the
  interleaved / zb-v     schedule runs the backward, sends are
  dualpipev              `ppermute_start` futures in flight over the next
                         tick; interleaved, ZB-V and DualPipeV run two
                         chunks a device (8 stages of 1 block).
  S, recompute           schedule S with `recompute=True` (zb-h1,
                         interleaved, zb-v, dualpipev).
  S, gathered once       schedule S (1f1b and the four above) with each
  [, recompute | kept]   stage's blocks gathered over FSDP once, before the
                         pipeline (MaxText's ag_once), each stage its blocks
                         unrolled; the platform's default, `recompute=True`
                         or `recompute=False`.
  shift (MaxText)        the approach MaxText and jax's shard_map notebook
                         write: a `lax.scan` over m + p - 1 iterations, every
                         stage running its stage on what it holds (stage 0
                         takes the next microbatch), then a `ppermute` shift
                         to the next stage; the backward is autodiff of that
                         scan (GPipe order, every iteration's activations
                         kept); its stages gather their weights with a plain
                         all_gather (FSDP left to XLA, as in MaxText).

Each is compiled ahead of time (.venv-aot); the scheduled module is read by
`jax_overlap.OverlapReport.from_hlo` on the h100 / tpu-v5e profile:
modelled step, compute, communication and exposed communication, the bytes
the collectives move (each one's `bytes` times its modelled `runs`), and the
compiled temp bytes (`memory_analysis()`). pipeline_loss runs its defaults
(`recompute=None`: True on the v5e, False on the H100). The bubble is the schedule's
under unit costs with free sends, as the literature gives it
(`pipeline_schedule(...).simulate(send=0)`: the table that runs, each send
costing nothing; the modelled step counts what they cost; the shift loop's
is GPipe's, (p-1)/(m+p-1), with its idle iterations computing on zeros).
Every time is modelled, not measured. Writes
benchmarks/results/bench-pipeline.{md,json}.

  python benchmarks/bench_pipeline.py [--targets gpu_h100 tpu_v5e]
      [--width 1024] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap._src.demo import model, pipeline  # noqa: E402
from jax_overlap._src.patterns import varying as _varying  # noqa: E402

PROFILE = {"gpu_h100": "h100", "tpu_v5e": "tpu-v5e"}
STAGES, FSDP = 4, 2
#: pipeline_loss's schedules, each a variant of its own
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "dualpipev")
#: a schedule's variants: its stages' blocks gathered over FSDP once before
#: the pipeline ("gathered once"), with the platform's default `recompute`,
#: `recompute=True` ("recompute") or `recompute=False` ("kept")
#: (docs/pipeline.md "Gathering a stage's weights once a step").
ONCE = tuple(f"{s}, gathered once{r}" for s in ("1f1b", "zb-h1", "interleaved",
                                                 "zb-v", "dualpipev")
             for r in ("", ", recompute", ", kept"))
RECOMPUTED = tuple(f"{s}, recompute" for s in ("zb-h1", "interleaved", "zb-v",
                                               "dualpipev"))
VARIANTS = SCHEDULES + RECOMPUTED + ONCE + ("shift (MaxText)",)


def how(variant: str) -> tuple[str, dict]:
  """(schedule, pipelined_loss's keywords) of a variant other than the shift
  loop: "SCHEDULE[, gathered once][, recompute | kept]"."""
  schedule, *rest = variant.split(", ")
  kw = {}
  if "gathered once" in rest:
    kw["gather_once"] = True
  if "recompute" in rest or "kept" in rest:
    kw["recompute"] = "recompute" in rest
  return schedule, kw


def shift_loss(cfg, mesh, param_specs, m):
  """MaxText's pipeline written out in shard_map: iteration i, stage d runs
  microbatch i - d; outputs shift one stage on with a ppermute; autodiff
  gives the backward."""
  p = STAGES
  loss_of = pipeline.logits_loss(cfg.vocab)

  def stage(w, x):
    # FSDP left to XLA, as MaxText does: the stage's weights gathered, then
    # its blocks. (fsdp_scan here, inside the shift loop's scan, aborts the
    # H100 compiler in HloCSE on a late-inlined constant.)
    full = jax.tree.map(
        lambda a: jax.lax.all_gather(a, pipeline.FSDP, axis=1, tiled=True), w)
    return jax.lax.scan(lambda x, wl: (model.block(cfg)(wl, x), None), x, full)[0]

  def body(params, tokens, targets):
    split = lambda a: a.reshape((m, -1) + a.shape[1:])
    xs, ts = model.embed(params, split(tokens)), split(targets)
    w = jax.tree.map(lambda a: a[0], params["blocks"])
    me = jax.lax.axis_index(pipeline.PP)
    shift = [(d, (d + 1) % p) for d in range(p)]

    def step(carry, i):
      state, total = carry
      state = jnp.where(me == 0, xs[jnp.minimum(i, m - 1)], state)
      state = stage(w, state)
      j = i - (p - 1)
      done = jnp.where((me == p - 1) & (j >= 0),
                       loss_of(state, ts[jnp.maximum(j, 0)]), 0.0)
      return (jax.lax.ppermute(state, pipeline.PP, shift), total + done), None

    # the carry varies over both axes, as what the loop puts in it does
    vary = lambda a: _varying.vary_over(a, (pipeline.PP, pipeline.FSDP))
    init = (vary(jnp.zeros_like(xs[0])), vary(jnp.zeros((), jnp.float32)))
    (_, total), _ = jax.lax.scan(step, init, jnp.arange(m + p - 1))
    return jax.lax.pmean(jax.lax.psum(total, pipeline.PP) / m, pipeline.FSDP)

  return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, P(pipeline.FSDP),
                                                  P(pipeline.FSDP)), out_specs=P())


def _mesh(target):
  from bench_vs_xla import _mesh as one_axis  # noqa: PLC0415
  devices = np.array(one_axis(target).devices).reshape(STAGES, FSDP)
  return Mesh(devices, (pipeline.PP, pipeline.FSDP))


def program(variant, mesh, width, m):
  cfg = model.Config(vocab=32, d=width, heads=max(1, width // 128),
                     hidden=4 * width, layers=2 * STAGES, seq=512)
  schedule, how_ = ("1f1b", {}) if variant == "shift (MaxText)" else how(variant)
  shapes = jax.eval_shape(lambda: pipeline.init(cfg, STAGES, jax.random.key(0),
                                                schedule))
  specs = pipeline.specs(shapes)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, s)), shapes, specs)
  tokens = jax.ShapeDtypeStruct((m * FSDP, cfg.seq), jnp.int32,
                                sharding=NamedSharding(mesh, P(pipeline.FSDP)))
  if variant == "shift (MaxText)":
    loss = shift_loss(cfg, mesh, specs, m)
  else:
    loss = pipeline.pipelined_loss(cfg, mesh, specs, m, schedule, **how_)
  return jax.value_and_grad(loss), (params, tokens, tokens)


def bubble(variant, m):
  if variant == "shift (MaxText)":
    return (STAGES - 1) / (m + STAGES - 1)
  schedule = how(variant)[0]
  plan = jax_overlap.pipeline_schedule(   # what pipeline_loss runs
      schedule, STAGES, m, pipeline.chunks(schedule))
  return plan.simulate(send=0).bubble_fraction   # the table's, sends free


def measure(target, variant, width, m) -> dict:
  rec = {"target": target, "variant": variant, "width": width, "microbatches": m,
         "bubble_unit_costs": bubble(variant, m)}
  try:
    fn, args = program(variant, _mesh(target), width, m)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    rec["compile_s"] = time.perf_counter() - t0
    report = jax_overlap.OverlapReport.from_hlo(compiled.as_text(),
                                                hardware=PROFILE[target])
    t = report.totals
    rec.update(step_s=report.step_s, compute_s=report.compute_s,
               comm_s=t["comm_s"], exposed_s=t["exposed_s"],
               temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
               # bytes the collectives move, each times its modelled runs
               comm_bytes=sum(c.bytes * c.runs for c in report.collectives))
  except Exception as e:  # noqa: BLE001 - a failed compile is a result
    rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
  return rec


def markdown(meta, records) -> str:
  out = ["# pipeline_loss against MaxText's shift loop: modelled step, exposed "
         "communication, bubble", "",
         "; ".join(f"`{run['command']}`, {run['date']}"
                   + (f" ({run['wall_s']:.0f} s wall)" if "wall_s" in run else "")
                   for run in meta.get("runs") or [meta])
         + "; " + (", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
                   if "versions" in meta else f"jax {meta['jax']}") + ". The demo's "
         f"transformer at width {meta['width']} (8 blocks, 4 stages x 2 FSDP, "
         f"{meta['microbatches']} microbatches), value_and_grad, f32. Times "
         "modelled by the library's report on the real compilers' schedules "
         "(ahead of time), not measured; bubble under unit costs, sends free.", "",
         "| target | variant | step (us) | compute (us) | comm (us) | exposed (us) "
         "| bubble | temp (MiB) | moved (MiB) | step / shift's | moved / shift's |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  base = {r["target"]: r for r in records if r["variant"] == "shift (MaxText)"
          and "error" not in r}
  for r in records:
    if "error" in r:
      out.append(f"| {r['target']} | {r['variant']} | failed: {r['error'][:80]} "
                 "| | | | | | | | |")
      continue
    b = base.get(r["target"])
    ratio = f"{r['step_s'] / b['step_s']:.2f}" if b else "-"
    moved = r.get("comm_bytes")
    moved_ratio = (f"{moved / b['comm_bytes']:.2f}"
                   if b and moved is not None and b.get("comm_bytes") else "-")
    out.append(f"| {r['target']} | {r['variant']} | {r['step_s'] * 1e6:.0f} | "
               f"{r['compute_s'] * 1e6:.0f} | {r['comm_s'] * 1e6:.0f} | "
               f"{r['exposed_s'] * 1e6:.0f} | {r['bubble_unit_costs']:.3f} | "
               f"{r['temp_bytes'] / 2**20:.1f} | "
               f"{'-' if moved is None else f'{moved / 2**20:.0f}'} | {ratio} | "
               f"{moved_ratio} |")
  return "\n".join(out) + "\n"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="+", choices=tuple(PROFILE),
                      default=list(PROFILE))
  parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                      default=list(VARIANTS))
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--microbatches", type=int, default=8)
  parser.add_argument("--out", default=str(HERE / "results" / "bench-pipeline"))
  parser.add_argument("--merge", action="store_true",
                      help="keep the records of OUT.json this run does not redo")
  opts = parser.parse_args()
  out = pathlib.Path(opts.out)
  started = time.perf_counter()
  redo = {(t, v) for t in opts.targets for v in opts.variants}
  before = json.loads(out.with_suffix(".json").read_text()) if opts.merge else None
  kept = [r for r in before["records"]
          if (r["target"], r["variant"]) not in redo] if before else []
  records = []
  for target in opts.targets:
    for variant in opts.variants:
      rec = measure(target, variant, opts.width, opts.microbatches)
      records.append(rec)
      if "error" in rec:
        print(f"{target} {variant}: failed: {rec['error'][:200]}", flush=True)
        continue
      print(f"{target} {variant}: step {rec['step_s'] * 1e6:.0f} us, exposed "
            f"{rec['exposed_s'] * 1e6:.0f} of {rec['comm_s'] * 1e6:.0f} us comm, "
            f"bubble {rec['bubble_unit_costs']:.3f}, temp "
            f"{rec['temp_bytes'] / 2**20:.1f} MiB (compile {rec['compile_s']:.0f} s)",
            flush=True)
  records = sorted(kept + records, key=lambda r: (
      tuple(PROFILE).index(r["target"]), VARIANTS.index(r["variant"])))
  for target in opts.targets:
    base = next((r for r in records if r["target"] == target and r["variant"]
                 == "shift (MaxText)" and "error" not in r), None)
    for r in records:
      if base and r["target"] == target and "error" not in r and r is not base:
        print(f"{target} {r['variant']} / shift: modelled step "
              f"{r['step_s'] / base['step_s']:.2f}x, exposed comm "
              f"{r['exposed_s'] / max(base['exposed_s'], 1e-12):.2f}x, temp "
              f"{r['temp_bytes'] / base['temp_bytes']:.2f}x, moved "
              f"{r.get('comm_bytes', 0) / max(base.get('comm_bytes', 0), 1):.2f}x")
  from bench_vs_xla import versions  # noqa: PLC0415
  run = {"command": "python benchmarks/bench_pipeline.py " + shlex.join(sys.argv[1:]),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime(
             "%Y-%m-%d %H:%M UTC"), "wall_s": time.perf_counter() - started}
  # merged: every run whose records are kept is named (the earlier file's own runs too)
  runs = ([*(before["meta"].get("runs") or [{k: before["meta"][k] for k in
                                              ("command", "date", "wall_s")
                                              if k in before["meta"]}]), run]
          if kept else [run])
  meta = {**run, "runs": runs, "jax": jax.__version__, "versions": versions(),
          "width": opts.width, "microbatches": opts.microbatches}
  out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records},
                                                 indent=2))
  out.with_suffix(".md").write_text(markdown(meta, records))
  print(f"wrote {out}.md and .json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
