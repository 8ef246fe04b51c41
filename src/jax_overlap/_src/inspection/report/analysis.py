"""What goes into an `OverlapReport`: schedule, cost model and timeline together."""

from __future__ import annotations

from typing import Any, Sequence

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.model.cost_model import (
    UNKNOWN_GROUP_SIZE, CostModel, CostSource)
from jax_overlap._src.inspection.model.hardware import HardwareProfile
from jax_overlap._src.inspection.reading.hlo_module import HloModule
from jax_overlap._src.inspection.report.in_flight import bytes_in_flight
from jax_overlap._src.inspection.report.records import (
    CollectiveRecord, CopyRecord, WrittenRecord)
from jax_overlap._src.inspection.schedule.pairing import Pair, Schedule, read_schedule
from jax_overlap._src.inspection.model.simulate import simulate
from jax_overlap._src.inspection.traced.written import WrittenWindow

_POINT_TO_POINT = {"collective-permute", "send", "recv",
                   "collective-broadcast"}
#: The flag of a blocking collective that autodiff wrote (see `_from_autodiff`).
FROM_AUTODIFF = "from autodiff"
SHAPES_LABEL = "shapes in the HLO text"


def analyse(module: HloModule, hardware: HardwareProfile, *,
                 source: str, cost_source: CostSource | None = None,
                 cost_label: str = SHAPES_LABEL,
                 written: list[WrittenWindow] | None = None,
                 schedule: str = "compiled",
                 notes: Sequence[str] = ()) -> dict[str, Any]:
  """The fields of the report of `module` with times modelled on `hardware`
  (`OverlapReport(**fields)`); `schedule` says which schedule `module` is
  ('compiled', or 'written' when it was built from the traced program),
  `notes` what its maker wants said."""
  scheduled = read_schedule(module)
  model = CostModel(hardware, module, cost_source)
  timeline = simulate(scheduled, model)
  collectives = scheduled.collectives()
  threads = sorted(set(scheduled.schedules.values())
                   | {p.thread for p in collectives})
  several_threads = len(threads) > 1
  in_flight = bytes_in_flight(collectives, module)
  records = [_collective(p, scheduled, timeline, several_threads,
                         in_flight[p.key]) for p in collectives]
  copies = [_copy(p, scheduled, timeline, several_threads)
            for p in scheduled.copies()]
  written_records = [_written(w, model) for w in written or []]
  totals = {
      "comm_s": sum(r.comm_s for r in records),
      "exposed_s": sum(r.exposed_s for r in records),
      "bound_exposed_s": timeline.bound_exposed_s,
      "serial_link_bound_s": timeline.serial_link_bound_s,
  }
  fields = dict(
      source=source, hardware=hardware,
      cost_source=cost_label if cost_source is not None else SHAPES_LABEL,
      collectives=records, copies=copies, written=written_records,
      totals=totals, compute_s=timeline.compute_s, step_s=timeline.step_s,
      threads=threads, schedule=schedule, timeline=timeline)
  own = _notes(fields, timeline)
  fields["notes"] = own[:1] + list(notes) + own[1:]
  return fields


def _loop_of(pair: Pair, schedule: Schedule) -> tuple[str | None, int | None]:
  """The loop a pair spans, else the innermost loop running its start."""
  if pair.loop is not None:
    return pair.loop, pair.trip_count
  parent = schedule.while_parents.get(pair.computation)
  if parent is None:
    return None, None
  comp_name, while_name = parent
  while_instr = schedule.module.computations[comp_name].by_name[while_name]
  return while_name, attrs.known_trip_count(while_instr)


def _common_flags(pair, schedule, several_threads, loop, trip) -> list[str]:
  flags = []
  if pair.done is None:
    flags.append("no done found")
  elif not pair.overlapped:
    flags.append("overlaps nothing")
  if pair.spans_iteration:
    flags.append("spans iteration")
  if loop is not None and trip is None:
    flags.append("trip count unknown (modelled as 1)")
  if several_threads:
    flags.append(f"thread {pair.thread}")
  return flags


def _collective(pair, schedule, timeline, several_threads,
                in_flight) -> CollectiveRecord:
  totals = timeline.totals.get(pair.key)
  loop, trip = _loop_of(pair, schedule)
  flags = _common_flags(pair, schedule, several_threads, loop, trip)
  if pair.made_blocking:
    flags.insert(0, "made blocking by the backend")
  elif not pair.is_async:
    flags.insert(0, "blocking")
    if _from_autodiff(pair.start):
      flags.append(FROM_AUTODIFF)
  if pair.group_size is None and pair.kind not in _POINT_TO_POINT:
    flags.append(f"group size unknown (modelled as {UNKNOWN_GROUP_SIZE})")
  queued = totals.queued_behind if totals else []
  if queued:
    flags.append("queued behind " + ", ".join(queued[:3])
                 + (f" (+{len(queued) - 3} more)" if len(queued) > 3 else ""))
  return CollectiveRecord(
      kind=pair.kind, start=pair.start.name,
      done=pair.done.name if pair.done else None,
      computation=pair.computation,
      where=attrs.source_location(pair.start, schedule.module),
      leaf=attrs.leaf(pair.start), step=attrs.step(pair.start),
      thread=pair.thread, link=totals.link if totals else "",
      queued_behind=list(queued),
      is_async=pair.is_async, made_blocking=pair.made_blocking,
      bytes=pair.bytes, bytes_in_flight=in_flight,
      group_size=pair.group_size, overlapped=list(pair.overlapped),
      spans_iteration=pair.spans_iteration, trip_count=trip, loop=loop,
      runs=totals.runs if totals else 0.0,
      comm_s=totals.seconds if totals else 0.0,
      exposed_s=totals.exposed if totals else 0.0, flags=flags)


def _from_autodiff(instr) -> bool:
  """Whether jax's autodiff wrote this collective: jax names the backward
  pass's scopes `transpose(...)` in op_name (the gradient of an input
  replicated over a shard_map axis is summed by an all-reduce written
  there). The user cannot make such a collective a future where it is
  written, so the summary suggests what to change instead
  (tests/integration/real_clients_report_test.py)."""
  return "transpose(" in attrs.op_name(instr)


def _copy(pair, schedule, timeline, several_threads) -> CopyRecord:
  totals = timeline.totals.get(pair.key)
  loop, trip = _loop_of(pair, schedule)
  return CopyRecord(
      start=pair.start.name, done=pair.done.name if pair.done else None,
      computation=pair.computation, thread=pair.thread, bytes=pair.bytes,
      overlapped=list(pair.overlapped), spans_iteration=pair.spans_iteration,
      trip_count=trip, loop=loop, runs=totals.runs if totals else 0.0,
      copy_s=totals.seconds if totals else 0.0,
      exposed_s=totals.exposed if totals else 0.0,
      flags=_common_flags(pair, schedule, several_threads, loop, trip))


def _written(window: WrittenWindow, model: CostModel) -> WrittenRecord:
  comm = model.collective_seconds(window.kind, window.bytes,
                                  window.group_size)
  compute = sum(model.roofline(f, b) for f, b in window.costs)
  flags = []
  if not window.overlapped:
    flags.append("overlaps nothing")
  if not window.finished:
    flags.append("done() not found")
  return WrittenRecord(
      collective=window.collective, kind=window.kind,
      where=window.where or None, leaf=window.leaf, step=window.step,
      bytes=window.bytes, group_size=window.group_size,
      overlapped=list(window.overlapped), loop=window.loop, comm_s=comm,
      compute_s=compute, exposed_s=max(0.0, comm - compute), flags=flags)


def _notes(report: dict[str, Any], timeline) -> list[str]:
  notes = [f"Times are modelled on {report['hardware'].describe()}, from "
           f"{report['cost_source']}; nothing was measured."]
  blocking = [c for c in report["collectives"] if c.made_blocking]
  if blocking:
    notes.append(
        f"The backend made {len(blocking)} collective(s) blocking: the "
        "compiled program has no window for them, so none is reported.")
  if report["written"]:
    notes.append("Written windows are read from the traced program (what "
                 "was written between start and done), not from the "
                 "compiled one.")
  if len(report["threads"]) > 1:
    notes.append("Scheduled work runs on threads " +
                 ", ".join(report["threads"]) + "; each collective says which.")
  if timeline.events_dropped:
    notes.append(f"The timeline keeps the first {len(timeline.events)} "
                 "events; the totals count them all.")
  return notes
