"""Benchmark: ring_attention's key/value rotation against the all-gather form
and a ring of plain ppermutes, on the real H100 and TPU v5e compilers.

One causal attention layer, forward and backward (`value_and_grad` of q, k,
v), sequence sharded over 8 devices, batch 1, 8 heads, 2 kv heads (GQA),
head_dim 128, bfloat16, at global sequence lengths 8K, 32K and 128K, in
three forms:

  ring (futures)     `jax_overlap.ring_attention(..., layout="zigzag")`: each
                     rotation a `ppermute_start` in flight over a step's
                     blocks, fully masked blocks skipped.
  ring (ppermute)    the same ring with `jax.lax.ppermute` where the future
                     was, run after the step's blocks as a ring written with
                     plain ppermutes is (haoliu's ringattention structure).
  all-gather         `jax.lax.all_gather` of k and v over the sequence, then
                     the same blockwise kernel over the whole sequence (no
                     block skipped); autodiff gives the reduce-scatter of
                     dk, dv (MaxText's GPU default, torchtitan's
                     kv_allgather).

Each is compiled ahead of time (.venv-aot: libtpu and the CUDA plugin, no
accelerator needed); the scheduled module is read by
`jax_overlap.OverlapReport.from_hlo` on the h100 / tpu-v5e profile:
modelled communication and modelled exposed communication, and the
compiled temp bytes (`memory_analysis()`). Every time is modelled, not
measured. Writes benchmarks/results/bench-attention.{md,json}.

  python benchmarks/bench_attention.py [--targets gpu_h100 tpu_v5e]
      [--seqs 8192 32768 131072]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap._src.patterns.attention import ring as _ring  # noqa: E402
from jax_overlap._src.patterns.attention.local import local_attention  # noqa: E402

PROFILE = {"gpu_h100": "h100", "tpu_v5e": "tpu-v5e"}
SHAPE = dict(batch=1, heads=8, kv_heads=2, head_dim=128, devices=8)
VARIANTS = ("ring (futures)", "ring (ppermute)", "all-gather")


class _Plain:
  """A finished ppermute standing where a future was."""

  def __init__(self, x, cfg, shift):
    self._x, self._cfg, self._shift = x, cfg, shift

  def done(self):
    n = self._cfg.size
    perm = [(j, (j + self._shift) % n) for j in range(n)]
    return jax.lax.ppermute(self._x, self._cfg.axis, perm)


@contextlib.contextmanager
def _plain_ppermutes():
  send = _ring._send   # (x, cfg, shift): sends x `shift` devices on
  _ring._send = lambda x, cfg, shift=1: _Plain(x.reshape(-1, x.shape[-1]), cfg, shift)
  try:
    yield
  finally:
    _ring._send = send


def all_gather_attention(q, k, v, *, axis):
  """Zigzag-laid-out q, k, v: k and v gathered, causal by global position."""
  p = jax.lax.axis_size(axis)
  d = jax.lax.axis_index(axis)
  chunk = q.shape[1] // 2
  local = lambda dev: jnp.concatenate([
      c * chunk + jnp.arange(chunk)
      for c in (dev, 2 * p - 1 - dev)])
  k_pos = jnp.concatenate([local(j) for j in range(p)])
  kg = jax.lax.all_gather(k, axis, axis=1, tiled=True)
  vg = jax.lax.all_gather(v, axis, axis=1, tiled=True)
  return local_attention(q, kg, vg, causal=True,
                         scale=1 / np.sqrt(q.shape[-1]),
                         positions=(local(d), k_pos))


def program(variant, mesh, seq):
  axis = mesh.axis_names[0]
  if variant == "all-gather":
    body = lambda q, k, v: all_gather_attention(q, k, v, axis=axis)
  else:
    body = lambda q, k, v: _ring.ring_attention(
        q, k, v, axis=axis, causal=True, layout="zigzag")
  attend = jax.shard_map(body, mesh=mesh, in_specs=P(None, axis),
                         out_specs=P(None, axis))
  step = jax.value_and_grad(
      lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
      argnums=(0, 1, 2))
  s = SHAPE
  arg = lambda heads: jax.ShapeDtypeStruct(
      (s["batch"], seq, heads, s["head_dim"]), jnp.bfloat16,
      sharding=NamedSharding(mesh, P(None, axis)))
  return step, (arg(s["heads"]), arg(s["kv_heads"]), arg(s["kv_heads"]))


def measure(target, variant, seq, keep_hlo=None) -> dict:
  from bench_vs_xla import _mesh  # noqa: PLC0415
  rec = {"target": target, "variant": variant, "seq": seq}
  try:
    fn, args = program(variant, _mesh(target), seq)
    t0 = time.perf_counter()
    with (_plain_ppermutes() if variant == "ring (ppermute)"
          else contextlib.nullcontext()):
      compiled = jax.jit(fn).lower(*args).compile()
    rec["compile_s"] = time.perf_counter() - t0
    if keep_hlo:
      path = pathlib.Path(keep_hlo) / f"{target}-{variant}-{seq}.txt".replace(" ", "_")
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(compiled.as_text())
      rec["hlo"] = str(path)
    report = jax_overlap.OverlapReport.from_hlo(compiled.as_text(),
                                                hardware=PROFILE[target])
    t = report.totals
    rec.update(comm_s=t["comm_s"], exposed_s=t["exposed_s"],
               compute_s=report.compute_s,
               temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
  except Exception as e:  # noqa: BLE001 - a failed compile is a result
    rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
  return rec


def versions() -> dict:
  from bench_vs_xla import versions as of_this_run  # noqa: PLC0415
  return of_this_run()


def markdown(meta, records) -> str:
  out = ["# ring_attention: modelled exposed communication and temp bytes", "",
         f"`{meta['command']}`, {meta['date']}"
         + (f" ({meta['wall_s']:.0f} s wall)" if "wall_s" in meta else "")
         + "; " + (", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
                   if "versions" in meta else f"jax {meta['jax']}") + ". Causal, "
         "forward and backward, batch 1, 8 heads, 2 kv heads, head_dim 128, "
         "bf16, 8 devices. Times modelled by the library's report on the "
         "compiled schedule (h100 / tpu-v5e profiles), not measured.", "",
         "| target | seq | form | comm (us) | exposed (us) | compute (us) | "
         "temp (MiB) |", "|---|---|---|---|---|---|---|"]
  for r in records:
    if "error" in r:
      out.append(f"| {r['target']} | {r['seq']} | {r['variant']} | failed: "
                 f"{r['error'][:120]} | | | |")
      continue
    out.append(
        f"| {r['target']} | {r['seq'] // 1024}K | {r['variant']} | "
        f"{r['comm_s'] * 1e6:,.0f} | {r['exposed_s'] * 1e6:,.0f} | "
        f"{r['compute_s'] * 1e6:,.0f} | {r['temp_bytes'] / 2**20:,.1f} |")
  return "\n".join(out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="+", choices=tuple(PROFILE),
                      default=list(PROFILE))
  parser.add_argument("--seqs", nargs="+", type=int,
                      default=[8192, 32768, 131072])
  parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                      default=list(VARIANTS))
  parser.add_argument("--out", default=str(HERE / "results"))
  parser.add_argument("--keep-hlo", metavar="DIR",
                      help="keep each compiled module (as_text) in DIR")
  opts = parser.parse_args()
  started = time.perf_counter()
  records = []
  for target in opts.targets:
    for seq in opts.seqs:
      for variant in opts.variants:
        rec = measure(target, variant, seq, opts.keep_hlo)
        records.append(rec)
        print(json.dumps(rec), flush=True)
  meta = {"command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:]),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime(
              "%Y-%m-%d %H:%M UTC"), "jax": jax.__version__,
          "versions": versions(), "wall_s": time.perf_counter() - started}
  text = markdown(meta, records)
  print("\n" + text)
  out = pathlib.Path(opts.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench-attention.md").write_text(text + "\n")
  (out / "bench-attention.json").write_text(
      json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
