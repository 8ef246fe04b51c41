"""`MeasuredReport`: what each collective took in a profile, how much of it
compute hid, and the modelled record of the same instruction beside it.

`to_dict` names the fields (docs/overlap-report.md, "Measured fields").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jax_overlap._src.inspection.measured import hlo_proto, measurement
from jax_overlap._src.inspection.measured.classify import OpKinds
from jax_overlap._src.inspection.measured.xplane import Capture, read_capture
from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.inspection.errors import HloParseError
from jax_overlap._src.inspection.reading import hlo_text
from jax_overlap._src.inspection.report.overlap_report import OverlapReport

_MODELLED_FIELDS = ("kind", "async", "runs", "comm_s", "exposed_s",
                    "overlapped", "flags")


@dataclasses.dataclass
class MeasuredRecord:
  """One collective instruction on one device, over the measured runs.
  `where` (source line) and `leaf` are those of the modelled record of the
  same instruction, the names `inspect`'s records carry, so the two
  reports match row by row (tests/integration/real_clients_report_test.py)."""
  name: str
  kind: str
  module: str | None
  device: int
  runs: int
  measured_s: float
  hidden_s: float
  exposed_s: float
  waiting_s: float
  flags: list[str]
  modelled: dict[str, Any] | None = None
  where: str | None = None
  leaf: str | None = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class MeasuredReport:
  """Measured overlap from a profile, beside the modelled report.

  Made by `jax_overlap.measure(fn)(*args)` (runs `fn` under the profiler) or
  `MeasuredReport.from_profile(path)` (an `.xplane.pb`, or the directory
  `jax.profiler.trace` wrote). `print(report)` shows a table.

  Attributes:
    source: the profile read.
    backend: 'cpu', 'gpu' or 'tpu': where the events ran.
    measured: a record per collective instruction per device.
    totals: per device, `comm_s`, `hidden_s`, `exposed_s`,
      `overlap_fraction` (from unions of intervals) and `compute_s`.
    modelled: the modelled report of each module whose HLO the profile
      carries, by module name.
    steps: how many steps were measured, where known.
    notes: what the reader should know.
  """
  source: str
  backend: str
  measured: list[MeasuredRecord]
  totals: dict[int, dict[str, Any]]
  modelled: dict[str, OverlapReport]
  notes: list[str]
  steps: int | None = None
  timelines: Any = dataclasses.field(default=None, repr=False, compare=False)

  @classmethod
  def from_profile(cls, path: str | os.PathLike, hardware=None,
                   modules=None, hlo=None) -> MeasuredReport:
    """The report of a profile file (`.xplane.pb`, or gzipped), or the
    newest under a directory.

    `hlo`: the compiled module that ran (`compile().as_text()`, or a dump's
    `*after_optimizations.txt`; text or a path, or a list of them), for a
    capture whose own HLO cannot be read here (one a jaxlib other than the
    running one wrote): its instructions give each event's kind and the
    modelled records. Matched to the capture's module of the same name
    (`jit_step`); a module given is read in place of the capture's.

    Raises:
      ProfileReadError: a missing, empty or malformed profile.
      HloParseError: `hlo` is not a readable module.
    """
    capture = read_capture(path)
    texts = {}
    for item in ([] if hlo is None else hlo if isinstance(hlo, (list, tuple))
                 else [hlo]):
      module = hlo_text.load_hlo(item)
      texts[module.name] = module
      if not any(e.module == module.name for e in capture.events):
        capture.notes.append(
            f"the HLO given is of module {module.name}, which did not run in "
            "this capture (its modules: "
            f"{', '.join(sorted({str(e.module) for e in capture.events}))})")
    return cls.from_capture(capture, hardware=hardware, modules=modules,
                            module_texts=texts)

  @classmethod
  def from_capture(cls, capture: Capture, hardware=None, modules=None,
                   module_texts: dict[str, Any] | None = None,
                   steps: int | None = None) -> MeasuredReport:
    """The report of a read capture. `modules` keeps only events of those
    module names; `module_texts` gives a read `HloModule` per module name
    (a live compile) in place of the profile's protos."""
    profile = resolve_hardware(hardware)
    notes = list(capture.notes)
    events = [e for e in capture.events
              if modules is None or e.module in modules]
    hlo = dict(module_texts or {})
    hlo.update({k: v for k, v in _modules_in(capture, notes, set(hlo)).items()
                if modules is None or k in modules})
    modelled = {}
    for name, module in hlo.items():
      try:
        modelled[name] = OverlapReport.build(module, profile,
                                             source=module.source)
      except (HloParseError, ValueError, KeyError, LookupError) as e:
        notes.append(f"module {name}: no modelled report ({e})")
    kinds = {name: OpKinds(module) for name, module in hlo.items()}
    timelines = measurement.device_timelines(events, kinds)
    records = []
    ran: dict[str | None, set[int]] = {}
    for e in events:
      ran.setdefault(e.module, set()).add(e.device)
    for m in measurement.measure_timelines(timelines):
      classify = kinds.get(m.module) or OpKinds(None)
      records.append(MeasuredRecord(
          name=m.name, kind=m.kind, module=m.module, device=m.device,
          runs=m.runs, measured_s=m.measured_s, hidden_s=m.hidden_s,
          exposed_s=m.measured_s - m.hidden_s, waiting_s=m.waiting_s,
          flags=measurement.flags(m, capture.backend,
                                  classify.is_async(m.name))))
    seen = {(r.module, r.name, r.device) for r in records}
    for name, report in modelled.items():
      for c in report.collectives:
        for device in sorted(ran.get(name, ())):
          if (name, c.start, device) not in seen:
            records.append(MeasuredRecord(
                name=c.start, kind=c.kind, module=name, device=device, runs=0,
                measured_s=0.0, hidden_s=0.0, exposed_s=0.0, waiting_s=0.0,
                flags=[measurement.no_kernel_flag(capture.backend)]))
    for r in records:
      report = modelled.get(r.module)
      match = next((c for c in report.collectives if c.start == r.name),
                   None) if report else None
      if match is not None:
        d = match.to_dict()
        r.modelled = {k: d[k] for k in _MODELLED_FIELDS if k in d}
        r.where, r.leaf = match.where, match.leaf
    records.sort(key=lambda r: (r.module or "", _order(modelled, r), r.name,
                                r.device))
    if not events:
      notes.append("the profile holds no timed HLO events")
    elif not records:
      notes.append("no collectives ran in this profile")
    if capture.backend == "cpu" and records:
      notes.append(
          "on CPU the runtime blocks on collectives: "
          + ("nothing ran beside any, so hidden_s is 0 and everything is "
             "exposed" if all(r.hidden_s == 0 for r in records) else
             "what hid is independent work its other threads ran beside one")
          + "; the times are the CPU runtime's, not a network's")
    return cls(source=capture.source, backend=capture.backend,
               measured=records,
               totals=measurement.device_totals(timelines),
               modelled=modelled, notes=notes, steps=steps,
               timelines=timelines)

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field under its documented name."""
    return {
        "source": self.source,
        "backend": self.backend,
        "steps": self.steps,
        "measured": [r.to_dict() for r in self.measured],
        "measured_totals": {str(d): dict(t) for d, t in self.totals.items()},
        "modelled": {name: {"hardware": r.hardware.name,
                            "totals": dict(r.totals), "step_s": r.step_s}
                     for name, r in self.modelled.items()},
        "notes": list(self.notes),
    }

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  def __str__(self) -> str:
    from jax_overlap._src.inspection.measured import measured_table  # noqa: PLC0415
    return measured_table.render(self)

  def __repr__(self) -> str:
    return (f"MeasuredReport({self.source!r}, {self.backend}, "
            f"{len(self.measured)} records on {len(self.totals)} devices)")

  def save_timeline(self, path: str | os.PathLike) -> None:
    """Draws the measured timeline as a PNG (needs matplotlib)."""
    from jax_overlap._src.inspection.measured import measured_timeline  # noqa: PLC0415
    measured_timeline.write_png(self, path)

  def save_trace(self, path: str | os.PathLike) -> None:
    """Writes the measured compute and collectives as a Trace Event Format
    JSON file for ui.perfetto.dev."""
    from jax_overlap._src.inspection.measured import measured_timeline  # noqa: PLC0415
    measured_timeline.write_trace(self, path)


def _modules_in(capture: Capture, notes: list[str],
                given: set[str]) -> dict[str, Any]:
  """The modules whose HLO the profile carries, read where the running
  jaxlib wrote them; not those `given` already."""
  names = {e.module for e in capture.events} - given
  protos = {k: v for k, v in capture.hlo_protos.items() if k[0] in names}
  if not protos:
    return {}
  if not hlo_proto.readable(capture.stats):
    notes.append(
        "the HLO in this profile was written by jaxlib "
        f"{capture.stats.get('jaxlib_version', '(unknown)')}, not the running "
        f"{hlo_proto.running_jaxlib()}: not read, so events are classified by "
        "name and no modelled records stand beside them")
    return {}
  out = {}
  for (name, _), proto in sorted(protos.items(), key=lambda kv: kv[0][1] or 0):
    try:
      out[name] = hlo_proto.module_from_hlo_proto(
          proto, source=f"{capture.source}: {name}")
    except (ValueError, HloParseError) as e:
      notes.append(f"module {name}: its HLO could not be read ({e})")
  return out


def _order(modelled, r) -> int:
  report = modelled.get(r.module)
  if report is None:
    return 0
  for k, c in enumerate(report.collectives):
    if c.start == r.name:
      return k
  return len(report.collectives)
