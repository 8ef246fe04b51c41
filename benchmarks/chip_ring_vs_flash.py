"""Benchmark, on one TPU: ring_attention on its flash kernel against jax's
Pallas flash_attention.

  PYTHONPATH=src python benchmarks/chip_ring_vs_flash.py [--seqs 8192 32768]
      [--json FILE] [--budget 170]

Causal attention, batch 1, 8 heads (8 kv heads), head dim 128, bfloat16, one
device (issue 45's setting):
- `ring_attention` on a 1-device mesh, `implementation=None`: on TPU the
  library's Pallas flash kernel (patterns/attention/flash_tpu.py; a ring of
  one device has nothing to rotate and runs it once a pass);
- `flash_attention 512`: `jax.experimental.pallas.ops.tpu.flash_attention`
  with every block size 512, on (batch, heads, seq, head_dim) inputs made
  before timing (its layout; ring_attention takes (batch, seq, heads,
  head_dim) and pays its own relayouts);
- `ring_attention xla`: `implementation="xla"`, the XLA blocks it ran before.
Forward alone, and forward + the vjp of a fixed cotangent, each one jitted
program. A sample is 5 calls back to back (host dispatch overlapped), timed to
`block_until_ready` and divided by 5; the median of 7 warm samples (fewer
calls and samples for slow programs). Prints ring / flash: the target is
<= 1.15 for forward + backward at 8K and 32K.

Also, once a length: the kernel's output and gradients against
flash_attention's (max abs difference; bf16 both), and at the first length
the kernel's tiles (256, 512, 1024) for docs/attention.md's tile rule.
Each case is in its own try/except; cases that would start past `--budget`
seconds (150) are skipped, said so: about 3 minutes in all on a v5e. Self-contained: jax, numpy and this repository's src/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

HEADS, HEAD_DIM, DTYPE = 8, 128, jnp.bfloat16
FORMS = ("ring_attention", "flash_attention 512", "ring_attention xla")


def environment() -> dict:
  import jaxlib  # noqa: PLC0415
  out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "device": jax.devices()[0].device_kind,
         "platform": jax.devices()[0].platform,
         "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  try:
    import importlib.metadata as md  # noqa: PLC0415
    out["libtpu"] = md.version("libtpu")
  except Exception:  # noqa: BLE001 - not installed as a distribution
    out["libtpu"] = None
  return out


def inputs(seq: int):
  """q, k, v and a cotangent, (1, seq, heads, head_dim)."""
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  return [jax.random.normal(k, (1, seq, HEADS, HEAD_DIM), DTYPE) for k in keys]


def ring_fn(implementation):
  from jax_overlap._src.patterns.attention.ring import ring_attention  # noqa: PLC0415
  mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  return jax.shard_map(
      lambda q, k, v: ring_attention(q, k, v, axis="cp", causal=True,
                                     implementation=implementation),
      mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))


def flash_fn(block: int = 512):
  from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415
  sizes = fa.BlockSizes(
      block_q=block, block_k_major=block, block_k=block, block_b=1,
      block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
      block_q_dkv=block, block_k_major_dq=block, block_k_dq=block,
      block_q_dq=block)
  return lambda q, k, v: fa.flash_attention(
      q, k, v, causal=True, sm_scale=1.0 / np.sqrt(HEAD_DIM), block_sizes=sizes)


def forward_only(fn):
  return lambda q, k, v, ct: fn(q, k, v)


def forward_and_backward(fn):
  def both(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(ct))
  return both


def time_program(fn, args):
  """(timings, the compiled program): compile, 2 warm calls, then samples
  of back-to-back calls."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(2):
    jax.block_until_ready(compiled(*args))
  t = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  once = time.perf_counter() - t
  calls = 5 if once < 0.05 else 1
  samples = 7 if once < 0.2 else 3
  times = []
  for _ in range(samples):
    t = time.perf_counter()
    outs = [compiled(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t) / calls)
    del outs
  return {"median_s": statistics.median(times), "min_s": min(times),
          "samples": samples, "calls_a_sample": calls,
          "compile_s": compile_s}, compiled


class Runner:
  def __init__(self, budget_s: float, json_path: str | None):
    self.deadline = time.time() + budget_s
    self.json_path = json_path
    self.compiled = {}   # (seq, form, pass) -> the compiled program
    self.results = {"environment": environment(),
                    "setting": dict(batch=1, heads=HEADS, kv_heads=HEADS,
                                    head_dim=HEAD_DIM, dtype="bfloat16",
                                    causal=True),
                    "rows": [], "checks": [], "tiles": []}

  def case(self, table: str, row: dict, fn, args):
    if time.time() > self.deadline:
      row["error"] = "skipped: past --budget"
    else:
      try:
        timings, compiled = time_program(fn, args)
        row.update(timings)
        self.compiled[row.get("seq"), row.get("form"), row.get("pass")] = compiled
      except Exception as e:  # noqa: BLE001 - one failure must not lose the rest
        row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        traceback.print_exc(limit=2)
    what = (f"{row['median_s'] * 1e3:.3f} ms (compile {row['compile_s']:.1f} s)"
            if "median_s" in row else row["error"][:300])
    print(f"  {table} {json.dumps({k: v for k, v in row.items() if k in ('seq', 'form', 'pass', 'tile')})}: {what}",
          flush=True)
    self.results[table].append(row)
    self.save()

  def check(self, seq: int, args, flash_args):
    """The kernel's output and gradients against flash_attention's, from
    the forward + backward programs just timed."""
    ours = self.compiled.get((seq, FORMS[0], "forward + backward"))
    theirs = self.compiled.get((seq, FORMS[1], "forward + backward"))
    if ours is None or theirs is None:
      return
    try:
      ours, theirs = ours(*args), theirs(*flash_args)
      row = {"seq": seq}
      for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        a = np.asarray(a, np.float32)
        b = np.asarray(jnp.swapaxes(b, 1, 2), np.float32)
        row[name] = {"max_abs_diff": float(np.max(np.abs(a - b))),
                     "max_abs_flash": float(np.max(np.abs(b))),
                     "finite": bool(np.isfinite(a).all())}
      del ours, theirs
    except Exception as e:  # noqa: BLE001
      row = {"seq": seq, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    print(f"  check {json.dumps(row)}", flush=True)
    self.results["checks"].append(row)
    self.save()

  def save(self):
    if self.json_path:
      with open(self.json_path, "w") as f:
        json.dump(self.results, f, indent=1)


def run(seqs, budget_s: float, json_path: str | None) -> dict:
  r = Runner(budget_s, json_path)
  print(json.dumps(r.results["environment"]), flush=True)
  passes = (("forward", forward_only), ("forward + backward", forward_and_backward))
  for seq in seqs:
    args = inputs(seq)
    flash_args = [jnp.swapaxes(a, 1, 2) for a in args]
    jax.block_until_ready(flash_args)
    for what, wrap in reversed(passes):   # forward + backward first: the target
      r.case("rows", {"seq": seq, "form": FORMS[0], "pass": what},
             wrap(ring_fn(None)), args)
      r.case("rows", {"seq": seq, "form": FORMS[1], "pass": what},
             wrap(flash_fn()), flash_args)
    r.check(seq, args, flash_args)
    r.compiled.clear()
    del args, flash_args
  # The kernel's tiles at the first length (flash_tpu.block_sizes' rule).
  from jax_overlap._src.patterns.attention import flash_tpu  # noqa: PLC0415
  rule = flash_tpu.block_sizes
  args = inputs(seqs[0])
  try:
    for tile in (256, 1024):
      flash_tpu.block_sizes = lambda sq, sk, d, t=tile: flash_tpu.Blocks(
          min(t, sq), min(t, sk))
      r.case("tiles", {"seq": seqs[0], "tile": tile, "pass": "forward + backward"},
             forward_and_backward(ring_fn(None)), args)
  finally:
    flash_tpu.block_sizes = rule
  # The XLA blocks (what ring_attention ran on TPU before the kernel).
  for seq in seqs:
    args = inputs(seq)
    for what, wrap in reversed(passes):
      r.case("rows", {"seq": seq, "form": FORMS[2], "pass": what},
             wrap(ring_fn("xla")), args)
    del args
  return r.results


def table(results) -> str:
  cell = {(x["seq"], x["pass"], x["form"]): x for x in results["rows"]}
  ms = lambda x: (f"{x['median_s'] * 1e3:.2f}" if "median_s" in x
                  else x.get("error", "-")[:30])
  lines = ["| sequence | pass | ring_attention (ms) | flash_attention 512 (ms) "
           "| ring / flash | ring_attention xla (ms) | xla / flash |",
           "|---|---|---|---|---|---|---|"]
  for seq in sorted({x["seq"] for x in results["rows"]}):
    for what in ("forward", "forward + backward"):
      a, b, c = (cell.get((seq, what, f), {}) for f in FORMS)
      ratio = lambda x: (f"{x['median_s'] / b['median_s']:.2f}"
                         if "median_s" in x and "median_s" in b else "-")
      lines.append(f"| {seq} | {what} | {ms(a)} | {ms(b)} | {ratio(a)} "
                   f"| {ms(c)} | {ratio(c)} |")
  if results["tiles"]:
    base = cell.get((results["tiles"][0]["seq"], "forward + backward", FORMS[0]), {})
    lines += ["", "| sequence | kernel tile | ring_attention fwd + bwd (ms) |",
              "|---|---|---|"]
    if "median_s" in base:
      lines.append(f"| {results['tiles'][0]['seq']} | 512 (the rule) | {ms(base)} |")
    for x in results["tiles"]:
      lines.append(f"| {x['seq']} | {x['tile']} | {ms(x)} |")
  for x in results["checks"]:
    if "error" in x:
      lines.append(f"\ncheck at {x['seq']}: {x['error'][:300]}")
      continue
    parts = ", ".join(f"{k} {x[k]['max_abs_diff']:.3g} (of {x[k]['max_abs_flash']:.3g})"
                      for k in ("out", "dq", "dk", "dv"))
    lines.append(f"\nkernel vs flash_attention at {x['seq']}, max abs difference: {parts}")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seqs", nargs="+", type=int, default=[8192, 32768])
  parser.add_argument("--json", help="write the results here as they come")
  parser.add_argument("--budget", type=float, default=150,
                      help="seconds after which the remaining cases are skipped")
  args = parser.parse_args(argv)
  results = run(args.seqs, args.budget, args.json)
  print(json.dumps(results["environment"]))
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
