"""`measure(fn, steps=..., warmup=...)(*args)`: run a jitted function under
jax's profiler and report what its collectives measured, beside the modelled
report of the same module; `measure(fn, *args, steps=...)` is its deprecated
form. Pinned by tests/inspection/measure_test.py and tests/inspection/report_api_test.py."""

from __future__ import annotations

import functools
import pathlib
import re
import tempfile
import warnings

import jax
from jax._src import traceback_util

from jax_overlap._src.inspection.measured.measured_report import MeasuredReport
from jax_overlap._src.inspection.measured.xplane import read_capture
from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.inspection.reading import live
from jax_overlap._src.inspection.traced.staging import (
    argument_errors, jax_compiled, jax_lowered, runnable)

traceback_util.register_exclusion(__file__)

_MODULE_NAME = re.compile(r"module @([\w.$-]+)")


def measure(fn, *args, steps: int = 3, warmup: int = 1, hardware=None,
            profile_dir=None, **kwargs):
  """Returns a function that runs `fn` `warmup` times, then `steps` times
  under `jax.profiler.trace`, and returns the measured report of those
  steps: `measure(fn, steps=..., warmup=...)(*args, **kwargs)`, as
  `jax.make_jaxpr(fn)(*args)` keeps its options apart from `fn`'s
  arguments.

  Each collective instruction of the compiled module gets a record per
  device: `runs`, `measured_s` (its kernels' time), `hidden_s` (the part
  during which compute ran on the same device) and `exposed_s`; `totals`
  gives each device's overlap from unions of intervals. The modelled record
  of the same instruction stands beside each, read from the module `fn`
  compiled to (the profile's HLO carries no source lines), so each record
  names its source line and leaf as `overlap_report`'s do. On CPU every
  collective is blocking, so `hidden_s` is 0.

  The options are checked here, at this call; the returned function has
  `fn`'s name and docstring, passes every argument it gets (keywords
  included) to `fn`, and can be called again, each call a new capture.

  Deprecated, kept for one release: `measure(fn, *args, steps=..., ...,
  **kwargs)`, with `fn`'s arguments after it, runs at once and returns the
  report, with a `DeprecationWarning`. That form is taken whenever an
  argument follows `fn` other than the four options (a positional one, or
  a keyword not among them), so a function whose own keyword arguments are
  named `steps`, `warmup`, `hardware` or `profile_dir`, or one that takes
  no arguments at all, must use the new form: `measure(fn)()` runs it.

  Args:
    fn: the function to run. A jitted function (one with `.lower`:
      `jax.jit`, flax `nnx.jit`, `eqx.filter_jit`) runs with its own jit and
      options; a plain function is wrapped in `jax.jit`, so its arguments
      must be arrays.
    *args: deprecated: `fn`'s arguments; give them to the returned function.
    steps: how many runs to measure (an int >= 1).
    warmup: runs before the profile starts (an int >= 0; the first compiles).
    hardware: the profile the modelled side is modelled on (as
      `overlap_report`'s).
    profile_dir: where `jax.profiler.trace` writes (kept); None for a
      temporary directory, removed after reading.
    **kwargs: deprecated: `fn`'s keyword arguments; give them to the
      returned function.

  Returns:
    A function of `fn`'s arguments (arrays) returning a `MeasuredReport`;
    in the deprecated form, that report.

  Raises:
    ValueError: `steps` or `warmup` is not a count (here).
    HardwareProfileError: `hardware` names no profile (here).
    TypeError: `fn` is not callable (here), or it is a plain function and
      an argument is not an array (at the returned function's call; the
      error names it).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> step = jax.shard_map(lambda x: jax.lax.psum(x @ x, 'i'), mesh=mesh,
    ...                      in_specs=P('i'), out_specs=P())
    >>> run = jax_overlap.measure(step, steps=2)
    >>> report = run(jnp.ones((4, 2)))
    >>> [(r["kind"], r["device"], r["runs"], r["hidden_s"])
    ...  for r in report.to_dict()["measured"]]
    [('all-reduce', 0, 2, 0.0), ('all-reduce', 1, 2, 0.0)]
    >>> len(run(jnp.ones((8, 4))).measured)      # again, at other arguments
    2
  """
  if not args and not kwargs:
    return _measurer(fn, steps, warmup, hardware, profile_dir)
  warnings.warn(
      "jax_overlap.measure(fn, *args, steps=..., warmup=..., ...) with fn's "
      "arguments after it is deprecated and will be removed in the next "
      "release: use jax_overlap.measure(fn, steps=..., warmup=...)(*args), "
      "the same report with the options apart from fn's arguments.",
      DeprecationWarning, stacklevel=2)
  return _measurer(fn, steps, warmup, hardware, profile_dir)(*args, **kwargs)


def _measurer(fn, steps, warmup, hardware, profile_dir):
  """Checks `measure`'s options now; the function that measures `fn`."""
  for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(
          f"measure({name}=...) must be an int >= {least} (how many runs "
          f"{'to measure' if name == 'steps' else 'before measuring'}); "
          f"got {value!r}.")
  jitted = runnable(fn, "measure")
  profile = resolve_hardware(hardware)

  @functools.wraps(fn, updated=())
  def run(*args, **kwargs) -> MeasuredReport:
    return _measure(fn, jitted, args, kwargs, steps, warmup, profile,
                    profile_dir)
  return run


def _measure(fn, jitted, args, kwargs, steps, warmup, profile, profile_dir):
  with argument_errors(fn, args, kwargs, "measure"):
    lowered = jax_lowered(jitted.lower(*args, **kwargs))
  module = _module_name(lowered)
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
  texts = None
  if modules is not None:
    # The executable that ran (jax caches it): its module keeps the
    # metadata (op_name, source lines) that the profile's copy drops.
    compiled = jax_compiled(lowered.compile())
    texts = {module: live.compiled_module(
        compiled, source=f"{live.SOURCE} of {module}")[0]}
  return MeasuredReport.from_capture(capture, hardware=profile,
                                     modules=modules, module_texts=texts,
                                     steps=steps)


def _module_name(lowered) -> str | None:
  """The HLO module name `fn` compiles to (`jit_<name>`), from its lowering."""
  match = _MODULE_NAME.search(lowered.as_text()[:2000])
  return match.group(1) if match else None
