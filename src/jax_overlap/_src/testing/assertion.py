"""`assert_overlapped`: a test that the real compiler hides a program's
collectives, for a user's CI with no accelerator.

`fn` is compiled ahead of time for a target's real compiler (`targets.py`),
its scheduled module read into an `OverlapReport` modelled on the target's
hardware profile, and each collective's modelled exposed time checked
against a limit: in seconds (`max_exposed`), or as a fraction of the
collective's own communication time (`max_exposed_fraction`). A failure
names the collectives over the limit with the report's rows and hints.

Pinned by tests/aot/testing_compiled_test.py (passes and fails on TPU and
GPU), tests/inspection/testing_test.py (what is checked here, and the
error without a compiler) and docs/overlap-report.md's example (run by
tests/aot/testing_compiled_test.py under pytest).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax._src import traceback_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
from jax_overlap._src.inspection.report import summary
from jax_overlap._src.inspection.report.overlap_report import OverlapReport
from jax_overlap._src.testing import targets

traceback_util.register_exclusion(__file__)


def target_mesh(target: str, axis_shapes, axis_names, *,
                axis_types=None) -> Mesh:
  """A mesh over the devices of `target`'s topology ('tpu-v5e', 'gpu-h100',
  ...; `jax_overlap.testing.TARGETS`), for building a function whose
  shard_map names its mesh, and its arguments, on the target.

  Args:
    target: the target's name (with an optional topology: 'tpu-v5e:4x4').
    axis_shapes, axis_names: as `jax.make_mesh`'s; the shapes multiply to
      the topology's device count (8 for every default topology).
    axis_types: as `jax.make_mesh`'s (default: Auto axes).

  Raises:
    CompilerNotFoundError: the target's compiler is not installed (the
      message says what to install).
    ValueError: the shapes do not multiply to the device count.

  Example (with libtpu installed):
    mesh = target_mesh("tpu-v5e", (8,), ("d",))
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32,
                             sharding=jax.NamedSharding(mesh, P("d")))
  """
  devs = targets.devices(target)
  shapes, names = tuple(axis_shapes), tuple(axis_names)
  if math.prod(shapes) != len(devs):
    raise ValueError(
        f"target_mesh: axis_shapes={shapes} make {math.prod(shapes)} devices; "
        f"target {targets.resolve_target(target).name!r} has {len(devs)} "
        f"(topology {targets.resolve_target(target).topology!r}): give shapes "
        f"that multiply to {len(devs)}, or a topology of {math.prod(shapes)} "
        "devices ('tpu-v5e:2x2')")
  if axis_types is None:
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
  try:
    return jax.make_mesh(shapes, names, devices=devs, axis_types=axis_types)
  except Exception:  # noqa: BLE001 - a topology make_mesh cannot lay out
    return Mesh(np.array(devs).reshape(shapes), names, axis_types=axis_types)


def assert_overlapped(fn: Callable, *args, target: str = "tpu-v5e",
                      max_exposed: float | None = None,
                      max_exposed_fraction: float | None = None,
                      hardware=None, compiler_options=None,
                      **kwargs) -> OverlapReport:
  """Asserts that each collective of `fn` compiled for `target`'s real
  compiler is hidden: its modelled exposed time at most `max_exposed`
  seconds, or at most `max_exposed_fraction` of its own communication time
  (give one or both). Nothing runs; the compile is real, the times are
  modelled (`OverlapReport`).

  Args:
    fn: the function (a jitted one keeps its own jit and options).
    *args, **kwargs: `fn`'s arguments: arrays or `jax.ShapeDtypeStruct`s.
      One sharded over the target's devices (`target_mesh`) stays so; one
      sharded over another mesh (your CPU devices) is laid out the same way
      over the target's devices (the mesh's axis names and sizes kept; its
      device count must be the target's), and `fn` is lowered under
      `jax.set_mesh` of that mesh, so a shard_map that takes the context
      mesh (no `mesh=`) compiles for the target (jax keeps the first mesh
      such a shard_map was called under: build it anew for each target).
      Any other array is replicated.
    target: 'tpu-v5e' (v5e 2x4), 'tpu-v5p' (v5p 2x2x2), 'gpu-h100',
      'gpu-a100' (8 GPUs each); a topology may follow a colon
      ('tpu-v5e:4x4', 'gpu-h100:1x2x8').
    max_exposed: the most modelled exposed seconds a collective may have
      (all its runs in one call of `fn` together).
    max_exposed_fraction: the most of a collective's modelled communication
      time that may be exposed (0.1: at least 90% hidden).
    hardware: the profile the times are modelled on (default: the
      target's, `jax_overlap.HardwareProfile`).
    compiler_options: passed to `compile()` (e.g. XLA flags for the target).

  Returns:
    The `OverlapReport` of the compiled program, for further checks.

  Raises:
    AssertionError: a collective exposes more than allowed (the message
      holds the report's rows of those collectives and its hints), or the
      compiled program has no collective.
    CompilerNotFoundError: the target's compiler is not installed (the
      message says what to install) or refused the topology.
    TypeError, ValueError: neither limit given, a limit that is not a
      number >= 0, an unknown target, or arguments that cannot be laid out
      over the target (the message names which and what to do).

  Example (a test file; the real TPU compiler needs `pip install libtpu`):
    def test_the_gather_hides_behind_the_matmul():
      assert_overlapped(step, x, w, target="tpu-v5e",
                        max_exposed_fraction=0.1)
  """
  _check_limit("max_exposed", max_exposed)
  _check_limit("max_exposed_fraction", max_exposed_fraction)
  if max_exposed is None and max_exposed_fraction is None:
    raise TypeError(
        "assert_overlapped needs a limit: max_exposed (seconds a collective "
        "may expose) or max_exposed_fraction (of its communication time, "
        "e.g. 0.1), or both")
  t = targets.resolve_target(target)
  profile = resolve_hardware(hardware if hardware is not None else t.profile)
  report = _report(fn, args, kwargs, t, profile, compiler_options)
  _check(report, t, max_exposed, max_exposed_fraction,
         getattr(fn, "__name__", None) or type(fn).__name__)
  return report


def _check_limit(name: str, value) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) \
      or not value >= 0:
    raise ValueError(f"assert_overlapped({name}=...) must be a number >= 0 "
                     f"(or None), got {value!r}")


def _report(fn, args, kwargs, t, profile, compiler_options) -> OverlapReport:
  devs = targets.devices(t)
  layout = _Layout(t, devs)
  args, kwargs = jax.tree.map(layout.move, (args, kwargs),
                              is_leaf=lambda x: x is None)
  mesh = layout.mesh()
  lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower
  try:
    with jax.set_mesh(mesh):
      lowered = lower(*args, **kwargs)
  except ValueError as e:
    if "mesh" not in str(e).lower() and "device" not in str(e).lower():
      raise
    raise ValueError(
        f"assert_overlapped: fn could not be lowered for target {t.name!r}: "
        f"{e}\nA shard_map (or sharding) that names a mesh of other devices "
        "cannot compile for the target: build fn on "
        "jax_overlap.testing.target_mesh(...), or write shard_map without "
        "mesh= (it takes the context mesh, which assert_overlapped sets; jax "
        "keeps the first mesh such a shard_map was called under, so build it "
        "anew for each target, and apart from the one you run on CPU)"
    ) from None
  text = lowered.compile(compiler_options=compiler_options).as_text()
  name = getattr(fn, "__name__", None) or type(fn).__name__
  return OverlapReport.build(
      parse_hlo_text(text, source=f"{name} compiled for {t.name} ({t.topology})"),
      profile, source=f"{name} compiled ahead of time for {t.name} "
      f"({t.topology}) by the real compiler")


class _Layout:
  """Moves arguments onto the target's devices, and says the mesh `fn` is
  lowered under."""

  def __init__(self, t, devs):
    self.t, self.devs = t, devs
    self.ids = {d.id for d in devs}
    self.meshes: dict[Any, Mesh] = {}
    self.first: Mesh | None = None

  def move(self, x):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      return x
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      mesh = self._on_target(sharding.mesh)
      sharding = NamedSharding(mesh, sharding.spec)
    else:
      sharding = NamedSharding(self.mesh(), PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  def _on_target(self, mesh) -> Mesh:
    if {d.id for d in np.ravel(mesh.devices)} == self.ids and \
        np.ravel(mesh.devices)[0].platform == self.devs[0].platform:
      self.first = self.first or mesh
      return mesh
    key = (tuple(mesh.axis_names), tuple(mesh.devices.shape),
           tuple(getattr(mesh, "axis_types", ()) or ()))
    if key not in self.meshes:
      if mesh.devices.size != len(self.devs):
        raise ValueError(
            f"assert_overlapped: an argument is sharded over a mesh of "
            f"{mesh.devices.size} devices {dict(mesh.shape)}; target "
            f"{self.t.name!r} has {len(self.devs)} (topology "
            f"{self.t.topology!r}): shard it over {len(self.devs)} devices, "
            f"or name a topology of {mesh.devices.size} (e.g. "
            f"'{self.t.name}:<topology>')")
      self.meshes[key] = target_mesh(
          self.t, mesh.devices.shape, mesh.axis_names,
          axis_types=getattr(mesh, "axis_types", None))
    self.first = self.first or self.meshes[key]
    return self.meshes[key]

  def mesh(self) -> Mesh:
    """The mesh of the first sharded argument, else one axis 'x' over all
    the target's devices."""
    if self.first is None:
      self.first = target_mesh(self.t, (len(self.devs),), ("x",))
    return self.first


def _check(report, t, max_exposed, max_fraction, name) -> None:
  if not report.collectives:
    raise AssertionError(
        f"assert_overlapped({name}): the program compiled for {t.name} "
        f"({t.topology}) has no collective, so nothing to overlap (XLA removes "
        "collectives over one device: is the mesh axis of size 1?)")
  over = []
  for index, c in enumerate(report.collectives, 1):
    limits = []
    if max_exposed is not None and c.exposed_s > max_exposed:
      limits.append(f"max_exposed={max_exposed:g} s")
    if max_fraction is not None and c.exposed_s > max_fraction * c.comm_s:
      limits.append(f"max_exposed_fraction={max_fraction:g}")
    if limits:
      over.append((index, c, limits))
  if not over:
    return
  n = len(report.collectives)
  lines = [f"assert_overlapped({name}) on {t.name} ({t.topology}), modelled "
           f"on {report.hardware.name}: {len(over)} of {n} collective"
           f"{'s' if n != 1 else ''} expose more than allowed:"]
  for rank, (index, c, limits) in enumerate(over, 1):
    head, tail = summary.collective_lines(rank, index, c)
    lines += [f"{head} (over {' and '.join(limits)})", tail]
  lines += summary.hint_lines(report)
  lines += ["", f"Note: {report.notes[0]}"]
  raise AssertionError("\n".join(lines))
