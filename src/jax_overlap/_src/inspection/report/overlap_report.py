"""`OverlapReport`: what each collective overlapped, and what that costs.

It holds plain records (`records.py`) made by `analysis.py`; `to_dict` gives
them under the field names of the docs (`docs/overlap-report.md`). All times
are modelled, never measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jax_overlap._src.inspection.model.hardware import (
    HardwareProfile, default_for_platform, resolve_hardware)
from jax_overlap._src.inspection.reading import hlo_text
from jax_overlap._src.inspection.reading.platform import compiled_for
from jax_overlap._src.inspection.report import analysis
from jax_overlap._src.inspection.report.records import (
    CollectiveRecord, CopyRecord, WrittenRecord, _plain)


@dataclasses.dataclass
class OverlapReport:
  """What each collective of a program overlapped, with modelled times: its
  exposed communication and what a perfect schedule would save.

  Made by `jax_overlap.overlap_report(fn)(*args)` (a live compile, or the schedule
  as written in the traced program) or `OverlapReport.from_hlo(text_or_path)`
  (a dump). `print(report)` shows a summary with what to change,
  `report.table()` every collective; `to_dict`/`to_json` give the fields; `save_timeline` draws a PNG and
  `save_trace` writes a trace for ui.perfetto.dev.

  Attributes:
    source: what was read.
    schedule: which schedule is modelled: 'compiled' (the one the compiler
      chose) or 'written' (the traced program's order, as if kept).
    hardware: the profile the times are modelled on.
    cost_source: where flops and bytes came from.
    collectives, copies: a record per start/done pair.
    written: the windows as written in the traced program (live only).
    totals: `comm_s`, `exposed_s`, `bound_exposed_s` (what no schedule
      keeping the data dependencies can hide) and `serial_link_bound_s` (the
      older, dependency-blind figure), in modelled seconds.
    compute_s, step_s: modelled compute, and the modelled step.
    threads: the execution threads that ran scheduled work.
    notes: what the reader should know about this report.

  Example:
    >>> from jax_overlap import OverlapReport
    >>> report = OverlapReport.from_hlo('''
    ... HloModule m, is_scheduled=true, num_partitions=8
    ... ENTRY %main (p: f32[1024]) -> f32[8192] {
    ...   %p = f32[1024]{0} parameter(0)
    ...   %ag = (f32[1024]{0}, f32[8192]{0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
    ...   ROOT %agd = f32[8192]{0} all-gather-done(%ag)
    ... }''', hardware="h100")
    >>> c = report.collectives[0]
    >>> c.kind, c.start, c.done, c.bytes, c.overlapped, c.flags[0]
    ('all-gather', 'ag', 'agd', 32768, [], 'overlaps nothing')
  """

  source: str
  hardware: HardwareProfile
  cost_source: str
  collectives: list[CollectiveRecord]
  copies: list[CopyRecord]
  written: list[WrittenRecord]
  totals: dict[str, float]
  compute_s: float
  step_s: float
  threads: list[str]
  notes: list[str]
  schedule: str = "compiled"
  timeline: Any = dataclasses.field(default=None, repr=False, compare=False)

  @classmethod
  def from_hlo(cls, text_or_path: str | os.PathLike,
               hardware=None) -> OverlapReport:
    """The report of a scheduled HLO dump (text, or the path of a file).

    Args:
      text_or_path: `*after_optimizations.txt` from `XLA_FLAGS=--xla_dump_to=`,
        or `compiled.as_text()`; a `str` with a newline (or starting with
        'HloModule') is text, anything else a path.
      hardware: a built-in profile name ('h100', 'a100', 'tpu-v5e',
        'tpu-v5p'), a `HardwareProfile`, or a .toml/.json profile path; None
        for the default of the dump's platform: tpu-v5e for a TPU dump (its
        layouts are tiled), h100 for a GPU one or where nothing says (a
        note in the report says which was taken and why).

    Raises:
      HloParseError: unreadable, malformed or truncated input, naming the line.
      HardwareProfileError: an unknown profile name or a bad profile file.
    """
    profile = None if hardware is None else resolve_hardware(hardware)
    module = hlo_text.load_hlo(text_or_path)
    if profile is not None:
      return cls.build(module, profile, source=module.source)
    platform = compiled_for(module)
    profile = default_for_platform(platform)
    return cls.build(module, profile, source=module.source,
                     notes=[_default_profile_note(profile, platform)])

  @classmethod
  def build(cls, module, hardware: HardwareProfile, **how) -> OverlapReport:
    """The report of a read `HloModule` with times modelled on `hardware`;
    `how` is `analysis.analyse`'s keyword arguments."""
    return cls(**analysis.analyse(module, hardware, **how))

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field under its documented name."""
    return {
        "source": self.source,
        "schedule": self.schedule,
        "modelled": ("all times are modelled from flops and bytes on "
                     f"{self.hardware.name}, not measured"),
        "hardware": _plain(dataclasses.asdict(self.hardware)),
        "cost_source": self.cost_source,
        "threads": list(self.threads),
        "collectives": [c.to_dict() for c in self.collectives],
        "copies": [c.to_dict() for c in self.copies],
        "written": [w.to_dict() for w in self.written],
        "totals": {k: self.totals[k] for k in
                   ("comm_s", "exposed_s", "bound_exposed_s",
                    "serial_link_bound_s")},
        "compute_s": self.compute_s,
        "step_s": self.step_s,
        "notes": list(self.notes),
    }

  def to_json(self, indent: int | None = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  def __str__(self) -> str:
    """The summary: totals, the collectives that expose the most, and what
    to change (`table()` for every collective)."""
    from jax_overlap._src.inspection.report import summary  # noqa: PLC0415
    return summary.render_summary(self)

  def table(self, use_rich: bool | None = None, width: int = 140) -> str:
    """Every collective, copy and written window as a table (`rich` when
    installed and asked or left to choose; plain text never cuts a cell)."""
    from jax_overlap._src.inspection.report import table  # noqa: PLC0415
    return table.render(self, use_rich=use_rich, width=width)

  def __repr__(self) -> str:
    t = self.totals
    return (f"OverlapReport({self.source!r}, {self.schedule} schedule, "
            f"{len(self.collectives)} "
            f"collectives, exposed_s={t['exposed_s']:.3g}, bound_exposed_s="
            f"{t['bound_exposed_s']:.3g}, modelled on {self.hardware.name})")

  def save_timeline(self, path: str | os.PathLike) -> None:
    """Draws the modelled timeline as a PNG (needs matplotlib)."""
    from jax_overlap._src.inspection.report import timeline  # noqa: PLC0415
    timeline.write_png(self, path)

  def save_trace(self, path: str | os.PathLike) -> None:
    """Writes the modelled timeline as a Trace Event Format JSON file, which
    ui.perfetto.dev and chrome://tracing open."""
    from jax_overlap._src.inspection.report import timeline  # noqa: PLC0415
    timeline.write_trace(self, path)


def _default_profile_note(profile: HardwareProfile, platform: str | None) -> str:
  """Why a dump read with no hardware named is modelled on `profile`."""
  why = {"tpu": "the default for a TPU dump (its layouts are tiled); the dump "
                "does not say which TPU",
         "gpu": "the default for a GPU dump; the dump does not say which GPU",
         }.get(platform, "the default; the dump does not say its platform")
  return (f"No hardware was named: modelled on {profile.name}, {why}. Name "
          "the chip with --hardware (hardware= in Python).")
