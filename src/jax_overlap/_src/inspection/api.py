"""`overlap_report(fn, hardware=..., schedule=...)(*args)`: the overlap
report of a function, compiled here or as written; `inspect(fn, *args)` is
its deprecated alias. Pinned by tests/inspection/report_api_test.py."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax
from jax._src import traceback_util

from jax_overlap._src.inspection.reading import live
from jax_overlap._src.inspection.model import xla_cost
from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.inspection.report.overlap_report import OverlapReport
from jax_overlap._src.inspection.traced.staging import (
    jax_compiled, runnable, stage)
from jax_overlap._src.inspection.traced.written import written_windows
from jax_overlap._src.inspection.traced.written_schedule import (
    COST_LABEL, written_schedule)

traceback_util.register_exclusion(__file__)

SCHEDULES = ("compiled", "written")
WRITTEN_NOTE = (
    "This is the schedule as written: the traced program's order, as if the "
    "compiler kept it (program_order(enforce=True) asks it to; "
    "docs/compiled-order.md says where it does), with one compute stream and "
    "every operation costed from its shapes, unfused.")


def overlap_report(fn, *, hardware=None, schedule=None
                   ) -> Callable[..., OverlapReport]:
  """Returns a function that reports what each collective of `fn`
  overlapped, in the compiled schedule or in the schedule as written, at
  the arguments it is given; as `jax.make_jaxpr(fn)(*args)` does.

  The compiled schedule is read from XLA's own module, each compute
  instruction costed by XLA's cost analysis. The written schedule is the
  traced program's order, as if the compiler kept it (what
  `program_order(enforce=True)` asks for), each operation costed from its
  shapes. Either way times are modelled on `hardware`, and
  `report.written` gives each future's window as written between its start
  and `done()`.

  The options are checked here, at this call; the returned function has
  `fn`'s name and docstring, takes `fn`'s arguments (all of them, keywords
  included: none is taken as an option) and can be called again with
  others, each call tracing `fn` anew (a jitted `fn` keeps its own cache).

  Args:
    fn: a function whose collectives to report. A jitted function (one
      with `.trace` or `.lower`: `jax.jit`, flax `nnx.jit`,
      `eqx.filter_jit`) is traced and compiled with its own jit and options
      (static arguments, shardings, an equinox module's non-array leaves);
      a plain function is wrapped in `jax.jit`, so its arguments must be
      arrays (or `jax.ShapeDtypeStruct`s).
    hardware: a built-in profile ('h100', 'a100', 'tpu-v5e', 'tpu-v5p'), a
      `HardwareProfile`, or a .toml/.json profile path (read here); None for
      h100.
    schedule: 'compiled', 'written', or None: 'compiled' unless the backend
      made every collective blocking (CPU does) and `fn` has futures, then
      'written' (a note says so). 'written' does not compile `fn`.

  Returns:
    A function of `fn`'s arguments (example arrays or
    `jax.ShapeDtypeStruct`s) returning an `OverlapReport`
    (`report.schedule` says which schedule); all times in it are modelled,
    not measured.

  Raises:
    TypeError: `fn` is not callable (here), or it is a plain function and
      an argument is not an array (at the returned function's call; the
      error names the argument).
    ValueError: `schedule` is not 'compiled', 'written' or None (here), or
      it is 'written' and `fn` could not be traced (it only lowers).
    HardwareProfileError: `hardware` names no profile (here).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.shard_map(mesh=mesh, in_specs=(P('i'), P()), out_specs=P('i'))
    ... @jax_overlap.program_order(enforce=True)
    ... def step(w_shard, x):
    ...   fut = jax_overlap.all_gather_start(w_shard, 'i', tiled=True)
    ...   y = x @ x                       # written while the gather runs
    ...   return (y @ fut.done())[:1]
    >>> args = jnp.ones((8, 8)), jnp.ones((8, 8))
    >>> compiled = jax_overlap.overlap_report(step, schedule="compiled")(*args)
    >>> compiled.collectives[0].made_blocking     # CPU compiles it blocking
    True
    >>> report = jax_overlap.overlap_report(step)(*args)  # so: as written
    >>> report.schedule, report.collectives[0].kind
    ('written', 'all-gather')
    >>> report.collectives[0].overlapped          # the matmul written inside
    ['dot_general.1']
    >>> report.written[0].overlapped
    ['dot_general f32[8,8]']

    The returned function takes other arguments, or their shapes alone:

    >>> on_h100 = jax_overlap.overlap_report(step, hardware="h100")
    >>> on_h100.__name__
    'step'
    >>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    >>> on_h100(f32(16, 8), f32(16, 16)).written[0].overlapped
    ['dot_general f32[16,16]']
  """
  return _reporter(fn, hardware, schedule, "overlap_report")


def inspect(fn, *args, hardware=None, schedule=None, **kwargs) -> OverlapReport:
  """Deprecated: `overlap_report(fn, hardware=..., schedule=...)(*args,
  **kwargs)`, which keeps its options apart from `fn`'s arguments (and does
  not shadow the standard library's `inspect` when imported).

  Returns the same report, and emits a `DeprecationWarning`; it is kept
  for one release. A function with keyword arguments named `hardware` or
  `schedule` cannot be given them here: use `overlap_report`.
  """
  warnings.warn(
      "jax_overlap.inspect(fn, *args, hardware=..., schedule=...) is "
      "deprecated and will be removed in the next release: use "
      "jax_overlap.overlap_report(fn, hardware=..., schedule=...)(*args), "
      "the same report with the options apart from fn's arguments.",
      DeprecationWarning, stacklevel=2)
  return _reporter(fn, hardware, schedule, "inspect")(*args, **kwargs)


def _reporter(fn, hardware, schedule, caller):
  """Checks `overlap_report`'s arguments now; the report function of `fn`."""
  runnable(fn, caller)                  # a TypeError naming fn, now
  if schedule not in (None, *SCHEDULES):
    raise ValueError(
        f"{caller}(schedule=...) must be 'compiled', 'written' or None (the "
        f"compiled one unless the backend made it blocking); got {schedule!r}.")
  profile = resolve_hardware(hardware)

  @functools.wraps(fn, updated=())
  def report(*args, **kwargs) -> OverlapReport:
    return _report(fn, args, kwargs, profile, schedule, caller)
  return report


def _report(fn, args, kwargs, profile, schedule, caller) -> OverlapReport:
  # A jitted function keeps its own jit and options (staging.py).
  staged = stage(fn, args, kwargs, caller)
  name = staged.name
  windows = [] if staged.jaxpr is None else written_windows(staged.jaxpr)
  if schedule == "written":
    if staged.jaxpr is None:
      raise ValueError(
          f"{caller}(schedule='written') needs the traced program of "
          f"fn={name!r}, which could not be traced here: "
          f"{' '.join(staged.notes)} Use schedule='compiled' or None.")
    return _written_report(staged.jaxpr, name, profile, windows, [])
  platform = jax.default_backend()
  report = _compiled_report(staged, name, platform, profile, windows)
  blocking = [c for c in report.collectives if c.made_blocking]
  keeps_pairs = any(c.is_async for c in report.collectives)
  if schedule == "compiled" or keeps_pairs or not blocking or not windows:
    return report
  return _written_report(staged.jaxpr, name, profile, windows, [
      f"The {platform} backend made {len(blocking)} collective(s) blocking, "
      "so the compiled program overlaps nothing; this report models the "
      "schedule as written instead. overlap_report(fn, schedule='compiled')"
      "(*args) gives the compiled one."])


def _compiled_report(staged, name, platform, profile, windows):
  compiled = jax_compiled(staged.lower().compile())
  source = f"{live.SOURCE} of {name} on {platform}"
  module, obj = live.compiled_module(compiled, source=source)
  costs = None
  if obj is not None:
    client = _client()
    candidate = xla_cost.XlaCosts(module, client)
    costs = candidate if candidate.available else None
  return OverlapReport.build(
      module, profile, source=source, cost_source=costs,
      cost_label=xla_cost.LABEL, written=windows, notes=staged.notes)


def _written_report(jaxpr, name, profile, windows, notes):
  written = written_schedule(jaxpr, profile, name=name)
  return OverlapReport.build(
      written.module, profile, source=f"traced program of {name}",
      cost_source=written.cost, cost_label=COST_LABEL, written=windows,
      schedule="written", notes=notes + [WRITTEN_NOTE] + written.notes)


def _client():
  try:
    return jax.devices()[0].client
  except (AttributeError, IndexError, RuntimeError):
    return None
