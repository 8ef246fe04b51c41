"""Reading the schedule of a live compile (`jax.jit(f).lower(...).compile()`).

Where the jaxlib exposes XLA's module object
(`compiled.runtime_executable().hlo_modules()[0]`, every supported jaxlib),
the instructions are read from its text and put in the order of XLA's own
schedule (`module.schedule().sequence(computation)`) for every non-fusion
computation. Otherwise `compiled.as_text()` is read, whose order is the
schedule too.
"""

from __future__ import annotations

from typing import Any

from jax_overlap._src.inspection.reading.hlo_module import HloModule
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text

SOURCE = "live compile"


def xla_module(compiled) -> Any | None:
  """XLA's HloModule object behind `compiled`, or None where not offered."""
  try:
    modules = compiled.runtime_executable().hlo_modules()
  except (AttributeError, RuntimeError, TypeError, NotImplementedError):
    return None
  return modules[0] if modules else None


def compiled_module(compiled, source: str = SOURCE) -> tuple[HloModule, Any]:
  """(our module, XLA's module object or None) for a compiled jit."""
  obj = xla_module(compiled)
  if obj is None:
    return parse_hlo_text(compiled.as_text(), source=source), None
  module = parse_hlo_text(obj.to_string(), source=source)
  _apply_schedule(module, obj)
  return module, obj


def _apply_schedule(module: HloModule, obj) -> None:
  """Orders each scheduled computation as XLA's schedule says."""
  try:
    schedule = obj.schedule()
    computations = obj.make_nonfusion_computations()
  except (AttributeError, RuntimeError, TypeError):
    return
  for comp_obj in computations:
    comp = module.computations.get(comp_obj.name)
    if comp is None:
      continue
    try:
      names = [i.name for i in schedule.sequence(comp_obj)]
    except (RuntimeError, TypeError, ValueError, IndexError):
      continue
    if sorted(names) != sorted(comp.by_name):
      continue
    comp.instructions = [comp.by_name[n] for n in names]
    comp.position = {n: k for k, n in enumerate(names)}
