"""Reading a profile: the timed HLO events of `.xplane.pb`, by device.

`jax.profiler.trace(dir)` writes `dir/plugins/profile/<date>/<host>.xplane.pb`;
`jax.profiler.ProfileData` (jaxlib, 0.10.2 to 0.12) reads it. Every HLO op that
ran is an event with stats `hlo_op`, `hlo_module` and `program_id`:

- on GPU, on `/device:GPU:N` planes, a line per stream (`Stream #N(...)`);
- on CPU, on the `/host:CPU` plane, a line per *thread*, with the device in
  the `device_ordinal` stat. One thread serves several devices, so events are
  grouped by the plane or by that stat, never by the line;
- on TPU, on `/device:TPU:N` planes, events named by their HLO text, with
  no stats to say which op or module: `tpu_lines.py` reads those.

Where device planes hold HLO events, the host plane's (kernel launches) are
left out, so a kernel is never counted twice.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib
import re
import warnings
from typing import Any

from jax_overlap._src.inspection.measured import hlo_proto, tpu_lines

_DEVICE_PLANE = re.compile(r"^/device:(GPU|TPU|CPU):(\d+)")
HOST_PLANE = "/host:CPU"


class ProfileReadError(ValueError):
  """A profile that cannot be read: missing, empty or malformed."""


@dataclasses.dataclass(frozen=True)
class TimedEvent:
  """One timed event of one device; times in seconds."""
  device: int
  line: str
  name: str
  hlo_op: str | None
  module: str | None
  program_id: int | None
  run_id: int | None
  start: float
  end: float
  #: the opcode, where the event names its HLO instruction's text (TPU)
  opcode: str | None = None
  #: an async pair's event, from its start (`hlo_op`) to its done: the done
  done: str | None = None

  @property
  def op(self) -> str:
    """The HLO op this event ran, or its own name where none is given."""
    return self.hlo_op or self.name


@dataclasses.dataclass
class Capture:
  """What a profile holds: its HLO events, and each module's HLO proto."""
  source: str
  backend: str
  events: list[TimedEvent]
  stats: dict[str, Any]
  hlo_protos: dict[tuple[str, int | None], bytes]
  notes: list[str]


def find_profile(path: str | os.PathLike) -> pathlib.Path:
  """`path` itself if a file (`.xplane.pb`, or gzipped); else the newest
  `*.xplane.pb` under it."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  if not p.exists():
    raise ProfileReadError(f"no such file or directory: {str(p)!r}")
  found = sorted(p.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
  if not found:
    raise ProfileReadError(
        f"no *.xplane.pb under {str(p)!r}: give the directory passed to "
        "jax.profiler.trace, or the .xplane.pb file")
  return found[-1]


def read_capture(path: str | os.PathLike) -> Capture:
  """The capture in an `.xplane.pb` file, or the newest one under a directory.

  Raises:
    ProfileReadError: a missing, empty or malformed file.
  """
  file = find_profile(path)
  try:
    data = file.read_bytes()
    if file.suffix == ".gz":
      data = gzip.decompress(data)
  except OSError as e:
    raise ProfileReadError(f"cannot read {str(file)!r}: {e.strerror or e}") from None
  capture = read_space(data, source=str(file))
  others = len(list(file.parent.glob("*.xplane.pb"))) - 1
  if others > 0:
    capture.notes.append(
        f"{others} other host file(s) beside {file.name} were not read: "
        "each host's devices are in its own file")
  return capture


def read_space(data: bytes, source: str = "<xspace>") -> Capture:
  """The capture in a serialized XSpace."""
  from jax.profiler import ProfileData  # noqa: PLC0415  (jaxlib, heavy)
  if not data:
    raise ProfileReadError(f"{source}: the file is empty")
  try:
    profile = ProfileData.from_serialized_xspace(data)
    protos, stats = hlo_proto.embedded_hlo(data)
  except (RuntimeError, ValueError) as e:
    raise ProfileReadError(
        f"{source}: not a profile written by jax.profiler.trace ({e})") from None
  planes = list(profile.planes)
  if not planes:
    raise ProfileReadError(f"{source}: the profile holds no planes")
  device_events, backend = [], "cpu"
  for plane in planes:
    match = _DEVICE_PLANE.match(plane.name)
    if match:
      found = _plane_events(plane, int(match.group(2)))
      if found:
        device_events += found
        backend = match.group(1).lower()
  if device_events:
    events = device_events
  else:
    events = [e for plane in planes if plane.name == HOST_PLANE
              for e in _plane_events(plane, None)]
  events.sort(key=lambda e: (e.device, e.start, e.end))
  return Capture(source=source, backend=backend, events=events, stats=stats,
                 hlo_protos=protos, notes=[])


def _plane_events(plane, device: int | None) -> list[TimedEvent]:
  """The events of a plane that belong to a device: an HLO op, or (on a device
  plane) a kernel, which may lack `hlo_op`."""
  with warnings.catch_warnings():
    # jaxlib's stats iterators warn that their type has no __module__.
    warnings.simplefilter("ignore", DeprecationWarning)
    lines = list(plane.lines)
    if device is not None and any(tpu_lines.is_tpu_ops_line(l.name) for l in lines):
      return _tpu_events(lines, device)
    return _collect(lines, device)


def _collect(lines, device) -> list[TimedEvent]:
  out = []
  for line in lines:
    for event in line.events:
      stats = dict(event.stats)
      ordinal = stats.get("device_ordinal")
      if device is None and (ordinal is None or "hlo_op" not in stats):
        continue
      if device is not None and "hlo_op" not in stats and not \
          line.name.startswith("Stream"):
        continue
      start = event.start_ns * 1e-9
      out.append(TimedEvent(
          device=int(device if device is not None else ordinal),
          line=line.name, name=event.name,
          hlo_op=_str(stats.get("hlo_op")), module=_str(stats.get("hlo_module")),
          program_id=_int(stats.get("program_id")),
          run_id=_int(stats.get("run_id")),
          start=start, end=start + event.duration_ns * 1e-9))
  return out


def _tpu_events(lines, device: int) -> list[TimedEvent]:
  """A TPU plane's "XLA Ops" and "Async XLA Ops" events, each named by its
  instruction (not its text), in the module run around it; an async pair's
  event carries its done's name in `done`."""
  runs = []
  for line in lines:
    if line.name == tpu_lines.MODULES_LINE:
      for event in line.events:
        start = event.start_ns * 1e-9
        runs.append((start, start + event.duration_ns * 1e-9,
                     tpu_lines.module_name(event.name),
                     _int(dict(event.stats).get("run_id"))))
  modules = tpu_lines.ModuleRuns(runs)
  out = []
  for line in lines:
    if not tpu_lines.is_tpu_ops_line(line.name):
      continue
    pairs = line.name == tpu_lines.ASYNC_LINE
    for event in line.events:
      stats = dict(event.stats)
      parsed = tpu_lines.instruction(event.name)
      name, opcode = parsed if parsed else (event.name, None)
      if pairs:
        op, done = name, _str(stats.get("hlo_op"))
        done = None if done == op else done
      else:
        op, done = _str(stats.get("hlo_op")) or name, None
      start = event.start_ns * 1e-9
      module, run_id = modules.at(start)
      out.append(TimedEvent(
          device=device, line=line.name, name=event.name, hlo_op=op,
          module=_str(stats.get("hlo_module")) or module,
          program_id=_int(stats.get("program_id")),
          run_id=_int(stats.get("run_id")) if "run_id" in stats else run_id,
          start=start, end=start + event.duration_ns * 1e-9,
          opcode=opcode, done=done))
  return out


def _str(value) -> str | None:
  return None if value is None else str(value)


def _int(value) -> int | None:
  try:
    return None if value is None else int(value)
  except (TypeError, ValueError):
    return None
