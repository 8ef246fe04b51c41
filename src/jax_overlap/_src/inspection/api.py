"""`inspect(fn, *args)`: the overlap report of a function, compiled here."""

from __future__ import annotations

import jax
from jax._src import traceback_util

from jax_overlap._src.inspection import analysis, live, xla_cost
from jax_overlap._src.inspection.hardware import resolve_hardware
from jax_overlap._src.inspection.report import OverlapReport
from jax_overlap._src.inspection.written import written_windows

traceback_util.register_exclusion(__file__)


def inspect(fn, *args, hardware=None, **kwargs) -> OverlapReport:
  """Compiles `fn` on `args` and reports what each collective overlapped.

  The compiled schedule is read from XLA's own module, each compute
  instruction is costed by XLA's cost analysis, and times are modelled on
  `hardware`. Where the backend made collectives blocking (CPU does), the
  report says so and gives the windows as written between each future's
  start and `done()` in the traced program (`report.written`).

  Args:
    fn: a function whose collectives to inspect; a `jax.jit` function is
      compiled with its own options (static arguments, shardings).
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
    hardware: a built-in profile ('h100', 'a100', 'tpu-v5e', 'tpu-v5p'), a
      `HardwareProfile`, or a .toml/.json profile path; None for h100.
    **kwargs: keyword arguments of `fn`.

  Returns:
    An `OverlapReport`; all times in it are modelled, not measured.

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
    >>> report = jax_overlap.inspect(step, jnp.ones((8, 8)), jnp.ones((8, 8)))
    >>> report.collectives[0].made_blocking    # CPU compiles it blocking
    True
    >>> report.written[0].overlapped           # ...but this was written
    ['dot_general f32[8,8]']
  """
  profile = resolve_hardware(hardware)
  # A jitted function keeps its own options (static arguments, shardings).
  jitted = fn if hasattr(fn, "trace") and hasattr(fn, "lower") else jax.jit(fn)
  traced = jitted.trace(*args, **kwargs)
  compiled = traced.lower().compile()
  platform = jax.default_backend()
  name = getattr(fn, "__name__", type(fn).__name__)
  source = f"{live.SOURCE} of {name} on {platform}"
  module, obj = live.compiled_module(compiled, source=source)
  costs = None
  if obj is not None:
    client = _client()
    candidate = xla_cost.XlaCosts(module, client)
    costs = candidate if candidate.available else None
  return analysis.build_report(
      module, profile, source=source, cost_source=costs,
      cost_label=xla_cost.LABEL, written=written_windows(traced.jaxpr))


def _client():
  try:
    return jax.devices()[0].client
  except (AttributeError, IndexError, RuntimeError):
    return None
