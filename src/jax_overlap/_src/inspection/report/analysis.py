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
from jax_overlap._src.inspection.schedule.pairing import (
    Pair, Schedule, meant_async, read_schedule)
from jax_overlap._src.inspection.model.simulate import simulate
from jax_overlap._src.inspection.traced.written import WrittenWindow

_POINT_TO_POINT = {"collective-permute", "send", "recv",
                   "collective-broadcast"}
#: The flag of a blocking collective that autodiff wrote (see `_from_autodiff`).
FROM_AUTODIFF = "from autodiff"
SHAPES_LABEL = "shapes in the HLO text"
#: The flag of a collective whose window's compute was costed from shapes
#: where the report's other costs came from its cost source.
COSTED_FROM_SHAPES = "compute costed from shapes"


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
  label, mixed = said_cost_source(model, cost_source, cost_label)
  records = [_collective(p, scheduled, timeline, several_threads,
                         in_flight[p.key], model if mixed else None)
             for p in collectives]
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
      source=source, hardware=hardware, cost_source=label,
      collectives=records, copies=copies, written=written_records,
      totals=totals, compute_s=timeline.compute_s, step_s=timeline.step_s,
      threads=threads, schedule=schedule, timeline=timeline)
  own = _notes(fields, timeline)
  fields["notes"] = own[:1] + list(notes) + own[1:]
  return fields


def said_cost_source(model: CostModel, cost_source, label: str) -> tuple[str, bool]:
  """(where the report's flops and bytes came from, whether some came from
  the source and some from shapes). Said as it happened: the source's label
  only when it answered for every instruction costed, never when its every
  call failed (XLA's analysis on TPU: `UNIMPLEMENTED`), which the label then
  quotes (tests/inspection/cost_label_test.py)."""
  if cost_source is None:
    return SHAPES_LABEL, False
  answered = sum(model.answered.values())
  total = len(model.answered)
  if answered == total:
    return label, False
  if answered == 0:
    failure = getattr(cost_source, "failure", None)
    why = f"{label} failed: {failure}" if failure else \
        f"{label} gave no cost for any instruction"
    return f"{SHAPES_LABEL} ({why})", False
  return (f"{label} ({answered} of {total}; {SHAPES_LABEL} for the other "
          f"{total - answered}, flagged '{COSTED_FROM_SHAPES}' where in a "
          "window)", True)


def _window_from_shapes(pair: Pair, schedule: Schedule,
                        model: CostModel) -> bool:
  """Whether compute in `pair`'s window (in the loops and calls it holds
  too) was costed from shapes."""
  comps = schedule.module.computations
  seen: set[str] = set()

  def from_shapes(comp_name: str) -> bool:
    if comp_name in seen or comp_name not in comps:
      return False
    seen.add(comp_name)
    return any(model.answered.get(i.name) is False
               or any(from_shapes(c) for c in i.callees(
                   "body", "to_apply", "branch_computations",
                   "true_computation", "false_computation"))
               for i in comps[comp_name].instructions)

  for name in pair.overlapped:
    if model.answered.get(name) is False:
      return True
    for comp in comps.values():
      instr = comp.by_name.get(name)
      if instr is not None and instr.opcode in ("while", "call", "conditional"):
        if any(from_shapes(c) for c in instr.callees(
            "body", "to_apply", "branch_computations", "true_computation",
            "false_computation")):
          return True
  return False


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
                in_flight, mixed_model=None) -> CollectiveRecord:
  """`mixed_model`: the model, where the report's costs are mixed, to say
  per row where shapes costed the window's compute."""
  totals = timeline.totals.get(pair.key)
  loop, trip = _loop_of(pair, schedule)
  flags = _common_flags(pair, schedule, several_threads, loop, trip)
  costed = None
  if mixed_model is not None and _window_from_shapes(pair, schedule,
                                                     mixed_model):
    costed = SHAPES_LABEL
    flags.append(COSTED_FROM_SHAPES)
  if pair.made_blocking:
    flags.insert(0, "made blocking by the backend")
  elif not pair.is_async:
    flags.insert(0, "blocking")
  # A future autodiff wrote (a transposed all_gather_start) is a future:
  # its hint is the backend's, not autodiff's.
  if not pair.is_async and not meant_async(pair.start) and \
      _from_autodiff(pair, schedule):
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
      leaf=_leaf(pair, schedule), step=attrs.step(pair.start),
      thread=pair.thread, link=totals.link if totals else "",
      queued_behind=list(queued),
      is_async=pair.is_async, made_blocking=pair.made_blocking,
      bytes=pair.bytes, bytes_in_flight=in_flight,
      group_size=pair.group_size, overlapped=list(pair.overlapped),
      spans_iteration=pair.spans_iteration, trip_count=trip, loop=loop,
      runs=totals.runs if totals else 0.0,
      comm_s=totals.seconds if totals else 0.0,
      exposed_s=totals.exposed if totals else 0.0, flags=flags,
      cost_source=costed)


def _leaf(pair: Pair, schedule: Schedule) -> str | None:
  """What the collective moves: the `jax_overlap.leaf=` name in its
  op_name; for one XLA combined from several (an all-reduce of several
  operands), the names its elements' `get-tuple-element`s keep, joined by
  '+', where each names one: the combined op keeps only one of them (on TPU
  v5e `pipeline_loss`'s loss sum combined with its sum of xs's gradient:
  tests/aot/report_hints_compiled_test.py)."""
  own = attrs.leaf(pair.start)
  if len(pair.start.operands) < 2:
    return own
  comp = schedule.module.computations.get(pair.done_computation
                                          or pair.computation)
  if comp is None:
    return own
  names = {}
  for user, _ in comp.users().get((pair.done or pair.start).name, []):
    if user.opcode == "get-tuple-element":
      index = attrs.integer_list(user.attributes.get("index"))
      names[index[0] if index else -1] = attrs.leaf(user)
  parts = [names.get(k) for k in range(len(pair.start.operands))]
  if not all(parts):
    return own
  return "+".join(dict.fromkeys(parts))


def _from_autodiff(pair: Pair, schedule: Schedule) -> bool:
  """Whether jax's autodiff wrote this collective: jax names the backward
  pass's scopes `transpose(...)` in op_name (the gradient of an input
  replicated over a shard_map axis is summed by an all-reduce written
  there). The user cannot make such a collective a future where it is
  written, so the summary suggests what to change instead
  (tests/integration/real_clients_report_test.py).

  XLA's combiners merge such a sum with others into one collective that
  keeps one of their op_names (on TPU the loss's `pmean` beside a `P()`
  weight's gradient: the forward pass's name), but each element of the
  result keeps its own collective's op_name on its `get-tuple-element`: the
  collective is autodiff's when the elements autodiff wrote carry most of
  its bytes. Where the elements carry no op_name (a dump writes them as
  `%t#N` operands) or XLA kept none at all (XLA:GPU on jax 0.10.2
  concatenates the sums into one buffer), what made its operands tells, for
  a combined collective named in the forward pass (`jvp(`) or one not named:
  a forward collective cannot read what the backward pass made, unless
  autodiff's sum was combined into it. A pattern's own collective (it has a
  `jax_overlap.leaf=` scope) is never autodiff's: the library wrote it
  (tests/inspection/autodiff_hint_test.py,
  tests/aot/report_hints_compiled_test.py)."""
  start = pair.start
  name = attrs.op_name(start)
  if attrs.leaf(start) or "jax_overlap.leaf=" in name:
    return False             # a pattern's own collective (fsdp_scan's, ...)
  if "transpose(" in name:
    return True
  comps = schedule.module.computations
  comp = comps.get(pair.done_computation or pair.computation)
  if comp is None:
    return False
  named = {}   # element index -> op_name of its get-tuple-element
  for user, _ in comp.users().get((pair.done or start).name, []):
    if user.opcode == "get-tuple-element" and attrs.op_name(user):
      index = attrs.integer_list(user.attributes.get("index"))
      named[index[0] if index else -1] = attrs.op_name(user)
  # What made the operands tells only for a combined collective (several
  # operands) named in the forward pass, or for one XLA kept no name for.
  from_producers = not name or ("jvp(" in name and len(start.operands) > 1)
  start_comp = comps[pair.computation]
  autodiff = total = 0.0
  for k, operand in enumerate(start.operands):
    source = start_comp.by_name.get(operand)
    if source is None:
      continue
    if k in named:
      names = [named[k]]
    elif from_producers:
      names = [attrs.op_name(p) for p in _named_inputs(source, start_comp, 3,
                                                       itself=True)]
    else:
      names = []
    if names:
      total += source.shape.bytes
      if any("transpose(" in n for n in names):
        autodiff += source.shape.bytes
  return autodiff > 0 and 2 * autodiff >= total


def _named_inputs(instr, comp, depth: int = 3, itself: bool = False) -> list:
  """The nearest instructions with an op_name that make `instr`'s operands
  (`itself`: `instr`, or what makes it), through unnamed ones and elements
  of tuples (whose names a dump does not write), `depth` deep."""
  if itself:
    if attrs.op_name(instr) and instr.opcode not in ("get-tuple-element",
                                                      "parameter"):
      return [instr]
  found = []
  for name in instr.operands:
    producer = comp.by_name.get(name)
    if producer is None or producer.opcode == "parameter":
      continue
    if attrs.op_name(producer) and producer.opcode != "get-tuple-element":
      found.append(producer)
    elif depth > 0:
      found += _named_inputs(producer, comp, depth - 1)
  return found


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
