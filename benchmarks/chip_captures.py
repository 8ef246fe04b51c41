"""Profile captures of small overlap programs on one chip, for the reader's tests.

  python benchmarks/chip_captures.py --out DIR [--only NAME ...]

Each program runs once to compile and warm up, then `--steps` times under
`jax.profiler.trace(DIR/NAME)`; DIR/NAME.hlo.txt is its compiled module
(`compile().as_text()`: a TPU capture holds no HLO). On a 1-device mesh XLA
keeps a collective-permute as an async pair (start, done), so the window of
a `ppermute_start` can be measured on one chip:

  futures              `ppermute_start(x).done()` with a bf16 matmul written
                       between, under `program_order(enforce=True)`.
  scan_ordered         a `lax.scan` of 4 steps, each a `ppermute_start` of
                       the carry, a matmul, then `done()`, the body under
                       `program_order(enforce=True)`.
  scan_unordered       the same body without `program_order`: XLA is free to
                       put the done before the matmul (it did not).
  scan_dependent       a `lax.scan` of 4 steps whose matmul reads the permuted
                       carry: the done must come first, nothing can hide it.
  fsdp_scan_step       the demo transformer's fsdp_scan train step at 2
                       layers (width 1024, 16x128 tokens, f32).

Also prints what `jax_overlap.measure` reports of each (`--measure`), for a
before/after of the reader. tests/fixtures/profiles/ keeps the captures.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import chip_programs as cp  # noqa: E402

N = 512 if cp.SMALL else 2048
SELF = [(0, 0)]


def futures():
  from jax_overlap import ppermute_start, program_order  # noqa: PLC0415

  @jax.jit
  @jax.shard_map(mesh=cp.mesh1(), in_specs=(P(cp.AXIS), P()),
                 out_specs=(P(cp.AXIS), P()))
  @program_order(enforce=True)
  def futures(x, w):
    fut = ppermute_start(x, cp.AXIS, SELF)
    y = jnp.tanh(w @ w)
    return fut.done(), y
  x = jnp.ones((N, N), jnp.float32)
  w = jax.random.normal(jax.random.PRNGKey(0), (N, N), jnp.bfloat16) / 50
  return futures, (x, w)


def scan(ordered: bool):
  def build():
    from jax_overlap import ppermute_start, program_order  # noqa: PLC0415

    def body(carry, _):
      x, h, w = carry
      fut = ppermute_start(x, cp.AXIS, SELF)
      h = jnp.tanh(h @ w)
      return (fut.done(), h, w), None
    if ordered:
      body = program_order(enforce=True)(body)

    @jax.jit
    @jax.shard_map(mesh=cp.mesh1(), in_specs=(P(cp.AXIS), P(), P()),
                   out_specs=(P(cp.AXIS), P()))
    def scan_of_permutes(x, h, w):
      (x, h, _), _ = jax.lax.scan(body, (x, h, w), None, length=4)
      return x, h
    x = jnp.ones((N, N), jnp.float32)
    h = jax.random.normal(jax.random.PRNGKey(1), (N, N), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(0), (N, N), jnp.bfloat16) / 50
    return scan_of_permutes, (x, h, w)
  return build


def scan_dependent():
  from jax_overlap import ppermute_start  # noqa: PLC0415

  def body(carry, _):
    x, h, w = carry
    x = ppermute_start(x, cp.AXIS, SELF).done()
    h = jnp.tanh((h + x.astype(h.dtype)) @ w)
    return (x, h, w), None

  @jax.jit
  @jax.shard_map(mesh=cp.mesh1(), in_specs=(P(cp.AXIS), P(cp.AXIS), P()),
                 out_specs=(P(cp.AXIS), P(cp.AXIS)))
  def scan_of_permutes(x, h, w):
    (x, h, _), _ = jax.lax.scan(body, (x, h, w), None, length=4)
    return x, h
  x = jnp.ones((N, N), jnp.float32)
  h = jax.random.normal(jax.random.PRNGKey(1), (N, N), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(0), (N, N), jnp.bfloat16) / 50
  return scan_of_permutes, (x, h, w)


def fsdp_scan_step():
  saved = cp.TRAIN["layers"]
  cp.TRAIN["layers"] = 2
  try:
    return cp.train_step("fsdp_scan", jnp.float32)
  finally:
    cp.TRAIN["layers"] = saved


PROGRAMS = {"futures": futures, "scan_ordered": scan(True),
            "scan_unordered": scan(False), "scan_dependent": scan_dependent,
            "fsdp_scan_step": fsdp_scan_step}


def capture(jitted, args, where: pathlib.Path, steps: int) -> str:
  """Traces `steps` runs into `where`; returns the compiled module's text."""
  compiled = jitted.lower(*args).compile()
  jax.block_until_ready(jitted(*args))
  if where.exists():
    shutil.rmtree(where)
  with jax.profiler.trace(str(where)):
    for _ in range(steps):
      jax.block_until_ready(jitted(*args))
  return compiled.as_text()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--only", nargs="+", choices=sorted(PROGRAMS))
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--deadline", type=float, default=None,
                      help="seconds from now after which programs are skipped")
  parser.add_argument("--measure", action="store_true",
                      help="also print jax_overlap.measure's report of each")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  deadline = None if args.deadline is None else time.time() + args.deadline
  for name, build in PROGRAMS.items():
    if args.only and name not in args.only:
      continue
    if deadline is not None and time.time() > deadline:
      print(f"{name}: skipped (past the deadline)", flush=True)
      continue
    t0 = time.perf_counter()
    try:
      jitted, fn_args = build()
      text = capture(jitted, fn_args, out / name, args.steps)
      (out / f"{name}.hlo.txt").write_text(text)
      files = sorted((out / name).rglob("*.xplane.pb"))
      print(f"{name}: captured {[f'{f.stat().st_size} bytes' for f in files]} "
            f"in {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
      continue
    if args.measure:
      try:
        import jax_overlap  # noqa: PLC0415
        report = jax_overlap.measure(jitted, steps=args.steps,
                                     hardware="tpu-v5e")(*fn_args)
        print(f"--- jax_overlap.measure of {name}:\n{report}", flush=True)
        (out / f"{name}.measured.json").write_text(report.to_json())
      except Exception as e:  # noqa: BLE001
        print(f"--- jax_overlap.measure of {name}: FAILED {type(e).__name__}: "
              f"{str(e)[:800]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
