"""Calibration: programs measured on a chip, beside the step the report models.

Two modes:

  python benchmarks/calibrate.py --measure DIR [--only NAME ...]
      On the device (a TPU v5e): compiles and runs each program, and writes
      DIR/calibration.json (per program: the median wall time of warm runs,
      each run to `block_until_ready`, and the runs' times; the median of the
      device's own time of 3 runs, from the profiler's "XLA Modules" events
      (`device_s`: the wall time also holds the host's dispatch, about 0.5
      to 1 ms a call); the compile time; what it is) and DIR/<name>.hlo.txt
      (the compiled module, `compile().as_text()`).

  python benchmarks/calibrate.py --report DIR [--hardware tpu-v5e] [--markdown]
      Anywhere, no accelerator: reads those, models each module with
      `jax_overlap.OverlapReport.from_hlo(text, hardware=...)` (its
      `step_s`: the modelled step, `cost_source`: where its costs came
      from) and prints measured (the device time where there is one, else
      the wall time) against modelled with their ratio. The goal (issue 44)
      is every program within +-15%.

The saved data does not depend on the model: rerun `--report` on a
committed DIR (benchmarks/results/chip-2026-12-05/calibration) whenever the
cost model changes. The programs are `chip_programs.py`'s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TOLERANCE = 0.15


def _matmul(n: int, dtype: str, precision: str | None):
  def build():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import chip_programs as cp  # noqa: PLC0415
    n_ = n // 16 if cp.SMALL else n
    dt = jnp.dtype(dtype)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n_, n_), dt)
    b = jax.random.normal(kb, (n_, n_), dt)
    prec = None if precision is None else getattr(jax.lax.Precision, precision)
    return jax.jit(lambda a, b: jnp.dot(a, b, precision=prec)), (a, b)
  return build


def _elementwise():
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  n = (1 << 27) // (64 if cp.SMALL else 1)          # 2**27 f32: 537 MB
  x = jax.random.normal(jax.random.PRNGKey(0), (n // 8192, 8192), jnp.float32)
  return jax.jit(lambda x: x * 1.5 + 1.0), (x,)


def _matmul_shape(m: int, k: int, n: int, dtype: str):
  def build():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (m, k), jnp.dtype(dtype))
    b = jax.random.normal(kb, (k, n), jnp.dtype(dtype))
    return jax.jit(lambda a, b: a @ b), (a, b)
  return build


def _attention_einsum(dtype: str):
  """The demo block's q @ k^T: 'bqhe,bkhe->bhqk' at 16x128 tokens, 8 heads of
  128 (XLA:TPU writes it as a convolution with a window)."""
  def build():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import chip_programs as cp  # noqa: PLC0415
    b, s = (4, 32) if cp.SMALL else (16, 128)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(ka, (b, s, 8, 128), jnp.dtype(dtype))
    k = jax.random.normal(kb, (b, s, 8, 128), jnp.dtype(dtype))
    return jax.jit(lambda q, k: jnp.einsum("bqhe,bkhe->bhqk", q, k)), (q, k)
  return build


def _elementwise_of(dtype: str, op: str):
  def build():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import chip_programs as cp  # noqa: PLC0415
    n = (1 << 27) // (64 if cp.SMALL else 1)
    x = jax.random.normal(jax.random.PRNGKey(0), (n // 8192, 8192), jnp.dtype(dtype))
    fn = {"scale": lambda x: x * 1.5 + 1.0, "sum_rows": lambda x: x.sum(axis=1),
          "transpose": lambda x: x.T}[op]
    return jax.jit(fn), (x,)
  return build


def _copies():
  """A transpose, a convert and a broadcast of one f32 array, each its own
  output (so none fuses into a consumer)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  rows = 512 if cp.SMALL else 4096
  x = jax.random.normal(jax.random.PRNGKey(0), (rows, 8192), jnp.float32)

  def copies(x):
    return (x.T, x.astype(jnp.bfloat16),
            jnp.broadcast_to(x[:, None, :1024], (rows, 4, 1024)),
            jnp.concatenate([x, x], axis=0))
  return jax.jit(copies), (x,)


def _train(variant: str, dtype: str):
  def build():
    import jax.numpy as jnp  # noqa: PLC0415
    import chip_programs as cp  # noqa: PLC0415
    return cp.train_step(variant, jnp.dtype(dtype))
  return build


def _ring(seq: int):
  def build():
    import jax  # noqa: PLC0415
    import chip_programs as cp  # noqa: PLC0415
    seq_ = seq // 32 if cp.SMALL else seq
    fn = cp.forward_and_backward(cp.ring_attention_fn(causal=True))
    return jax.jit(fn), tuple(cp.attention_inputs(seq_))
  return build


def _tick():
  import chip_programs as cp  # noqa: PLC0415
  return cp.pipeline_stage_tick()


def _stage_microbatches(recompute: bool, seq: int | None = None,
                        batch: int | None = None):
  def build():
    import chip_programs as cp  # noqa: PLC0415
    seq_ = seq // 8 if seq and cp.SMALL else seq
    return cp.pipeline_stage_microbatches(recompute, seq=seq_, batch=batch)
  return build


#: name -> (what it is, builder of (jitted, args)).
PROGRAMS = {
    **{f"matmul_{n}_{dt}{'_highest' if p else ''}": (
        f"{n}x{n} @ {n}x{n}, {dt}, precision={p or 'default'}",
        _matmul(n, dt, p))
       for n in (4096, 8192) for dt in ("bfloat16", "float32")
       for p in (None, "HIGHEST")},
    "elementwise_f32_537MB": ("x * 1.5 + 1 on 2**27 f32 (537 MB in, 537 out)",
                              _elementwise),
    "copies_f32": ("x.T, x as bf16, a broadcast and a concatenate of a "
                   "4096x8192 f32 (each its own output)", _copies),
    "matmul_2048x1024x4096_float32": (
        "2048x1024 @ 1024x4096 f32 (the train step's up projection)",
        _matmul_shape(2048, 1024, 4096, "float32")),
    "matmul_2048x4096x1024_float32": (
        "2048x4096 @ 4096x1024 f32 (its down projection)",
        _matmul_shape(2048, 4096, 1024, "float32")),
    "matmul_2048x1024x4096_bfloat16": (
        "2048x1024 @ 1024x4096 bf16", _matmul_shape(2048, 1024, 4096, "bfloat16")),
    "attention_scores_f32": (
        "einsum bqhe,bkhe->bhqk, 16x128 tokens, 8 heads of 128, f32",
        _attention_einsum("float32")),
    "attention_scores_bf16": (
        "the same in bf16", _attention_einsum("bfloat16")),
    "elementwise_bf16_268MB": ("x * 1.5 + 1 on 2**27 bf16 (268 MB in, 268 out)",
                               _elementwise_of("bfloat16", "scale")),
    "row_sums_f32_537MB": ("x.sum(axis=1) of 2**27 f32 as (16384, 8192)",
                           _elementwise_of("float32", "sum_rows")),
    "transpose_f32_537MB": ("x.T of 2**27 f32 as (16384, 8192)",
                            _elementwise_of("float32", "transpose")),
    "train_step_jit_scan_f32": (
        "demo transformer train step, 8 layers, width 1024, 16x128 tokens, "
        "f32: jit, lax.scan over the layers, SGD", _train("jit, lax.scan", "float32")),
    "train_step_jit_unrolled_f32": (
        "the same, the layers unrolled in Python", _train("jit, unrolled", "float32")),
    "train_step_shard_map_scan_f32": (
        "the same as a lax.scan in shard_map (1-device mesh)",
        _train("shard_map, lax.scan", "float32")),
    "train_step_fsdp_scan_f32": (
        "the same through fsdp_scan (1-device mesh, demo ends)",
        _train("fsdp_scan", "float32")),
    "train_step_jit_scan_bf16": (
        "the jit + lax.scan train step, parameters in bf16",
        _train("jit, lax.scan", "bfloat16")),
    "train_step_shard_map_scan_bf16": (
        "the shard_map + lax.scan train step, parameters in bf16",
        _train("shard_map, lax.scan", "bfloat16")),
    "train_step_fsdp_scan_bf16": (
        "the fsdp_scan train step, parameters in bf16",
        _train("fsdp_scan", "bfloat16")),
    "ring_attention_8k_bf16": (
        "ring_attention, 1-device mesh, causal, seq 8192, 8 heads, head dim "
        "128, bf16, forward + vjp", _ring(8192)),
    "pipeline_stage_tick_f32": (
        "one stage of the demo's pipeline (fsdp_scan over 2 blocks, width "
        "1024), forward + vjp of a 4x128-token microbatch, f32", _tick),
    "pipeline_stage_4_microbatches_kept_f32": (
        "that stage's gradient over 4 microbatches, every forward first, "
        "each keeping its residuals (pipeline_loss(recompute=False))",
        _stage_microbatches(False)),
    "pipeline_stage_4_microbatches_recomputed_f32": (
        "the same, each backward recomputing its forward (recompute=True)",
        _stage_microbatches(True)),
    "pipeline_stage_4_microbatches_kept_seq512_f32": (
        "the kept-residuals program at bench_pipeline's microbatch (one "
        "sequence of 512 a device)", _stage_microbatches(False, 512, 1)),
    "pipeline_stage_4_microbatches_recomputed_seq512_f32": (
        "the same, recomputing", _stage_microbatches(True, 512, 1)),
}


def measure(out: pathlib.Path, only: list[str] | None, deadline: float | None) -> int:
  import chip_programs as cp  # noqa: PLC0415
  out.mkdir(parents=True, exist_ok=True)
  path = out / "calibration.json"
  data = json.loads(path.read_text()) if path.exists() else {}
  data["environment"] = cp.environment()
  data.setdefault("programs", {})
  data["command"] = "python benchmarks/calibrate.py " + " ".join(sys.argv[1:])
  names = [n for n in PROGRAMS if not only or n in only]
  for name in names:
    what, build = PROGRAMS[name]
    if deadline is not None and time.time() > deadline:
      print(f"{name}: skipped (past the deadline)", flush=True)
      data["programs"].setdefault(name, {"what": what, "error": "skipped: deadline"})
      path.write_text(json.dumps(data, indent=1))
      continue
    rec = {"what": what}
    try:
      jitted, args = build()
      r = cp.time_program(jitted, args, budget_s=1.0)
      (out / f"{name}.hlo.txt").write_text(r.pop("hlo"))
      rec.update(r, hlo=f"{name}.hlo.txt")
      print(f"{name}: median {r['median_s'] * 1e3:.3f} ms over {r['runs']} runs, "
            f"on the device {r.get('device_s', float('nan')) * 1e3:.3f} ms "
            f"(compile {r['compile_s']:.1f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
      rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      print(f"{name}: FAILED {rec['error'][:300]}", flush=True)
    data["programs"][name] = rec
    path.write_text(json.dumps(data, indent=1))
  return 0


def _read_text(path: pathlib.Path) -> str:
  """A file's text, or its gzipped copy's (`NAME.gz`) where only that is kept."""
  import gzip  # noqa: PLC0415
  if path.exists():
    return path.read_text()
  return gzip.decompress(path.with_name(path.name + ".gz").read_bytes()).decode()


def report_rows(where: pathlib.Path, hardware: str) -> tuple[dict, list[dict]]:
  """(environment, a row per program: measured, modelled, ratio)."""
  import jax_overlap  # noqa: PLC0415
  data = json.loads((where / "calibration.json").read_text())
  rows = []
  for name, rec in data["programs"].items():
    row = {"program": name, "what": rec.get("what", ""),
           "measured_s": rec.get("device_s", rec.get("median_s")),
           "wall_s": rec.get("median_s"),
           "measured_on": "device" if "device_s" in rec else "wall"}
    if "error" in rec:
      row["error"] = rec["error"]
    else:
      try:
        report = jax_overlap.OverlapReport.from_hlo(
            _read_text(where / rec["hlo"]), hardware=hardware)
        row.update(modelled_s=report.step_s,
                   cost_source=getattr(report, "cost_source", None),
                   ratio=report.step_s / row["measured_s"])
      except Exception as e:  # noqa: BLE001 - one model failure, one row
        row["error"] = f"model: {type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
  return data.get("environment", {}), rows


def _ms(s):
  return "-" if s is None else f"{s * 1e3:.3f}"


def render(env: dict, rows: list[dict], hardware: str, markdown: bool) -> str:
  head = ["program", "measured (ms)", "wall (ms)", f"modelled on {hardware} (ms)",
          "modelled / measured", "within 15%", "cost source"]
  body = []
  for r in rows:
    measured = _ms(r["measured_s"]) + ("" if r["measured_on"] == "device" else " (wall)")
    if "ratio" in r:
      ok = "yes" if abs(r["ratio"] - 1) <= TOLERANCE else "no"
      body.append([r["program"], measured, _ms(r["wall_s"]), _ms(r["modelled_s"]),
                   f"{r['ratio']:.2f}", ok, str(r["cost_source"])])
    else:
      body.append([r["program"], measured, _ms(r["wall_s"]), "-", "-", "-",
                   r.get("error", "")[:80]])
  n_ok = sum(1 for b in body if b[5] == "yes")
  lines = [f"measured on {env.get('device_kind', '?')} ({env.get('platform', '?')}), "
           f"jax {env.get('jax', '?')}, libtpu {env.get('libtpu', '?')}, "
           f"{env.get('date_utc', '?')}; measured: the device's own time (profiler), "
           "'(wall)' where only the wall time was taken; modelled by jax_overlap "
           "OverlapReport.from_hlo(...).step_s"]
  if markdown:
    lines += ["", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(b) + " |" for b in body]
  else:
    widths = [max(len(h), *(len(b[k]) for b in body)) for k, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
  lines.append(f"{n_ok} of {len(body)} programs within +-{TOLERANCE:.0%}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--measure", metavar="DIR", help="run the programs (on the device)")
  mode.add_argument("--report", metavar="DIR", help="measured against modelled")
  parser.add_argument("--only", nargs="+", choices=sorted(PROGRAMS),
                      help="these programs only (--measure)")
  parser.add_argument("--deadline", type=float, default=None,
                      help="seconds from now after which programs are skipped")
  parser.add_argument("--hardware", default="tpu-v5e", help="the profile (--report)")
  parser.add_argument("--markdown", action="store_true", help="a Markdown table")
  parser.add_argument("--json", action="store_true", help="the rows as JSON")
  args = parser.parse_args(argv)
  if args.measure:
    deadline = None if args.deadline is None else time.time() + args.deadline
    return measure(pathlib.Path(args.measure), args.only, deadline)
  env, rows = report_rows(pathlib.Path(args.report), args.hardware)
  print(json.dumps(rows, indent=1) if args.json
        else render(env, rows, args.hardware, args.markdown))
  return 0


if __name__ == "__main__":
  sys.exit(main())
