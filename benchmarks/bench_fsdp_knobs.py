"""`fsdp_scan`'s knobs on the demo's training step: modelled exposed
communication (the overlap inspector's cost model, on a named hardware
profile: modelled, not measured) and the compiled step's temp bytes
(`memory_analysis()` on the CPU devices), one line per setting.

  python benchmarks/bench_fsdp_knobs.py [--hardware h100] [--layers 4]

Temp bytes: `compiled.memory_analysis().temp_size_in_bytes` per device of
the compiled CPU step. Each setting is the demo's step (`jax_overlap._src.demo`, width 1024, 8
devices) with `fsdp_scan` given those keyword arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax_overlap._src.demo import model, training  # noqa: E402

#: name -> fsdp_scan's keyword arguments. The demo's step gives fsdp_scan
#: its embedding as `before=` and its head and loss as `after=` (the ends of
#: the stack); `ENDS_OUTSIDE` runs them outside the call instead, as the step
#: was written before that API.
ENDS_OUTSIDE = "_ends_outside"
#: Layer 0 gathered and reduce-scattered whole, not split by use order
#: (patterns/fsdp/use_order.py; the default splits it).
WHOLE_ENDS = "_whole_ends"
SETTINGS = {
    "default, ends outside, layer 0 whole":
        dict(**{ENDS_OUTSIDE: True, WHOLE_ENDS: True}),
    "default, before=embedding, after=head, layer 0 whole":
        dict(**{WHOLE_ENDS: True}),
    "bucket=False, ends outside": dict(bucket=False, **{ENDS_OUTSIDE: True}),
    "default (bucket=True), ends outside": {ENDS_OUTSIDE: True},
    "default, before=embedding, after=head": dict(),
    "bucket=False": dict(bucket=False),
    "param_dtype=bfloat16, ends outside":
        dict(param_dtype=jnp.bfloat16, **{ENDS_OUTSIDE: True}),
    "param_dtype=bfloat16": dict(param_dtype=jnp.bfloat16),
    "param_dtype=bfloat16, reduce_dtype=float32":
        dict(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
    # The memory knobs, with the ends outside (keeping more than the last
    # layer, or prefetching deeper, is refused with before=/after=).
    # reshard_after_forward=True was the default before 1 was measured better.
    "reshard_after_forward=True, ends outside":
        dict(reshard_after_forward=True, **{ENDS_OUTSIDE: True}),
    "reshard_after_forward=True, before=embedding, after=head":
        dict(reshard_after_forward=True),
    "reshard_after_forward=2, ends outside":
        dict(reshard_after_forward=2, **{ENDS_OUTSIDE: True}),
    "reshard_after_forward=False, ends outside":
        dict(reshard_after_forward=False, **{ENDS_OUTSIDE: True}),
    "reshard_after_forward=True, prefetch=2, ends outside":
        dict(reshard_after_forward=True, prefetch=2, **{ENDS_OUTSIDE: True}),
    "prefetch=2 (reshard_after_forward=1), ends outside":
        dict(prefetch=2, **{ENDS_OUTSIDE: True}),
}


def _ends_outside(fsdp_scan):
  """fsdp_scan with `before` and `after` run outside it (around the call)."""
  def call(layer, x, params, *, before=None, after=None, **kwargs):
    y = fsdp_scan(layer, before(x) if before else x, params, **kwargs)
    return after(y) if after else y
  return call


def measure(kwargs, layers: int, hardware: str):
  """The report's totals and the compiled step's temp bytes."""
  # The demo imports both from these modules at each call (not from the
  # public package), so they are replaced there.
  from jax_overlap._src.inspection import api  # noqa: PLC0415
  from jax_overlap._src.patterns.fsdp import scan  # noqa: PLC0415
  plain, overlap_report = scan.fsdp_scan, api.overlap_report
  temp = []

  def report_and_measure(fn, **options):
    def report(*args, **kw):
      if not temp:   # the first step reported is fsdp_scan's
        compiled = fn.lower(*args, **kw).compile()
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
      return overlap_report(fn, **options)(*args, **kw)
    return report
  kwargs = dict(kwargs)
  run = _ends_outside(plain) if kwargs.pop(ENDS_OUTSIDE, False) else plain
  from jax_overlap._src.patterns.fsdp import use_order  # noqa: PLC0415
  whole = contextlib.ExitStack()
  if kwargs.pop(WHOLE_ENDS, False):
    whole.enter_context(use_order.layer_0_whole())
  scan.fsdp_scan = functools.partial(run, **kwargs)
  api.overlap_report = report_and_measure
  try:
    opts = training.Options(layers=layers, hardware=hardware)
    cfg = model.Config(vocab=32, layers=layers)   # as benchmarks/bench.py
    import optax  # noqa: PLC0415
    report = training.overlap_reports(cfg, opts,
                                      optax.adamw(3e-3))["fsdp_scan"]
  finally:
    scan.fsdp_scan, api.overlap_report = plain, overlap_report
    whole.close()
  return report.totals, temp[0]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--hardware", default="h100")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--only", nargs="*", default=None,
                      help="run only the settings whose name holds one of "
                           "these (names as printed; default all)")
  args = parser.parse_args()
  print(f"demo step, {args.layers} blocks, modelled on {args.hardware}")
  for name, kwargs in SETTINGS.items():
    if args.only is not None and not any(o in name for o in args.only):
      continue
    t, temp = measure(kwargs, args.layers, args.hardware)
    print(f"{name:40s} exposed {t['exposed_s'] * 1e6:7.1f} us of "
          f"{t['comm_s'] * 1e6:7.1f} us comm "
          f"({t['exposed_s'] / t['comm_s']:.1%}, modelled); bound "
          f"{t['bound_exposed_s'] * 1e6:.1f} us ("
          f"{(t['exposed_s'] - t['bound_exposed_s']) / t['comm_s']:.1%} of "
          f"the comm above it); temp "
          f"{temp / 2**20:.1f} MiB (compiled, CPU)", flush=True)


if __name__ == "__main__":
  main()
