"""`measure(fn, *args)`: run a jitted function under jax's profiler and report
what its collectives measured, beside the modelled report of the same module."""

from __future__ import annotations

import pathlib
import re
import tempfile

import jax
from jax._src import traceback_util

from jax_overlap._src.inspection.measured.measured_report import MeasuredReport
from jax_overlap._src.inspection.measured.xplane import read_capture

traceback_util.register_exclusion(__file__)

_MODULE_NAME = re.compile(r"module @([\w.$-]+)")


def measure(fn, *args, steps: int = 3, warmup: int = 1, hardware=None,
            profile_dir=None, **kwargs) -> MeasuredReport:
  """Runs `fn` `warmup` times, then `steps` times under `jax.profiler.trace`,
  and returns the measured report of those steps.

  Each collective instruction of the compiled module gets a record per
  device: `runs`, `measured_s` (its kernels' time), `hidden_s` (the part
  during which compute ran on the same device) and `exposed_s`; `totals`
  gives each device's overlap from unions of intervals. The modelled record
  of the same instruction (from the HLO the profile carries) stands beside
  each. On CPU every collective is blocking, so `hidden_s` is 0.

  Args:
    fn: the function to run; a `jax.jit` function keeps its own options.
    *args: its arguments (arrays).
    steps: how many runs to measure (an int >= 1).
    warmup: runs before the profile starts (an int >= 0; the first compiles).
    hardware: the profile the modelled side is modelled on (as `inspect`).
    profile_dir: where `jax.profiler.trace` writes (kept); None for a
      temporary directory, removed after reading.
    **kwargs: keyword arguments of `fn`.

  Raises:
    ValueError: `steps` or `warmup` is not a count.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> step = jax.shard_map(lambda x: jax.lax.psum(x @ x, 'i'), mesh=mesh,
    ...                      in_specs=P('i'), out_specs=P())
    >>> report = jax_overlap.measure(step, jnp.ones((4, 2)), steps=2)
    >>> [(r["kind"], r["device"], r["runs"], r["hidden_s"])
    ...  for r in report.to_dict()["measured"]]
    [('all-reduce', 0, 2, 0.0), ('all-reduce', 1, 2, 0.0)]
  """
  for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(
          f"measure({name}=...) must be an int >= {least} (how many runs "
          f"{'to measure' if name == 'steps' else 'before measuring'}); "
          f"got {value!r}.")
  if not callable(fn):
    raise TypeError(f"measure(fn=...) must be a function to run, got {fn!r}.")
  jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
  module = _module_name(jitted, args, kwargs)
  for _ in range(warmup):
    jax.block_until_ready(jitted(*args, **kwargs))
  with tempfile.TemporaryDirectory(prefix="jax_overlap_measure_") as tmp:
    where = pathlib.Path(tmp if profile_dir is None else profile_dir)
    before = set(where.rglob("*.xplane.pb"))
    with jax.profiler.trace(str(where)):
      for _ in range(steps):
        jax.block_until_ready(jitted(*args, **kwargs))
    # Only this call's capture, not an older one kept in profile_dir.
    new = sorted(set(where.rglob("*.xplane.pb")) - before,
                 key=lambda f: f.stat().st_mtime)
    capture = read_capture(new[-1] if new else where)
  modules = {module} if any(e.module == module for e in capture.events) else None
  return MeasuredReport.from_capture(capture, hardware=hardware,
                                     modules=modules, steps=steps)


def _module_name(jitted, args, kwargs) -> str | None:
  """The HLO module name `fn` compiles to (`jit_<name>`), from its lowering."""
  match = _MODULE_NAME.search(jitted.lower(*args, **kwargs).as_text()[:2000])
  return match.group(1) if match else None
