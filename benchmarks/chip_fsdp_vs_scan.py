"""Benchmark, on a chip: fsdp_scan's train step against the same layers as a
plain scan, with nothing to hide (a 1-device mesh).

  python benchmarks/chip_fsdp_vs_scan.py [--dtypes float32 bfloat16]
      [--variants ...] [--out DIR] [--profile DIR]
  python benchmarks/chip_fsdp_vs_scan.py --summarise DIR

The demo transformer's train step (`chip_programs.train_step`: 8 layers,
width 1024, hidden 4096, 16x128 tokens, `value_and_grad` + SGD) in each of
`chip_programs.TRAIN_VARIANTS`, in f32 and bf16 (parameters stored in the
dtype): the median wall time of warm steps (each to `block_until_ready`)
and the median of the device's own time of 3 steps (the profiler's "XLA
Modules" events; TPU only), and each one's ratio to 'shard_map, lax.scan' (the same layers as a plain
`lax.scan` in `shard_map`: issue 45's target is fsdp_scan <= 1.05x it).
On one device XLA removes every gather and reduce-scatter, so the ratio is
the cost of the program fsdp_scan builds, not of communication.

`--profile DIR` also captures 2 steps of 'fsdp_scan' and of 'shard_map,
lax.scan' (in `--profile-dtype`, default f32) under `jax.profiler.trace`
(DIR/<variant>[_<dtype>]/..., and its module beside). `--summarise DIR`
(anywhere) reads those captures' "XLA Ops" line and prints where each program's time goes by kind of op
(fusions by the ops inside them), and the kinds whose time differs most.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BASE = "shard_map, lax.scan"
PROFILED = ("fsdp_scan", "shard_map, lax.scan")


def _slug(variant: str, dtype: str = "") -> str:
  return re.sub(r"[^A-Za-z0-9]+", "_", f"{variant} {dtype}").strip("_")


def measure(dtypes, variants, out: pathlib.Path | None, deadline: float | None):
  import jax.numpy as jnp  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  results = {"environment": cp.environment(), "train": cp.TRAIN, "rows": []}
  for dtype in dtypes:
    for variant in variants:
      row = {"dtype": dtype, "variant": variant}
      if deadline is not None and time.time() > deadline:
        row["error"] = "skipped: deadline"
      else:
        try:
          jitted, args = cp.train_step(variant, jnp.dtype(dtype))
          r = cp.time_program(jitted, args)
          hlo = r.pop("hlo")
          if out is not None:
            (out / f"{_slug(variant, dtype)}.hlo.txt").write_text(hlo)
          row.update(r)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
          row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
      print(f"{dtype} {variant}: " + (
          f"median {row['median_s'] * 1e3:.2f} ms over {row['runs']}, on the "
          f"device {row.get('device_s', float('nan')) * 1e3:.2f} ms "
          f"(compile {row['compile_s']:.1f} s)" if "median_s" in row
          else row["error"][:300]), flush=True)
      results["rows"].append(row)
      if out is not None:
        (out / "fsdp_vs_scan.json").write_text(json.dumps(results, indent=1))
  return results


def table(results) -> str:
  lines = ["| dtype | variant | median step, wall (ms) | / shard_map, lax.scan | "
           "on the device (ms) | / shard_map, lax.scan | runs | compile (s) |",
           "|---|---|---|---|---|---|---|---|"]
  rows = results["rows"]
  base = {(r["dtype"], k): r.get(k) for r in rows if r["variant"] == BASE
          for k in ("median_s", "device_s")}
  for r in rows:
    if "median_s" not in r:
      lines.append(f"| {r['dtype']} | {r['variant']} | {r['error'][:60]} | | | | | |")
      continue
    cells = []
    for k in ("median_s", "device_s"):
      b = base.get((r["dtype"], k))
      cells += ([f"{r[k] * 1e3:.2f}", f"{r[k] / b:.2f}" if b else "-"]
                if r.get(k) else ["-", "-"])
    lines.append(f"| {r['dtype']} | {r['variant']} | " + " | ".join(cells)
                 + f" | {r['runs']} | {r['compile_s']:.1f} |")
  return "\n".join(lines)


def _profiled(variant: str, dtype: str) -> str:
  """The folder (and module file stem) of a variant's capture."""
  return _slug(variant) if dtype == "float32" else _slug(variant, dtype)


def profile(where: pathlib.Path, dtype: str = "float32", steps: int = 2) -> None:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import chip_programs as cp  # noqa: PLC0415
  for variant in PROFILED:
    try:
      jitted, args = cp.train_step(variant, jnp.dtype(dtype))
      compiled = jitted.lower(*args).compile()
      (where / f"{_profiled(variant, dtype)}.hlo.txt").write_text(compiled.as_text())
      jax.block_until_ready(jitted(*args))
      with jax.profiler.trace(str(where / _profiled(variant, dtype))):
        for _ in range(steps):
          jax.block_until_ready(jitted(*args))
      print(f"profiled {variant}", flush=True)
    except Exception as e:  # noqa: BLE001
      print(f"profile of {variant}: FAILED {type(e).__name__}: {str(e)[:800]}",
            flush=True)


# --- reading a TPU capture's "XLA Ops" line, for --summarise ----------------------

_INSTR = re.compile(r"^%?([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_KIND = re.compile(r"kind=(k\w+)")
_TRIVIAL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple",
            "broadcast", "iota"}
_CONTROL = {"while", "call", "conditional"}


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Each computation's opcodes, from the compiled module's text."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head and not line.startswith(" "):
      current = out.setdefault(head.group(1), [])
      continue
    m = _INSTR.match(line.strip().removeprefix("ROOT "))
    if current is not None and m:
      current.append(m.group(2))
  return out


def op_label(event_name: str, comps: dict[str, list[str]]) -> tuple[str, str]:
  """(instruction, what it is): a fusion by its kind and the ops inside."""
  m = _INSTR.match(event_name)
  if not m:
    return event_name.split(" ")[0], event_name.split(" ")[0]
  name, opcode = m.groups()
  if opcode != "fusion":
    return name, opcode
  kind = _KIND.search(event_name)
  calls = _CALLS.search(event_name)
  inner = sorted({o for o in comps.get(calls.group(1), []) if o not in _TRIVIAL}
                 ) if calls else []
  return name, f"fusion {kind.group(1) if kind else '?'} [{'+'.join(inner) or '-'}]"


def op_times(xplane: pathlib.Path, hlo_text: str, steps: int):
  """{label: seconds a step}, {instruction: (label, seconds a step)} from the
  device's "XLA Ops" line; loops and calls (which span their bodies) left out."""
  import warnings  # noqa: PLC0415
  from jax.profiler import ProfileData  # noqa: PLC0415
  comps = computations(hlo_text)
  by_label, by_instr = collections.Counter(), {}
  import gzip  # noqa: PLC0415
  data = xplane.read_bytes()
  profile = ProfileData.from_serialized_xspace(
      gzip.decompress(data) if xplane.suffix == ".gz" else data)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for plane in profile.planes:
      if not plane.name.startswith("/device:TPU:0"):
        continue
      for line in plane.lines:
        if line.name != "XLA Ops":
          continue
        for e in line.events:
          name, label = op_label(e.name, comps)
          if label in _CONTROL:
            continue
          s = e.duration_ns * 1e-9 / steps
          by_label[label] += s
          old = by_instr.get(name, (label, 0.0))
          by_instr[name] = (label, old[1] + s)
  return by_label, by_instr


def _read_text(path: pathlib.Path) -> str:
  import gzip  # noqa: PLC0415
  gz = path.with_name(path.name + ".gz")
  return gzip.decompress(gz.read_bytes()).decode() if gz.exists() else path.read_text()


def summarise(where: pathlib.Path, dtype: str = "float32", steps: int = 2,
              top: int = 12) -> str:
  lines, labels = [], {}
  for variant in PROFILED:
    folder = where / _profiled(variant, dtype)
    found = sorted(folder.rglob("*.xplane.pb")) + sorted(folder.rglob("*.xplane.pb.gz"))
    if not found:
      lines.append(f"{variant}: no capture under {folder}")
      continue
    hlo = _read_text(where / f"{_profiled(variant, dtype)}.hlo.txt")
    by_label, by_instr = op_times(found[-1], hlo, steps)
    labels[variant] = by_label
    total = sum(by_label.values())
    lines += [f"\n{variant}: {total * 1e3:.2f} ms of ops a step "
              f"({len(by_instr)} instructions)", "",
              "| what | ms a step | share |", "|---|---|---|"]
    for label, s in by_label.most_common(top):
      lines.append(f"| {label} | {s * 1e3:.3f} | {s / total:.1%} |")
  if len(labels) == 2:
    a, b = (labels[v] for v in PROFILED)
    diff = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))
    lines += [f"\nWhat differs most ({PROFILED[0]} minus {PROFILED[1]}, ms a step):",
              "", f"| what | {PROFILED[0]} | {PROFILED[1]} | difference |",
              "|---|---|---|---|"]
    for k in diff[:top]:
      lines.append(f"| {k} | {a.get(k, 0) * 1e3:.3f} | {b.get(k, 0) * 1e3:.3f} | "
                   f"{(a.get(k, 0) - b.get(k, 0)) * 1e3:+.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  import chip_programs as cp  # noqa: PLC0415
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--variants", nargs="+", default=list(cp.TRAIN_VARIANTS),
                      choices=cp.TRAIN_VARIANTS)
  parser.add_argument("--out", help="write fsdp_vs_scan.json and the modules here")
  parser.add_argument("--profile", help="capture fsdp_scan and the plain scan here")
  parser.add_argument("--profile-dtype", default="float32",
                      help="the dtype of the captured steps (--profile, --summarise)")
  parser.add_argument("--summarise", help="read the captures under DIR")
  parser.add_argument("--deadline", type=float, default=None,
                      help="seconds from now after which rows are skipped")
  args = parser.parse_args(argv)
  if args.summarise:
    print(summarise(pathlib.Path(args.summarise), args.profile_dtype))
    return 0
  out = pathlib.Path(args.out) if args.out else None
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
  if args.profile:
    pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
    profile(pathlib.Path(args.profile), args.profile_dtype)
  deadline = None if args.deadline is None else time.time() + args.deadline
  results = measure(args.dtypes, args.variants, out, deadline)
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
